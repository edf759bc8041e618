"""Scale-out study on simulated nodes: 1P1D to 8P8D (and co-located replicas) behind the real proxy.

Every node runs ``--model sim:<shape>@<gpu>`` (``pdserve.engine.sim``): the real scheduler, block
pool, prefix cache, leases, Redis prefix index and KV protocol, with step times modelled from this
project's GPU benchmarks; so a 16-node cluster fits one CPU host. For each cluster shape
(``1P1D``, ``2P2D``, ``4P4D``, ``8P8D``: prefill + decode nodes; ``2C``, ``16C``: co-located
``--role both`` replicas), started once, fresh:

1. two workloads, each swept over request rates that grow with the shape (``--shared-rates`` and
   ``--fresh-rates`` per prefill+decode pair, times the shape's pairs: node count / 2):
   * ``shared-prefix``: multi-turn conversations (``--turns`` user turns of ``--turn-min``..
     ``--turn-max`` tokens) behind ``--prefixes`` system prompts of ``--prefix-len`` tokens per
     pair; every turn carries the earlier answers (rates are conversations per second);
   * ``fresh``: single prompts of ``--input-min``..``--input-max`` random tokens (requests/s);
   each rate offers its own prompts (its own slice, fresh prefixes), Poisson arrivals, for
   ``--duration-s``; the load comes from ``--clients`` ``pdserve bench serve`` processes at
   rate / clients each, whose per-request records are merged;
2. the **knee**: the highest rate at which >= 90 % of requests meet TTFT <= ``--slo-ttft-ms`` and
   TPOT <= ``--slo-tpot-ms`` (DistServe's goodput rate); reported there: output tok/s, goodput
   (requests/s meeting both SLOs), and whether the sweep passed its knee (else the knee is only a
   lower bound: raise ``--rates``);
3. prefix-aware against round-robin routing: the shared-prefix workload at
   ``--routing-rate`` per pair through the cluster's proxy and through a second proxy with
   ``--routing round-robin`` over the same nodes, each on fresh prefixes; the prompt tokens the
   nodes computed (``pdserve_prompt_tokens_computed_total``) in each run;
4. failures (requests that got no answer), and the CPU each part used while loaded (node
   processes, the proxy and its workers, the load clients) as shares of a core: where a ceiling
   that is not the simulated GPUs comes from.

Writes ``summary.json`` and, with matplotlib, ``scale_out.png`` (output tok/s and goodput at the
knee against node count, with linear scaling from the smallest shape) and ``routing.png`` under
``--out-dir``. Nodes run with ``--node-flags`` (by default ``--max-num-seqs 32``: a decode node then
streams about 3,000 tok/s, so 8 of them stay within what the proxy and the clients carry on 16
cores; the scaling, not the absolute figure, is what the study measures). On a 16-core host the
default study (6 shapes, 2 workloads x 3 rates x 4 s, the routing check) takes about 7 minutes.
The default rates put a pair's knee (about 15 conversations/s, 30 fresh requests/s with 32
sequences per decode node) inside each sweep, with the top rate well past it so that its queue
builds within a short run:

    python -m pdserve.benchmarks.scale_out_sim --out-dir docs/benchmarks/scale_out_sim_16core

A quick dry run at tiny scale (a few minutes on 2 cores):

    python -m pdserve.benchmarks.scale_out_sim --shapes 1P1D,2P2D --shared-rates 1,2 \\
        --fresh-rates 2,4 --duration-s 3 --routing-duration-s 3 --out-dir /tmp/scale_out_sim
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.benchmarks.serve_metrics import SLO, max_goodput_rate, summarize
from pdserve.benchmarks.serve_report import jsonable, record_from_json
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig, cpu_count
from pdserve.metrics import parse_text
from pdserve.utils import child_pids

SHAPES = ("1P1D", "2P2D", "4P4D", "8P8D", "2C", "16C")
WORKLOADS = ("shared-prefix", "fresh")
ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class Shape:
    name: str
    prefill: int
    decode: int
    both: int

    @classmethod
    def parse(cls, name: str) -> Shape:
        if m := re.fullmatch(r"(\d+)P(\d+)D", name):
            return cls(name, int(m[1]), int(m[2]), 0)
        if m := re.fullmatch(r"(\d+)C", name):
            return cls(name, 0, 0, int(m[1]))
        raise ValueError(f"a shape is <n>P<m>D or <n>C (co-located replicas), got {name!r}")

    @property
    def num_nodes(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def pairs(self) -> float:
        """What the load is scaled by: prefill+decode pairs, or co-located nodes / 2."""
        return self.num_nodes / 2


# -- workloads -------------------------------------------------------------------------------


FIRST_ID = 300


def write_slice(
    path: Path, workload: str, num: int, pairs: float, rng: random.Random, args, shift: int = 0
) -> None:
    """``num`` conversations of ``workload`` with prefixes of their own (no earlier slice's).
    ``shift`` moves every token id (modulo the range): the same lengths, other prompts."""
    span = args.vocab - FIRST_ID

    def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
        return [FIRST_ID + (rng.randrange(span) + shift) % span for _ in range(n)]

    lines = []
    if workload == "shared-prefix":
        prefixes = [
            _ids(rng, args.prefix_len, args.vocab) for _ in range(max(1, round(args.prefixes * pairs)))
        ]
        for i in range(num):
            turns = [
                _ids(rng, rng.randint(args.turn_min, args.turn_max), args.vocab) for _ in range(args.turns)
            ]
            outputs = [rng.randint(args.output_min, args.output_max) for _ in range(args.turns)]
            lines.append({"system": prefixes[i % len(prefixes)], "turns": turns, "output_len": outputs})
        rng.shuffle(lines)  # conversations sharing a prefix arrive interleaved
    else:
        for _ in range(num):
            prompt = _ids(rng, rng.randint(args.input_min, args.input_max), args.vocab)
            lines.append({"prompt": prompt, "output_len": rng.randint(args.output_min, args.output_max)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# -- CPU accounting --------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _groups(cluster: LocalCluster) -> dict[str, list[int]]:
    """Process ids by part: each node, and the proxies with their workers."""
    out: dict[str, list[int]] = {}
    for child in cluster.children:
        if child.proc.poll() is not None:
            continue
        pids = [child.proc.pid]
        if child.role.startswith("proxy"):
            pids += child_pids(child.proc.pid)
        out[child.role] = pids
    return out


def _cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(_cpu_s(pid) for pid in pids) for name, pids in groups.items()}


# -- one load --------------------------------------------------------------------------------


def _prompt_tokens_computed(cluster: LocalCluster) -> float:
    total = 0.0
    for child in cluster.children:
        if child.role.startswith("proxy") or child.proc.poll() is not None:
            continue
        metrics = parse_text(httpx.get(f"{child.url}/metrics", timeout=10).text)
        total += metrics.get("pdserve_prompt_tokens_computed_total", 0.0)
    return total


def offer(
    url: str, workload: str, rate: float, shape: Shape, work: Path, tag: str, rng, args, shift: int = 0
) -> dict:
    """The workload at ``rate`` for ``--duration-s`` from ``--clients`` bench processes; merged."""
    clients = max(1, min(args.clients or math.ceil(shape.num_nodes / 4), 8))
    num = max(clients, round(rate * args.duration_s))
    procs = []
    outs = []
    for k in range(clients):
        data = work / f"{tag}-c{k}.jsonl"
        share = num // clients + (k < num % clients)
        write_slice(data, workload, share, shape.pairs / clients, rng, args, shift)
        out = work / f"{tag}-c{k}.json"
        cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url]
        cmd += ["--endpoint", "/v1/completions", "--dataset", "jsonl", "--dataset-path", str(data)]
        cmd += ["--num-prompts", str(share), "--request-rate", f"{rate / clients:g}", "--seed", str(k)]
        cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
        cmd += ["--request-timeout-s", "120", "--disable-tqdm", "--label", tag, "--output-json", str(out)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    records = []
    duration = 0.0
    for proc, out in zip(procs, outs):
        _, err = proc.communicate()
        if not out.is_file():
            raise RuntimeError(f"pdserve bench serve failed (exit {proc.returncode}): {err[-2000:]}")
        (run,) = json.loads(out.read_text())["runs"]
        duration = max(duration, run["duration_s"])
        records += [record_from_json(r) for r in run["requests"]]
    s = summarize(records, duration, SLO(args.slo_ttft_ms, args.slo_tpot_ms))
    return {
        "rate": rate,
        "clients": clients,
        "requests": s.num_requests,
        "failed": s.num_failed,
        "duration_s": s.duration_s,
        "output_tok_s": s.output_throughput,
        "request_throughput": s.request_throughput,
        "goodput_req_s": s.request_goodput,
        "slo_attainment": s.slo_attainment,
        "ttft_p50_ms": s.ttft_ms.p(50),
        "ttft_p99_ms": s.ttft_ms.p(99),
        "tpot_p50_ms": s.tpot_ms.p(50),
        "tpot_p99_ms": s.tpot_ms.p(99),
        "prompt_tokens": s.total_input_tokens,
        "cached_prompt_tokens": s.total_cached_tokens,
        "errors": sorted({r.error[:120] for r in records if r.error})[:5],
    }


def sweep(cluster: LocalCluster, url: str, workload: str, shape: Shape, work: Path, rng, args) -> dict:
    rates = [
        r * shape.pairs for r in (args.shared_rates if workload == "shared-prefix" else args.fresh_rates)
    ]
    points = []
    cpu = {}
    for i, rate in enumerate(rates):
        groups = _groups(cluster)
        before, wall, children = _cpu_snapshot(groups), time.monotonic(), os.times()
        point = offer(url, workload, rate, shape, work, f"{shape.name}-{workload}-{i}", rng, args)
        elapsed = time.monotonic() - wall
        after, now = _cpu_snapshot(groups), os.times()
        clients_s = (now.children_user + now.children_system) - (
            children.children_user + children.children_system
        )
        point["cpu_cores"] = _cpu_shares(before, after, clients_s, elapsed)
        cpu = point["cpu_cores"]
        points.append(point)
        print(
            f"  {shape.name} {workload} rate {rate:g}: attainment {point['slo_attainment'] or 0:.2f}, "
            f"{point['output_tok_s']:.0f} output tok/s, {point['failed']} failed, "
            f"TTFT p50 {point['ttft_p50_ms'] or 0:.0f} ms, TPOT p50 {point['tpot_p50_ms'] or 0:.1f} ms; "
            f"CPU cores: nodes {cpu['nodes_total']:.2f} (max {cpu['node_max']:.2f}), "
            f"proxy {cpu['proxy']:.2f}, clients {cpu['clients']:.2f}",
            flush=True,
        )
    knee = max_goodput_rate([(p["rate"], p["slo_attainment"]) for p in points], ATTAINMENT_TARGET)
    at_knee = next((p for p in points if p["rate"] == knee), None)
    return {
        "points": points,
        "knee_rate": knee,
        "knee_is_lower_bound": knee == rates[-1],
        "output_tok_s_at_knee": at_knee["output_tok_s"] if at_knee else 0.0,
        "goodput_req_s_at_knee": at_knee["goodput_req_s"] if at_knee else 0.0,
        "failed": sum(p["failed"] for p in points),
    }


def _cpu_shares(before: dict, after: dict, clients_s: float, elapsed: float) -> dict:
    used = {name: (after[name] - before.get(name, 0.0)) / elapsed for name in after}
    nodes = {n: v for n, v in used.items() if not n.startswith("proxy")}
    return {
        "nodes_total": sum(nodes.values()),
        "node_max": max(nodes.values(), default=0.0),
        "node_mean": sum(nodes.values()) / max(1, len(nodes)),
        "proxy": sum(v for n, v in used.items() if n.startswith("proxy")),
        "clients": clients_s / elapsed,
        "per_process": used,
    }


def routing_check(cluster: LocalCluster, url: str, shape: Shape, work: Path, args) -> dict:
    """Prompt tokens the nodes computed for the same shared-prefix load (the same lengths, arrivals and
    sharing, other token ids: nothing cached by the first run), prefix-aware then round-robin."""
    flags = ["--routing", "round-robin", "--workers", str(args.proxy_workers or _proxy_workers(shape))]
    for role in ("prefill", "decode", "both"):
        urls = cluster.node_urls(role)
        if urls:
            flags += [f"--{role}-urls", ",".join(urls)]
    if cluster.redis_url:
        flags += ["--redis-url", cluster.redis_url]
    rr_url = cluster.add_proxy(*flags)
    rate = args.routing_rate * shape.pairs
    out = {"rate": rate, "prefix_index": bool(cluster.redis_url)}
    saved = args.duration_s
    args.duration_s = args.routing_duration_s
    try:
        for shift, (policy, target) in enumerate((("prefix-aware", url), ("round-robin", rr_url))):
            before = _prompt_tokens_computed(cluster)
            rng = random.Random(f"{args.seed}-{shape.name}-routing")
            point = offer(
                target,
                "shared-prefix",
                rate,
                shape,
                work,
                f"{shape.name}-routing-{policy}",
                rng,
                args,
                shift * 7919,
            )
            time.sleep(0.5)  # the last steps' counters
            computed = _prompt_tokens_computed(cluster) - before
            out[policy] = {
                "prompt_tokens_computed": computed,
                "prompt_tokens_sent": point["prompt_tokens"],
                "computed_share": computed / point["prompt_tokens"] if point["prompt_tokens"] else None,
                "failed": point["failed"],
                "requests": point["requests"],
                "cached_prompt_tokens": point["cached_prompt_tokens"],
            }
    finally:
        args.duration_s = saved
    pa, rr = out["prefix-aware"]["prompt_tokens_computed"], out["round-robin"]["prompt_tokens_computed"]
    out["prefix_aware_over_round_robin"] = pa / rr if rr else None
    print(
        f"  {shape.name} routing: computed prompt tokens prefix-aware {pa:.0f}, round-robin {rr:.0f}",
        flush=True,
    )
    return out


def _proxy_workers(shape: Shape) -> int:
    return max(1, min(8, math.ceil(shape.num_nodes / 2)))


def run_shape(shape: Shape, work: Path, args) -> dict:
    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=shape.prefill,
        decode_nodes=shape.decode,
        both_nodes=shape.both,
        threads_per_node=1,
        routing="prefix-aware",
        proxy_workers=args.proxy_workers or _proxy_workers(shape),
        startup_timeout_s=300.0,
        log_dir=str(work / f"logs-{shape.name}"),
        extra_node_flags=args.node_flags,
    )
    cluster = LocalCluster(cfg, ["--model", args.model], ModelConfig(args.model))
    rng = random.Random(f"{args.seed}-{shape.name}")
    started = time.monotonic()
    try:
        url = cluster.start()
        startup_s = time.monotonic() - started
        print(f"{shape.name}: {shape.num_nodes} nodes up in {startup_s:.0f} s", flush=True)
        out = {"nodes": shape.num_nodes, "prefill": shape.prefill, "decode": shape.decode, "both": shape.both}
        out["startup_s"] = startup_s
        out["proxy_workers"] = cfg.proxy_workers
        out["prefix_index"] = bool(cluster.redis_url)
        for workload in args.workloads:
            out[workload] = sweep(cluster, url, workload, shape, work, rng, args)
        if args.routing_duration_s > 0:
            out["routing"] = routing_check(cluster, url, shape, work, args)
    finally:
        cluster.stop()
    return out


# -- the study -------------------------------------------------------------------------------


def scaling(shapes: dict[str, dict], workload: str) -> dict:
    """Output tok/s at the knee per node, against the smallest disaggregated (and co-located) shape."""
    out = {}
    for kind in ("pd", "colocated"):
        names = [n for n, s in shapes.items() if (s["both"] == 0) == (kind == "pd") and workload in s]
        if not names:
            continue
        base_name = min(names, key=lambda n: shapes[n]["nodes"])
        base = shapes[base_name]
        per_node = base[workload]["output_tok_s_at_knee"] / base["nodes"]
        out[kind] = {
            "base": base_name,
            "shapes": {
                n: {
                    "nodes": shapes[n]["nodes"],
                    "output_tok_s_at_knee": shapes[n][workload]["output_tok_s_at_knee"],
                    "share_of_linear": shapes[n][workload]["output_tok_s_at_knee"]
                    / (per_node * shapes[n]["nodes"])
                    if per_node
                    else None,
                    "knee_is_lower_bound": shapes[n][workload]["knee_is_lower_bound"],
                }
                for n in sorted(names, key=lambda n: shapes[n]["nodes"])
            },
        }
    return out


def plot(summary: dict, out_dir: Path) -> list[str]:
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = summary["shapes"]
    written = []
    workloads = summary["args"]["workloads"]
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 9), squeeze=False)
    for col, workload in enumerate(workloads):
        for row, (key, label) in enumerate(
            (
                ("output_tok_s_at_knee", "output tok/s at the knee"),
                ("goodput_req_s_at_knee", "goodput (req/s)"),
            )
        ):
            ax = axes[row][col]
            for kind, marker in (("pd", "o"), ("colocated", "s")):
                names = sorted(
                    (n for n, s in shapes.items() if (s["both"] == 0) == (kind == "pd") and workload in s),
                    key=lambda n: shapes[n]["nodes"],
                )
                if not names:
                    continue
                xs = [shapes[n]["nodes"] for n in names]
                ys = [shapes[n][workload][key] for n in names]
                ax.plot(xs, ys, marker=marker, label="P/D" if kind == "pd" else "co-located")
                for x, y, n in zip(xs, ys, names):
                    ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
                if ys[0]:
                    ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ls="--", lw=0.8, color="gray")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("nodes")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}: {label} (dashed: linear)")
            ax.legend()
    fig.suptitle(f"{summary['model']}: scale-out on simulated nodes ({summary['host_cores']} cores)")
    fig.tight_layout()
    path = out_dir / "scale_out.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    routed = [(n, s["routing"]) for n, s in shapes.items() if "routing" in s]
    if routed:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = range(len(routed))
        ax.bar([x - 0.2 for x in xs], [r["prefix-aware"]["prompt_tokens_computed"] for _, r in routed], 0.4)
        ax.bar([x + 0.2 for x in xs], [r["round-robin"]["prompt_tokens_computed"] for _, r in routed], 0.4)
        ax.set_xticks(list(xs), [n for n, _ in routed])
        ax.legend(["prefix-aware", "round-robin"])
        ax.set_ylabel("prompt tokens computed")
        ax.set_title("shared-prefix workload, same offered load")
        fig.tight_layout()
        path = out_dir / "routing.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sim:llama-3-8b@h100")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--shared-rates", type=_floats, default=[6, 12, 24], help="conversations/s per prefill+decode pair"
    )
    p.add_argument("--fresh-rates", type=_floats, default=[12, 24, 48], help="requests/s per pair")
    p.add_argument("--duration-s", type=float, default=4.0, help="of each rate's offered load")
    p.add_argument("--routing-rate", type=float, default=6.0, help="conversations/s per pair")
    p.add_argument("--routing-duration-s", type=float, default=3.0, help="0: no routing comparison")
    p.add_argument("--prefixes", type=int, default=4, help="system prompts per pair")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--turn-min", type=int, default=64)
    p.add_argument("--turn-max", type=int, default=256)
    p.add_argument("--input-min", type=int, default=256, help="fresh prompts")
    p.add_argument("--input-max", type=int, default=2048)
    p.add_argument("--output-min", type=int, default=32)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--clients", type=int, default=0, help="bench processes per load; 0: one per 4 nodes")
    p.add_argument("--proxy-workers", type=int, default=0, help="0: one per 2 nodes, at most 8")
    p.add_argument(
        "--node-flags",
        default="--max-num-seqs 32",
        help="more flags for every node; the default caps a decode batch at 32 (about 3,000 output "
        "tok/s on the simulated H100), so 8 decode nodes stream what the proxy and the load clients "
        "can carry on 16 cores",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="scale_out_sim")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    shapes_in = [Shape.parse(n) for n in args.shapes.split(",") if n]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="scale-out-sim-"))
    started = time.monotonic()
    shapes = {}
    for shape in shapes_in:
        shapes[shape.name] = run_shape(shape, work, args)
    summary = {
        "benchmark": "scale_out_sim",
        "simulated": True,
        "model": args.model,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m pdserve.benchmarks.scale_out_sim", *(argv or sys.argv[1:])]),
        "host": platform.node(),
        "host_cores": cpu_count(),
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(args).items()},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": ATTAINMENT_TARGET},
        "shapes": shapes,
        "scaling": {w: scaling(shapes, w) for w in args.workloads},
        "failed_requests": sum(s[w]["failed"] for s in shapes.values() for w in args.workloads)
        + sum(
            s["routing"][p]["failed"]
            for s in shapes.values()
            if "routing" in s
            for p in ("prefix-aware", "round-robin")
        ),
        "elapsed_s": time.monotonic() - started,
        "logs": str(work),
    }
    summary["plots"] = plot(summary, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(jsonable(summary), indent=1) + "\n")
    for w in args.workloads:
        for kind, sc in summary["scaling"][w].items():
            line = ", ".join(
                f"{n} {v['output_tok_s_at_knee']:.0f} tok/s ({v['share_of_linear'] or 0:.2f} of linear"
                f"{', knee not reached' if v['knee_is_lower_bound'] else ''})"
                for n, v in sc["shapes"].items()
            )
            print(f"{w} {kind}: {line}")
    print(
        f"failed requests: {summary['failed_requests']}; {summary['elapsed_s']:.0f} s; "
        f"{out_dir / 'summary.json'}"
    )


if __name__ == "__main__":
    main()
