"""The load client's CPU per streamed token: what one `pdserve bench serve` process can drive.

A stand-in server (``sse_stand_in``: pdserve's chunk bytes, one token per ``--interval-ms`` per
stream, next to no CPU) serves the scale-out study's shared-prefix workload (``scale_out_sim``'s
jsonl of token-id prompts, multi-turn) offered at ``--rate`` conversations/s by one
``python -m pdserve.benchmarks.serve`` process; the client's CPU (user + system, from its rusage,
start-up and all, as the study counts it) over the output tokens it received. ``--compare DIR``
runs the same load with the client code of another checkout (e.g. /work/main, before a change),
alternating with this one, ``--repeats`` times each; the best (least CPU per token) of each counts.

    python -m pdserve.benchmarks.serve_client_cpu --repeats 3 --compare /work/main

``capacity_tok_s`` is 1 / (CPU per token): the output tok/s one client process streams at a whole
core, which ``scale_out_sim`` divides the expected load by (``CLIENT_TOK_S``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pdserve
from pdserve.utils import free_port


def _wait(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _env(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": root}


def one_run(url: str, data: Path, num: int, rate: float, root: str, out: Path) -> dict:
    """One client process; its CPU seconds, output tokens and run figures."""
    cmd = [sys.executable, "-m", "pdserve.benchmarks.serve", "--base-url", url, "--endpoint"]
    cmd += ["/v1/completions", "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", str(num)]
    cmd += ["--request-rate", f"{rate:g}", "--disable-tqdm", "--output-json", str(out)]
    # In ``root`` (``-m`` puts the working directory before PYTHONPATH on sys.path).
    proc = subprocess.Popen(cmd, cwd=root, env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(
            f"the client failed (exit {proc.returncode}): {proc.stderr.read().decode()[-2000:]}"
        )
    (run,) = json.loads(out.read_text())["runs"]
    cpu_s = usage.ru_utime + usage.ru_stime
    tokens = run["total_output_tokens"]
    return {
        "client": root,
        "cpu_s": cpu_s,
        "output_tokens": tokens,
        "failed": run["num_failed"],
        "duration_s": run["duration_s"],
        "output_tok_s": run["output_throughput"],
        "cpu_us_per_token": 1e6 * cpu_s / tokens,
        "capacity_tok_s": tokens / cpu_s,
        "itl_p99_ms": run["itl_ms"]["p99"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=60.0, help="conversations/s (2 turns each)")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--interval-ms", type=float, default=20.0, help="between two tokens of a stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare", default="", help="another checkout whose client runs the same load")
    p.add_argument("--output", default="", help="write the runs and the best of each as JSON here")
    args = p.parse_args(argv)

    from pdserve.benchmarks.scale_out_sim import parse_args as study_args
    from pdserve.benchmarks.scale_out_sim import write_slice

    work = Path(tempfile.mkdtemp(prefix="client-cpu-"))
    data = work / "shared.jsonl"
    write_slice(data, "shared-prefix", args.num_prompts, 2, random.Random(0), study_args([]))
    port = free_port()
    here = str(Path(pdserve.__file__).resolve().parents[1])
    server = subprocess.Popen(
        [sys.executable, "-m", "pdserve.benchmarks.sse_stand_in", "--port", str(port)]
        + ["--interval-ms", str(args.interval_ms)],
        cwd=here,
        env=_env(here),
    )
    roots = [here] + ([args.compare] if args.compare else [])
    runs = []
    try:
        _wait(f"http://127.0.0.1:{port}/health")
        for _ in range(args.repeats):
            for root in roots:
                run = one_run(
                    f"http://127.0.0.1:{port}", data, args.num_prompts, args.rate, root, work / "o.json"
                )
                runs.append(run)
                print(
                    f"{root}: {run['cpu_us_per_token']:.1f} us CPU/token ({run['cpu_s']:.2f} s for "
                    f"{run['output_tokens']} tokens at {run['output_tok_s']:.0f} tok/s, ITL p99 "
                    f"{run['itl_p99_ms']:.1f} ms, {run['failed']} failed)",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()
    best = {
        root: min((r for r in runs if r["client"] == root), key=lambda r: r["cpu_us_per_token"])
        for root in roots
    }
    for root, run in best.items():
        us, capacity = run["cpu_us_per_token"], run["capacity_tok_s"]
        print(f"best of {args.repeats}, {root}: {us:.1f} us/token, capacity {capacity:.0f} tok/s per core")
    if args.output:
        result = {
            "benchmark": "serve_client_cpu",
            "args": vars(args),
            "cpus": os.cpu_count(),
            "runs": runs,
            "best": best,
        }
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
