"""The scale-out study's record: one JSON that several runs of ``pdserve.benchmarks.scale_out_sim``
fill shape by shape and point by point, what is derived from it, and its PNG plots.

A study is too long for one sitting on a machine lent by the call (16 nodes start in a minute or
two; each point of a sweep takes its duration plus the tail of its last requests), so each run
measures some shapes (or one workload of a shape) and merges them into the JSON, written again after
every point: a run cut short keeps what it measured. What a run measures replaces the same entry of
an earlier run; entries it does not touch stay. Runs merge only when the things that define the
study agree (``STUDY_KEYS``: model, SLOs, workload shapes, node flags); rates, durations and proxy
workers may differ and are recorded per entry.

Layout (``schema`` 3)::

    {"benchmark": "scale_out_sim", "schema": 3, "study": {STUDY_KEYS...}, "slo": {...},
     "runs": [{"date", "command", "device", "host", "cores", "cpu_model", "gpus", "status", ...}],
     "shapes": {"8P8D": {"nodes", "prefill", "decode", "both",
                         "shared-prefix": SWEEP, "fresh": SWEEP, "routing": ROUTING}},
     "summary": {...}}   # derived (``summarize``): knees, scaling, routing, failures, ceilings

    SWEEP = {"run": index into runs, "proxy_workers", "coarse_rates", "points": [POINT...],
             "complete": whether the sweep ended by its own rule}
    POINT = {"rate", "rate_per_pair", "slo_attainment", "output_tok_s", "goodput_req_s", "failed",
             "steady_window_s", "steady_output_tok_s", "steady_goodput_req_s",
             "ttft_p50_ms", ..., "cpu": CPU, "elapsed_s"}
    CPU = {"host_busy_cores", "host_cores", "roles": {"prefill"|"decode"|"both": {"count", "total",
           "max", "mean"}}, "proxy": {"workers", "total", "worker_max", "worker_mean"},
           "clients": {"processes", "total"}, "per_process": {name: cores}}

The **knee** of a sweep is DistServe's goodput rate: the highest offered rate at which
``ATTAINMENT_TARGET`` of the requests meet both SLOs; it is a lower bound (say so, and raise the
rates) until a higher rate was measured and missed the target. Its output tok/s and goodput are the
point's steady-state figures (``steady_*``: from a quarter into its arrivals' period to that
period's end, ``serve_metrics.output_tok_s_between``); ``output_tok_s`` and ``goodput_req_s`` are
the whole run's, drain included (schema 2 studies held only those: their scaling understated the
larger shapes, whose drain is longer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from pdserve.benchmarks.serve_metrics import max_goodput_rate
from pdserve.benchmarks.serve_report import jsonable

SCHEMA = 3
ATTAINMENT_TARGET = 0.9
WORKLOADS = ("shared-prefix", "fresh")
STUDY_KEYS = (
    "model",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "prefixes",
    "prefix_len",
    "turns",
    "turn_min",
    "turn_max",
    "input_min",
    "input_max",
    "output_min",
    "output_max",
    "vocab",
    "node_flags",
)
SATURATED = 0.8
"""Share of a core from which a part is named as a possible ceiling: a proxy worker or a node runs
its event loop (and a node its engine loop) under one GIL, so about one core is all it can use."""


class StudyMismatch(ValueError):
    """The JSON at the output path belongs to another study (or to no study of this driver)."""


# -- the record ------------------------------------------------------------------------------


def new_study(study: dict) -> dict:
    return {
        "benchmark": "scale_out_sim",
        "schema": SCHEMA,
        "simulated": study["model"].startswith("sim:"),
        "study": {k: study[k] for k in STUDY_KEYS},
        "slo": {
            "ttft_ms": study["slo_ttft_ms"],
            "tpot_ms": study["slo_tpot_ms"],
            "attainment": ATTAINMENT_TARGET,
        },
        "runs": [],
        "shapes": {},
    }


def read(path: Path) -> dict:
    data = json.loads(path.read_text())
    if data.get("benchmark") != "scale_out_sim" or data.get("schema") != SCHEMA:
        raise StudyMismatch(
            f"{path} was not written by this driver (schema {SCHEMA}): pass --replace to start a new "
            "study there, or another --output"
        )
    return data


def open_study(path: Path, study: dict, replace: bool) -> dict:
    """The study at ``path`` to merge into, or a new one (none there, or ``replace``)."""
    if replace or not path.is_file():
        return new_study(study)
    data = read(path)
    differ = {k: (data["study"].get(k), study[k]) for k in STUDY_KEYS if data["study"].get(k) != study[k]}
    if differ:
        lines = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        raise StudyMismatch(f"{path} holds another study ({lines}): pass --replace or another --output")
    return data


def shape_entry(study: dict, name: str, prefill: int, decode: int, both: int) -> dict:
    entry = study["shapes"].setdefault(name, {})
    entry.update(nodes=prefill + decode + both, prefill=prefill, decode=decode, both=both)
    return entry


def is_done(study: dict, shape: str, key: str) -> bool:
    """Whether ``key`` (a workload or "routing") of ``shape`` was measured to its end."""
    entry = study["shapes"].get(shape, {}).get(key)
    return bool(entry and entry.get("complete"))


def write(study: dict, path: Path) -> None:
    """Derive the summary and write the JSON in one step (a reader never sees half a file)."""
    study["summary"] = summarize(study)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(study), indent=1) + "\n")
    os.replace(tmp, path)


# -- sweeps ----------------------------------------------------------------------------------


def meets(point: dict, target: float = ATTAINMENT_TARGET) -> bool:
    return point.get("slo_attainment") is not None and point["slo_attainment"] >= target


def next_rate(
    points: Sequence[dict],
    coarse: Sequence[float],
    refine: int,
    start: float | None = None,
    target: float = ATTAINMENT_TARGET,
):
    """The next rate a sweep offers, or None when it is done. It starts at ``start`` (a coarse rate;
    by default the lowest) and climbs the ``coarse`` rates while they meet the target; once one
    misses, it steps down the coarse rates below that one until one meets it, then bisects
    ``refine`` times between the highest rate that met the target below the lowest that missed and
    that one (the knee to within a quarter of a coarse step after two). A sweep that misses at its
    lowest coarse rate stops there: its knee is below the rates swept."""
    coarse = sorted(coarse)
    if not points:
        return start if start is not None else coarse[0]
    measured = {p["rate"] for p in points}
    missed = [p["rate"] for p in points if not meets(p, target)]
    if not missed:
        return next((r for r in coarse if r > max(measured)), None)
    high = min(missed)
    below = [p["rate"] for p in points if meets(p, target) and p["rate"] < high]
    if not below:
        return next((r for r in reversed(coarse) if r < high and r not in measured), None)
    if sum(1 for p in points if p["rate"] not in coarse) >= refine:
        return None
    mid = round((max(below) + high) / 2, 3)
    return None if mid in measured else mid


def knee(points: Sequence[dict], target: float = ATTAINMENT_TARGET) -> dict:
    """The sweep's knee and its figures there (``module docstring``)."""
    rate = max_goodput_rate([(p["rate"], p.get("slo_attainment")) for p in points], target)
    at = next((p for p in points if p["rate"] == rate), None)
    return {
        "knee_rate": rate,
        "knee_rate_per_pair": at["rate_per_pair"] if at else None,
        "knee_is_lower_bound": rate is not None and not any(p["rate"] > rate for p in points),
        "knee_below_rates": bool(points) and rate is None,
        "output_tok_s_at_knee": at["steady_output_tok_s"] if at else 0.0,
        "goodput_req_s_at_knee": at["steady_goodput_req_s"] if at else 0.0,
        "busiest_at_knee": busiest(at["cpu"]) if at and at.get("cpu") else None,
        "failed": sum(p["failed"] for p in points),
    }


