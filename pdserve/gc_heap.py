"""The cyclic garbage collector in a serving process: the start-up heap frozen out of its passes
(``freeze``), and its passes counted and timed (``pauses``).

A pass of the oldest generation walks every object the collector tracks, and once a node has
started those are mostly torch's, the model's and the engine's: in the KV benchmark's prefill
process on the 2-core box (172k objects tracked) such a pass took 45-65 ms, and one of the middle
generation 1.7-2.0 ms, all of it with the GIL held, so every thread of the process waited behind
it (the engine loop's step, the KV sender and receiver). None of that heap is garbage. ``freeze``,
called once a process has started (as vLLM's engine core and workers, SGLang's server and
TensorRT-LLM do after their warm-up), moves it out of every later pass; what serving allocates
afterwards is collected as before. Objects frozen are never collected, so a process freezes once,
at the end of its start-up, and never in a process that starts and stops engines at will (tests,
notebooks)."""

from __future__ import annotations

import gc
import time

from pdserve import envs
from pdserve.messages import GcStats
from pdserve.metrics import Registry

_collections = [0, 0, 0]
_seconds = [0.0, 0.0, 0.0]
_started = 0.0
_tracking = False


def freeze() -> int:
    """Collect what start-up left as garbage, then freeze every object still tracked (not with
    ``PDSERVE_NO_GC_FREEZE``); how many are frozen now (``gc.get_freeze_count``)."""
    if not envs.PDSERVE_NO_GC_FREEZE:
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()


def _callback(phase: str, info: dict) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
        return
    generation = info["generation"]
    _collections[generation] += 1
    _seconds[generation] += time.perf_counter() - _started


def track() -> None:
    """Count and time this process's collector passes from now on (once per process; passes never
    overlap: the collector runs one at a time, under the GIL)."""
    global _tracking
    if not _tracking:
        gc.callbacks.append(_callback)
        _tracking = True


def pauses() -> GcStats:
    """This process's passes by generation since ``track``, and the objects frozen."""
    return GcStats(list(_collections), list(_seconds), gc.get_freeze_count())


class GcMetrics:
    """The collector's figures on a process's /metrics, by process (a node's "node" and "core",
    the proxy's "proxy"; a proxy of several workers sums them): ``update`` before each render."""

    def __init__(self, registry: Registry) -> None:
        self.collections = registry.counter(
            "pdserve_gc_collections_total",
            "Passes of Python's cyclic garbage collector, by process (node, core: its engine core; "
            "proxy) and generation (2: the oldest, which walks every object not frozen at start-up).",
            ["process", "generation"],
        )
        self.seconds = registry.counter(
            "pdserve_gc_pause_seconds_total",
            "Seconds those passes took, by process and generation: the GIL is held throughout, so "
            "every thread of the process (the engine loop's steps, the KV transfers, the proxy's "
            "event loop) waited.",
            ["process", "generation"],
        )
        self.frozen = registry.gauge(
            "pdserve_gc_frozen_objects",
            "Objects each process froze out of the collector's passes once it had started (pdserve.gc_heap).",
            ["process"],
        )
        self._last: dict[tuple[str, int], tuple[int, float]] = {}

    def update(self, process: str, stats: GcStats) -> None:
        """Advance ``process``'s counters to the totals of ``stats`` (``pauses()`` of that process)."""
        for generation, (count, seconds) in enumerate(zip(stats.collections, stats.seconds)):
            last_count, last_seconds = self._last.get((process, generation), (0, 0.0))
            self.collections.labels(process, str(generation)).inc(max(0, count - last_count))
            self.seconds.labels(process, str(generation)).inc(max(0.0, seconds - last_seconds))
            self._last[process, generation] = (count, seconds)
        self.frozen.labels(process).set(stats.frozen)
