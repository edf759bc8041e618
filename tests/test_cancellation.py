"""A cancellation is never lost: ``pdserve.utils.wait_at_most`` (the proxy's and the prefill node's
bounded waits), a proxy's prefill call cancelled as its request channel opens, a prefill node's
landing call cancelled while its prompt reaches the engine core.

On Python 3.10 and 3.11 ``asyncio.wait_for`` returns the result when the cancellation comes in the
loop turn in which the awaited future completes. A prefill call cancelled that way (its request's
reservation failed in a burst) went out as its channel opened and sat unaborted on the prefill
node, holding a queue place, until the node's 30 s landing limit: the requests that waited for
that queue lost their decode leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from pdserve.messages import (
    AddPrefill,
    Call,
    LandingDescriptor,
    LandPrefill,
    PrefillLanding,
    PrefillRequest,
    PrefillResult,
    TransferDone,
    decode,
)
from pdserve.node.service import NodeRefused
from pdserve.prefill_node.server import add_prefill_calls
from pdserve.proxy.channel import NodeChannel
from pdserve.sampling_params import SamplingParams
from pdserve.utils import wait_at_most


async def _cancel_as_it_completes(wait) -> str:
    """Cancel a task waiting on ``fut`` in the loop turn that completes ``fut``."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wait(fut))
    for _ in range(3):
        await asyncio.sleep(0)
    fut.set_result(None)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "ran on"


def test_wait_at_most_keeps_a_cancellation_that_comes_as_the_future_completes():
    assert asyncio.run(_cancel_as_it_completes(lambda fut: wait_at_most(fut, 10.0))) == "cancelled"


def test_wait_at_most_times_out_and_leaves_the_future_running():
    async def run() -> tuple[bool, bool, bool]:
        fut = asyncio.get_running_loop().create_future()
        timed_out = not await wait_at_most(fut, 0.01)
        still_pending = not fut.done()
        fut.set_result(1)
        return timed_out, still_pending, await wait_at_most(fut, 0.0)

    assert asyncio.run(run()) == (True, True, True)


class _Socket:
    """Records what the channel sends (a unit test of the channel's own logic: no node)."""

    def __init__(self) -> None:
        self.sent: list[Call] = []

    def send(self, data, flags=0, copy=True) -> asyncio.Future:
        self.sent.append(decode(bytes(data), Call))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


@pytest.mark.parametrize("turns_before_open", [0, 3])
def test_a_prefill_call_cancelled_as_its_channel_opens_never_goes_out(turns_before_open):
    async def run() -> tuple[str, list[str]]:
        channel = NodeChannel("http://127.0.0.1:1", "tcp://127.0.0.1:1", "token")
        sock = _Socket()
        channel._start = lambda: setattr(channel, "_sock", sock)  # connecting is not under test
        request = PrefillRequest("r1", [1, 2, 3], SamplingParams(max_tokens=1))
        task = asyncio.ensure_future(channel.prefill(request, timeout=None))
        for _ in range(turns_before_open):
            await asyncio.sleep(0)
        channel._open.set()  # welcomed, in the same loop turn as the cancellation
        channel._changed.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        outcome = "cancelled" if done and task.cancelled() else "still waiting for the node"
        task.cancel()
        return outcome, [type(call.body).__name__ for call in sock.sent]

    outcome, sent = asyncio.run(run())
    assert outcome == "cancelled"
    assert "PrefillRequest" not in sent, sent


def _landing_handlers(core, admission):
    handlers: dict = {}
    state = types.SimpleNamespace(
        info=types.SimpleNamespace(block_size=16),
        core=core,
        admission=admission,
        transfers={},
        subs=types.SimpleNamespace(subscribe=lambda rid: None),
        end_request=lambda rid, why: None,
    )
    channel = types.SimpleNamespace(handle=lambda kind, fn: handlers.__setitem__(kind, fn))
    add_prefill_calls(channel, state)
    return handlers


