"""Statistics of a `pdserve bench serve` run: per-request records in, a summary out.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

* TTFT: from sending the request to the first chunk that carries output text.
* ITL: the gap between two consecutive chunks that carry output text (a chunk that
  carries several tokens is one gap, as the client sees it).
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request; requests with one output
  token have none and are left out of the TPOT statistics.
* E2E: from sending the request to the end of its stream.
* SLO attainment: the share of all requests (failed ones count as missing) whose TTFT
  and TPOT are within ``--slo-ttft-ms`` / ``--slo-tpot-ms``; a request without a TPOT
  meets any TPOT limit. Request goodput (vLLM's term) is the number of such requests per
  second of the run.
* Max goodput rate (DistServe): in a rate sweep, the highest (finite) request rate whose
  SLO attainment is at least the target (90 % by default).

Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
DEFAULT_ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times in seconds; ``start_s`` is since the run began."""

    success: bool
    start_s: float
    e2e_s: float
    ttft_s: float | None
    """None when no output text arrived (failed, or an empty answer)."""
    itl_s: tuple[float, ...]
    num_input_tokens: int | None
    """From the server's usage when it sent one, else counted with --tokenizer, else None."""
    num_output_tokens: int
    """From the server's usage when it sent one, else the number of chunks carrying text."""
    usage_reported: bool
    num_cached_tokens: int = 0
    error: str = ""
    conversation: int = 0
    turn: int = 0

    def __post_init__(self) -> None:
        assert self.success == (not self.error), "a record fails exactly when it carries an error"
        assert self.num_output_tokens >= 0 and self.e2e_s >= 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Latency limits; None leaves that dimension unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for value in (self.ttft_ms, self.tpot_ms):
            assert value is None or value > 0, "SLO limits are positive milliseconds"

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, record: RequestRecord) -> bool:
        if not record.success or record.ttft_s is None:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Mean, standard deviation and percentiles of one latency, in milliseconds."""

    count: int
    mean: float
    std: float
    percentiles: tuple[tuple[float, float], ...]

    @classmethod
    def of_seconds(cls, values: Sequence[float], qs: Sequence[float] = DEFAULT_PERCENTILES) -> Stats:
        ms = [v * 1000 for v in values]
        n = len(ms)
        mean = sum(ms) / n if n else math.nan
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / n) if n else math.nan
        return cls(n, mean, std, tuple((q, percentile(ms, q)) for q in qs))

    def p(self, q: float) -> float:
        return dict(self.percentiles)[q]

    def to_dict(self) -> dict:
        out = {"count": self.count, "mean": self.mean, "std": self.std}
        out.update({f"p{q:g}": v for q, v in self.percentiles})
        return out


@dataclass(frozen=True)
class Summary:
    """One run at one load; rates are derived from the counts so they cannot disagree."""

    duration_s: float
    num_requests: int
    num_completed: int
    num_skipped: int
    """Later turns of conversations whose earlier turn failed: never sent."""
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    num_usage_reported: int
    input_tokens_known: bool
    """False when some request had no usage and no tokenizer counted its prompt."""
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo: SLO
    num_slo_met: int

    @property
    def num_failed(self) -> int:
        return self.num_requests - self.num_completed - self.num_skipped

    @property
    def request_throughput(self) -> float:
        return self.num_completed / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def input_throughput(self) -> float:
        return self.total_input_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def slo_attainment(self) -> float | None:
        if not self.slo.is_set or not self.num_requests:
            return None
        return self.num_slo_met / self.num_requests

    @property
    def request_goodput(self) -> float | None:
        if not self.slo.is_set or self.duration_s <= 0:
            return None
        return self.num_slo_met / self.duration_s

    def to_dict(self) -> dict:
        return {
            "duration_s": self.duration_s,
            "num_requests": self.num_requests,
            "num_completed": self.num_completed,
            "num_failed": self.num_failed,
            "num_skipped": self.num_skipped,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "total_cached_tokens": self.total_cached_tokens,
            "num_usage_reported": self.num_usage_reported,
            "input_tokens_known": self.input_tokens_known,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.input_throughput + self.output_throughput,
            "ttft_ms": self.ttft_ms.to_dict(),
            "tpot_ms": self.tpot_ms.to_dict(),
            "itl_ms": self.itl_ms.to_dict(),
            "e2e_ms": self.e2e_ms.to_dict(),
            "slo": {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms},
            "num_slo_met": self.num_slo_met if self.slo.is_set else None,
            "slo_attainment": self.slo_attainment,
            "request_goodput": self.request_goodput,
        }


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO = SLO(),
    qs: Sequence[float] = DEFAULT_PERCENTILES,
    num_skipped: int = 0,
) -> Summary:
    """Aggregate a run's records; failed requests count in ``num_requests`` but in no latency."""
    ok = [r for r in records if r.success]
    return Summary(
        duration_s=duration_s,
        num_requests=len(records) + num_skipped,
        num_completed=len(ok),
        num_skipped=num_skipped,
        total_input_tokens=sum(r.num_input_tokens or 0 for r in ok),
        total_output_tokens=sum(r.num_output_tokens for r in ok),
        total_cached_tokens=sum(r.num_cached_tokens for r in ok),
        num_usage_reported=sum(r.usage_reported for r in ok),
        input_tokens_known=all(r.num_input_tokens is not None for r in ok),
        ttft_ms=Stats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None], qs),
        tpot_ms=Stats.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None], qs),
        itl_ms=Stats.of_seconds([gap for r in ok for gap in r.itl_s], qs),
        e2e_ms=Stats.of_seconds([r.e2e_s for r in ok], qs),
        slo=slo,
        num_slo_met=sum(slo.met(r) for r in records),
    )


