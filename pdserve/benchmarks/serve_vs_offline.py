"""The whole serving path against the engine alone, on one GPU in one run.

    python -m pdserve.benchmarks.serve_vs_offline --model random:llama-3-8b \\
        --concurrency 128 --num-prompts 384 --input-len 128 --output-len 256

The anchor is the engine without any serving: in a process of its own, ``LLM.generate`` on all
``--num-prompts`` random token-id prompts at once (``max_num_seqs`` = ``--concurrency``, so the
engine keeps that many running; greedy, EOS ignored, exactly ``--output-len`` tokens each), warmed
by one call at that exact shape, best of ``--repeats``; then, for TTFT and TPOT, the same engine
driven in a closed loop of ``--concurrency`` requests (a new one added as one finishes), as a
client holding that many streams open would, best of ``--repeats`` by throughput.

Then, for each topology, the processes a user runs (``pdserve node``, ``pdserve proxy``) on the
same GPU, with the same engine settings and KV blocks, loaded through the OpenAI API
(``/v1/completions``, streamed) by client processes on raw sockets that hold ``--concurrency``
streams in a closed loop until ``--num-prompts`` requests have completed; one warm-up pass at
the same shape first, then best of ``--repeats``:

- ``colocated``: one node (``--role both``) behind the proxy;
- ``pd``: a prefill node and a decode node sharing the GPU (KV over nixl/CUDA IPC), each with
  the anchor's KV blocks.

Output tok/s is completed requests x ``--output-len`` over the wall time from the first send to
the last finish (so the same count as the anchor's). TTFT is send to the first token event, TPOT
(end - first token) / (tokens - 1), per request. Each timed run also records the mean of every
``*_seconds`` histogram the proxy and the nodes export over that run (``mean_seconds``: reserve,
prefill call, KV transfer, ...), to show where the time went. Writes JSON (``--out``) naming the
device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.benchmarks.serve_metrics import means_since, seconds_totals
from pdserve.cluster import log_tail
from pdserve.utils import free_port

DEFAULT_OUT = "docs/benchmarks/serve_vs_offline.json"
VOCAB = 32000
"""Prompt token ids are drawn below this (every preset's vocabulary is larger)."""


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(ttfts: list[float], tpots: list[float], tokens: int, wall: float) -> dict:
    return {
        "output_tok_s": tokens / wall,
        "wall_s": wall,
        "ttft_p50_ms": 1e3 * _pct(ttfts, 0.5),
        "ttft_p90_ms": 1e3 * _pct(ttfts, 0.9),
        "tpot_p50_ms": 1e3 * _pct(tpots, 0.5),
        "tpot_p90_ms": 1e3 * _pct(tpots, 0.9),
    }


# -- the anchor: the engine alone ---------------------------------------------------------------


def _offline(args: argparse.Namespace, out_path: str) -> None:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        max_num_seqs=args.concurrency,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.input_len + args.output_len + 16,
    )
    prompts = _prompts(args.num_prompts, args.input_len, VOCAB, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens = args.num_prompts * args.output_len
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # warm-up at the timed shape
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append(time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
    generate = {"output_tok_s": tokens / min(runs), "wall_s": min(runs), "runs_s": runs}

    engine = llm.engine
    loops = []
    for r in range(args.repeats + 1):  # the first is a warm-up
        pending = list(enumerate(prompts))
        sent: dict[str, float] = {}
        first: dict[str, float] = {}
        ttfts, tpots = [], []
        start = time.perf_counter()
        while pending or sent:
            while pending and len(sent) < args.concurrency:
                i, p = pending.pop(0)
                rid = f"loop{r}-{i}"
                engine.add_request(rid, None, params, prompt_token_ids=p)
                sent[rid] = time.perf_counter()
            for out in engine.step():
                now = time.perf_counter()
                rid = out.request_id
                if rid not in first and out.outputs[0].token_ids:
                    first[rid] = now
                    ttfts.append(now - sent[rid])
                if out.finished:
                    n = len(out.outputs[0].token_ids)
                    tpots.append((now - first[rid]) / max(1, n - 1))
                    del sent[rid]
        wall = time.perf_counter() - start
        if r:
            loops.append(_summary(ttfts, tpots, tokens, wall))
    closed_loop = max(loops, key=lambda s: s["output_tok_s"])
    Path(out_path).write_text(json.dumps({"generate": generate, "closed_loop": closed_loop}))


# -- the serving path ---------------------------------------------------------------------------


def _client(
    port: int, model: str, jobs: list[list[int]], streams: int, output_len: int, ready, go, results
) -> None:
    """One client process: ``streams`` concurrent streams over its share of the prompts, started
    when ``go`` is set (so that no process start-up falls into the timed wall). Puts its rows and
    the ``time.monotonic()`` of its first send and last finish."""

    async def one(ids: list[int]) -> tuple[float, float, int, bool]:
        body = json.dumps(
            {
                "model": model,
                "prompt": ids,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        sent = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        first = 0.0
        events = 0
        tail = b""
        ok = False
        while chunk := await reader.read(65536):
            seen = tail + chunk
            n = seen.count(b"data: {") - tail.count(b"data: {")
            if n and not first:
                first = time.perf_counter()
            events += n
            if b"data: [DONE]" in seen:
                ok = b'"error"' not in seen
            tail = seen[-16:]
        writer.close()
        return first - sent if first else float("nan"), time.perf_counter() - first, events, ok

    async def main() -> list:
        queue = list(jobs)
        out = []

        async def worker() -> None:
            while queue:
                out.append(await one(queue.pop()))

        await asyncio.gather(*(worker() for _ in range(streams)))
        return out

    ready.put(os.getpid())
    go.wait()
    started = time.monotonic()
    rows = asyncio.run(main())
    results.put((rows, started, time.monotonic()))


def _load(
    port: int, model: str, prompts: list[list[int]], concurrency: int, output_len: int, procs: int
) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    shares = [prompts[i::procs] for i in range(procs)]
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    workers = [
        ctx.Process(target=_client, args=(port, model, shares[i], per[i], output_len, ready, go, results))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get()
    go.set()
    parts = [results.get() for _ in workers]
    rows = [r for part in parts for r in part[0]]
    wall = max(p[2] for p in parts) - min(p[1] for p in parts)
    for w in workers:
        w.join()
    ok = [r for r in rows if r[3] and r[2] > 0]
    ttfts = [r[0] for r in ok]
    tpots = [r[1] / max(1, output_len - 1) for r in ok]
    summary = _summary(ttfts, tpots, len(ok) * output_len, wall)
    summary["failed"] = len(rows) - len(ok)
    summary["token_events_per_request"] = statistics.mean(r[2] for r in ok) if ok else 0
    return summary


def _wait_ready(url: str, timeout: float, procs: list[subprocess.Popen]) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{shlex.join(p.args)} exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout:g} s")


def _serve(args: argparse.Namespace, topology: str, prompts: list[list[int]], log_dir: Path) -> dict:
    py = [sys.executable, "-m", "pdserve"]
    engine = [
        "--model",
        args.model,
        "--max-num-seqs",
        str(args.concurrency),
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-model-len",
        str(args.input_len + args.output_len + 16),
        *shlex.split(args.node_flags),
    ]
    procs: list[subprocess.Popen] = []
    logs: dict[str, Path] = {}

    def start(name: str, cmd: list[str]) -> None:
        logs[name] = log_dir / f"{topology}-{name}.log"
        log = open(logs[name], "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def totals(name: str, url: str) -> dict[str, tuple[float, float]]:
        """A server's histogram totals; if it is gone, which one, how it ended and its log's end."""
        try:
            return _seconds_totals(url)
        except OSError as e:
            ended = {n: p.poll() for n, p in zip(logs, procs)}
            tails = "".join(
                f"\n--- {n} (exit code {ended[n]}), last lines of {logs[n]}:\n{log_tail(logs[n], 40)}"
                for n in logs
                if ended[n] is not None or n == name
            )
            raise RuntimeError(f"{topology}: {name} at {url} did not answer /metrics ({e}){tails}") from None

    nodes: dict[str, str] = {}
    try:
        if topology == "colocated":
            port = free_port()
            start("both", [*py, "node", "--role", "both", "--port", str(port), *engine])
            nodes["--both-urls"] = f"http://127.0.0.1:{port}"
        else:
            for role in ("prefill", "decode"):
                port = free_port()
                start(role, [*py, "node", "--role", role, "--port", str(port), *engine])
                nodes[f"--{role}-urls"] = f"http://127.0.0.1:{port}"
                _wait_ready(f"http://127.0.0.1:{port}/health", args.ready_timeout_s, procs)
        for url in nodes.values():
            _wait_ready(f"{url}/health", args.ready_timeout_s, procs)
        proxy_port = free_port()
        node_args = [x for kv in nodes.items() for x in kv]
        proxy = [
            *py,
            "proxy",
            "--port",
            str(proxy_port),
            "--model",
            args.model,
            "--workers",
            str(args.workers),
        ]
        proxy += node_args
        start("proxy", [*proxy, *shlex.split(args.proxy_flags)])
        _wait_ready(f"http://127.0.0.1:{proxy_port}/health", args.ready_timeout_s, procs)
        load = (proxy_port, args.model)
        at_ready = [_jit_compiles(url) for url in nodes.values()]
        warm = _load(*load, prompts[: args.concurrency], args.concurrency, args.output_len, args.client_procs)
        after_warmup = [_jit_compiles(url) for url in nodes.values()]
        servers = {flag.removeprefix("--").removesuffix("-urls"): url for flag, url in nodes.items()}
        servers["proxy"] = f"http://127.0.0.1:{proxy_port}"
        runs = []
        for _ in range(args.repeats):
            before = {name: totals(name, url) for name, url in servers.items()}
            runs.append(_load(*load, prompts, args.concurrency, args.output_len, args.client_procs))
            runs[-1]["mean_seconds"] = {
                name: means_since(before[name], totals(name, url)) for name, url in servers.items()
            }
        best = max(runs, key=lambda s: s["output_tok_s"])
        best["runs_tok_s"] = [r["output_tok_s"] for r in runs]
        best["warmup_tok_s"] = warm["output_tok_s"]
        at_end = [_jit_compiles(url) for url in nodes.values()]
        best["jit_compiles"] = {"at_ready": at_ready, "after_warmup_pass": after_warmup, "at_end": at_end}
        best["jit_compiles_during_timed_runs"] = [e - w for e, w in zip(at_end, after_warmup)]
        return best
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _seconds_totals(url: str) -> dict[str, tuple[float, float]]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return seconds_totals(r.read().decode())


def _jit_compiles(url: str) -> float | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("pdserve_jit_compiles_total"):
            return float(line.split()[-1])
    return None


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return platform.processor() or "cpu"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=384)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topologies", default="colocated,pd")
    p.add_argument("--workers", type=int, default=2, help="proxy worker processes")
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--node-flags", default="", help="more flags for every node")
    p.add_argument("--proxy-flags", default="", help="more flags for the proxy")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default="/tmp/serve_vs_offline")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--offline-only", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.offline_only:
        _offline(args, args.offline_only)
        return
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    anchor_path = log_dir / "offline.json"
    cmd = [sys.executable, "-m", "pdserve.benchmarks.serve_vs_offline", *(argv or sys.argv[1:])]
    subprocess.run([*cmd, "--offline-only", str(anchor_path)], check=True)
    anchor = json.loads(anchor_path.read_text())
    gen_tok_s = anchor["generate"]["output_tok_s"]
    print(f"anchor: LLM.generate {gen_tok_s:,.0f} tok/s; closed loop {anchor['closed_loop']}")
    prompts = _prompts(args.num_prompts, args.input_len, VOCAB, args.seed)
    result = {
        "device": _device(),
        "host_cpus": os.cpu_count(),
        "command": shlex.join(cmd),
        "anchor": {
            "what": "LLM.generate on all prompts (max_num_seqs = concurrency), warmed at the timed shape, "
            "best of repeats; TTFT/TPOT from the same engine in a closed loop of `concurrency` requests",
            **anchor,
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("offline_only", "log_dir", "out")},
        "topologies": {},
    }
    gen = anchor["generate"]["output_tok_s"]
    loop = anchor["closed_loop"]
    for topology in args.topologies.split(","):
        r = _serve(args, topology, prompts, log_dir)
        r["over_generate"] = r["output_tok_s"] / gen
        r["ttft_p50_over_offline"] = r["ttft_p50_ms"] / loop["ttft_p50_ms"]
        r["tpot_p50_over_offline"] = r["tpot_p50_ms"] / loop["tpot_p50_ms"]
        result["topologies"][topology] = r
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # what is done so far
        print(
            f"{topology}: {r['output_tok_s']:,.0f} tok/s = {r['over_generate']:.2f} of LLM.generate; "
            f"TTFT p50 {r['ttft_p50_ms']:.0f} ms ({r['ttft_p50_over_offline']:.2f}x offline), "
            f"TPOT p50 {r['tpot_p50_ms']:.1f} ms ({r['tpot_p50_over_offline']:.2f}x); failed {r['failed']}; "
            f"compiles in timed runs {r['jit_compiles_during_timed_runs']} ({r['jit_compiles']})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
