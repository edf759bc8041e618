"""A test's own request channel to a node, spoken the way a proxy worker does (blocking).

Tests drive the node's protocol directly with it: reserve, prefill, stream and abort calls, a
refused Hello. Each link is a peer of its own; a stream's request ends when its link goes away.
"""

from __future__ import annotations

import secrets
import time

import httpx
import zmq

from pdserve.messages import (
    AbortRequest,
    Call,
    Events,
    Hello,
    Message,
    NodeInfo,
    Ping,
    Pong,
    Reply,
    StreamRequest,
    TokenEvent,
    ToProxy,
    Welcome,
    decode,
    encode,
)


class LinkRefused(Exception):
    def __init__(self, reply: Reply) -> None:
        super().__init__(f"{reply.status}: {reply.error}")
        self.reply = reply


class NodeLink:
    def __init__(self, url: str, token: str = "", hello: bool = True, timeout: float = 10.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        r = httpx.get(f"{url}/internal/info", headers=headers, timeout=timeout)
        r.raise_for_status()
        self.info = decode(r.content, NodeInfo)
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{host}:{self.info.channel_port}")
        self._next = 0
        self._replies: dict[int, Reply] = {}
        self._events: list[TokenEvent] = []
        if hello:
            self.hello(token, timeout)

    def __enter__(self) -> NodeLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def _recv(self, timeout: float) -> bool:
        if not self.sock.poll(int(timeout * 1000)):
            return False
        msg = decode(self.sock.recv(), ToProxy)
        if isinstance(msg, Reply):
            self._replies[msg.call_id] = msg
        elif isinstance(msg, Events):
            self._events += msg.events
        elif isinstance(msg, Welcome):
            self._replies[0] = Reply(0)
        elif isinstance(msg, Ping):
            self.send(Pong(msg.sent))
        return True

    def _wait(self, call_id: int, timeout: float) -> Reply:
        give_up = time.monotonic() + timeout
        while call_id not in self._replies:
            left = give_up - time.monotonic()
            if left <= 0 or not self._recv(left):
                raise TimeoutError(f"no reply to call {call_id} within {timeout:g} s")
        return self._replies.pop(call_id)

    def hello(self, token: str, timeout: float = 10.0) -> Reply:
        """Say Hello; the node's answer (status 200 for its Welcome). Raises LinkRefused on 401."""
        self.send(Hello(token, "test"))
        reply = self._wait(0, timeout)
        if reply.status != 200:
            raise LinkRefused(reply)
        return reply

    def start(self, body: Message) -> int:
        """Send a call without waiting for its reply; its id, for ``reply``."""
        self._next += 1
        self.send(Call(self._next, body))
        return self._next

    def reply(self, call_id: int, timeout: float = 60.0) -> Reply:
        return self._wait(call_id, timeout)

    def call(self, body: Message, timeout: float = 60.0) -> Reply:
        return self.reply(self.start(body), timeout)

    def abort(self, request_id: str) -> Reply:
        return self.call(AbortRequest(request_id), 10.0)

    def stream(self, request_id: str, timeout: float = 60.0) -> list[TokenEvent]:
        """Open the request's stream and read it to its final event; raises LinkRefused when the
        node refuses to open it."""
        reply = self.call(StreamRequest(request_id), timeout)
        if reply.status != 200:
            raise LinkRefused(reply)
        return self.read(request_id, timeout)

    def read(self, request_id: str, timeout: float = 60.0) -> list[TokenEvent]:
        """The request's events until its final one (a stream opened with ``start``)."""
        give_up = time.monotonic() + timeout
        out: list[TokenEvent] = []
        while True:
            mine = [e for e in self._events if e.request_id == request_id]
            self._events = [e for e in self._events if e.request_id != request_id]
            out += mine
            if out and out[-1].finish_reason is not None:
                return out
            left = give_up - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"stream of {request_id} did not finish within {timeout:g} s: {out}")
            self._recv(left)


def call(url: str, body: Message, token: str = "", timeout: float = 60.0) -> Reply:
    """One call on a link of its own."""
    with NodeLink(url, token) as link:
        return link.call(body, timeout)