# -- CPU: where a ceiling that is not the simulated GPUs comes from ---------------------------


def cpu_shares(before: dict[str, float], after: dict[str, float], elapsed_s: float, extra: dict) -> dict:
    """Cores each part used between two snapshots of CPU seconds by process name (``prefill-0``,
    ``decode-3``, ``both-1``, ``proxy-0`` (a supervisor), ``proxy-0.w2`` (its third worker));
    ``extra``: ``host_busy_cores``, ``host_cores``, ``clients`` (processes, CPU seconds)."""
    used = {n: max(0.0, after[n] - before.get(n, 0.0)) / elapsed_s for n in after}
    roles = {}
    for role in ("prefill", "decode", "both"):
        vals = [v for n, v in used.items() if n.startswith(role + "-")]
        if vals:
            roles[role] = {
                "count": len(vals),
                "total": sum(vals),
                "max": max(vals),
                "mean": sum(vals) / len(vals),
            }
    workers = [v for n, v in used.items() if n.startswith("proxy") and ".w" in n]
    proxy = {
        "workers": len(workers),
        "total": sum(v for n, v in used.items() if n.startswith("proxy")),
        "worker_max": max(workers, default=0.0),
        "worker_mean": sum(workers) / len(workers) if workers else 0.0,
    }
    processes, client_s = extra["clients"]
    return {
        "host_busy_cores": extra["host_busy_cores"],
        "host_cores": extra["host_cores"],
        "roles": roles,
        "proxy": proxy,
        "clients": {"processes": processes, "total": client_s / elapsed_s},
        "per_process": used,
    }


