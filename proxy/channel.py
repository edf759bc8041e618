"""The proxy worker's end of a node's request channel (the node's end: pdserve.node.channel).

One ZeroMQ DEALER per (proxy worker, node), with a random routing id, carries every call of the
request path (reserve, prefill, stream, abort) and every token event of the worker's streams on
that node, batched by the node once per engine step.

What a caller sees keeps HTTP's meanings, as ``NodeError``:

- no connection to the node (yet, or any more): ``connect_failed`` — the call never left;
- the connection drops, or the node stops answering pings for ``dead_after_s``, with calls or
  streams open: status 0 (unreachable) for each of them — they may have reached the node;
- a ``Reply`` with a status other than 200: that status, message and Retry-After.

Liveness is judged by what arrives, and only while the proxy's own loop keeps time: a heartbeat
tick that comes late (the loop lagged) does not judge, since what the node sent may be waiting
unread; a busy proxy does not mistake its own slowness for a dead node.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.messages import (
    AbortRequest,
    Call,
    Events,
    Hello,
    LandingDescriptor,
    Message,
    NodeLoad,
    Ping,
    Pong,
    PrefillLanding,
    PrefillRequest,
    PrefillResult,
    Reply,
    ReserveRequest,
    StreamRequest,
    TokenEvent,
    ToProxy,
    Welcome,
    decode,
    encode,
)
from pdserve.utils import wait_at_most

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0
"""Bound of calls that should answer at once (abort, reserve, opening a stream)."""


class NodeError(Exception):
    """A node call failed; ``status`` 0 means no answer (connection lost, node silent, timeout)."""

    def __init__(
        self,
        url: str,
        message: str,
        status: int = 0,
        error_type: str = "",
        connect_failed: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.message = message
        self.status = status
        self.error_type = error_type
        self.connect_failed = connect_failed
        self.retry_after = retry_after

    @property
    def unreachable(self) -> bool:
        return self.status == 0


StreamSink = Callable[[TokenEvent | NodeError], None]
"""Takes a stream's events as they arrive, then a ``NodeError`` if the channel fails under it."""


class _Stream:
    """One open token stream: whom to hand its events, and which of its sequences have ended."""

    __slots__ = ("sink", "num_sequences", "ended", "finished")

    def __init__(self, sink: StreamSink, num_sequences: int) -> None:
        self.sink = sink
        self.num_sequences = num_sequences
        self.ended: set[int] = set()
        self.finished = False


