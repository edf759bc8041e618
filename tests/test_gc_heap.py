"""A started process freezes its heap out of the garbage collector's passes (``pdserve.gc_heap``):
a pass of the oldest generation then skips torch's and the engine's objects; and the passes are
counted and timed for the node's metrics. Each case runs in a child process: a frozen heap is
never collected, and this test process must stay as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = """
import gc, json, time
import torch  # a heap the size of a node's at start-up (torch's modules, functions, types)
from pdserve import gc_heap

gc_heap.track()

def full_pass():
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started

before = min(full_pass() for _ in range(3))
frozen = gc_heap.freeze()
after = min(full_pass() for _ in range(3))
stats = gc_heap.pauses()
print(json.dumps({"frozen": frozen, "before": before, "after": after,
                  "collections": stats.collections, "seconds": stats.seconds, "reported": stats.frozen}))
"""


def _child(env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_frozen_heap_leaves_the_oldest_generations_pass_with_little_to_walk():
    r = _child()
    print(
        f"full pass: {r['before'] * 1e3:.2f} ms before the freeze, {r['after'] * 1e3:.3f} ms after; "
        f"{r['frozen']} objects frozen"
    )
    assert r["frozen"] > 10_000 and r["reported"] == r["frozen"]
    assert r["after"] < r["before"] / 5
    # Every pass was counted (three before, the freeze's own, three after) and timed.
    assert r["collections"][2] >= 7 and r["seconds"][2] > 0


def test_the_debug_toggle_leaves_the_heap_in_the_passes():
    r = _child({"PDSERVE_NO_GC_FREEZE": "1"})
    assert r["frozen"] == 0 and r["reported"] == 0