class _Core:
    """The engine core as the node process sees it: commands recorded, none ever answered."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def submit(self, msg):
        self.calls.append(type(msg).__name__)
        return asyncio.get_running_loop().create_future()

    async def call(self, msg):
        return await self.submit(msg)

    def send(self, msg):
        pass


@pytest.mark.parametrize("admitted", [False, True])
def test_a_landing_goes_to_the_core_right_behind_its_prompt_and_a_cancelled_one_lands_nothing(admitted):
    """The prefill node's ``PrefillLanding`` handler waits only until its prompt's ``AddPrefill``
    went to the engine core (which takes commands in order), not for the core's answer: a core
    busy with a long step reads the landing, and renews its lease, right away. Cancelled while
    it waits (its proxy gone, the prompt not yet past admission), it ends there and never hands
    the core the landing (a suppressed CancelledError had it run on)."""
    core = _Core()

    @contextlib.asynccontextmanager
    async def admission(deadline):
        if not admitted:
            await asyncio.sleep(3600)  # the prompt is still on its way to the core
        yield

    handlers = _landing_handlers(core, admission)

    async def run() -> str:
        prompt = list(range(40))  # 3 blocks
        prefill = asyncio.ensure_future(
            handlers[PrefillRequest](None, PrefillRequest("r1", prompt, SamplingParams(max_tokens=1)))
        )
        await asyncio.sleep(0)
        landing = LandingDescriptor("r1", "d0", "tcp://127.0.0.1:1", [4, 5, 6], len(prompt), 1e12)
        land = asyncio.ensure_future(handlers[PrefillLanding](None, PrefillLanding(landing)))
        for _ in range(3):
            await asyncio.sleep(0)
        if not admitted:
            land.cancel()
        done, _ = await asyncio.wait({land}, timeout=0.2)
        outcome = "cancelled" if done and land.cancelled() else "waiting"
        for task in (land, prefill):
            task.cancel()
        await asyncio.gather(land, prefill, return_exceptions=True)
        return outcome

    outcome = asyncio.run(run())
    if admitted:  # the prompt's AddPrefill unanswered: the landing went right behind it
        assert core.calls == [AddPrefill.__name__, LandPrefill.__name__] and outcome == "waiting"
    else:
        assert outcome == "cancelled" and core.calls == [], (outcome, core.calls)


class _SlowCore(_Core):
    """An engine core that answers a prompt at once and takes its landing only after ``delay_s``
    (a long step: the engine loop takes commands between steps)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def submit(self, msg):
        fut = super().submit(msg)
        loop = asyncio.get_running_loop()
        loop.call_later(0 if isinstance(msg, AddPrefill) else self.delay_s, fut.set_result, None)
        return fut


@pytest.mark.parametrize("landing_comes", [True, False])
def test_the_landing_timeout_waits_for_the_landing_not_for_the_engine_loop_to_take_it(landing_comes):
    """A prefill's landing timeout (the node's ``kv_transfer_timeout_s`` from its first token) bounds
    what the proxy owes, the landing: one that came is not failed because the engine loop, busy
    with a step 3x that long, took it later (a prefill node stopped 0.6 s in every 0.8 s failed
    such requests: "no landing descriptor came within 10 s"). One that never comes still fails
    then."""
    core = _SlowCore(delay_s=0.6)
    finished = types.SimpleNamespace(
        finish_reason="length", error="", num_cached_tokens=0, prompt_logprobs=None
    )

    class _Sub:
        async def wait_finished(self):
            return [finished]

    state = types.SimpleNamespace(
        info=types.SimpleNamespace(block_size=16),
        node=types.SimpleNamespace(kv_transfer_timeout_s=0.2),
        metrics=types.SimpleNamespace(prefill_seconds=types.SimpleNamespace(observe=lambda s: None)),
        core=core,
        admission=None,  # below
        transfers={},
        subs=types.SimpleNamespace(subscribe=lambda rid: _Sub(), unsubscribe=lambda rid: None),
        end_request=lambda rid, why: None,
    )
    handlers: dict = {}
    add_prefill_calls(types.SimpleNamespace(handle=lambda kind, fn: handlers.__setitem__(kind, fn)), state)

    @contextlib.asynccontextmanager
    async def admission(deadline):
        yield

    state.admission = admission

    async def run():
        prompt = list(range(40))
        prefill = asyncio.ensure_future(
            handlers[PrefillRequest](None, PrefillRequest("r1", prompt, SamplingParams(max_tokens=1)))
        )
        await asyncio.sleep(0.05)  # the first token is out: the landing timeout runs
        if landing_comes:
            landing = LandingDescriptor("r1", "d0", "tcp://127.0.0.1:1", [4, 5, 6], len(prompt), 1e12)
            land = asyncio.ensure_future(handlers[PrefillLanding](None, PrefillLanding(landing)))
            await land  # answered once the core took it, 0.6 s later
            state.transfers["r1"].set_result(TransferDone("r1"))
        try:
            return await asyncio.wait_for(prefill, 2.0)
        except NodeRefused as e:
            return e

    outcome = asyncio.run(run())
    if landing_comes:
        assert isinstance(outcome, PrefillResult) and outcome.ok, outcome
        assert core.calls == [AddPrefill.__name__, LandPrefill.__name__]
    else:
        assert isinstance(outcome, NodeRefused) and "no landing descriptor came within 0.2 s" in str(outcome)
