"""Admission by the proxy's own capacity (proxy/overload.py): a late event loop parks new requests
in order, lets them in as it catches up, and refuses those that waited too long."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.proxy.overload import LoopLag


def test_a_late_loop_parks_requests_in_order_and_lets_them_in_as_it_recovers():
    async def run() -> None:
        lag = LoopLag(limit_s=0.05)
        lag.start()
        await asyncio.sleep(0.1)
        assert not lag.behind and await lag.admit(0.01)  # on time: in at once
        order: list[int] = []

        async def request(i: int, timeout: float) -> None:
            if await lag.admit(timeout):
                order.append(i)

        time.sleep(0.4)  # the loop is stuck for 400 ms, as under a CPU-bound burst
        await asyncio.sleep(0.03)  # the monitor's late wake-up
        assert lag.behind and lag.lag >= 0.1
        waiting = [asyncio.ensure_future(request(i, 5.0)) for i in range(20)]
        late = asyncio.ensure_future(request(99, 0.01))  # cannot wait: refused
        await asyncio.sleep(0)
        assert lag.num_waiting == 21
        await asyncio.gather(*waiting, late)
        assert order == list(range(20))  # first come, first in; the impatient one was refused
        assert lag.num_waiting == 0 and not lag.behind and lag.stalled_s >= 0.3
        await lag.stop()

    asyncio.run(run())


def test_a_cancellation_of_stops_caller_reaches_it():
    """``stop`` waits for its watch to end without swallowing a cancellation of its own caller
    (proxy shutdown cancelled midway ends cancelled, not as if ``stop`` had returned)."""

    async def run() -> None:
        lag = LoopLag(limit_s=0.05)
        lag.start()
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(lag.stop())
        await asyncio.sleep(0)  # stop cancelled the watch and waits for its end
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert stopping.cancelled()

    asyncio.run(run())


def test_stop_lets_every_waiter_go_refused():
    async def run() -> None:
        lag = LoopLag(limit_s=0.01)
        lag.lag = 1.0  # behind, and no monitor running to catch up
        waiter = asyncio.ensure_future(lag.admit(10.0))
        await asyncio.sleep(0.01)
        await lag.stop()
        assert await waiter is False

    asyncio.run(run())


def test_arrivals_on_time_keep_admission_at_their_pace():
    """While the loop is on time, each arrival lets the oldest waiter in (and queues behind the
    rest): a backlog left by a stall does not cap admission at the ticks' release rate."""

    async def run() -> None:
        lag = LoopLag(limit_s=0.05)  # no monitor: only arrivals release
        order: list[int] = []

        async def request(i: int) -> None:
            if await lag.admit(5.0):
                order.append(i)

        lag.lag = 1.0  # behind: the first ten park
        parked = [asyncio.ensure_future(request(i)) for i in range(10)]
        await asyncio.sleep(0)
        assert lag.num_waiting == 10 and not order
        lag.lag = 0.0  # on time again
        for i in range(10, 30):  # each arrival lets one in, in order
            asyncio.ensure_future(request(i))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        for _ in range(5):  # the last one let in resumes
            await asyncio.sleep(0)
        assert order == list(range(20))
        assert lag.num_waiting == 10
        await lag.stop()
        await asyncio.gather(*parked)

    asyncio.run(run())
