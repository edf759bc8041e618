"""Goodput against request rate: 1 prefill + 1 decode node against 2 co-located replicas, same GPUs.

Both shapes use the same two GPUs and the same proxy. One workload (random token-id prompts
of ``--input-min``..``--input-max`` tokens, ``--output-min``..``--output-max`` output tokens,
Poisson arrivals, seeded) is swept over ``--rates`` with ``pdserve bench serve``; goodput is
the share of requests meeting TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``, and the
highest rate with >= 90 % is each shape's goodput rate (DistServe's definition).

    python -m pdserve.benchmarks.goodput_pd_vs_replicas --model random:llama-3-8b --gpus 0,1 \\
        --out-dir docs/benchmarks/goodput_h200x2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig


def write_workload(path: Path, args, num_lines: int) -> None:
    rng = random.Random(args.seed)
    with open(path, "w") as f:
        for _ in range(num_lines):
            n = rng.randint(args.input_min, args.input_max)
            line = {
                "prompt": [rng.randrange(10, args.vocab) for _ in range(n)],
                "output_len": rng.randint(args.output_min, args.output_max),
            }
            f.write(json.dumps(line) + "\n")


def bench_sweep(url: str, workload: Path, out_dir: Path, name: str, args) -> dict:
    """``pdserve bench serve`` over ``args.rates`` against ``url``: token-id prompts from
    ``workload`` (``args.num_prompts`` per rate, each rate its own slice of the file), one chunk
    per step (``logprobs: 0``), SLOs from ``args``; returns its JSON."""
    result = out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url]
    cmd += ["--endpoint", "/v1/completions", "--dataset", "jsonl", "--dataset-path", str(workload)]
    cmd += ["--num-prompts", str(args.num_prompts), "--sweep-rates", args.rates]
    cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    cmd += ["--extra-body", '{"logprobs": 0}', "--num-warmups", "2", "--seed", str(args.seed)]
    cmd += ["--label", name, "--disable-tqdm", "--output-json", str(result)]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot-dir", str(out_dir / name)]
    subprocess.run(cmd, check=True)
    return json.loads(result.read_text())


def run_shape(name: str, cfg: ClusterConfig, workload: Path, out_dir: Path, args) -> dict:
    flags = ["--model", args.model, *args.engine_flags.split()]
    cluster = LocalCluster(cfg, flags, ModelConfig(args.model))
    try:
        return bench_sweep(cluster.start(), workload, out_dir, name, args)
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--gpus", default="0,1")
    p.add_argument("--rates", default="2,4,8,12")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-min", type=int, default=1024)
    p.add_argument("--input-max", type=int, default=4096)
    p.add_argument("--output-min", type=int, default=128)
    p.add_argument("--output-max", type=int, default=512)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-flags", default="")
    p.add_argument("--device", default="", help="the machine, for the JSON (e.g. 2x NVIDIA H200)")
    p.add_argument("--out-dir", default="goodput")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = out_dir / "workload.jsonl"
    # Every rate (and the warmups) gets prompts of its own: a prefix cache must not serve a rate
    # from an earlier rate's requests.
    write_workload(workload, args, args.num_prompts * (len(args.rates.split(",")) + 1))
    common = dict(threads_per_node=4, routing="least-loaded", startup_timeout_s=600.0, redis_url="none")
    shapes = {
        "1P1D": ClusterConfig(
            port=free_port(),
            prefill_nodes=1,
            decode_nodes=1,
            gpus=args.gpus,
            log_dir=tempfile.mkdtemp(prefix="gp-pd-"),
            **common,
        ),
        "2xcolocated": ClusterConfig(
            port=free_port(),
            prefill_nodes=0,
            decode_nodes=0,
            both_nodes=2,
            gpus=args.gpus,
            log_dir=tempfile.mkdtemp(prefix="gp-co-"),
            **common,
        ),
    }
    results = {name: run_shape(name, cfg, workload, out_dir, args) for name, cfg in shapes.items()}
    workload.unlink()  # large and reproducible from the seed
    summary = {"benchmark": "goodput_pd_vs_replicas", "device": args.device, "args": vars(args), "shapes": {}}
    for name, r in results.items():
        summary["shapes"][name] = {"sweep": r["sweep"], "runs": r["runs"]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, r in results.items():
        points = ", ".join(f"{pt['request_rate']}: {pt['slo_attainment']:.2f}" for pt in r["sweep"]["points"])
        print(f"{name}: SLO attainment by rate {points}; goodput rate {r['sweep']['max_goodput_rate']}")


if __name__ == "__main__":
    main()
