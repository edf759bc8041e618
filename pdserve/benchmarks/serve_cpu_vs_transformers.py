"""CPU serving comparison: `pdserve up` against `transformers serve --continuous-batching`.

One run, one JSON. Both servers serve the same model folder (the default model, which
pdserve converted; transformers loads it as any HF folder) in float32 on the CPU, pinned to
the same cores with ``taskset``, with the same explicit KV cache: pages of ``--block-size``
tokens, ``--num-kv-blocks`` of them per engine, ``--max-batch-tokens`` per step. pdserve runs
its default cluster (one prefill node, one decode node, the proxy; the cores split between
the nodes); transformers one process with as many torch threads as cores.

Both are up at once, the idle one waiting, and ``pdserve bench serve`` loads them in turn
at each request rate (rotating which goes first), so that background load on a shared
machine falls on all alike. transformers runs once per ``--transformers-threads`` setting
(default: as many torch threads as cores, and one thread): with every core busy, torch's
OpenMP thread team stalls whenever another process takes one of its cores, so on a shared
machine one thread can beat two. Every request is a streaming chat completion of a random prompt
(``--input-len`` words after the chat template) asking for exactly ``--output-len`` greedy
tokens: pdserve gets ``ignore_eos``; transformers, which rejects unknown fields, gets a
``generation_config`` with ``eos_token_id: -1`` (EOS disabled) and ``do_sample: false``.
Each rate has its own prompts (the same for both servers), and each server first answers
``--num-warmups`` requests that are not counted.

    python -m pdserve.benchmarks.serve_cpu_vs_transformers --cores 0,1 --num-prompts 64 \\
        --rates 1,2,inf --output docs/benchmarks/serve_cpu_vs_transformers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.serve_metrics import max_goodput_rate
from pdserve.benchmarks.serve_report import record_from_json
from pdserve.utils import free_port

DEFAULT_OUTPUT = "docs/benchmarks/serve_cpu_vs_transformers.json"


@dataclass(frozen=True)
class Server:
    """A server under test: how to start it and what its bench requests need."""

    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    base_url: str
    bench_flags: tuple[str, ...]


def _servers(args: argparse.Namespace, model_dir: Path, log_dir: Path) -> list[Server]:
    cores = args.cores
    num_cores = len(cores.split(","))
    pin = ("taskset", "-c", cores)
    cache = ["--block-size", str(args.block_size), "--num-kv-blocks", str(args.num_kv_blocks)]
    pd_port = free_port()
    pdserve = Server(
        "pdserve",
        (
            *pin,
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--port",
            str(pd_port),
            "--threads-per-node",
            str(max(1, num_cores // 2)),
            "--log-dir",
            str(log_dir / "pdserve"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *cache,
            "--max-num-batched-tokens",
            str(args.max_batch_tokens),
            *shlex.split(args.pdserve_flags),
        ),
        (),
        f"http://127.0.0.1:{pd_port}",
        (),
    )
    generation_config = json.dumps({"eos_token_id": -1, "do_sample": False})
    baselines = []
    for threads in args.transformers_threads:
        port = free_port()
        command = (
            *pin,
            sys.executable,
            "-m",
            "transformers.cli.transformers",  # the `transformers` console script
            "serve",
            str(model_dir),
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--cb-block-size",
            str(args.block_size),
            "--cb-num-blocks",
            str(args.num_kv_blocks),
            "--cb-max-batch-tokens",
            str(args.max_batch_tokens),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        )
        bench_flags = ("--model", str(model_dir), "--no-ignore-eos")
        bench_flags += ("--extra-body", json.dumps({"generation_config": generation_config}))
        env = (("HF_HUB_OFFLINE", "1"), ("OMP_NUM_THREADS", str(threads)))
        baselines.append(
            Server(f"transformers-{threads}t", command, env, f"http://127.0.0.1:{port}", bench_flags)
        )
    return [pdserve, *baselines]


def _start(server: Server, log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{server.name}.log", "w") as log:
        return subprocess.Popen(
            server.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **dict(server.env)},
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_healthy(server: Server, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} not healthy after {timeout_s:g} s")


def _bench_command(args, server: Server, rate: float, seed: int, warmups: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        *server.bench_flags,
        "--dataset",
        "random",
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--num-warmups",
        str(warmups),
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tpot-ms",
        str(args.slo_tpot_ms),
        "--label",
        server.name,
        "--save-detailed",
        "--disable-tqdm",
        "--ready-timeout-s",
        "600",
        "--output-json",
        str(out),
    ]


def _load() -> float:
    return os.getloadavg()[0]


def _versions() -> dict:
    import torch
    import transformers

    import pdserve

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pdserve": pdserve.__version__,
    }


def _compare(per_server: dict[str, list[dict]], rates: list[str]) -> list[dict]:
    """pdserve over each transformers setting at each rate: throughput (higher is better for
    pdserve) and median latency ratios (lower is better for pdserve)."""
    rows = []
    for name, runs in per_server.items():
        if name == "pdserve":
            continue
        for rate, pd, hf in zip(rates, per_server["pdserve"], runs):
            rows.append(
                {
                    "baseline": name,
                    "request_rate": rate,
                    "output_throughput_ratio": pd["output_throughput"] / hf["output_throughput"],
                    "request_throughput_ratio": pd["request_throughput"] / hf["request_throughput"],
                    "ttft_p50_ratio": pd["ttft_ms"]["p50"] / hf["ttft_ms"]["p50"],
                    "tpot_p50_ratio": pd["tpot_ms"]["p50"] / hf["tpot_ms"]["p50"],
                    "same_prompt_tokens": pd["total_input_tokens"] == hf["total_input_tokens"],
                }
            )
    return rows


def run(args: argparse.Namespace) -> dict:
    from pdserve.config import ModelConfig
    from pdserve.default_model import ensure_default_model

    model_dir = ensure_default_model(ModelConfig().resolved_cache_dir)
    if args.transformers_threads is None:
        args.transformers_threads = sorted({len(args.cores.split(",")), 1}, reverse=True)
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pdserve-serve-cmp-"))
    servers = _servers(args, model_dir, work / "logs")
    result: dict = {
        "benchmark": "serve_cpu_vs_transformers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", "-m", "pdserve.benchmarks.serve_cpu_vs_transformers", *sys.argv[1:]]
        ),
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores on the host",
        "versions": _versions(),
        "load_avg_1m_at_start": _load(),
        "setup": {
            "model": str(model_dir),
            "dtype": "float32",
            "cores": args.cores,
            "block_size": args.block_size,
            "num_kv_blocks_per_engine": args.num_kv_blocks,
            "max_batch_tokens": args.max_batch_tokens,
            "workload": f"{args.num_prompts} streaming chat requests per rate, random {args.input_len} words "
            f"(+ chat template), {args.output_len} greedy output tokens, Poisson arrivals",
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        },
        "servers": {s.name: {"command": shlex.join(s.command), "env": dict(s.env)} for s in servers},
    }
    procs = {}
    per_server: dict[str, list[dict]] = {s.name: [] for s in servers}
    records: dict[str, list] = {s.name: [] for s in servers}
    try:
        for s in servers:
            procs[s.name] = _start(s, work / "logs")
        for s in servers:
            _wait_healthy(s, procs[s.name], args.startup_timeout_s)
        for i, rate in enumerate(rates):
            order = servers[i % len(servers) :] + servers[: i % len(servers)]  # rotate who goes first
            for s in order:
                out = work / f"{s.name}_{i}.json"
                cmd = _bench_command(args, s, rate, args.seed + i, args.num_warmups if i == 0 else 0, out)
                load_before = _load()
                print(f"--- {s.name} at {rate:g} req/s (load {load_before:.2f})", flush=True)
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"bench against {s.name} failed:\n{proc.stdout}\n{proc.stderr}")
                bench = json.loads(out.read_text())
                (run_result,) = bench["runs"]
                records[s.name].append([record_from_json(r) for r in run_result.pop("requests")])
                run_result["load_avg_1m_before"] = load_before
                run_result["bench_command"] = shlex.join(cmd)
                per_server[s.name].append(run_result)
                print(
                    f"    {run_result['output_throughput']:.1f} out tok/s, TTFT p50 "
                    f"{run_result['ttft_ms']['p50']:.0f} ms, TPOT p50 {run_result['tpot_ms']['p50']:.0f} ms, "
                    f"SLO attainment {run_result['slo_attainment']:.0%}",
                    flush=True,
                )
    finally:
        for proc in procs.values():
            _stop(proc)
    names = [r["request_rate"] for r in per_server["pdserve"]]
    for s in servers:
        runs = per_server[s.name]
        points = [(rate, r["slo_attainment"]) for rate, r in zip(rates, runs)]
        result["servers"][s.name]["runs"] = runs
        result["servers"][s.name]["max_goodput_rate"] = max_goodput_rate(points, args.slo_attainment_target)
    result["comparison"] = _compare(per_server, names)
    result["load_avg_1m_at_end"] = _load()
    result["logs"] = str(work / "logs")
    if args.plot_dir:
        result["plots"] = _plots(args, servers, rates, per_server, records)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print(result)
    print(f"wrote {out}")
    return result


def _plots(args, servers: list[Server], rates, per_server, records) -> list[str]:
    from pdserve.benchmarks import serve_plots
    from pdserve.benchmarks.serve_metrics import SLO

    out = Path(args.plot_dir)
    series = [
        (
            s.name,
            rates,
            [r["slo_attainment"] for r in per_server[s.name]],
            [r["output_throughput"] for r in per_server[s.name]],
        )
        for s in servers
    ]
    paths = [serve_plots.plot_sweep(series, args.slo_attainment_target, out / "goodput_sweep.png")]
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    for i, rate in enumerate(rates):
        named = [(s.name, records[s.name][i]) for s in servers]
        name = "inf" if rate == float("inf") else f"{rate:g}"
        paths.append(serve_plots.plot_latency_cdfs(named, slo, out / f"latency_cdf_rate_{name}.png"))
    return [str(p) for p in paths]


def _print(result: dict) -> None:
    print(f"serve on {result['setup']['cores']} cores: {result['setup']['workload']}")
    for row in result["comparison"]:
        print(
            f"  rate {row['request_rate']:>4}: pdserve / {row['baseline']}: output tok/s "
            f"{row['output_throughput_ratio']:.2f}x, TTFT p50 {row['ttft_p50_ratio']:.2f}x, "
            f"TPOT p50 {row['tpot_p50_ratio']:.2f}x"
        )
    for name, server in result["servers"].items():
        print(f"  {name}: max goodput rate {server['max_goodput_rate']}")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cores", default="0,1", help="taskset CPU list both servers are pinned to")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", type=int, default=64, help="random words per prompt")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rates", default="1,2,inf", help="request rates to sweep (req/s)")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    p.add_argument("--slo-attainment-target", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16, help="KV page size, both servers")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV pages per engine, both servers")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step, both servers")
    p.add_argument("--num-warmups", type=int, default=4, help="uncounted requests per server first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pdserve-flags", default="", help="more flags for `pdserve up`")
    p.add_argument(
        "--transformers-threads",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="torch threads of transformers serve, one server each (default: number of cores, 1)",
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--plot-dir", default="", help="PNGs: goodput sweep, latency CDFs per rate")
    p.add_argument("--output", default=DEFAULT_OUTPUT)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
