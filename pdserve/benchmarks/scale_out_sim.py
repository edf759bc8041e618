"""Scale-out study on simulated nodes: 1P1D to 8P8D (and co-located replicas) behind the real proxy.

Every node runs ``--model sim:<shape>@<gpu>`` (``pdserve.engine.sim``): the real scheduler, block
pool, prefix cache, leases, Redis prefix index and KV protocol, with step times modelled from this
project's GPU benchmarks; so a 16-node cluster fits one CPU host. For each cluster shape
(``1P1D``, ``2P2D``, ``4P4D``, ``8P8D``: prefill + decode nodes; ``2C`` .. ``16C``: co-located
``--role both`` replicas), started fresh:

1. two workloads, each swept over request rates per prefill+decode pair (``--shared-rates``,
   ``--fresh-rates``; times the shape's pairs, node count / 2):
   * ``shared-prefix``: multi-turn conversations (``--turns`` user turns of ``--turn-min``..
     ``--turn-max`` tokens) behind ``--prefixes`` system prompts of ``--prefix-len`` tokens per
     pair; every turn carries the earlier answers (rates are conversations per second);
   * ``fresh``: single prompts of ``--input-min``..``--input-max`` random tokens (requests/s);
   each rate offers its own prompts (its own slice, fresh prefixes), Poisson arrivals, for
   ``--duration-s``; the load comes from ``--clients`` ``pdserve bench serve`` processes at
   rate / clients each, whose per-request records are merged (by default as many as keep each
   below half a core at the output tok/s the rate asks for: ``default_clients``). The rates rise
   until one misses the SLOs, then ``--refine`` bisections close in on the **knee**: the highest
   rate at which >= 90 % of requests meet TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``
   (DistServe's goodput rate). A shape larger than the smallest of its kind also offers that
   one's knee rate per pair, so both are measured at the same load per pair;
2. prefix-aware against round-robin routing: the shared-prefix workload at ``--routing-rate`` per
   pair through the cluster's proxy and through a second proxy with ``--routing round-robin`` over
   the same nodes, each on fresh prefixes; the prompt tokens the nodes computed
   (``pdserve_prompt_tokens_computed_total``) in each;
3. failures (requests that got no answer), and the CPU each part used at each point (every node by
   role, each proxy worker, the load clients, the whole host), as shares of a core: the part
   nearest its limit is named, so a ceiling that is not the simulated GPUs shows.

The proxy grows with the cluster: ``--proxy-workers 0`` (the default) runs one worker per
``--streams-per-proxy-worker`` decode (or co-located) nodes, at most half the host's cores.

**One JSON, many runs.** Everything goes into ``--output`` (``scale_out_sim_report`` describes it),
written after every point, merged with what earlier runs put there: a run measures the shapes it is
given (``--shapes``, ``--workloads``, ``--routing-duration-s 0`` to skip the routing check), skips
what the JSON already holds complete (``--redo`` measures it again) and stops starting points once
``--budget-s`` is nearly spent, so a machine lent for ten minutes at a time runs the study in a few
calls, each repeatable until done. ``--plot-only`` draws the PNGs beside the JSON from what it holds
(``<output>.png``: output tok/s and goodput at the knee against node count; ``<output>_sweeps.png``;
``<output>_routing.png``). Nodes run with ``--node-flags`` (by default ``--max-num-seqs 32``: a
decode node then streams about 3,000 tok/s, so 8 of them stay within what the proxy and the clients
carry on 16 cores; the scaling, not the absolute figure, is what the study measures).

A shape larger than the smallest measured one of its kind starts its sweeps at that one's knee per
pair, so measure the smallest first; one call per line on 16 cores (docs/benchmarks/README.md):

    python -m pdserve.benchmarks.scale_out_sim --shapes 1P1D,2C \\
        --output docs/benchmarks/scale_out_sim_gpuhost.json --budget-s 420
    python -m pdserve.benchmarks.scale_out_sim --shapes 8P8D \\
        --output docs/benchmarks/scale_out_sim_gpuhost.json --budget-s 420
    python -m pdserve.benchmarks.scale_out_sim --plot-only \\
        --output docs/benchmarks/scale_out_sim_gpuhost.json

**Real GPUs.** The same driver measures real nodes: ``--model random:llama-3-8b --gpus 0,1,2,3``
gives each node a GPU in turn (1P1D takes the first two; 2P2D and 4C all four), with node flags of
the caller's choosing (``--node-flags ""`` for the engine's defaults) and rates for real GPUs.
Run the simulated study with the same shapes, flags and rates beside it, into another JSON, to see
how far the model is from the hardware:

    G="--shapes 1P1D,2P2D,4C --shared-rates 4,8,16,32 --fresh-rates 2,4,8,16 --node-flags ''"
    python -m pdserve.benchmarks.scale_out_sim $G --model random:llama-3-8b --gpus 0,1,2,3 \
        --output docs/benchmarks/scale_out_h200x4.json --budget-s 540
    python -m pdserve.benchmarks.scale_out_sim $G --output docs/benchmarks/scale_out_h200x4_sim.json

A dry run at tiny scale (about 2 minutes a shape on 2 cores; the second run merges into the first's
JSON and starts its sweeps at 1P1D's knees):

    S="python -m pdserve.benchmarks.scale_out_sim --shared-rates 2,8,16 --fresh-rates 4,16,32 \\
        --refine 1 --duration-s 3 --routing-duration-s 3 --output /tmp/sos.json"
    $S --shapes 1P1D && $S --shapes 2P2D && $S --plot-only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.benchmarks import scale_out_sim_report as report
from pdserve.benchmarks.serve_metrics import SLO, goodput_between, output_tok_s_between, summarize
from pdserve.benchmarks.serve_report import record_from_json
from pdserve.cluster import ClusterConfig, LocalCluster, free_port
from pdserve.config import ModelConfig, cpu_count
from pdserve.metrics import parse_text
from pdserve.utils import child_pids

SHAPES = ("1P1D", "2P2D", "4P4D", "8P8D", "2C", "16C")


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


def default_proxy_workers(shape: Shape, cores: int, streams_per_worker: float = 1.0) -> int:
    """Proxy workers for ``shape``: one per ``streams_per_worker`` nodes that stream tokens (decode
    and co-located), at most half the host's cores (the nodes and the load need the rest)."""
    streaming = shape.decode + shape.both
    return max(1, min(math.ceil(streaming / streams_per_worker), cores // 2))


CLIENT_TOK_S = 20_000.0
"""Output tok/s one load client (``pdserve bench serve``) streams per core of CPU on this study's
workload: ~49,000 measured by ``serve_client_cpu`` (20 us a token, start-up included, best of 3 on a
2-core box; 30 us through a simulated 1P1D's proxy), taken as 20,000 for a host whose every core is
busy with nodes and proxy workers (the client before it cost 2-3x more per token on the 16-core GPU
host than on that box)."""
CLIENT_SHARE = 0.5
"""Share of a core a client is planned to use at the load it is offered: well below
``report.SATURATED``, so that no knee is the clients'."""


def offered_tok_s(workload: str, rate: float, args) -> float:
    """Output tok/s the workload asks for at ``rate`` (conversations/s of ``--turns`` answers, or
    fresh requests/s of one), at the mean output length."""
    answers = args.turns if workload == "shared-prefix" else 1
    return rate * answers * (args.output_min + args.output_max) / 2


def default_clients(tok_s: float, cores: int) -> int:
    """Load clients for ``tok_s`` output tok/s: each at most ``CLIENT_SHARE`` of a core by
    ``CLIENT_TOK_S``, and at most a quarter of the host's cores (the nodes and the proxy workers
    need the rest); at least one."""
    need = math.ceil(tok_s / (CLIENT_TOK_S * CLIENT_SHARE))
    return max(1, min(need, cores // 4))


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


def _host_busy_s() -> float:
    """CPU seconds the whole host spent busy (all cores; /proc/stat less idle and iowait)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(values[:8]) - values[3] - values[4]) / _TICK


def _processes(cluster: LocalCluster) -> dict[str, int]:
    """Process ids by name: each node (``decode-3``), each proxy (``proxy-0``) and its workers
    (``proxy-0.w1``; a proxy of one worker runs it in its own process: ``proxy-0.w0``)."""
    out: dict[str, int] = {}
    for child in cluster.children:
        if child.proc.poll() is not None:
            continue
        workers = sorted(child_pids(child.proc.pid)) if child.role.startswith("proxy") else []
        if child.role.startswith("proxy") and not workers:
            out[f"{child.role}.w0"] = child.proc.pid
            continue
        out[child.role] = child.proc.pid
        for i, pid in enumerate(workers):
            out[f"{child.role}.w{i}"] = pid
    return out


class CpuMeter:
    """CPU each process (and the host) used over one load; ``stop`` gives ``report.cpu_shares``."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.pids = _processes(cluster)
        self.before = {n: _cpu_s(pid) for n, pid in self.pids.items()}
        self.host = _host_busy_s()
        self.wall = time.monotonic()

    def stop(self, clients: int, client_cpu_s: float) -> dict:
        elapsed = max(1e-6, time.monotonic() - self.wall)
        after = {n: _cpu_s(pid) for n, pid in self.pids.items()}
        extra = {
            "host_busy_cores": (_host_busy_s() - self.host) / elapsed,
            "host_cores": cpu_count(),
            "clients": (clients, client_cpu_s),
        }
        return report.cpu_shares(self.before, after, elapsed, extra)


# -- one load --------------------------------------------------------------------------------


def _prompt_tokens_computed(cluster: LocalCluster) -> float:
    total = 0.0
    for child in cluster.children:
        if child.role.startswith("proxy") or child.proc.poll() is not None:
            continue
        metrics = parse_text(httpx.get(f"{child.url}/metrics", timeout=10).text)
        total += metrics.get("pdserve_prompt_tokens_computed_total", 0.0)
    return total


STEADY_FROM = 0.25
"""A point's steady-state figures (the study's output tok/s and goodput) count what happened from
this share of its arrivals' period to that period's end: before, the batches fill; after, the last
requests drain, and a run of a few seconds whose slowest request ends later (a larger shape: the
slowest of more requests) would otherwise show less throughput at the same load per node."""


def offer(
    cluster: LocalCluster,
    url: str,
    workload: str,
    rate: float,
    duration_s: float,
    shape: Shape,
    work: Path,
    tag: str,
    rng,
    args,
    shift: int = 0,
) -> dict:
    """The workload at ``rate`` for ``duration_s`` from ``--clients`` bench processes; merged, with
    the CPU every part used meanwhile."""
    clients = args.clients or default_clients(offered_tok_s(workload, rate, args), cpu_count())
    num = max(clients, round(rate * duration_s))
    procs = []
    outs = []
    for k in range(clients):
        data = work / f"{tag}-c{k}.jsonl"
        share = num // clients + (k < num % clients)
        write_slice(data, workload, share, shape.pairs / clients, rng, args, shift)
        outs.append(work / f"{tag}-c{k}.json")
    meter = CpuMeter(cluster)
    started = os.times()
    for k, out in enumerate(outs):
        share = num // clients + (k < num % clients)
        # `pdserve bench serve` by its module: the `pdserve` command line imports torch (~1.5 s of CPU
        # a client, counted in its share at every point) for benchmarks this one does not run.
        cmd = [sys.executable, "-m", "pdserve.benchmarks.serve", "--base-url", url]
        cmd += [
            "--endpoint",
            "/v1/completions",
            "--dataset",
            "jsonl",
            "--dataset-path",
            str(out.with_suffix(".jsonl")),
        ]
        cmd += ["--num-prompts", str(share), "--request-rate", f"{rate / clients:g}", "--seed", str(k)]
        cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
        cmd += ["--request-timeout-s", "120", "--disable-tqdm", "--label", tag, "--output-json", str(out)]
        if not args.model.startswith("sim:"):
            # A random model's ids mostly lie past its tokenizer's vocabulary: no text, so no chunk
            # would mark a token and no TTFT be measured (``logprobs: 0`` makes one a step).
            cmd += ["--extra-body", '{"logprobs": 0}']
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [proc.communicate()[1] for proc in procs]
    ended = os.times()
    cpu = meter.stop(
        clients,
        (ended.children_user + ended.children_system) - (started.children_user + started.children_system),
    )
    records = []
    duration = 0.0
    for proc, out, err in zip(procs, outs, errs):
        if not out.is_file():
            raise RuntimeError(f"pdserve bench serve failed (exit {proc.returncode}): {err[-2000:]}")
        (run,) = json.loads(out.read_text())["runs"]
        duration = max(duration, run["duration_s"])
        records += [record_from_json(r) for r in run["requests"]]
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    s = summarize(records, duration, slo)
    window = (STEADY_FROM * num / rate, num / rate)  # the arrivals' period, less its ramp-up
    return {
        "rate": rate,
        "rate_per_pair": rate / shape.pairs,
        "clients": clients,
        "requests": s.num_requests,
        "failed": s.num_failed,
        "duration_s": s.duration_s,
        "output_tok_s": s.output_throughput,
        "request_throughput": s.request_throughput,
        "goodput_req_s": s.request_goodput,
        "steady_window_s": list(window),
        "steady_output_tok_s": output_tok_s_between(records, *window),
        "steady_goodput_req_s": goodput_between(records, slo, *window),
        "slo_attainment": s.slo_attainment,
        "ttft_p50_ms": s.ttft_ms.p(50),
        "ttft_p99_ms": s.ttft_ms.p(99),
        "tpot_p50_ms": s.tpot_ms.p(50),
        "tpot_p99_ms": s.tpot_ms.p(99),
        "prompt_tokens": s.total_input_tokens,
        "cached_prompt_tokens": s.total_cached_tokens,
        "errors": sorted({r.error[:120] for r in records if r.error})[:5],
        "cpu": cpu,
    }


# -- one shape -------------------------------------------------------------------------------


class OutOfBudget(Exception):
    """Too little of ``--budget-s`` is left to start the next point."""


class Study:
    """The JSON being filled, the run's clock and budget."""

    def __init__(self, path: Path, data: dict, run_index: int, budget_s: float) -> None:
        self.path = path
        self.data = data
        self.run = run_index
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.longest_point_s = 0.0

    def save(self) -> None:
        self.data["runs"][self.run]["elapsed_s"] = time.monotonic() - self.started
        report.write(self.data, self.path)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started) if self.budget_s else math.inf

    def check(self, need_s: float) -> None:
        if self.left_s() < need_s:
            raise OutOfBudget(
                f"{self.left_s():.0f} s of --budget-s left, the next step needs ~{need_s:.0f} s"
            )

    def point_estimate_s(self, args) -> float:
        return max(self.longest_point_s, args.duration_s + 10.0)


def _rates(study: Study, shape: Shape, workload: str, args) -> tuple[list[float], float | None]:
    """Absolute rates of the coarse sweep (the per-pair rates times the shape's pairs) and where it
    starts: for a shape larger than the smallest measured one of its kind, at that one's knee per
    pair (added to the coarse rates), so both are measured at the same load per pair and a shape
    that scales needs few points; else at the lowest rate."""
    per_pair = set(args.shared_rates if workload == "shared-prefix" else args.fresh_rates)
    start = None
    base = report.scaling(study.data["shapes"], workload).get("colocated" if shape.both else "pd")
    smaller = base and study.data["shapes"][base["base"]]["nodes"] < shape.num_nodes
    if smaller and (k := base["shapes"][base["base"]]["knee_rate_per_pair"]):
        per_pair.add(k)
        start = round(k * shape.pairs, 3)
    return sorted(round(r * shape.pairs, 3) for r in per_pair), start


def sweep(
    study: Study, cluster: LocalCluster, url: str, workload: str, shape: Shape, work: Path, rng, args
) -> None:
    coarse, start = _rates(study, shape, workload, args)
    entry = {
        "run": study.run,
        "proxy_workers": args.workers_now,
        "coarse_rates": coarse,
        "start_rate": start,
        "points": [],
        "complete": False,
    }
    study.data["shapes"][shape.name][workload] = entry
    study.save()
    while (rate := report.next_rate(entry["points"], coarse, args.refine, start)) is not None:
        study.check(study.point_estimate_s(args))
        t0 = time.monotonic()
        point = offer(
            cluster,
            url,
            workload,
            rate,
            args.duration_s,
            shape,
            work,
            f"{shape.name}-{workload}-{rate:g}",
            rng,
            args,
        )
        point["elapsed_s"] = time.monotonic() - t0
        study.longest_point_s = max(study.longest_point_s, point["elapsed_s"])
        entry["points"].append(point)
        study.save()
        cpu = point["cpu"]
        b = report.busiest(cpu)
        roles = ", ".join(f"{r} max {v['max']:.2f}" for r, v in cpu["roles"].items())
        p, proxy = point, cpu["proxy"]
        print(
            f"  {shape.name} {workload} rate {rate:g} ({p['rate_per_pair']:g}/pair): attainment "
            f"{p['slo_attainment'] or 0:.2f}, {p['steady_output_tok_s']:.0f} output tok/s steady "
            f"({p['output_tok_s']:.0f} over the whole run), {p['failed']} failed, "
            f"TTFT p50 {p['ttft_p50_ms'] or 0:.0f} ms, TPOT p50 {p['tpot_p50_ms'] or 0:.1f} ms; cores: "
            f"host {cpu['host_busy_cores']:.1f}/{cpu['host_cores']}, {roles}, proxy {proxy['total']:.2f} "
            f"(worker max {proxy['worker_max']:.2f}), clients {cpu['clients']['total']:.2f}; "
            f"busiest {b['part']} {b['load']:.2f}; {p['elapsed_s']:.0f} s",
            flush=True,
        )
    entry["complete"] = True
    entry.update({k: v for k, v in report.knee(entry["points"]).items() if k != "busiest_at_knee"})
    study.save()


def routing_check(study: Study, cluster: LocalCluster, url: str, shape: Shape, work: Path, args) -> None:
    """Prompt tokens the nodes computed for the same shared-prefix load (the same lengths, arrivals and
    sharing, other token ids: nothing cached by the first run), prefix-aware then round-robin."""
    study.check(2 * study.point_estimate_s(args) + 15)
    flags = ["--routing", "round-robin", "--workers", str(args.workers_now)]
    for role in ("prefill", "decode", "both"):
        urls = cluster.node_urls(role)
        if urls:
            flags += [f"--{role}-urls", ",".join(urls)]
    if cluster.redis_url:
        flags += ["--redis-url", cluster.redis_url]
    rr_url = cluster.add_proxy(*flags)
    rate = round(args.routing_rate * shape.pairs, 3)
    out = {"run": study.run, "rate": rate, "prefix_index": bool(cluster.redis_url), "complete": False}
    study.data["shapes"][shape.name]["routing"] = out
    for shift, (policy, target) in enumerate((("prefix-aware", url), ("round-robin", rr_url))):
        before = _prompt_tokens_computed(cluster)
        rng = random.Random(f"{args.seed}-{shape.name}-routing")
        tag = f"{shape.name}-routing-{policy}"
        point = offer(
            cluster,
            target,
            "shared-prefix",
            rate,
            args.routing_duration_s,
            shape,
            work,
            tag,
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
            "slo_attainment": point["slo_attainment"],
            "output_tok_s": point["output_tok_s"],
        }
        study.save()
    pa, rr = out["prefix-aware"]["prompt_tokens_computed"], out["round-robin"]["prompt_tokens_computed"]
    out["prefix_aware_over_round_robin"] = pa / rr if rr else None
    out["complete"] = True
    study.save()
    print(
        f"  {shape.name} routing: computed prompt tokens prefix-aware {pa:.0f}, round-robin {rr:.0f}",
        flush=True,
    )


def run_shape(study: Study, shape: Shape, todo: list[str], work: Path, args) -> None:
    args.workers_now = args.proxy_workers or default_proxy_workers(
        shape, cpu_count(), args.streams_per_proxy_worker
    )
    # Starting 16 nodes takes a while; leave room for it and one point.
    study.check(30 + 4 * shape.num_nodes + study.point_estimate_s(args))
    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=shape.prefill,
        decode_nodes=shape.decode,
        both_nodes=shape.both,
        threads_per_node=1,
        routing="prefix-aware",
        proxy_workers=args.workers_now,
        startup_timeout_s=300.0,
        log_dir=str(work / f"logs-{shape.name}"),
        extra_node_flags=args.node_flags,
        gpus=args.gpus,
    )
    cluster = LocalCluster(cfg, ["--model", args.model], ModelConfig(args.model))
    rng = random.Random(f"{args.seed}-{shape.name}")
    started = time.monotonic()
    try:
        url = cluster.start()
        startup_s = time.monotonic() - started
        up = f"{shape.num_nodes} nodes + {args.workers_now} proxy workers"
        print(f"{shape.name}: {up} up in {startup_s:.0f} s", flush=True)
        entry = report.shape_entry(study.data, shape.name, shape.prefill, shape.decode, shape.both)
        entry["startup_s"] = startup_s
        entry["prefix_index"] = bool(cluster.redis_url)
        for key in todo:
            if key == "routing":
                routing_check(study, cluster, url, shape, work, args)
            else:
                sweep(study, cluster, url, key, shape, work, rng, args)
    finally:
        cluster.stop()


# -- the study -------------------------------------------------------------------------------


def describe_host(label: str) -> dict:
    """The machine the run measured on: its cores, CPU model and GPUs (named even though the nodes
    only simulate theirs: the host's CPUs are what the study loads)."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        cpu_model = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            gpus = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    cores = cpu_count()
    device = label or f"{cores}-core host ({cpu_model or platform.machine()})" + (
        f" of {gpus[0].split(' (')[0]}" if gpus else ""
    )
    return {
        "device": device,
        "host": platform.node(),
        "cores": cores,
        "cpu_model": cpu_model,
        "gpus": gpus,
        "python": platform.python_version(),
        "load_avg_at_start": list(os.getloadavg()),
    }


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sim:llama-3-8b@h100")
    p.add_argument(
        "--gpus",
        default="",
        help="GPUs the nodes take in turn (CUDA_VISIBLE_DEVICES each), for a real --model: 0,1,2,3 runs "
        "1P1D on the first two and 2P2D or 4C on all four",
    )
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--workloads", default=",".join(report.WORKLOADS))
    p.add_argument(
        "--shared-rates", type=_floats, default=[12, 24, 36, 48], help="conversations/s per pair, rising"
    )
    p.add_argument(
        "--fresh-rates", type=_floats, default=[12, 24, 36, 48], help="requests/s per pair, rising"
    )
    p.add_argument(
        "--refine",
        type=int,
        default=2,
        help="bisections between the last rate within the SLOs and the first not",
    )
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
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="bench processes per load; 0: enough that none uses more than half a core at the output "
        "tok/s offered (CLIENT_TOK_S), at most a quarter of the cores",
    )
    p.add_argument(
        "--proxy-workers", type=int, default=0, help="0: grow with the shape (--streams-per-proxy-worker)"
    )
    p.add_argument(
        "--streams-per-proxy-worker",
        type=float,
        default=1.0,
        help="decode (or co-located) nodes per proxy worker when --proxy-workers is 0 (at most half "
        "the cores)",
    )
    p.add_argument(
        "--node-flags",
        default="--max-num-seqs 32",
        help="more flags for every node; the default caps a decode batch at 32 (about 3,000 output "
        "tok/s on the simulated H100), so 8 decode nodes stream what the proxy and the load clients "
        "can carry on 16 cores",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output", default="docs/benchmarks/scale_out_sim.json", help="the study's JSON (merged into)"
    )
    p.add_argument("--replace", action="store_true", help="start a new study at --output instead of merging")
    p.add_argument("--redo", action="store_true", help="measure again what --output already holds complete")
    p.add_argument(
        "--budget-s", type=float, default=0.0, help="start no point that would end after this; 0: none"
    )
    p.add_argument(
        "--device",
        default="",
        help="how to name the machine in the JSON; empty: from its cores, CPU and GPUs",
    )
    p.add_argument("--plot-only", action="store_true", help="draw the PNGs from --output and measure nothing")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := set(args.workloads) - set(report.WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}; choose from {report.WORKLOADS}")
    try:
        args.shape_list = [Shape.parse(n) for n in args.shapes.split(",") if n]
    except ValueError as e:
        p.error(str(e))
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = Path(args.output)
    if args.plot_only:
        data = report.read(path)
        report.write(data, path)
        for line in report.report_lines(data):
            print(line)
        print("plots:", ", ".join(report.plot(data, path)) or "none (matplotlib is not installed)")
        return 0
    study_args = {k: getattr(args, k) for k in report.STUDY_KEYS}
    try:
        data = report.open_study(path, study_args, args.replace)
    except report.StudyMismatch as e:
        print(f"scale_out_sim: {e}", file=sys.stderr)
        return 2
    data["runs"].append(
        {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(
                ["python -m pdserve.benchmarks.scale_out_sim", *(argv if argv is not None else sys.argv[1:])]
            ),
            **describe_host(args.device),
            "args": {k: v for k, v in vars(args).items() if k != "shape_list"},
            "status": "running",
        }
    )
    study = Study(path, data, len(data["runs"]) - 1, args.budget_s)
    study.save()
    work = Path(tempfile.mkdtemp(prefix="scale-out-sim-"))
    signal.signal(signal.SIGTERM, _interrupt)  # so the clusters stop (finally) and the run says so
    status = "done"
    try:
        for shape in args.shape_list:
            keys = [*args.workloads] + (["routing"] if args.routing_duration_s > 0 else [])
            todo = [k for k in keys if args.redo or not report.is_done(data, shape.name, k)]
            if skipped := [k for k in keys if k not in todo]:
                print(
                    f"{shape.name}: {', '.join(skipped)} already in {path} (--redo measures again)",
                    flush=True,
                )
            if todo:
                run_shape(study, shape, todo, work, args)
    except OutOfBudget as e:
        status = f"stopped: {e}"
    except KeyboardInterrupt as e:
        status = f"interrupted ({e or 'SIGINT'})"
    data["runs"][study.run]["status"] = status
    data["runs"][study.run]["logs"] = str(work)
    study.save()
    for line in report.report_lines(data):
        print(line)
    print(f"{status}; {time.monotonic() - study.started:.0f} s; {path} (logs: {work})")
    return 0 if status == "done" else 3


if __name__ == "__main__":
    sys.exit(main())
