"""Where should a short prompt be prefilled: on a prefill node, or on the decode node itself?

One 1P1D cluster, two proxies over it: ``remote`` (``--min-remote-prefill-tokens 0``: always the
prefill node) and ``local`` (a huge threshold: always the decode node). For each prompt length
L, while ``--background`` streams keep the decode node busy decoding, probe requests of L
random tokens (one output token) go through one proxy at a time. Reported per (L, mode): the
probes' TTFT and the background streams' TPOT. Local prefill saves the hop and the transfer
(lower TTFT) but stalls the decode batch while the prompt is computed (higher TPOT); the
``--min-remote-prefill-tokens`` default is where the TPOT cost starts to outweigh the TTFT gain.

    python -m pdserve.benchmarks.conditional_prefill --model random:llama-3-8b --gpus 0,1 \\
        --output docs/benchmarks/conditional_prefill_h200x2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, times=None
):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,  # a chunk per step even without a tokenizer
    }
    start = time.perf_counter()
    times = [] if times is None else times  # the caller's list fills as tokens arrive
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"choices":[{' in line:
                times.append(time.perf_counter())
    return start, times


async def _phase(url: str, model: str, rng: random.Random, length: int, args) -> dict:
    stop = asyncio.Event()
    streams: list[list[float]] = []  # token arrival times of every background stream

    async def background(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            prompt = [rng.randrange(10, args.vocab) for _ in range(64)]
            streams.append([])
            await _stream(client, url, model, prompt, args.background_tokens, streams[-1])

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.ensure_future(background(client)) for _ in range(args.background)]
        await asyncio.sleep(args.settle_s)
        window = time.perf_counter()
        ttfts = []
        for _ in range(args.probes):
            prompt = [rng.randrange(10, args.vocab) for _ in range(length)]
            start, times = await _stream(client, url, model, prompt, 1)
            ttfts.append(times[0] - start)
            await asyncio.sleep(args.probe_gap_s)
        end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    # Token gaps of the background streams that ended inside the probes' window.
    during = [b - a for ts in streams for a, b in zip(ts, ts[1:]) if window <= b <= end]
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        **_gap_stats(during),
    }


def _gap_stats(gaps: list[float]) -> dict:
    gaps = sorted(gaps)
    if not gaps:
        return {"tpot_p50_s": 0.0, "tpot_p99_s": 0.0}
    return {"tpot_p50_s": gaps[len(gaps) // 2], "tpot_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--gpus", default="0,1")
    p.add_argument("--lengths", default="16,64,256,1024")
    p.add_argument("--background", type=int, default=16, help="concurrent decoding streams")
    p.add_argument("--background-tokens", type=int, default=256)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--probe-gap-s", type=float, default=0.05)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads-per-node", type=int, default=4)
    p.add_argument("--engine-flags", default="")
    p.add_argument("--output", default="")
    args = p.parse_args()
    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=1,
        decode_nodes=1,
        gpus=args.gpus,
        threads_per_node=args.threads_per_node,
        routing="least-loaded",
        min_remote_prefill_tokens=0,
        log_dir=tempfile.mkdtemp(prefix="cond-"),
        startup_timeout_s=600.0,
    )
    cluster = LocalCluster(cfg, ["--model", args.model, *args.engine_flags.split()], ModelConfig(args.model))
    rows = []
    try:
        remote = cluster.start()
        nodes = ["--prefill-urls", ",".join(cluster.node_urls("prefill"))]
        nodes += ["--decode-urls", ",".join(cluster.node_urls("decode"))]
        local = cluster.add_proxy(*nodes, "--min-remote-prefill-tokens", "1000000")
        model = httpx.get(f"{remote}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(0)
        for length in [int(x) for x in args.lengths.split(",")]:
            for mode, url in (("remote", remote), ("local", local)):
                row = {
                    "prompt_len": length,
                    "mode": mode,
                    **asyncio.run(_phase(url, model, rng, length, args)),
                }
                rows.append(row)
                print(
                    f"L={length:>5} {mode:<6} TTFT p50 {row['ttft_p50_s'] * 1e3:8.1f} ms   "
                    f"background TPOT p50 {row['tpot_p50_s'] * 1e3:7.2f} ms "
                    f"p99 {row['tpot_p99_s'] * 1e3:7.2f} ms",
                    flush=True,
                )
    finally:
        cluster.stop()
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the report just names no device
        device = "unknown"
    result = {"benchmark": "conditional_prefill", "device": device, "args": vars(args), "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
