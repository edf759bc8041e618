"""Prometheus metrics without a dependency: counters, gauges and histograms with labels.

A ``Registry`` owns metrics and renders them in the text exposition format 0.0.4, the one
every Prometheus server and vLLM dashboard scrapes::

    registry = Registry()
    requests = registry.counter("pdserve_requests_total", "Requests by final status.", ["status"])
    ttft = registry.histogram("pdserve_time_to_first_token_seconds", "Time to first token.")
    requests.labels(status="200").inc()
    ttft.observe(0.031)
    body = registry.render()  # serve with CONTENT_TYPE

Metrics are safe to update from several threads (each holds a lock); rendering takes a
consistent snapshot per metric, not across metrics.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# Latency buckets in seconds, from sub-millisecond proxy overheads to long generations.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
DEFAULT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it (Go's float formatting for the special values)."""
    if isinstance(value, int):
        return str(value)  # bucket counts
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


class _Metric:
    """A named family of samples, one child per combination of label values."""

    type_name = ""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = ()) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        for label in self.labelnames:
            if not _LABEL_RE.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        if len(set(self.labelnames)) != len(self.labelnames):
            raise ValueError(f"duplicate label names {self.labelnames} for metric {name}")
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], object] = {}

    def _new_child(self):
        raise NotImplementedError

    def labels(self, *values: object, **kwvalues: object):
        """The child for these label values (created on first use); positional or by name."""
        if values and kwvalues:
            raise ValueError("pass label values either positionally or by name, not both")
        if kwvalues:
            if set(kwvalues) != set(self.labelnames):
                raise ValueError(f"{self.name} expects labels {self.labelnames}, got {sorted(kwvalues)}")
            values = tuple(kwvalues[n] for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} expects {len(self.labelnames)} label values, got {len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, self._new_child())
        return child

    def remove(self, *values: object) -> None:
        """Forget the child of these label values (a node that left, say)."""
        with self._lock:
            self._children.pop(tuple(str(v) for v in values), None)

    def _only_child(self):
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: call .labels(...) first")
        return self.labels()

    def render(self) -> list[str]:
        lines = [
            f"# HELP {self.name} {_escape_help(self.documentation)}",
            f"# TYPE {self.name} {self.type_name}",
        ]
        if not self.labelnames and not self._children:
            self.labels()  # an unlabelled metric always shows its (zero) sample
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            pairs = list(zip(self.labelnames, key))
            for suffix, extra, value in child._samples():
                lines.append(f"{self.name}{suffix}{_label_text(pairs + extra)} {format_value(value)}")
        return lines


class _CounterChild:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up; got inc({amount})")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        return self._value

    def _samples(self):
        yield "", [], self._value


class Counter(_Metric):
    """A value that only goes up. Name it ``*_total``; the name is exposed as given."""

    type_name = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._only_child().inc(amount)

    @property
    def value(self) -> float:
        return self._only_child().value


