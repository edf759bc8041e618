"""Scale-out: 2 prefill + 2 decode nodes with the shared prefix index, against 1P1D on the same workload.

One GPU per node. A shared-prefix multi-turn workload of token-id conversations (``--prefixes``
system prompts of ``--prefix-len`` tokens per rate, each opening ``num_prompts / prefixes``
conversations of ``--turns`` user turns; every turn's history carries the earlier answers' token
ids) is swept over ``--rates`` (conversations per second, Poisson) with ``pdserve bench serve``.
Shapes, each on a fresh cluster (cold caches, its own Redis):

- ``2P2D-prefix-aware`` and ``2P2D-round-robin``: 4 GPUs, the routing policy is what differs;
- ``1P1D-prefix-aware``: the first 2 GPUs, the anchor for scaling.

Reported per shape: goodput (share of requests with TTFT <= ``--slo-ttft-ms`` and TPOT <=
``--slo-tpot-ms``; the highest rate where >= 90 % meet both), request and token throughput per
rate, prompt tokens computed and prefix-cache hit tokens on the prefill nodes (hit rate), KV bytes
the prefill nodes sent and the mean per-request transfer rate (bytes over summed transfer time);
then 2P2D over 1P1D. Each rate takes its own slice of the workload file, so no rate finds an
earlier rate's prompts cached.

    python -m pdserve.benchmarks.scale_out --gpus 0,1,2,3 --out-dir docs/benchmarks/scale_out_h200x4
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.benchmarks.goodput_pd_vs_replicas import bench_sweep
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig
from pdserve.metrics import parse_text

SHAPES = ("2P2D-prefix-aware", "2P2D-round-robin", "1P1D-prefix-aware")


def write_workload(path: Path, args, num_runs: int) -> None:
    """``num_runs`` slices of ``args.num_prompts`` conversations, each slice with its own prefixes."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, args.vocab) for _ in range(n)]

    with open(path, "w") as f:
        for _ in range(num_runs):
            prefixes = [ids(args.prefix_len) for _ in range(args.prefixes)]
            convs = []
            for i in range(args.num_prompts):
                convs.append(
                    {
                        "system": prefixes[i % args.prefixes],
                        "turns": [ids(rng.randint(args.turn_min, args.turn_max)) for _ in range(args.turns)],
                        "output_len": [
                            rng.randint(args.output_min, args.output_max) for _ in range(args.turns)
                        ],
                    }
                )
            rng.shuffle(convs)  # conversations sharing a prefix arrive interleaved
            f.writelines(json.dumps(c) + "\n" for c in convs)


def _node_totals(urls: list[str]) -> dict[str, float]:
    names = (
        "pdserve_prompt_tokens_computed_total",
        "pdserve_prefix_cache_hit_tokens_total",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_seconds_sum",
        "pdserve_kv_transfer_seconds_count",
    )
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        metrics = parse_text(httpx.get(f"{url}/metrics", timeout=10).text)
        for name in names:
            totals[name] += metrics.get(name, 0.0)
    return totals


def run_shape(name: str, workload: Path, out_dir: Path, args) -> dict:
    nodes, routing = name.split("-", 1)
    size = int(nodes[0])
    gpus = args.gpus.split(",")[: 2 * size]
    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=size,
        decode_nodes=size,
        gpus=",".join(gpus),
        routing=routing,
        threads_per_node=4,
        startup_timeout_s=600.0,
        log_dir=tempfile.mkdtemp(prefix=f"scale-{name}-"),
    )
    cluster = LocalCluster(cfg, ["--model", args.model, *args.engine_flags.split()], ModelConfig(args.model))
    started = time.perf_counter()
    try:
        url = cluster.start()
        startup_s = time.perf_counter() - started
        result = bench_sweep(url, workload, out_dir, name, args)
        prefill = _node_totals(cluster.node_urls("prefill"))
        decode = _node_totals(cluster.node_urls("decode"))
    finally:
        cluster.stop()
    computed = prefill["pdserve_prompt_tokens_computed_total"]
    hits = prefill["pdserve_prefix_cache_hit_tokens_total"]
    seconds = prefill["pdserve_kv_transfer_seconds_sum"]
    summary = {
        "gpus": gpus,
        "routing": routing,
        "startup_s": startup_s,
        "sweep": result["sweep"],
        "runs": [{k: v for k, v in run.items() if k != "requests"} for run in result["runs"]],
        "prefill_prompt_tokens_computed": computed,
        "prefill_prefix_hit_tokens": hits,
        "prefill_prefix_hit_rate": hits / max(1.0, hits + computed),
        "decode_prompt_tokens_computed": decode["pdserve_prompt_tokens_computed_total"],
        "kv_bytes_sent": prefill["pdserve_kv_transfer_bytes_total"],
        "kv_transfers": prefill["pdserve_kv_transfer_seconds_count"],
        "kv_transfer_gb_per_s": prefill["pdserve_kv_transfer_bytes_total"] / seconds / 1e9
        if seconds
        else None,
    }
    (out_dir / f"{name}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _best(shape: dict, key: str) -> float:
    return max(run[key] for run in shape["runs"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--gpus", default="0,1,2,3")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rates", default="2,4,8,16", help="conversations per second")
    p.add_argument("--num-prompts", type=int, default=48, help="conversations per rate")
    p.add_argument("--prefixes", type=int, default=8, help="system prompts per rate")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-min", type=int, default=64)
    p.add_argument("--turn-max", type=int, default=256)
    p.add_argument("--output-min", type=int, default=64)
    p.add_argument("--output-max", type=int, default=192)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-flags", default="")
    p.add_argument("--device", default="", help="the machine, for the JSON (e.g. 4x NVIDIA H200)")
    p.add_argument("--out-dir", default="scale_out")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = Path(tempfile.mkdtemp(prefix="scale-out-")) / "workload.jsonl"
    write_workload(workload, args, len(args.rates.split(",")) + 1)
    shapes = {}
    for name in args.shapes.split(","):
        shapes[name] = run_shape(name, workload, out_dir, args)
        s = shapes[name]
        points = ", ".join(f"{pt['request_rate']}: {pt['slo_attainment']:.2f}" for pt in s["sweep"]["points"])
        print(
            f"{name}: attainment by rate {points}; goodput rate {s['sweep']['max_goodput_rate']}; "
            f"prefix hit rate {s['prefill_prefix_hit_rate']:.3f}; "
            f"computed {s['prefill_prompt_tokens_computed']:.0f}; "
            f"KV {s['kv_transfer_gb_per_s'] or 0:.1f} GB/s; startup {s['startup_s']:.0f} s",
            flush=True,
        )
    summary = {"benchmark": "scale_out", "device": args.device, "args": vars(args), "shapes": shapes}
    base = shapes.get("1P1D-prefix-aware")
    if base is not None:
        summary["scaling_vs_1P1D"] = {
            name: {
                "goodput_rate": (s["sweep"]["max_goodput_rate"] or 0)
                / (base["sweep"]["max_goodput_rate"] or 1),
                "max_output_throughput": _best(s, "output_throughput") / _best(base, "output_throughput"),
                "max_request_goodput": _best(s, "request_goodput")
                / max(1e-9, _best(base, "request_goodput")),
            }
            for name, s in shapes.items()
            if name != "1P1D-prefix-aware"
        }
        print("scaling vs 1P1D:", json.dumps(summary["scaling_vs_1P1D"]))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
