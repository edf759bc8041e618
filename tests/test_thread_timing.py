"""Threads that poll in a loop sleep as long as they ask (``pdserve.utils.precise_sleeps``): Linux's
default timer slack (50 us) made each ``time.sleep(0)`` of the KV receiver's turns while a READ
ran cost ~56 us here."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from pdserve import kv_transfer
from pdserve.kv_transfer import control_receiver
from pdserve.kv_transfer.base import ReservationTable
from pdserve.utils import TIMER_SLACK_NS, precise_sleeps
from tests.test_kv_transfer_nixl import SMALL, cache, info

PR_GET_TIMERSLACK = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_precise_sleeps_sets_the_calling_threads_slack_only():
    prctl = ctypes.CDLL(None).prctl
    seen: list[int] = []

    def body() -> None:
        before = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
        precise_sleeps()
        seen.extend([before, prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)])

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen[1] == TIMER_SLACK_NS and seen[0] != TIMER_SLACK_NS
    assert prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0) == seen[0]  # this thread's is as it was


def test_the_kv_receivers_control_thread_makes_its_sleeps_precise(monkeypatch):
    callers: list[str] = []
    record = lambda: callers.append(threading.current_thread().name)  # noqa: E731
    monkeypatch.setattr(control_receiver, "precise_sleeps", record)
    receiver = kv_transfer.create_receiver("zmq")
    receiver.register_kv_cache(cache(SMALL, 4, fill=False))
    receiver.start(info("decode", SMALL), ReservationTable(SMALL[0]), lambda commit: None)
    try:
        deadline = time.monotonic() + 5
        while not callers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert callers == ["kv-receiver"]
    finally:
        receiver.close()
