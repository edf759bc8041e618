"""PNG plots of `pdserve bench serve` runs; matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pdserve.benchmarks.serve_metrics import SLO, RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_latency_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], slo: SLO, path: Path) -> Path:
    """TTFT, TPOT, ITL and E2E CDFs, one line per run (label, records); SLO limits as dashed lines."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        ("TTFT", lambda rs: [r.ttft_s for r in rs if r.ttft_s is not None], slo.ttft_ms),
        ("TPOT", lambda rs: [r.tpot_s for r in rs if r.tpot_s is not None], slo.tpot_ms),
        ("ITL", lambda rs: [g for r in rs for g in r.itl_s], None),
        ("E2E latency", lambda rs: [r.e2e_s for r in rs], None),
    )
    for ax, (name, pick, limit) in zip(axes.flat, panels):
        for label, records in runs:
            _cdf(ax, [v * 1000 for v in pick([r for r in records if r.success])], label)
        if limit is not None:
            ax.axvline(limit, color="gray", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests" if name != "ITL" else "share of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pdserve bench serve: latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(
    series: Sequence[tuple[str, Sequence[float], Sequence[float | None], Sequence[float]]],
    target: float,
    path: Path,
) -> Path:
    """SLO attainment and output throughput against the offered request rate.

    ``series``: one (label, rates, attainments, output tokens/s) per server or configuration.
    """
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rates, attainment, throughput in series:
        finite = [i for i, r in enumerate(rates) if math.isfinite(r)]  # "all at once" has no place on an axis
        shown = [(rates[i], attainment[i]) for i in finite if attainment[i] is not None]
        if shown:
            left.plot([r for r, _ in shown], [a * 100 for _, a in shown], marker="o", label=label)
        right.plot([rates[i] for i in finite], [throughput[i] for i in finite], marker="o", label=label)
    left.axhline(target * 100, color="gray", linestyle="--", label=f"target {target:.0%}")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("requests meeting both SLOs (%)")
    left.set_ylim(0, 102)
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("output tokens/s")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pdserve bench serve: goodput sweep")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
