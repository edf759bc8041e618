"""The engine loop's output slots: a request's outputs wait for their reader (event-loop logic only)."""

from __future__ import annotations

import asyncio

from pdserve.node.engine_loop import EngineLoop, error_output


def test_final_output_before_the_reader_attaches_is_kept_for_it(monkeypatch):
    """A decode node subscribes at reservation; the proxy opens the stream concurrently with the
    prefill, so a one-token request may finish before its reader attaches."""

    async def run() -> None:
        monkeypatch.setattr(EngineLoop, "UNREAD_FINAL_S", 0.05)
        loop = EngineLoop(None, asyncio.get_running_loop())  # never started: no engine thread
        loop.subscribe("early")
        loop._deliver(error_output("early", "done"))
        slot = loop.attach("early")
        assert slot is not None and (await slot.get()).finished
        # An attached slot leaves with its final output.
        loop.subscribe("attached")
        assert loop.attach("attached") is not None
        loop._deliver(error_output("attached", "done"))
        assert not loop.is_subscribed("attached")
        # A final output nobody attaches to is dropped after UNREAD_FINAL_S.
        loop.subscribe("never")
        loop._deliver(error_output("never", "done"))
        assert loop.is_subscribed("never")
        await asyncio.sleep(0.1)
        assert not loop.is_subscribed("never") and loop.attach("never") is None
        assert loop.attach("unknown") is None

    asyncio.run(run())