def busiest(cpu: dict) -> dict:
    """The part closest to its limit (a share of one core for a single process, of the host for the
    host) and whether it is there (``SATURATED``); the others in falling order."""
    parts = {"host": cpu["host_busy_cores"] / cpu["host_cores"] if cpu.get("host_cores") else 0.0}
    if cpu["proxy"]["workers"]:
        parts["proxy worker"] = cpu["proxy"]["worker_max"]
    for role, r in cpu["roles"].items():
        parts[f"{role} node"] = r["max"]
    if cpu["clients"]["processes"]:
        parts["load client"] = cpu["clients"]["total"] / cpu["clients"]["processes"]
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    name, load = ranked[0]
    return {"part": name, "load": load, "saturated": load >= SATURATED, "ranked": dict(ranked)}


# -- the summary -----------------------------------------------------------------------------


def _kind(entry: dict) -> str:
    return "colocated" if entry["both"] else "pd"


def scaling(shapes: dict[str, dict], workload: str) -> dict:
    """Output tok/s at the knee per node against the smallest measured shape of each kind
    (disaggregated, co-located): its share of linear scaling."""
    out = {}
    for kind in ("pd", "colocated"):
        names = sorted(
            (n for n, s in shapes.items() if _kind(s) == kind and s.get(workload, {}).get("points")),
            key=lambda n: shapes[n]["nodes"],
        )
        if not names:
            continue
        base = shapes[names[0]]
        per_node = knee(base[workload]["points"])["output_tok_s_at_knee"] / base["nodes"]
        rows = {}
        for n in names:
            s = shapes[n]
            k = knee(s[workload]["points"])
            rows[n] = {
                "nodes": s["nodes"],
                "knee_rate_per_pair": k["knee_rate_per_pair"],
                "output_tok_s_at_knee": k["output_tok_s_at_knee"],
                "goodput_req_s_at_knee": k["goodput_req_s_at_knee"],
                "share_of_linear": k["output_tok_s_at_knee"] / (per_node * s["nodes"]) if per_node else None,
                "knee_is_lower_bound": k["knee_is_lower_bound"],
                "knee_below_rates": k["knee_below_rates"],
                "complete": bool(s[workload].get("complete")),
                "proxy_workers": s[workload].get("proxy_workers"),
                "busiest_at_knee": k["busiest_at_knee"],
            }
        out[kind] = {"base": names[0], "shapes": rows}
    return out


