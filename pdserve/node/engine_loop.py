"""The engine core's loop: commands between steps, one step, the step's outputs out in one hand-off.

It runs on the main thread of the node's engine core process (``pdserve.node.engine_core``), as
vLLM V1's ``EngineCoreProc.run_busy_loop``. Everything that touches the engine is a command run
here between steps: the node's typed calls (decoded by the core's reader thread) and work handed
over by the core's own threads (a KV commit from the receiver, a finished send from the sender).
After each turn, ``emit`` gets every output published during it (a step's outputs and those of
commands, such as an aborted request's error) in one list: the core sends them to the node process
as one message. Outputs of commands go out before the step that follows them, not with its
outputs: a request whose KV landed streams its first token a decode step sooner.

A step that raises does not wedge the node: every request in the engine ends with an error
output and the loop goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import RequestStatus

logger = logging.getLogger(__name__)


class EngineLoop:
    IDLE_WAIT_S = 0.02

    def __init__(
        self,
        engine: LLMEngine,
        emit: Callable[[list[RequestOutput]], None],
        after_step: Callable[[list[RequestOutput]], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.emit = emit
        self.after_step = after_step
        self.on_idle = on_idle
        self._commands: queue.Queue[Callable[[LLMEngine], Any]] = queue.Queue()
        self._published: list[RequestOutput] = []
        self._stop = threading.Event()
        self.num_steps = 0

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the loop between steps; from any thread."""
        self._commands.put(fn)

    def stop(self) -> None:
        """Make ``run`` return after its current turn (any thread)."""
        self._stop.set()
        self._commands.put(lambda engine: None)  # wake it

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- loop thread ---------------------------------------------------------------------------

    def publish(self, output: RequestOutput) -> None:
        """Send ``output`` with this turn's outputs."""
        self._published.append(output)

    def run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_work()
            try:
                cmd = self._commands.get(timeout=0 if busy else self.IDLE_WAIT_S)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._guard(cmd, self.engine)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.on_idle is not None:
                self._guard(self.on_idle)
            if self.engine.has_work() and not self._stop.is_set():
                if self._published:
                    # What the commands published (a decode node's first token, on a KV commit)
                    # goes out now, not a step later with that step's outputs.
                    self._flush()
                self._step()
            self._flush()

    def _flush(self) -> None:
        outputs, self._published = self._published, []
        self._guard(self.emit, outputs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; ending every request in the engine with an error")
            self._fail_all("internal error in the engine step")
            return
        self.num_steps += 1
        self._published.extend(outputs)
        if self.after_step is not None:
            self._guard(self.after_step, outputs)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("engine loop command or hook failed")

    def _fail_all(self, message: str) -> None:
        ids = self.engine.request_ids()
        self.engine.abort_request(ids, RequestStatus.FINISHED_ERROR)
        self._published.extend(error_output(request_id, message) for request_id in ids)


def error_output(request_id: str, message: str) -> RequestOutput:
    """A final output that ends a request with an error (``finish_reason='error'``)."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(0, "", [], finish_reason="error", stop_reason=message)],
        finished=True,
    )