class NodeChannel:
    """The request channel to one node; every method runs on the proxy's event loop."""

    PING_EVERY_S = 0.5

    def __init__(
        self,
        url: str,
        address: str,
        token: str,
        connect_timeout_s: float = 5.0,
        dead_after_s: float = 10.0,
        on_load: Callable[[NodeLoad], None] | None = None,
    ) -> None:
        self.url = url  # the node's HTTP URL: its name in errors and logs
        self.on_load = on_load  # the load each reply carries goes here (the router's view of the node)
        self.address = address
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.dead_after_s = dead_after_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self._open = asyncio.Event()  # welcomed on the current connection
        self._changed = asyncio.Event()  # set on every connection event
        self._retrying = False  # the last connection attempt failed (refused, unreachable)
        self._refused: NodeError | None = None  # the node refused our Hello (wrong token)
        self._last_heard = 0.0
        self._tasks: list[asyncio.Task] = []
        self._rehello: asyncio.Task | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"NodeChannel({self.address})"

    # -- life cycle ----------------------------------------------------------------------------

    def _start(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))  # nobody else can speak as us
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a connection that is not there
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CLOSED
            | zmq.EVENT_CONNECT_RETRIED
        )
        sock.connect(self.address)
        self._sock = sock
        self._tasks = [
            asyncio.ensure_future(self._watch(monitor)),
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._heartbeat()),
        ]
        return sock

    async def close(self) -> None:
        self._closed = True
        if self._rehello is not None:
            self._tasks.append(self._rehello)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._lost("the proxy closed the channel")
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Connection events: say Hello on each new connection, fail everything when one drops."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._refused = None
                    self._retrying = False
                    await self._hello()
                elif event == zmq.EVENT_CONNECT_RETRIED:
                    self._retrying = True
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    self._open.clear()
                    self._lost("connection lost")
                self._changed.set()
        finally:
            monitor.close(0)

    def _welcome_again(self) -> None:
        if self._rehello is None or self._rehello.done():
            self._rehello = asyncio.ensure_future(self._hello())

    async def _hello(self) -> None:
        """Say Hello on a new connection. The monitor reports the handshake from ZeroMQ's I/O
        thread, a moment before the socket can send on the connection: retry briefly."""
        hello = Hello(self.token, f"proxy pid {os.getpid()}")
        for _ in range(200):
            if self._send(hello):
                return
            await asyncio.sleep(0.005)
        logger.warning("could not say Hello to %s on its request channel", self.url)

    async def _read(self) -> None:
        sock = self._sock
        while True:
            # Copied frames: messages are small, and a bytes object costs less than a zmq.Frame.
            frames = await sock.recv_multipart()
            self._receive(frames[-1])

    def _receive(self, data: bytes) -> None:
        try:
            msg = decode(data, ToProxy)
        except msgspec.DecodeError as exc:
            logger.warning("bad message from %s on the request channel: %s", self.url, exc)
            return
        self._last_heard = time.monotonic()
        if isinstance(msg, Events):
            # The per-token path: each event goes straight to its stream's sink, on this task.
            streams = self._streams
            for event in msg.events:
                stream = streams.get(event.request_id)
                if stream is None:
                    continue
                if event.finish_reason is not None:
                    stream.ended.add(event.index)
                    if len(stream.ended) >= stream.num_sequences:
                        stream.finished = True
                        del streams[event.request_id]
                stream.sink(event)
        elif isinstance(msg, Reply):
            if msg.status == 428:  # the node forgot us (we were silent too long to it): Hello again
                self._welcome_again()
                fut = self._calls.pop(msg.call_id, None) if msg.call_id else None
                if fut is not None and not fut.done():  # that call did not run: it may go elsewhere
                    fut.set_exception(NodeError(self.url, msg.error, connect_failed=True))
                return
            if msg.call_id == 0:  # about the channel itself: our Hello was refused
                self._refused = NodeError(self.url, f"request channel refused: {msg.error}", msg.status)
                self._changed.set()  # wake the waiters, who find ``_refused``
                logger.error("%s refused the request channel: %s", self.url, msg.error)
                return
            if msg.load is not None and self.on_load is not None:
                self.on_load(msg.load)
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Welcome):
            self._open.set()
            self._changed.set()
        elif isinstance(msg, Ping):
            self._send(Pong(msg.sent))

    async def _heartbeat(self) -> None:
        tick = time.monotonic()
        on_time = 0  # ticks in a row that came on time
        while True:
            await asyncio.sleep(self.PING_EVERY_S)
            now = time.monotonic()
            late = now - tick > self.PING_EVERY_S + 0.25
            tick = now
            on_time = 0 if late else on_time + 1
            if not self._open.is_set() or self._refused is not None:
                continue
            self._send(Ping(time.time()))
            if not (self._calls or self._streams):
                self._last_heard = max(self._last_heard, now - self.PING_EVERY_S)  # idle: no judging
                continue
            silent = now - self._last_heard
            if silent > self.dead_after_s and on_time >= 2:  # the lag is not ours: our clock ran
                self._lost(f"no answer from the node for {silent:.1f} s")
                self._last_heard = now  # judge the next calls afresh

    def _lost(self, why: str) -> None:
        """Fail every call and stream in flight: they may or may not have reached the node."""
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(NodeError(self.url, why))
        for stream in list(self._streams.values()):
            stream.sink(NodeError(self.url, why))

    # -- sending -------------------------------------------------------------------------------

    def _send(self, msg: Message) -> bool:
        sock = self._sock
        if sock is None:
            return False
        fut = sock.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
        return fut.exception() is None  # zmq.Again: no connection (IMMEDIATE)

    async def _ready(self, timeout: float) -> None:
        if self._closed:
            raise NodeError(self.url, "the channel is closed", connect_failed=True)
        if self._sock is None:
            self._start()
        give_up = time.monotonic() + min(timeout, self.connect_timeout_s)
        while not self._open.is_set():
            if self._refused is not None:
                raise self._refused
            if self._retrying:
                raise NodeError(self.url, f"cannot connect to {self.address}", connect_failed=True)
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                # Not asyncio.wait_for: on Python 3.11 it loses a cancellation that comes as the
                # channel opens, and a cancelled prefill call would then go out, never aborted.
                if not await wait_at_most(changed, max(0.0, give_up - time.monotonic())):
                    why = f"no request channel to {self.address} (connect timed out)"
                    raise NodeError(self.url, why, connect_failed=True)
            finally:
                changed.cancel()
        if self._refused is not None:
            raise self._refused

    async def call(self, body: Message, timeout: float | None, sent: asyncio.Future | None = None) -> Reply:
        """Send one call and wait for its reply (``timeout`` None: as long as the node is alive);
        ``sent`` is resolved once it is on the wire (calls sent after that reach the node after it)."""
        if self._closed or not self._open.is_set() or self._refused is not None:
            await self._ready(timeout or CONTROL_TIMEOUT_S)
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls[call_id] = fut
        if not self._send(Call(call_id, body)):
            self._calls.pop(call_id, None)
            raise NodeError(self.url, f"no connection to {self.address}", connect_failed=True)
        if sent is not None and not sent.done():
            sent.set_result(None)
        # The timeout is a timer on the reply's future, not asyncio.wait_for: on Python 3.11 that
        # wraps the future in a task of its own, a cost every call would pay.
        timer = None if timeout is None else loop.call_later(timeout, _time_out, fut)
        try:
            reply = await fut
        except _TimedOut:
            raise NodeError(self.url, f"ReadTimeout: no answer within {timeout:g} s") from None
        finally:
            if timer is not None:
                timer.cancel()
            self._calls.pop(call_id, None)
        if reply.status != 200:
            raise NodeError(
                self.url, reply.error, reply.status, reply.error_type, retry_after=reply.retry_after
            )
        return reply

    def abort_soon(self, request_id: str) -> None:
        """Fire-and-forget abort (a request we stopped caring about: nothing waits for the reply)."""
        if self._open.is_set():
            self._send(Call(next(self._ids), AbortRequest(request_id)))

    # -- the request path ----------------------------------------------------------------------

    async def abort(self, request_id: str, timeout: float = 5.0) -> None:
        await self.call(AbortRequest(request_id), timeout)

    async def reserve(self, request: ReserveRequest, timeout: float = CONTROL_TIMEOUT_S) -> LandingDescriptor:
        return _body(self.url, await self.call(request, timeout), LandingDescriptor)

    async def prefill(
        self, request: PrefillRequest, timeout: float | None = None, sent: asyncio.Future | None = None
    ) -> PrefillResult:
        """Runs until the KV is committed on the decode node (or failed); ``sent`` as ``call``'s.
        Cancelled, it aborts the prefill on the node."""
        try:
            return _body(self.url, await self.call(request, timeout, sent), PrefillResult)
        except asyncio.CancelledError:
            self.abort_soon(request.request_id)
            raise

    async def land(self, request: PrefillLanding, timeout: float | None = CONTROL_TIMEOUT_S) -> None:
        """Hand a prefill sent without its landing descriptor the descriptor; returns once the node
        took it (its KV is on its way)."""
        await self.call(request, timeout)

    @asynccontextmanager
    async def stream(
        self,
        request: StreamRequest,
        sink: StreamSink,
        timeout: float = CONTROL_TIMEOUT_S,
        num_sequences: int = 1,
    ) -> AsyncIterator[None]:
        """Open the request's token stream; entering returns once the node said yes (``timeout``
        bounds that wait only). Until the final event of each of the request's ``num_sequences``
        sequences (parallel sampling), ``sink`` gets every event as it arrives, called from the
        channel's reader (it must not block: this is the per-token path, with no task switch), and
        a ``NodeError`` if the channel fails; leaving before the final events aborts the request."""
        rid = request.request_id
        if rid in self._streams:
            raise NodeError(self.url, f"a stream of {rid!r} is already open", 409)
        stream = self._streams[rid] = _Stream(sink, num_sequences)  # events may precede the reply
        try:
            await self.call(request, timeout)
            yield
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not stream.finished:
                self.abort_soon(rid)


class _TimedOut(Exception):
    """A call's reply did not come within its timeout."""


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_TimedOut())


def _body(url: str, reply: Reply, kind: type) -> Message:
    if not isinstance(reply.body, kind):
        raise NodeError(
            url, f"bad reply from node: {type(reply.body).__name__} instead of {kind.__name__}", 200
        )
    return reply.body
