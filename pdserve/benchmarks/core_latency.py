"""What the engine core's process boundary costs a request: command round trips node -> core -> node.

    python -m pdserve.benchmarks.core_latency --model sim:llama-3-8b@h100 --rounds 300

The node process's end of the boundary (``pdserve.node.core_client.CoreClient``) spawns a real
engine core (a co-located node's services, ``--role both``) and drives it as the node's handlers
do, at concurrency 1, on an idle core:

- ``stats``: ``GetStats`` answered (one command, one reply: the bare round trip);
- ``reserve``: ``Reserve`` of a prompt's KV blocks answered, then ended (``EndRequest``, no reply);
- ``local``: a one-token request computed on the node: ``Reserve`` (local), ``StartLocal``, and its
  final token event (the engine steps of a simulated model: their modelled time is in the figure);
- ``offline`` (the anchor): the same request on an ``LLMEngine`` of the same model in this process,
  stepped until it finishes: ``local`` minus ``offline`` is what the boundary costs a request.

Reported: p50, p90 and mean of each, in microseconds, and ``local`` against ``offline`` at p50.
Writes JSON under docs/benchmarks/ with ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

TIMEOUT_S = 30.0


class _Driver:
    """One engine core and the node-side state a request needs: its final events, by request id."""

    def __init__(self) -> None:
        self.finished: dict[str, asyncio.Future] = {}

    def on_outputs(self, msg) -> None:
        for rid in msg.finished:
            fut = self.finished.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def start(self, model: str, threads: int):
        from pdserve.config import EngineConfig, NodeConfig, Role
        from pdserve.decode_node.server import core_services
        from pdserve.node.core_client import CoreClient

        def died(why: str) -> None:
            raise SystemExit(f"the engine core died: {why}")

        self.core = CoreClient(self.on_outputs, died)
        engine = EngineConfig.from_kwargs(model=model, num_threads=threads, max_model_len=4096)
        node = NodeConfig(role=Role.BOTH, port=0, insecure_no_cluster_token=True)
        await self.core.start(engine, node, core_services)

    def start_offline(self, model: str, threads: int) -> None:
        from pdserve.config import EngineConfig
        from pdserve.engine.llm_engine import LLMEngine

        config = EngineConfig.from_kwargs(model=model, num_threads=threads, max_model_len=4096)
        self.engine = LLMEngine(config)

    async def offline(self, rid: str, prompt: list[int]) -> None:
        from pdserve.sampling_params import SamplingParams

        engine = self.engine
        engine.add_request(rid, None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt)
        while engine.has_work():
            engine.step()

    async def stats(self, rid: str, prompt: list[int]) -> None:
        from pdserve.messages import GetStats

        await self.core.call(GetStats())

    async def reserve(self, rid: str, prompt: list[int]) -> None:
        from pdserve.messages import EndRequest, Reserve, ReserveRequest
        from pdserve.sampling_params import SamplingParams

        msg = ReserveRequest(rid, prompt, SamplingParams(max_tokens=1), 30.0)
        reserved = await self.core.call(Reserve(msg, time.time() + 30.0))
        assert reserved.ok, "the core has no free blocks"
        self.core.send(EndRequest(rid, "FINISHED_ABORTED", "benchmark"))

    async def local(self, rid: str, prompt: list[int]) -> None:
        from pdserve.messages import Reserve, ReserveRequest, StartLocal
        from pdserve.sampling_params import SamplingParams

        done = self.finished[rid] = asyncio.get_running_loop().create_future()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        msg = ReserveRequest(rid, prompt, params, 30.0, local_prefill=True)
        reserved = await self.core.call(Reserve(msg, time.time() + 30.0, local=True))
        assert reserved.ok, "the core has no free blocks"
        await self.core.call(StartLocal(rid))
        await asyncio.wait_for(done, TIMEOUT_S)


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": statistics.median(s) * 1e6,
        "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6,
        "mean_us": statistics.fmean(s) * 1e6,
    }


async def _measure(args) -> dict[str, list[float]]:
    from pdserve.messages import Shutdown

    driver = _Driver()
    await driver.start(args.model, args.threads)
    driver.start_offline(args.model, args.threads)
    rng = random.Random(0)
    kinds = {
        "stats": driver.stats,
        "reserve": driver.reserve,
        "local": driver.local,
        "offline": driver.offline,
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for i in range(args.warmup + args.rounds):
            for name, run in kinds.items():  # interleaved: each kind sees the same conditions
                prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
                started = time.perf_counter()
                await run(f"core-{name}-{i}", prompt)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - started)
                await asyncio.sleep(args.gap_ms / 1000)  # the core idles between requests
    finally:
        await driver.core.close(Shutdown())
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.core_latency", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="sim:llama-3-8b@h100")
    p.add_argument("--rounds", type=int, default=300, help="measured rounds of each kind")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gap-ms", type=float, default=2.0, help="idle time before each command")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the core")
    p.add_argument("--output", default="", help="JSON path (default: print only)")
    args = p.parse_args(argv)
    try:  # the loop a node runs on (uvicorn takes uvloop where it is installed)
        import uvloop

        times = uvloop.run(_measure(args))
    except ImportError:
        times = asyncio.run(_measure(args))
    rows = {name: _percentiles(samples) for name, samples in times.items()}
    print(f"engine core {args.model}, {args.rounds} rounds, concurrency 1, prompt {args.prompt_len} tokens")
    for name, row in rows.items():
        p50, p90, mean = row["p50_us"], row["p90_us"], row["mean_us"]
        print(f"{name:8s} p50 {p50:9.1f} us  p90 {p90:9.1f} us  mean {mean:9.1f} us")
    boundary = {
        "local_minus_offline_p50_us": rows["local"]["p50_us"] - rows["offline"]["p50_us"],
        "local_over_offline_p50": rows["local"]["p50_us"] / rows["offline"]["p50_us"],
    }
    print(
        f"the boundary costs a local one-token request {boundary['local_minus_offline_p50_us']:.1f} us p50 "
        f"({boundary['local_over_offline_p50']:.3f}x offline)"
    )
    if args.output:
        result = {
            "benchmark": "core_latency",
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(
                ["python -m pdserve.benchmarks.core_latency", *(argv if argv is not None else sys.argv[1:])]
            ),
            "host": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "anchor": "the same one-token request on an in-process LLMEngine (offline), interleaved",
            "settings": vars(args),
            "figures": rows,
            "boundary": boundary,
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
