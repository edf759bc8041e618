"""The node process's end of its engine core: spawning it, typed calls to it, and its outputs.

``CoreClient`` spawns the engine core (``pdserve.node.engine_core.run_core``) in a process of its
own (multiprocessing's spawn start method, safe with CUDA) and binds two ZeroMQ ipc:// sockets for
it (abstract names on Linux: nothing left on disk): ``CoreCall``s go out on one; ``CoreReply``s
and one ``StepOutputs`` per engine step come back on the other, read on the node's event loop.
``call`` awaits a command's reply (a refusal raises ``CoreRefused`` with its status); ``send``
wants none.

Impossible to wedge: the client watches the process's sentinel. A core that dies (or reports
``CoreFailed``) fails every call in flight at once and tells the node (``on_death``), which ends its
streams and exits instead of waiting for a reply that never comes.

``Subscriptions`` hold each request's token events in the node process until their reader (a
prefill call, or the decode stream's sink) takes them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineConfig, NodeConfig
from pdserve.messages import (
    CoreCall,
    CoreFailed,
    CoreReady,
    CoreReply,
    FromCore,
    Message,
    StepOutputs,
    TokenEvent,
    decode,
    encode,
)
from pdserve.node.channel import CallRefused

logger = logging.getLogger(__name__)


class CoreRefused(CallRefused):
    """A command the engine core refused (or could not answer: its process is gone, 503)."""


class CoreGone(CoreRefused):
    def __init__(self, why: str) -> None:
        super().__init__(503, f"the node's engine core is gone: {why}", "unavailable")


def _core_main(*args: Any) -> None:
    """The spawned process's target (imports the engine there, not in the node process)."""
    from pdserve.node.engine_core import run_core

    run_core(*args)


