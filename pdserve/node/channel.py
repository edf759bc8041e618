"""The node's end of the request channel: one ZeroMQ ROUTER socket that every proxy worker joins.

The request path (reserve, prefill, token stream, abort) used to be an HTTP request each, and
every token of every stream an HTTP chunk of its own. Here each proxy worker holds one
connection (a DEALER with a random routing id) and everything is a message on it:

- ``Hello`` first, with the cluster token; a peer that has not been welcomed gets 401 replies;
- ``Call``s, each answered by a ``Reply`` with the same ``call_id``; calls run concurrently (a
  prefill call lasts until its KV is committed, a reserve returns at once);
- ``Events``: after each engine step, one message per peer carries the token events of all the
  streams that peer opened;
- ``Ping``/``Pong`` both ways keep each side's view of the other current.

A peer that goes away stops paying: sending to it fails at once when its connection is gone
(``ROUTER_MANDATORY``), and a peer silent for ``peer_timeout_s`` (the proxy pings every half
second) is forgotten too; either way its calls are cancelled and its streams end, which aborts
their requests, as closing an HTTP connection did.

Everything here runs on the node's event loop; handlers register per message type.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pdserve.messages import (
    Call,
    Events,
    Hello,
    Message,
    NodeLoad,
    Ping,
    Pong,
    Reply,
    TokenEvent,
    ToNode,
    Welcome,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

SAY_HELLO = "say Hello with the cluster token first"


class CallRefused(Exception):
    """What a handler raises to answer a call with an error status (HTTP's meanings)."""

    def __init__(self, status: int, message: str, kind: str = "", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.retry_after = retry_after


@dataclass(eq=False)
class Peer:
    """One proxy worker's connection."""

    routing_id: bytes
    name: str = ""
    welcomed: bool = False
    last_seen: float = 0.0
    calls: set[asyncio.Task] = field(default_factory=set)
    streams: set[str] = field(default_factory=set)  # request ids whose events go to this peer
    pending: list[TokenEvent] = field(default_factory=list)  # events of this step, not sent yet
    gone: bool = False

    def __repr__(self) -> str:
        return f"peer {self.name or self.routing_id.hex()}"


Handler = Callable[[Peer, Message], Awaitable[Message | None]]


class ChannelServer:
    """Serves the request channel on ``tcp://host:port`` (port 0: a free one, see ``port``)."""

    MAX_PEERS = 4096

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        on_streams_lost: Callable[[Peer, list[str]], None],
        peer_timeout_s: float = 10.0,
        load: Callable[[], NodeLoad | None] = lambda: None,
    ) -> None:
        self.token = token
        self.load = load  # the node's newest load, sent with every call's reply
        self.node_id = ""  # said in every Welcome; set once the node knows its id
        self.on_streams_lost = on_streams_lost
        self.peer_timeout_s = peer_timeout_s
        self.handlers: dict[type, Handler] = {}
        self.peers: dict[bytes, Peer] = {}
        self._ctx = zmq.asyncio.Context()
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails instead of dropping
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the peer timeout, not by dropping events
        sock.setsockopt(zmq.RCVHWM, 0)
        host_part = f"[{host}]" if ":" in host else host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        if port:
            sock.bind(f"tcp://{host_part}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host_part}", min_port=20000, max_port=60000)
        self._tasks: list[asyncio.Task] = []
        self.num_events_messages = 0

    def handle(self, kind: type, handler: Handler) -> None:
        self.handlers[kind] = handler

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._serve()), asyncio.ensure_future(self._sweep())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for peer in list(self.peers.values()):
            self._forget(peer, "the node is stopping")
        self._sock.close(0)
        self._ctx.term()

    # -- receiving -----------------------------------------------------------------------------

    async def _serve(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) != 2:
                continue  # not a DEALER's message: ignore it
            routing_id = frames[0].bytes
            try:
                msg = decode(frames[1].buffer, ToNode)
            except msgspec.DecodeError as exc:
                logger.warning("bad message on the request channel: %s", exc)
                peer = self.peers.get(routing_id)
                if peer is not None and peer.welcomed:
                    self._send(peer, Reply(0, 400, error=f"bad message: {exc}"))
                continue
            self._receive(routing_id, msg)

    def _receive(self, routing_id: bytes, msg: Message) -> None:
        peer = self.peers.get(routing_id)
        if isinstance(msg, Hello):
            if not hmac.compare_digest(msg.token.encode(), self.token.encode()):
                logger.warning("request channel: refused %s (wrong cluster token)", msg.peer or "a peer")
                self._send_raw(routing_id, Reply(0, 401, error="wrong or missing cluster token"))
                return
            if peer is None:
                if len(self.peers) >= self.MAX_PEERS:
                    self._send_raw(routing_id, Reply(0, 503, error="too many proxy connections"))
                    return
                peer = self.peers[routing_id] = Peer(routing_id, msg.peer)
                logger.info("request channel: %s joined", peer)
            peer.welcomed = True
            peer.last_seen = time.monotonic()
            self._send(peer, Welcome(self.node_id))
            return
        if peer is None or not peer.welcomed:
            # 428: the call was not run. A peer the node forgot (it was silent too long) says Hello
            # again on seeing this, and its call may go elsewhere.
            if isinstance(msg, Call):
                self._send_raw(routing_id, Reply(msg.call_id, 428, error=SAY_HELLO))
            elif isinstance(msg, Ping):
                self._send_raw(routing_id, Reply(0, 428, error=SAY_HELLO))
            return
        peer.last_seen = time.monotonic()
        if isinstance(msg, Call):
            task = asyncio.ensure_future(self._call(peer, msg))
            peer.calls.add(task)
            task.add_done_callback(peer.calls.discard)
        elif isinstance(msg, Ping):
            self._send(peer, Pong(msg.sent))

    async def _call(self, peer: Peer, call: Call) -> None:
        handler = self.handlers.get(type(call.body))
        if handler is None:
            reply = Reply(call.call_id, 404, error=f"this node does not serve {type(call.body).__name__}")
        else:
            try:
                body = await handler(peer, call.body)
                reply = Reply(call.call_id, body=body, load=self.load())
            except CallRefused as exc:
                reply = Reply(
                    call.call_id, exc.status, None, exc.message, exc.kind, exc.retry_after, self.load()
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: answer, keep serving
                logger.exception("request channel call %s failed", type(call.body).__name__)
                reply = Reply(call.call_id, 500, error=f"internal error: {type(exc).__name__}: {exc}")
        if not peer.gone:
            self._send(peer, reply)

    # -- sending -------------------------------------------------------------------------------

    def add_event(self, peer: Peer, event: TokenEvent) -> None:
        """Queue a token event for ``peer``; ``flush`` sends each peer's queue as one message."""
        if not peer.gone:
            peer.pending.append(event)

    def flush(self) -> None:
        for peer in list(self.peers.values()):
            if peer.pending:
                events, peer.pending = peer.pending, []
                self.num_events_messages += 1
                self._send(peer, Events(events))

    def _send(self, peer: Peer, msg: Message) -> None:
        if not self._send_raw(peer.routing_id, msg):
            self._forget(peer, "its connection is gone")

    def _send_raw(self, routing_id: bytes, msg: Message) -> bool:
        # With NOBLOCK the asyncio socket sends at once and resolves its future on the spot.
        fut = self._sock.send_multipart([routing_id, encode(msg)], flags=zmq.NOBLOCK, copy=False)
        exc = fut.exception()
        if exc is None:
            return True
        if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            return False
        raise exc

    # -- peers that went away ------------------------------------------------------------------

    async def _sweep(self) -> None:
        every = min(1.0, self.peer_timeout_s / 4)
        tick = time.monotonic()
        on_time = 0  # ticks in a row that came on time
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            on_time = 0 if now - tick > every + 0.25 else on_time + 1
            tick = now
            for peer in list(self.peers.values()):
                # Judged only while this loop keeps time: a node that was stalled (a long GC, a
                # SIGSTOP) has its peers' messages still unread, and they are not silent.
                if now - peer.last_seen > self.peer_timeout_s and on_time >= 2:
                    self._forget(peer, f"silent for {now - peer.last_seen:.1f} s")
                elif peer.welcomed:
                    self._send(peer, Ping(time.time()))

    def _forget(self, peer: Peer, why: str) -> None:
        if peer.gone:
            return
        peer.gone = True
        self.peers.pop(peer.routing_id, None)
        for task in list(peer.calls):
            task.cancel()
        streams = list(peer.streams)
        peer.streams.clear()
        peer.pending.clear()
        if peer.calls or streams:
            logger.warning(
                "request channel: %s left (%s): %d call(s) and %d stream(s) end",
                peer,
                why,
                len(peer.calls),
                len(streams),
            )
        if streams:
            self.on_streams_lost(peer, streams)
