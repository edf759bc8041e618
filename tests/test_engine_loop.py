"""The engine core's loop and the node's subscriptions, as pure logic (a fake engine, no processes)."""

from __future__ import annotations

import asyncio

from pdserve.messages import StepOutputs, TokenEvent
from pdserve.node.core_client import Subscriptions, error_event
from pdserve.node.engine_loop import EngineLoop


def _event(rid: str, tokens: list[int], finish: str | None = None) -> TokenEvent:
    return TokenEvent(request_id=rid, token_ids=tokens, text="", finish_reason=finish)


def test_final_events_before_the_reader_attaches_are_kept_for_it(monkeypatch):
    """A decode node subscribes at reservation; the proxy opens the stream concurrently with the
    prefill, so a one-token request may finish before its reader attaches."""

    async def run() -> None:
        monkeypatch.setattr(Subscriptions, "UNREAD_FINAL_S", 0.05)
        subs = Subscriptions()
        subs.subscribe("early")
        subs.deliver(StepOutputs([_event("early", [1]), _event("early", [2], "length")], ["early"]))
        sub = subs.attach("early")
        seen: list[TokenEvent] = []
        ended: list[bool] = []
        sub.set_sink(seen.append, lambda: ended.append(True))
        assert [e.token_ids for e in seen] == [[1], [2]] and ended == [True]
        # An attached subscription leaves with its request's end; later events go to its sink.
        subs.subscribe("attached")
        live = subs.attach("attached")
        live.set_sink(seen.append, lambda: None)
        subs.deliver(StepOutputs([_event("attached", [3])], []))
        assert seen[-1].token_ids == [3] and subs.num_unfinished == 1
        subs.deliver(StepOutputs([_event("attached", [4], "stop")], ["attached"]))
        assert not subs.is_subscribed("attached") and subs.num_unfinished == 0
        # A finished request nobody attaches to is dropped after UNREAD_FINAL_S.
        subs.subscribe("never")
        subs.deliver(StepOutputs([_event("never", [5], "length")], ["never"]))
        assert subs.is_subscribed("never")
        await asyncio.sleep(0.1)
        assert not subs.is_subscribed("never") and subs.attach("never") is None
        assert subs.attach("unknown") is None
        # A prefill call waits for the end and reads every event; fail_all ends what is open.
        waiting = subs.subscribe("prefill")
        task = asyncio.ensure_future(waiting.wait_finished())
        subs.deliver(StepOutputs([_event("prefill", [6])], []))
        subs.fail_all("the node is shutting down")
        events = await task
        assert [e.token_ids for e in events] == [[6], []] and events[-1] == error_event(
            "prefill", "the node is shutting down"
        )

    asyncio.run(run())


class _Engine:
    """What the loop asks of an ``LLMEngine``; its second step raises."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def has_work(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def abort_request(self, ids, status=None) -> None:
        self.aborted += ids
        self.requests = [r for r in self.requests if r not in ids]

    def step(self):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("boom")
        return [f"out-{self.steps}"]


def test_the_loop_emits_command_outputs_before_the_step_and_survives_a_step_that_raises():
    engine = _Engine()
    emitted: list[list] = []

    def emit(outputs: list) -> None:
        emitted.append(outputs)
        if engine.aborted:  # the failing step's errors are out
            loop.stop()

    loop = EngineLoop(engine, emit)
    loop.IDLE_WAIT_S = 0.001

    def add(e) -> None:
        e.requests += ["a", "b"]
        loop.publish("added")

    loop.submit(add)
    loop.run()
    with_outputs = [x for x in emitted if x]
    # The command's output leaves before the step that follows it (a decode node's first token
    # on a KV commit is not held back a step), then the step's; the failing step ends every
    # request with an error output instead of wedging the loop.
    assert with_outputs[0] == ["added"]
    assert with_outputs[1] == ["out-1"]
    assert sorted(o.request_id for o in with_outputs[2]) == ["a", "b"]
    assert all(o.outputs[0].finish_reason == "error" for o in with_outputs[2])
    assert engine.aborted == ["a", "b"] and not engine.has_work()