class _GaugeChild:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value from ``function`` at every render instead of storing it."""
        self._function = function

    @property
    def value(self) -> float:
        return float(self._function()) if self._function is not None else self._value

    def _samples(self):
        yield "", [], self.value


class Gauge(_Metric):
    """A value that goes up and down. ``merge`` says how processes' values combine on a shared
    /metrics (``merge_snapshots``): ``sum`` (requests in flight) or ``max`` (a node seen up by any)."""

    type_name = "gauge"

    def __init__(
        self, name: str, documentation: str, labelnames: Iterable[str] = (), merge: str = "sum"
    ) -> None:
        super().__init__(name, documentation, labelnames)
        if merge not in ("sum", "max"):
            raise ValueError(f"gauge {name}: merge must be sum or max, got {merge!r}")
        self.merge = merge

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild()

    def set(self, value: float) -> None:
        self._only_child().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._only_child().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._only_child().dec(amount)

    def set_function(self, function: Callable[[], float]) -> None:
        self._only_child().set_function(function)

    @property
    def value(self) -> float:
        return self._only_child().value


class _HistogramChild:
    def __init__(self, upper_bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._upper_bounds = upper_bounds
        self._counts = [0] * len(upper_bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, value: float) -> None:
        # The first bound >= value (its ``le`` bucket); the last bound is +Inf, and a NaN lands
        # in the first bucket as every comparison with it is false.
        i = min(bisect.bisect_left(self._upper_bounds, value), len(self._upper_bounds) - 1)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    @property
    def sum(self) -> float:
        return self._sum

    def _samples(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = 0
        for bound, n in zip(self._upper_bounds, counts):
            cumulative += n
            yield "_bucket", [("le", format_value(bound))], cumulative
        yield "_sum", [], total
        yield "_count", [], cumulative


class Histogram(_Metric):
    """Counts of observations in cumulative buckets (``le``), plus their sum and count."""

    type_name = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        if "le" in self.labelnames:
            raise ValueError(f"histogram {name} cannot have a label named 'le'")
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"histogram {name} needs strictly increasing buckets, got {list(buckets)}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.upper_bounds = tuple(bounds)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.upper_bounds)

    def observe(self, value: float) -> None:
        self._only_child().observe(value)

    @property
    def count(self) -> int:
        return self._only_child().count

    @property
    def sum(self) -> float:
        return self._only_child().sum


class Registry:
    """The metrics one process exposes on ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, documentation: str, labelnames: Iterable[str] = ()) -> Counter:
        return self.register(Counter(name, documentation, labelnames))

    def gauge(
        self, name: str, documentation: str, labelnames: Iterable[str] = (), merge: str = "sum"
    ) -> Gauge:
        return self.register(Gauge(name, documentation, labelnames, merge))

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return self.register(Histogram(name, documentation, labelnames, buckets))

    def get(self, name: str) -> _Metric | None:
        return self._metrics.get(name)

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for metric in metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n" if lines else ""

    def snapshot(self) -> list[dict]:
        """Every metric's samples as plain data (JSON-able), for ``merge_snapshots`` in another
        process: ``{name, type, help, merge, samples: [[sample name with labels, value], ...]}``."""
        with self._lock:
            metrics = list(self._metrics.values())
        out = []
        for metric in metrics:
            lines = metric.render()
            samples = [line.rsplit(" ", 1) for line in lines[2:]]
            out.append(
                {
                    "name": metric.name,
                    "type": metric.type_name,
                    "help": metric.documentation,
                    "merge": getattr(metric, "merge", "sum"),
                    "samples": [[key, float(value)] for key, value in samples],
                }
            )
        return out


def merge_snapshots(snapshots: Sequence[list[dict]]) -> str:
    """One exposition for several processes' ``Registry.snapshot()`` (the proxy's workers): counters
    and histograms add up sample by sample, gauges add up or take the largest (``Gauge.merge``).
    Metrics and samples keep the order in which they first appear."""
    merged: dict[str, dict] = {}
    for snapshot in snapshots:
        for metric in snapshot:
            into = merged.setdefault(
                metric["name"],
                {**metric, "samples": {}},  # sample key -> value
            )
            samples = into["samples"]
            for key, value in metric["samples"]:
                if key not in samples:
                    samples[key] = value
                elif metric["type"] == "gauge" and metric["merge"] == "max":
                    samples[key] = max(samples[key], value)
                else:
                    samples[key] += value
    lines: list[str] = []
    for metric in merged.values():
        lines.append(f"# HELP {metric['name']} {_escape_help(metric['help'])}")
        lines.append(f"# TYPE {metric['name']} {metric['type']}")
        for key, value in metric["samples"].items():
            if metric["type"] == "histogram" and (key.endswith("_count") or "_bucket{" in key):
                value = int(value)  # counts stay integers, as a single process writes them
            lines.append(f"{key} {format_value(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def parse_text(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition: ``name{labels}`` as written -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