def routing_summary(shapes: dict[str, dict]) -> dict:
    """Prompt tokens computed, prefix-aware against round-robin, per shape; a shape with one node
    that prefills has nothing to choose (both policies send everything there)."""
    rows = {}
    for n, s in sorted(shapes.items(), key=lambda kv: kv[1]["nodes"]):
        r = s.get("routing")
        if not r or "round-robin" not in r:
            continue
        pa, rr = r["prefix-aware"]["prompt_tokens_computed"], r["round-robin"]["prompt_tokens_computed"]
        choice = s["prefill"] + s["both"] > 1
        rows[n] = {
            "prefix_aware": pa,
            "round_robin": rr,
            "ratio": pa / rr if rr else None,
            "fewer": pa < rr if choice else None,
        }
    judged = [r["fewer"] for r in rows.values() if r["fewer"] is not None]
    return {"shapes": rows, "prefix_aware_fewer_at_every_shape": all(judged) if judged else None}


def summarize(study: dict) -> dict:
    shapes = study["shapes"]
    workloads = [w for w in WORKLOADS if any(w in s for s in shapes.values())]
    failed = sum(
        p["failed"] for s in shapes.values() for w in workloads for p in s.get(w, {}).get("points", [])
    )
    failed += sum(
        s["routing"][policy]["failed"]
        for s in shapes.values()
        if "routing" in s
        for policy in ("prefix-aware", "round-robin")
        if policy in s["routing"]
    )
    cpu_models = {r.get("cpu_model") for r in study["runs"]}
    return {
        "scaling": {w: scaling(shapes, w) for w in workloads},
        "routing": routing_summary(shapes),
        "failed_requests": failed,
        "incomplete": sorted(
            f"{n} {k}"
            for n, s in shapes.items()
            for k in (*WORKLOADS, "routing")
            if k in s and not s[k].get("complete")
        ),
        "mixed_hosts": len(cpu_models) > 1 or len({r.get("cores") for r in study["runs"]}) > 1,
    }


def report_lines(study: dict) -> list[str]:
    """What the driver prints at the end: the knees against linear, routing, failures."""
    s = study.get("summary") or summarize(study)
    lines = []
    for w, kinds in s["scaling"].items():
        for kind, sc in kinds.items():
            parts = []
            for n, v in sc["shapes"].items():
                note = ", knee not reached" if v["knee_is_lower_bound"] else ""
                note += ", knee below the rates" if v["knee_below_rates"] else ""
                note += ", incomplete" if not v["complete"] else ""
                b = v["busiest_at_knee"]
                busy = f"; busiest {b['part']} {b['load']:.2f}" if b else ""
                share = v["share_of_linear"] or 0
                parts.append(f"{n} {v['output_tok_s_at_knee']:.0f} tok/s ({share:.2f} of linear{note}{busy})")
            lines.append(f"{w} {kind}: " + ", ".join(parts))
    for n, r in s["routing"]["shapes"].items():
        lines.append(
            f"routing {n}: computed prompt tokens prefix-aware {r['prefix_aware']:.0f}, round-robin "
            f"{r['round_robin']:.0f}" + ("" if r["fewer"] is not None else " (one prefilling node)")
        )
    lines.append(
        f"failed requests: {s['failed_requests']}; incomplete: {', '.join(s['incomplete']) or 'none'}"
    )
    return lines


# -- plots -----------------------------------------------------------------------------------


def plot_paths(json_path: Path) -> dict[str, Path]:
    stem = json_path.with_suffix("")
    return {
        "scaling": Path(f"{stem}.png"),
        "sweeps": Path(f"{stem}_sweeps.png"),
        "routing": Path(f"{stem}_routing.png"),
    }


