"""Admission by the proxy's own capacity: past it, new requests wait (bounded) instead of slowing
every stream the proxy already relays.

A proxy process relays every token of every stream on one event loop. Past what its core can
do, the loop runs late for everybody: measured on a 16-core host with stand-in nodes
(docs/benchmarks/proxy_alone_h100host.json), one worker relayed 2,240 tok/s at 64 streams, 337 at
256, and its late reads of the nodes' stream headers timed out and sent 143 healthy streams to
other nodes. So the proxy watches how late its loop runs (``LoopLag``) and, while it runs later
than ``max_loop_lag_s``, parks new generation requests in a FIFO queue; they go in a few at a time
as the loop catches up, or get a 429 with Retry-After once they have waited ``admission_wait_s``;
/health and /metrics are never held. Same host, one worker, 50 ms
(docs/benchmarks/proxy_alone_admission_h100host.json): 2,137 tok/s at 64 streams, 1,910 at 256 and
1,718 at 512, no migration. Admitted streams still run slower than the stand-ins offer once the
worker's core is full (stream p50 1.8 s for 0.64 s of tokens at 64 streams): the loop is on time
but has more tokens to relay than it can; that limit is the cost per token, not admission.
Once the loop is on time again, every arrival also lets the oldest waiter in, so a backlog left by
a stall never holds admission below the arrivals' pace (docs/benchmarks/proxy_alone_cpu.json).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from pdserve.utils import wait_at_most


class LoopLag:
    """How late this process's event loop runs, and a queue of requests waiting for it to catch up.

    ``run`` sleeps ``INTERVAL_S`` again and again and measures how much later than asked it wakes:
    ``lag`` takes a late wake-up at once and forgets it over a few intervals. Each wake-up with the
    loop on time lets the oldest waiters in: at most ``RELEASE_PER_TICK`` and at most a quarter of
    the queue, so a recovered loop is not flooded again at once.
    """

    INTERVAL_S = 0.02
    RELEASE_PER_TICK = 8
    DECAY = 0.7  # per interval: a 1 s stall reads as under 50 ms after ~9 intervals

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.lag = 0.0
        self.stalled_s = 0.0  # total lag seen beyond the limit (how long the loop was behind)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._task: asyncio.Task | None = None

    @property
    def behind(self) -> bool:
        return self.lag > self.limit_s

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        """Stop watching and let every waiter go (refused); returns once the watch ended. A
        cancellation of the caller while it waits still reaches the caller (``asyncio.wait``
        neither raises the watch's own CancelledError nor swallows the caller's)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(False)
        self._waiters.clear()
        if task is not None:
            await asyncio.wait([task])

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.INTERVAL_S)
            late = max(0.0, loop.time() - asked - self.INTERVAL_S)
            self.lag = max(late, self.lag * self.DECAY)
            if late > self.limit_s:
                self.stalled_s += late
            if not self.behind:
                self._release()

    def _release(self, n: int = 0) -> None:
        n = n or min(self.RELEASE_PER_TICK, max(1, len(self._waiters) // 4))
        while n and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                n -= 1

    async def admit(self, timeout: float) -> bool:
        """True at once while the loop is on time and nobody waits before us; else wait our turn
        for at most ``timeout`` seconds (False: the caller answers 429). An arrival while the loop
        is on time also lets the oldest waiter in, so that admission keeps pace with arrivals while
        the backlog drains (the ticks alone let in at most ``RELEASE_PER_TICK`` per interval: 400
        requests a second, 50 with four waiting, which capped a busy proxy below what it relays)."""
        if not self.behind:
            if not self._waiters:
                return True
            self._release(1)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await wait_at_most(waiter, timeout) and waiter.result()
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
