"""The load client's HTTP/1.1: an asyncio protocol per connection that hands each socket read's body
bytes to the caller's sink, kept-alive connections.

A load client must not be the ceiling of what it measures. Through httpx (httpcore, h11, anyio) a
streamed token cost ~90 µs of client CPU on a 2-core box, most of it framework layers and task
wake-ups per SSE line. Here nothing wakes per token: the event loop calls ``data_received`` with
what a socket read returned, the body's chunked framing is undone in one pass over it, and the
sink (``serve_client``'s SSE parser) gets the body bytes with one timestamp; the request's task
wakes once, when the sink says the stream is over (``serve_client_cpu`` measures it). http and
https (``ssl``); no proxies, no redirects, no HTTP/2.

Timeouts: ``connect_timeout_s`` to open a connection; ``read_timeout_s`` of silence from sending a
request on (as httpx's read timeout: between bytes, not over the whole body), kept by one timer per
response that is pushed back only when it fires, not on every read. A connection goes back to the
pool when its response's body has been read to its end; a body still open ``DRAIN_S`` after the
caller is done with it (a server that keeps a stream open past ``[DONE]``) closes its connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD = 1 << 16
DRAIN_S = 1.0

Sink = Callable[[bytes, float], bool]
"""Body bytes and the perf_counter time of the read that brought them; False: the caller has what
it needs (the rest of the body is read and dropped)."""


class HttpError(Exception):
    """The connection failed, dropped, timed out or answered something that is not HTTP/1.x."""


class _Dechunker:
    """Undoes ``Transfer-Encoding: chunked`` on bytes as they come; ``done`` after the last chunk and
    its trailer section (RFC 9112 7.1), ``clean`` while nothing came after that."""

    def __init__(self) -> None:
        self.pending = b""  # an incomplete size (or trailer) line
        self.data_left = 0  # bytes of the current chunk's data not yet seen
        self.crlf_left = 0  # of the CRLF after it
        self.in_trailers = False  # after the last (0-size) chunk
        self.done = False
        self.clean = True

    def feed(self, data: bytes) -> bytes:
        buf = self.pending + data if self.pending else data
        self.pending = b""
        out = []
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self.data_left:
                take = min(self.data_left, n - pos)
                out.append(buf[pos : pos + take])
                self.data_left -= take
                pos += take
            elif self.crlf_left:
                take = min(self.crlf_left, n - pos)
                self.crlf_left -= take
                pos += take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self.pending = buf[pos:]
                    break
                line, pos = buf[pos:eol], eol + 2
                if self.in_trailers:
                    self.done = not line  # an empty line ends the trailers
                    continue
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HttpError(f"bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    self.in_trailers = True
                else:
                    self.data_left, self.crlf_left = size, 2
        if self.done and pos < n:
            self.clean = False  # bytes after the body: the connection is not in a known state
        return out[0] if len(out) == 1 else b"".join(out)


class Response:
    """One request's response: ``status`` and ``headers`` once its head arrived, then its body,
    pushed into the sink of ``stream``."""

    def __init__(self, conn: _Conn, read_timeout_s: float) -> None:
        self.conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_received = False
        self.any_byte = False
        self.dropped = False  # the connection ended (not a timeout, not a bad response)
        self._loop = asyncio.get_running_loop()
        self._head_waiter = self._loop.create_future()
        self._done = self._loop.create_future()  # the sink said stop (its time) or the body ended (None)
        self._sink: Sink | None = None
        self._early: list[tuple[bytes, float]] = []  # body bytes that came before a sink
        self._dechunk: _Dechunker | None = None
        self._left = -1  # bytes of a Content-Length body not yet read; -1: none / until the close
        self.complete = False
        self.reusable = True
        self._released = False
        self.read_timeout_s = read_timeout_s
        self.last = time.perf_counter()
        self._timer = self._loop.call_later(read_timeout_s, self._check_silence)

    # -- called by the connection ----------------------------------------------------------

    def head(self, raw: bytes) -> None:
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        connection = self.headers.get("connection", "").lower()
        self.reusable = connection == "keep-alive" if parts[0] == "HTTP/1.0" else connection != "close"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._dechunk = _Dechunker()
        elif (length := self.headers.get("content-length")) is not None:
            self._left = int(length)
        else:
            self.reusable = False  # the body ends with the connection
        self.status = int(parts[1])
        self.head_received = True
        if not self._head_waiter.done():
            self._head_waiter.set_result(None)
        if self._left == 0:
            self._body_ended()

    def body(self, data: bytes, now: float) -> None:
        if self._dechunk is not None:
            data = self._dechunk.feed(data)
            ended = self._dechunk.done
            if ended:
                self.reusable = self.reusable and self._dechunk.clean
        elif self._left >= 0:
            if len(data) > self._left:
                data, self.reusable = data[: self._left], False
            self._left -= len(data)
            ended = self._left == 0
        else:
            ended = False
        if data and not self._done.done():
            if self._sink is None:
                self._early.append((data, now))
            elif not self._sink(data, now):
                self._done.set_result(now)
        if ended:
            self._body_ended()

    def lost(self, exc: BaseException | None) -> None:
        self.dropped = True
        if self._left < 0 and self._dechunk is None and self.head_received and exc is None:
            self._body_ended()  # a body that ends with the connection
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
        self.fail(HttpError(f"{reason} mid-response" if self.head_received else reason))

    def fail(self, exc: BaseException) -> None:
        self._timer.cancel()
        self.reusable = False
        for fut in (self._head_waiter, self._done):
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: a failure nobody awaits is no "never retrieved" warning
        self.conn.close()

    def _body_ended(self) -> None:
        self.complete = True
        self._timer.cancel()
        if not self._done.done():
            self._done.set_result(None)
        if self._released:
            self.conn.finished(self.reusable)

    def _check_silence(self) -> None:
        idle = time.perf_counter() - self.last
        if idle >= self.read_timeout_s:
            self.fail(HttpError(f"ReadTimeout: no byte in {self.read_timeout_s:g} s"))
        else:
            self._timer = self._loop.call_later(self.read_timeout_s - idle, self._check_silence)

    # -- called by the caller --------------------------------------------------------------

    async def stream(self, sink: Sink) -> float | None:
        """Push the body into ``sink`` as it arrives; returns the time of the read after which the
        sink said stop, or None when the body ended first. Raises HttpError."""
        early, self._early = self._early, []
        for data, now in early:
            if not sink(data, now):
                if not self._done.done():
                    self._done.set_result(now)
                return now
        self._sink = sink
        return await self._done

    async def read(self) -> bytes:
        parts: list[bytes] = []
        await self.stream(lambda data, now: parts.append(data) is None)
        return b"".join(parts)

    def release(self) -> None:
        """The caller is done: the connection goes back to the pool when the body is complete
        (now, or within ``DRAIN_S``), else it closes."""
        self._released = True
        self._sink = None
        if self.complete:
            self.conn.finished(self.reusable)
        elif self.conn.response is self:
            self._loop.call_later(DRAIN_S, self._abandon)

    def _abandon(self) -> None:
        if not self.complete and self.conn.response is self:
            self.fail(HttpError("the body did not end"))


class _Conn(asyncio.Protocol):
    """One connection: reads responses' heads, passes their bodies on, then waits in the pool."""

    def __init__(self, pool: list[_Conn]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.head = b""
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection is in no known state
            self.close()
            return
        resp.last = now
        resp.any_byte = True
        try:
            if not resp.head_received:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.head) > MAX_HEAD:
                        raise HttpError("a response head of more than 64 KiB")
                    return
                raw, data, self.head = self.head[:end], self.head[end + 4 :], b""
                resp.head(raw)
                if not data:
                    return
            resp.body(data, now)
        except Exception as exc:  # a bad response, or the sink failed: this request fails
            resp.fail(exc if isinstance(exc, HttpError) else HttpError(f"{type(exc).__name__}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        if self.response is not None:
            self.response.lost(exc)

    def send(self, message: bytes, read_timeout_s: float) -> Response:
        self.response = Response(self, read_timeout_s)
        self.transport.write(message)
        return self.response

    def finished(self, reusable: bool) -> None:
        self.response = None
        if reusable and not self.closed:
            self.pool.append(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True


class Client:
    """Requests to one server (``base_url``: scheme, host, port, a path prefix) over kept-alive
    connections."""

    def __init__(self, base_url: str, read_timeout_s: float = 600.0, connect_timeout_s: float = 30.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the server URL must be http:// or https://, got {base_url!r}")
        self.base = base_url.rstrip("/")
        self.prefix = url.path.rstrip("/")  # a server mounted under a path: every request's path
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        default_port = self.port == (443 if self.ssl else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self._idle), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        except asyncio.TimeoutError:
            raise HttpError(f"ConnectTimeout: {self.host}:{self.port}") from None
        except OSError as exc:
            raise HttpError(f"ConnectError: {exc}") from None
        return conn

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send a request and wait for the response's head; the caller reads the body (``stream``
        or ``read``) and calls ``release()``. A kept-alive connection that the server closed
        before a byte of the answer is retried once on a new one."""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        message = head.encode("latin-1") + b"\r\n" + body
        reused = self._idle.pop() if self._idle else None
        if reused is not None:
            resp = reused.send(message, self.read_timeout_s)
            try:
                await resp._head_waiter
                return resp
            except HttpError:
                if resp.any_byte or not resp.dropped:
                    raise  # only a request that never reached a server goes again
        resp = (await self._connect()).send(message, self.read_timeout_s)
        await resp._head_waiter
        return resp

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A whole GET: (status, body)."""
        resp = await self.request("GET", path, headers=headers)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    def close(self) -> None:
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
