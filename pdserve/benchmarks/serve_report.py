"""What `pdserve bench serve` prints and writes: a table per run, the JSON result, the plots."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.serve_load import LoadResult
from pdserve.benchmarks.serve_metrics import SLO, RequestRecord, Summary, max_goodput_rate


@dataclass(frozen=True)
class RateRun:
    """The workload offered once, at one request rate."""

    rate: float
    result: LoadResult
    summary: Summary


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def jsonable(obj):
    """NaN and infinities (JSON has none) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def record_json(r: RequestRecord, detailed: bool) -> dict:
    # Field by field, not dataclasses.asdict: that deep-copies every ITL (one per token) to drop them.
    out = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "itl_s"}
    out["tpot_s"] = r.tpot_s
    if detailed:
        out["itl_s"] = list(r.itl_s)
    return out


def record_from_json(d: dict) -> RequestRecord:
    """The inverse of ``record_json`` (ITLs only where they were saved)."""
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    values = {k: v for k, v in d.items() if k in fields}
    values["itl_s"] = tuple(d.get("itl_s") or ())
    return RequestRecord(**values)


def run_json(run: RateRun, detailed: bool) -> dict:
    return {
        "request_rate": rate_name(run.rate),
        **run.summary.to_dict(),
        "requests": [record_json(r, detailed) for r in run.result.records],
    }


def sweep_json(runs: Sequence[RateRun], slo: SLO, target: float) -> dict:
    points = [(run.rate, run.summary.slo_attainment) for run in runs]
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "attainment_target": target,
        "points": [{"request_rate": rate_name(r), "slo_attainment": a} for r, a in points],
        "max_goodput_rate": max_goodput_rate(points, target) if slo.is_set else None,
    }


def print_summary(title: str, s: Summary) -> None:
    """The run as a table, in the layout of vLLM's benchmark_serving."""

    def row(name: str, value, fmt: str = "{:.2f}") -> None:
        shown = value if isinstance(value, str) else ("n/a" if value is None else fmt.format(value))
        print(f"{name:<42}{shown:>12}")

    print(f"{' ' + title + ' ':=^54}")
    row("Successful requests:", s.num_completed, "{}")
    row("Failed requests:", s.num_failed, "{}")
    if s.num_skipped:
        row("Skipped turns (earlier turn failed):", s.num_skipped, "{}")
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens if s.input_tokens_known else "unknown", "{}")
    row("Total generated tokens:", s.total_output_tokens, "{}")
    row("Cached prompt tokens (server usage):", s.total_cached_tokens, "{}")
    row("Request throughput (req/s):", s.request_throughput)
    row("Input token throughput (tok/s):", s.input_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    for name, stats in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        print(f"{' ' + name + ' (ms) ':-^54}")
        row(f"Mean {name}:", stats.mean)
        for q, v in stats.percentiles:
            row(f"P{q:g} {name}:", v)
    if s.slo.is_set:
        print(f"{' SLO ':-^54}")
        row("Limits TTFT / TPOT (ms):", f"{s.slo.ttft_ms} / {s.slo.tpot_ms}")
        row("Requests meeting both (%):", 100 * s.slo_attainment)
        row("Request goodput (req/s):", s.request_goodput)
    print("=" * 54)


def write_plots(runs: Sequence[RateRun], slo: SLO, label: str, target: float, out: Path) -> list[str]:
    """Latency CDFs of every run, and attainment/throughput against the rate for a sweep."""
    from pdserve.benchmarks import serve_plots

    named = [(f"{label} @ {rate_name(run.rate)} req/s", run.result.records) for run in runs]
    paths = [serve_plots.plot_latency_cdfs(named, slo, out / f"{label}_latency_cdf.png")]
    if len(runs) > 1:
        rates = [run.rate for run in runs]
        attainment = [run.summary.slo_attainment for run in runs]
        throughput = [run.summary.output_throughput for run in runs]
        series = [(label, rates, attainment, throughput)]
        paths.append(serve_plots.plot_sweep(series, target, out / f"{label}_goodput_sweep.png"))
    return [str(p) for p in paths]
