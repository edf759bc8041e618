"""The prefill node's lease keeper (``prefill_node.leases``): which decode leases it renews, when."""

from __future__ import annotations

import time

import pytest

from pdserve.messages import LandingDescriptor
from pdserve.prefill_node.leases import MIN_PERIOD_S, LeaseKeeper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def landing(rid: str, address: str = "tcp://d0", lease_s: float = 3.0) -> LandingDescriptor:
    return LandingDescriptor(rid, "d0", address, [1], 16, time.time() + lease_s)


def test_a_lease_is_renewed_three_times_per_lease_length_grouped_by_decode_node():
    clock = Clock()
    keeper = LeaseKeeper(unconfirmed_s=60.0, clock=clock)
    keeper.keep(landing("a"), confirmed=True)
    keeper.keep(landing("b"), confirmed=True)
    keeper.keep(landing("c", address="tcp://d1"), confirmed=True)
    assert keeper.due() == {}  # none due at once
    clock.now += 1.05  # a third of the 3 s lease
    assert keeper.due() == {"tcp://d0": ["a", "b"], "tcp://d1": ["c"]}
    assert keeper.due() == {}  # scheduled a period later
    clock.now += 1.05
    assert sorted(keeper.due()) == ["tcp://d0", "tcp://d1"]


def test_keeping_again_keeps_the_schedule_and_drop_ends_the_renewals():
    clock = Clock()
    keeper = LeaseKeeper(unconfirmed_s=60.0, clock=clock)
    keeper.keep(landing("a"), confirmed=False)
    clock.now += 0.9
    keeper.keep(landing("a"), confirmed=True)  # the engine loop took it: not rescheduled
    clock.now += 0.15
    assert keeper.due() == {"tcp://d0": ["a"]}
    keeper.drop("a")
    clock.now += 10
    assert keeper.due() == {} and "a" not in keeper
    keeper.drop("a")  # twice is fine


def test_an_unconfirmed_lease_is_renewed_only_until_its_time_unless_confirmed():
    """A landing read off the command socket is renewed while the engine loop is busy; one the
    loop never confirms (nor drops) stops being renewed after ``unconfirmed_s``."""
    clock = Clock()
    keeper = LeaseKeeper(unconfirmed_s=5.0, clock=clock)
    keeper.keep(landing("stuck"), confirmed=False)
    keeper.keep(landing("taken"), confirmed=False)
    clock.now += 1.05
    assert keeper.due() == {"tcp://d0": ["stuck", "taken"]}  # renewed before the loop took them
    keeper.keep(landing("taken"), confirmed=True)
    clock.now += 4.0  # 5.05 s: past the unconfirmed one's time
    assert keeper.due() == {"tcp://d0": ["taken"]}
    assert "stuck" not in keeper and "taken" in keeper


@pytest.mark.parametrize("left_s", [0.05, -2.0])
def test_a_landing_with_little_or_no_time_left_is_renewed_at_the_shortest_period(left_s):
    clock = Clock()
    keeper = LeaseKeeper(unconfirmed_s=60.0, clock=clock)
    keeper.keep(landing("late", lease_s=left_s), confirmed=True)
    assert keeper.due() == {}
    clock.now += MIN_PERIOD_S
    assert keeper.due() == {"tcp://d0": ["late"]}