def plot(study: dict, json_path: Path) -> list[str]:
    """PNGs beside the JSON: output tok/s and goodput at the knee against node count (dashed:
    linear from the smallest shape; hollow markers: knee not reached), each sweep's SLO attainment
    against the rate per pair, and the routing comparison. Needs matplotlib ([] without it)."""
    try:
        from pdserve.benchmarks.serve_plots import _pyplot

        plt = _pyplot()
    except ImportError:
        return []
    paths = plot_paths(json_path)
    summary = study.get("summary") or summarize(study)
    shapes = study["shapes"]
    workloads = list(summary["scaling"])
    device = study["runs"][-1]["device"] if study["runs"] else "?"
    written = []
    if workloads:
        fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 9), squeeze=False)
        for col, w in enumerate(workloads):
            for row, (key, label) in enumerate(
                (
                    ("output_tok_s_at_knee", "output tok/s at the knee"),
                    ("goodput_req_s_at_knee", "goodput (req/s)"),
                )
            ):
                ax = axes[row][col]
                for kind, marker in (("pd", "o"), ("colocated", "s")):
                    sc = summary["scaling"][w].get(kind)
                    if not sc:
                        continue
                    names = list(sc["shapes"])
                    xs = [sc["shapes"][n]["nodes"] for n in names]
                    ys = [sc["shapes"][n][key] for n in names]
                    (line,) = ax.plot(xs, ys, marker=marker, label="P/D" if kind == "pd" else "co-located")
                    for x, y, n in zip(xs, ys, names):
                        v = sc["shapes"][n]
                        if v["knee_is_lower_bound"]:
                            ax.plot([x], [y], marker=marker, mfc="white", color=line.get_color())
                        text = (
                            n if key != "output_tok_s_at_knee" else f"{n} ({v['share_of_linear'] or 0:.2f})"
                        )
                        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
                    if ys[0]:
                        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ls="--", lw=0.8, color=line.get_color())
                ax.set_xscale("log", base=2)
                nodes = sorted(
                    {v["nodes"] for sc in summary["scaling"][w].values() for v in sc["shapes"].values()}
                )
                ax.set_xticks(nodes, [str(n) for n in nodes])
                ax.minorticks_off()
                ax.set_xlabel("nodes")
                ax.set_ylabel(label)
                ax.set_title(f"{w}: {label}", fontsize=10)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        slo = study["slo"]
        fig.suptitle(
            f"{study['study']['model']}, {'simulated nodes on ' if study.get('simulated', True) else ''}"
            f"{device}\nknee: highest rate with "
            f">= {slo['attainment']:.0%} within TTFT {slo['ttft_ms']:g} ms and TPOT {slo['tpot_ms']:g} ms "
            "(dashed: linear from the smallest shape; hollow: knee not reached)",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(paths["scaling"], dpi=100)
        plt.close(fig)
        written.append(str(paths["scaling"]))

        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
        for col, w in enumerate(workloads):
            ax = axes[0][col]
            for n, s in sorted(shapes.items(), key=lambda kv: (kv[1]["both"] > 0, kv[1]["nodes"])):
                pts = sorted(s.get(w, {}).get("points", []), key=lambda p: p["rate"])
                if pts:
                    ax.plot(
                        [p["rate_per_pair"] for p in pts],
                        [(p["slo_attainment"] or 0) * 100 for p in pts],
                        marker="o",
                        ls="-" if not s["both"] else ":",
                        label=n,
                    )
            ax.axhline(ATTAINMENT_TARGET * 100, color="gray", ls="--", lw=0.8)
            ax.set_xlabel("offered rate per prefill+decode pair (/s)")
            ax.set_ylabel("requests within both SLOs (%)")
            ax.set_ylim(0, 102)
            ax.set_title(w, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(paths["sweeps"], dpi=100)
        plt.close(fig)
        written.append(str(paths["sweeps"]))
    routed = summary["routing"]["shapes"]
    if routed:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = range(len(routed))
        ax.bar([x - 0.2 for x in xs], [r["prefix_aware"] for r in routed.values()], 0.4, label="prefix-aware")
        ax.bar([x + 0.2 for x in xs], [r["round_robin"] for r in routed.values()], 0.4, label="round-robin")
        ax.set_xticks(list(xs), list(routed))
        ax.legend()
        ax.set_ylabel("prompt tokens computed")
        ax.set_title("shared-prefix workload, the same offered load per pair", fontsize=10)
        fig.tight_layout()
        fig.savefig(paths["routing"], dpi=100)
        plt.close(fig)
        written.append(str(paths["routing"]))
    return written