def output_tok_s_between(records: Sequence[RequestRecord], t0: float, t1: float) -> float:
    """Output tokens a second that reached the client in ``[t0, t1]`` (seconds since the run
    began): a request's first token at its TTFT, its others spread evenly from there to its end
    (what TPOT assumes). At a steady load this is the serving rate, free of the ramp-up before the
    batches fill and of the drain after the last arrival, which the whole run's throughput (tokens
    over first send to last end) counts against any run whose slowest request ends later."""
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    tokens = 0.0
    for r in records:
        if not r.success or r.ttft_s is None or r.num_output_tokens <= 0:
            continue
        first = r.start_s + r.ttft_s
        end = r.start_s + r.e2e_s
        tokens += t0 <= first <= t1
        rest = r.num_output_tokens - 1
        if rest and end > first:
            tokens += rest * max(0.0, min(end, t1) - max(first, t0)) / (end - first)
        elif rest:
            tokens += rest * (t0 <= end <= t1)
    return tokens / (t1 - t0)


def goodput_between(records: Sequence[RequestRecord], slo: SLO, t0: float, t1: float) -> float:
    """Requests a second sent in ``[t0, t1]`` that met ``slo``: the steady-state goodput."""
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    return sum(t0 <= r.start_s <= t1 and slo.met(r) for r in records) / (t1 - t0)


def max_goodput_rate(
    points: Sequence[tuple[float, float | None]], target: float = DEFAULT_ATTAINMENT_TARGET
) -> float | None:
    """DistServe's goodput: the highest swept request rate whose SLO attainment reaches ``target``.

    ``points`` are (request rate, attainment) pairs in any order; None if no rate reaches it.
    An infinite rate (everything at once) is no rate one can offer, so it never counts.
    """
    passing = [
        rate
        for rate, attainment in points
        if math.isfinite(rate) and attainment is not None and attainment >= target
    ]
    return max(passing) if passing else None


Totals = dict[str, tuple[float, float]]
"""(sum, count) per histogram name."""


def seconds_totals(metrics_text: str) -> Totals:
    """(sum, count) of every ``*_seconds`` histogram in a Prometheus text exposition (labels
    and all series of a name added together)."""
    totals: dict[str, list[float]] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        name = name.partition("{")[0]
        for part, i in (("_sum", 0), ("_count", 1)):
            if name.endswith("_seconds" + part):
                totals.setdefault(name[: -len(part)], [0.0, 0.0])[i] += float(value.split()[0])
    return {k: (v[0], v[1]) for k, v in totals.items()}


def means_since(before: Totals, after: Totals) -> dict[str, float]:
    """Mean of each histogram over the observations between two :func:`seconds_totals`."""
    means = {}
    for name, (total, count) in after.items():
        total0, count0 = before.get(name, (0.0, 0.0))
        if count > count0:
            means[name] = (total - total0) / (count - count0)
    return means
