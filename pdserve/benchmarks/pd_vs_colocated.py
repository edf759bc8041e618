"""Disaggregated (1 prefill + 1 decode node, one GPU each) against one co-located node at low load.

The same requests — random prompts of each of ``--input-len``'s lengths (no shared prefix),
``--output-len`` tokens each, sent one at a time — go through a fresh local cluster of each shape
(one cluster a shape, every length in turn, each warmed by a request of its length first). The
client measures TTFT (request sent to first token) and TPOT (mean gap of the following tokens)
from the SSE stream; the ratio of TTFTs is what disaggregation adds (transfer, an extra hop). P/D
runs twice: as the proxy does by default (the prompt sent to the prefill node while the decode node
reserves) and with ``--no-overlap-reserve`` (``1P1D-serial``: the prefill call after the reservation).

    python -m pdserve.benchmarks.pd_vs_colocated --model random:llama-3-8b --gpus 0,1 \\
        --input-len 512,2048,8000 --output docs/benchmarks/pd_vs_colocated_h200.json

``--gpus 0,0`` puts both nodes of the P/D shape on one GPU (then give each a share of its
memory: ``--engine-flags "--gpu-memory-utilization 0.42"``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.benchmarks.serve_metrics import means_since, percentile, seconds_totals
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig


def _stats(xs: list[float]) -> dict[str, float]:
    stats = {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}
    return {"mean": statistics.fmean(xs), **stats, "max": max(xs)}


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,  # a chunk per step even when a model without tokenizer makes no text
    }
    start = time.perf_counter()
    times = []
    tokens = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                    lp = chunk["choices"][0].get("logprobs") or {}
                    tokens += lp.get("tokens") or [chunk["choices"][0].get("text", "")]
    ttft = times[0] - start
    tpot = (times[-1] - times[0]) / max(1, output_len - 1)  # a chunk may carry several tokens
    return ttft, tpot, " ".join(tokens)


async def _drive(url: str, prompts: list[list[int]], output_len: int) -> list[tuple[float, float, str]]:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        return [await _one(client, url, model, p, output_len) for p in prompts]


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _seconds_totals(url: str) -> dict[str, tuple[float, float]]:
    return seconds_totals(httpx.get(f"{url}/metrics", timeout=30).text)


def run_shape(name: str, cfg: ClusterConfig, args, prompts: dict[int, list], warmups: dict[int, list]):
    """One cluster of this shape; every prompt length in turn: ``{input_len: figures}``."""
    cluster = LocalCluster(cfg, ["--model", args.model, *args.engine_flags.split()], ModelConfig(args.model))
    by_len = {}
    try:
        started = time.perf_counter()
        url = cluster.start()
        startup = time.perf_counter() - started
        servers = {"proxy": url} | {c.role: c.url for c in cluster.children if not c.role.startswith("proxy")}
        for input_len, batch in prompts.items():
            # Warm-up: one request of the real size (first-use costs such as a KV communicator's
            # set-up and kernels compiled for the shape stay out of the figures).
            asyncio.run(_drive(url, [warmups[input_len]], 4))
            before = {role: _seconds_totals(u) for role, u in servers.items()}
            results = asyncio.run(_drive(url, batch, args.output_len))
            phases = {role: means_since(before[role], _seconds_totals(u)) for role, u in servers.items()}
            by_len[input_len] = {
                "shape": name,
                "startup_s": startup,
                "mean_seconds": phases,
                "ttft_s": _stats([r[0] for r in results]),
                "tpot_s": _stats([r[1] for r in results]),
                "outputs": [r[2] for r in results],
            }
    finally:
        cluster.stop()
    return by_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--gpus", default="0,1")
    p.add_argument("--input-len", default="2048", help="prompt lengths, comma-separated (each a sweep)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--engine-flags", default="", help="more engine flags for every node")
    p.add_argument("--kv-transport", default="auto")
    p.add_argument("--output", default="")
    args = p.parse_args()
    rng = random.Random(0)
    lengths = [int(x) for x in args.input_len.split(",")]
    prompts = {n: [_prompt(rng, n, args.vocab) for _ in range(args.num_requests)] for n in lengths}
    warmups = {n: _prompt(rng, n, args.vocab) for n in lengths}
    gpus = args.gpus.split(",")
    common = dict(threads_per_node=4, routing="least-loaded", startup_timeout_s=600.0)
    pd = dict(
        prefill_nodes=1,
        decode_nodes=1,
        gpus=",".join(gpus[:2]),
        min_remote_prefill_tokens=0,
        extra_node_flags=f"--kv-transport {args.kv_transport}",
        **common,
    )
    shapes = {
        "1P1D": ClusterConfig(port=free_port(), log_dir=tempfile.mkdtemp(prefix="pd-"), **pd),
        "1P1D-serial": ClusterConfig(
            port=free_port(),
            log_dir=tempfile.mkdtemp(prefix="pd-serial-"),
            extra_proxy_flags="--no-overlap-reserve",
            **pd,
        ),
        "colocated": ClusterConfig(
            port=free_port(),
            prefill_nodes=0,
            decode_nodes=0,
            both_nodes=1,
            gpus=gpus[0],
            log_dir=tempfile.mkdtemp(prefix="co-"),
            **common,
        ),
    }
    runs = {name: run_shape(name, cfg, args, prompts, warmups) for name, cfg in shapes.items()}
    by_len = {}
    for n in lengths:
        pd, serial, co = runs["1P1D"][n], runs["1P1D-serial"][n], runs["colocated"][n]
        print(f"input {n} tokens")
        print(f"{'shape':<12}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}{'TPOT p90':>10}  (ms)")
        for r in (pd, serial, co):
            t, o = r["ttft_s"], r["tpot_s"]
            ms = [t["p50"], t["p90"], o["p50"], o["p90"]]
            print(f"{r['shape']:<12}" + "".join(f"{x * 1e3:>10.2f}" for x in ms))
        added = pd["ttft_s"]["p50"] / co["ttft_s"]["p50"] - 1
        added_serial = serial["ttft_s"]["p50"] / co["ttft_s"]["p50"] - 1
        same = pd["outputs"] == co["outputs"] == serial["outputs"]
        print(
            f"disaggregation adds {100 * added:.1f} % to TTFT p50 ({100 * added_serial:.1f} % with the "
            f"prefill after the reservation); identical outputs: {same}"
        )
        for r in (pd, serial, co):
            for role, means in r["mean_seconds"].items():
                figures = ", ".join(f"{k.removeprefix('pdserve_')} {v * 1e3:.2f}" for k, v in means.items())
                print(f"{r['shape']} {role} mean ms: {figures}")
        by_len[n] = {
            "ttft_added_p50": added,
            "ttft_added_p50_serial_reserve": added_serial,
            "identical_outputs": same,
            "runs": {r["shape"]: {k: v for k, v in r.items() if k != "outputs"} for r in (pd, serial, co)},
        }
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the report just names no device
        device = "unknown"
    result = {
        "benchmark": "pd_vs_colocated",
        "device": device,
        "command": "python -m pdserve.benchmarks.pd_vs_colocated " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "gpus": args.gpus,
        "output_len": args.output_len,
        "num_requests": args.num_requests,
        "kv_transport": args.kv_transport,
        "engine_flags": args.engine_flags,
        "by_input_len": by_len,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
