"""Runs an ``LLMEngine`` on its own thread and bridges it to asyncio servers.

The engine is single-threaded: every call into it (add, reserve, abort, landed KV)
is queued as a command and run on the engine thread between steps. Outputs of each
step cross to the server's event loop in one hand-off and go to per-request ``OutputSlot``s,
or straight to a slot's ``sink`` (the request channel's streams); the flush hooks run after
each hand-off, so a step's events leave in one message per peer. Torch
releases the GIL inside its kernels, so the HTTP side stays responsive while a step
runs.

A step that raises does not wedge the node: every request in the engine ends with
an error output and the loop goes on.

Nothing here grows without bound: an output slot keeps one output (outputs are cumulative), and
every command comes from an HTTP handler awaiting it or from a request the node admitted, whose
number the node bounds (``NodeConfig.max_waiting_requests``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import RequestStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineLoop:
    IDLE_WAIT_S = 0.02
    UNREAD_FINAL_S = 60.0
    """How long a final output waits for a reader that has not attached yet (then it is dropped)."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        after_step: Callable[[list[RequestOutput]], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.after_step = after_step
        self.on_idle = on_idle
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._subscribers: dict[str, OutputSlot] = {}
        self._flush_hooks: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- from the event loop -------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread; its result or exception comes back here."""
        fut: asyncio.Future = self.loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                self.loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    def add_flush_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop after each hand-off of outputs (once per step)."""
        self._flush_hooks.append(fn)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget, from any thread."""
        self._commands.put(lambda: fn(self.engine))

    def subscribe(self, request_id: str) -> OutputSlot:
        """The slot that will receive the request's outputs; call before the request can produce any."""
        q = self._subscribers.get(request_id)
        if q is None:
            q = self._subscribers[request_id] = OutputSlot()
        return q

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def num_unfinished(self) -> int:
        """Subscriptions whose request has not ended yet: what a drain waits for. A final output
        kept for a reader yet to attach is over; the drain does not wait for its reader."""
        return sum(1 for q in list(self._subscribers.values()) if not q.finished)

    def is_subscribed(self, request_id: str) -> bool:
        return request_id in self._subscribers

    def attach(self, request_id: str) -> OutputSlot | None:
        """The slot ``subscribe`` made, now with its reader (None if there is none): a slot whose
        final output arrived before its reader is kept for it (``UNREAD_FINAL_S`` at most)."""
        q = self._subscribers.get(request_id)
        if q is not None:
            q.attached = True
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    def fail_subscribers(self, message: str) -> None:
        """End every open subscription with an error output (event loop); a last resort at shutdown
        for requests the engine no longer knows."""
        self._deliver_many([error_output(request_id, message) for request_id in list(self._subscribers)])

    # -- engine thread -------------------------------------------------------------------------

    def publish(self, output: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self._deliver_many, [output])

    def publish_many(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one hand-over to the event loop: each ``call_soon_threadsafe`` wakes
        the loop through its self-pipe (a syscall), a cost per step rather than per request."""
        if outputs:
            self.loop.call_soon_threadsafe(self._deliver_many, outputs)

    def _deliver_many(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output)
        for hook in self._flush_hooks:
            try:
                hook()
            except Exception:
                logger.exception("output flush hook failed")

    def _deliver(self, output: RequestOutput) -> None:
        q = self._subscribers.get(output.request_id)
        if q is not None:
            if q.sink is not None:
                q.finished = output.finished
                q.sink(output)
            else:
                q.put_nowait(output)
            if output.finished and q.attached:
                self._subscribers.pop(output.request_id, None)
            elif output.finished:  # its reader is yet to come (``attach``)
                self.loop.call_later(self.UNREAD_FINAL_S, self._drop_unread, output.request_id, q)

    def _drop_unread(self, request_id: str, q: OutputSlot) -> None:
        if self._subscribers.get(request_id) is q and not q.attached:
            del self._subscribers[request_id]

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_work()
            try:
                cmd = self._commands.get(timeout=0 if busy else self.IDLE_WAIT_S)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                cmd()
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.on_idle is not None:
                self._guard(self.on_idle)
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; ending every request in the engine with an error")
                self._fail_all("internal error in the engine step")
                continue
            self.num_steps += 1
            self.publish_many(outputs)
            if self.after_step is not None:
                self._guard(self.after_step, outputs)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("engine loop hook failed")

    def _fail_all(self, message: str) -> None:
        ids = self.engine.request_ids()
        self.engine.abort_request(ids, RequestStatus.FINISHED_ERROR)
        self.publish_many([error_output(request_id, message) for request_id in ids])


class OutputSlot:
    """Where a request's outputs wait for their reader (event loop only).

    The engine's outputs are cumulative (every one carries all tokens and text so far), so only
    the newest unread one is kept: a reader slower than the engine costs one output, not one per
    step. A final output is never replaced.
    """

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._ready = asyncio.Event()
        self.attached = False  # a reader took it (``EngineLoop.attach``)
        self.sink: Callable[[RequestOutput], None] | None = None
        """Set by a reader that takes outputs as they come (the request channel) instead of
        awaiting ``get``; it gets every output from then on, final one included."""
        self.finished = False  # the final output came (read or not)

    def put_nowait(self, output: RequestOutput) -> None:
        if self.finished:
            return
        self._output = output
        self.finished = output.finished
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._output is None:
            self._ready.clear()
            await self._ready.wait()
        output, self._output = self._output, None
        self._ready.clear()
        return output

    def empty(self) -> bool:
        return self._output is None

    def take(self) -> RequestOutput | None:
        """The unread output, if any (for a reader about to set ``sink``)."""
        output, self._output = self._output, None
        return output


def error_output(request_id: str, message: str) -> RequestOutput:
    """A final output that ends a request with an error (``finish_reason='error'``)."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(0, "", [], finish_reason="error", stop_reason=message)],
        finished=True,
    )


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