class CoreClient:
    """One engine core process and the node's two sockets to it (event loop only)."""

    STOP_TIMEOUT_S = 10.0

    def __init__(
        self,
        on_outputs: Callable[[StepOutputs], None],
        on_death: Callable[[str], None],
    ) -> None:
        self.on_outputs = on_outputs
        self.on_death = on_death
        # Linux: names in the abstract socket namespace, which vanish with the sockets (a node killed
        # with SIGKILL leaves no file behind); elsewhere files in a folder of their own.
        if sys.platform.startswith("linux"):
            self._dir = ""
            where = f"@pdserve-core-{os.getpid()}-{secrets.token_hex(8)}"
        else:
            where = self._dir = tempfile.mkdtemp(prefix="pdserve-core-")
        self.commands_address = f"ipc://{where}/commands"
        self.outputs_address = f"ipc://{where}/outputs"
        self._ctx = zmq.asyncio.Context()
        out = self._out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)
        out.bind(self.commands_address)
        inbox = self._in = self._ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.bind(self.outputs_address)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self.gone = ""  # why the core is gone, once it is
        self._closing = False

    async def start(
        self, engine_config: EngineConfig, node: NodeConfig, make_services: Callable
    ) -> CoreReady:
        """Spawn the core and wait until its engine is loaded; raises RuntimeError if it fails."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        args = (engine_config, node, make_services, self.commands_address, self.outputs_address, os.getpid())
        self.process = ctx.Process(target=_core_main, args=args, name="pdserve-engine-core")
        self.process.start()
        logger.info("engine core process %d started", self.process.pid)
        self._reader = asyncio.ensure_future(self._read())
        loop.add_reader(self.process.sentinel, self._exited)
        return await self._ready

    def _exited(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.process.sentinel)
        # The sentinel fires as the process goes, maybe before it can be reaped: wait a moment for
        # its exit status (the node exits anyway when the core is lost), which names a crash.
        self.process.join(1.0)
        if not self._closing:
            self._lost(f"its process {_exit_status(self.process.exitcode)}")

    def _lost(self, why: str) -> None:
        if self.gone:
            return
        self.gone = why
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(CoreGone(why))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"the engine core failed to start: {why}"))
            return
        if not self._closing:
            logger.error("the engine core is gone: %s", why)
            self.on_death(why)

    async def _read(self) -> None:
        sock = self._in
        while True:
            data = await sock.recv(copy=False)
            try:
                msg = decode(data.buffer, FromCore)
            except msgspec.DecodeError:
                logger.exception("bad message from the engine core")
                continue
            if isinstance(msg, StepOutputs):
                try:
                    self.on_outputs(msg)
                except Exception:
                    logger.exception("handling the engine core's outputs failed")
            elif isinstance(msg, CoreReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.status == 200:
                        fut.set_result(msg.body)
                    else:
                        fut.set_exception(CoreRefused(msg.status, msg.error, msg.kind, msg.retry_after))
            elif isinstance(msg, CoreReady):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
            elif isinstance(msg, CoreFailed):
                self._lost(msg.error)

    async def call(self, body: Message) -> Any:
        """Run ``body`` in the core (between engine steps) and return its reply's body."""
        return await self.submit(body)

    def submit(self, body: Message) -> asyncio.Future:
        """Send ``body`` to the core now and return the future of its reply's body (what ``call``
        awaits). The core takes commands in the order they were sent."""
        if self.gone:
            raise CoreGone(self.gone)
        call_id = next(self._ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda _: self._calls.pop(call_id, None))  # answered, failed or cancelled
        if not self._push(CoreCall(call_id, body)):
            fut.cancel()
            raise CoreGone("its command socket refused the call")
        return fut

    def send(self, body: Message) -> None:
        """Run ``body`` in the core; no reply (nothing is sent once the core is gone)."""
        if not self.gone:
            self._push(CoreCall(0, body))

    def _push(self, call: CoreCall) -> bool:
        # With NOBLOCK the asyncio socket sends at once and resolves its future on the spot.
        fut = self._out.send(encode(call), flags=zmq.NOBLOCK, copy=False)
        exc = fut.exception()
        if exc is None:
            return True
        if isinstance(exc, zmq.ZMQError):
            logger.warning("could not send %s to the engine core: %s", type(call.body).__name__, exc)
            return False
        raise exc

    async def close(self, shutdown: Message) -> None:
        """Stop the core (``shutdown`` is its ``Shutdown`` command), killing it if it does not exit
        within ``STOP_TIMEOUT_S``."""
        self._closing = True
        process = self.process
        if process is not None and process.is_alive():
            self._push(CoreCall(0, shutdown))
            await asyncio.to_thread(process.join, self.STOP_TIMEOUT_S)
            if process.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it", self.STOP_TIMEOUT_S)
                process.kill()
                await asyncio.to_thread(process.join, 5)
        if self._reader is not None:
            self._reader.cancel()
        self._out.close(0)
        self._in.close(0)
        self._ctx.term()
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the sockets' folder, where they have one (also before a node whose core died exits)."""
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def _exit_status(code: int | None) -> str:
    """``exited with code 1``, ``was killed by SIGSEGV``, ``exited`` (status unknown)."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Subscription:
    """Where a request's token events wait for their reader (event loop only).

    A prefill call awaits ``finished`` and reads every event; a decode stream sets a ``sink`` that
    gets the events as they come (those that came before it first)."""

    def __init__(self) -> None:
        self.created = time.monotonic()  # the request's arrival on the node, as far as it knows
        self.got_token = False
        self.events: list[TokenEvent] = []
        self.finished = False  # the request's outputs ended (read or not)
        self.attached = False  # a reader took it (``Subscriptions.attach``)
        self.sink: Callable[[TokenEvent], None] | None = None
        self.on_finish: Callable[[], None] | None = None
        self._done = asyncio.Event()

    def deliver(self, event: TokenEvent) -> None:
        if self.finished:
            return
        if self.sink is not None:
            self.sink(event)
        else:
            self.events.append(event)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._done.set()
        if self.on_finish is not None:
            self.on_finish()

    async def wait_finished(self) -> list[TokenEvent]:
        """Every event of the request, once its outputs ended."""
        await self._done.wait()
        events, self.events = self.events, []
        return events

    def set_sink(self, sink: Callable[[TokenEvent], None], on_finish: Callable[[], None]) -> None:
        """From now on events go to ``sink``; the unread ones first, then ``on_finish`` if it ended."""
        unread, self.events = self.events, []
        for event in unread:
            sink(event)
        self.sink = sink
        self.on_finish = on_finish
        if self.finished:
            on_finish()


class Subscriptions:
    """The node's subscriptions by request id (event loop only)."""

    UNREAD_FINAL_S = 60.0
    """How long a finished request's events wait for a reader that has not attached yet."""

    def __init__(self, on_first_token: Callable[[float], None] | None = None) -> None:
        self._subs: dict[str, Subscription] = {}
        self.on_first_token = on_first_token
        """Called with the seconds from a subscription to its request's first token event."""

    def subscribe(self, request_id: str) -> Subscription:
        """The subscription that will receive the request's events; before it can produce any."""
        sub = self._subs.get(request_id)
        if sub is None:
            sub = self._subs[request_id] = Subscription()
        return sub

    def attach(self, request_id: str) -> Subscription | None:
        """The subscription ``subscribe`` made, now with its reader (None if there is none)."""
        sub = self._subs.get(request_id)
        if sub is not None:
            sub.attached = True
        return sub

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    def is_subscribed(self, request_id: str) -> bool:
        return request_id in self._subs

    def __len__(self) -> int:
        return len(self._subs)

    @property
    def num_unfinished(self) -> int:
        """Subscriptions whose request has not ended yet: what a drain waits for."""
        return sum(1 for s in self._subs.values() if not s.finished)

    def deliver(self, outputs: StepOutputs) -> None:
        subs = self._subs
        now = 0.0
        for event in outputs.events:
            sub = subs.get(event.request_id)
            if sub is not None:
                if not sub.got_token and event.token_ids:
                    sub.got_token = True
                    if self.on_first_token is not None:
                        now = now or time.monotonic()
                        self.on_first_token(now - sub.created)
                sub.deliver(event)
        for request_id in outputs.finished:
            sub = subs.get(request_id)
            if sub is None:
                continue
            sub.finish()
            if sub.attached:
                if subs.get(request_id) is sub:
                    del subs[request_id]
            else:  # its reader is yet to come (``attach``)
                asyncio.get_running_loop().call_later(self.UNREAD_FINAL_S, self._drop_unread, request_id, sub)

    def _drop_unread(self, request_id: str, sub: Subscription) -> None:
        if self._subs.get(request_id) is sub and not sub.attached:
            del self._subs[request_id]

    def fail_all(self, message: str) -> None:
        """End every open subscription with an error event (a drain that ran out, a core gone)."""
        ids = [r for r, s in self._subs.items() if not s.finished]
        events = [error_event(r, message) for r in ids]
        self.deliver(StepOutputs(events, ids))


def error_event(request_id: str, message: str) -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=[], text="", finish_reason="error", error=message)
