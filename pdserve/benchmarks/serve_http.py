"""The load client's HTTP/1.1: raw asyncio streams, kept-alive connections, a body a socket read at a time.

A load client must not be the ceiling of what it measures. Through httpx (httpcore, h11, anyio) a
streamed token cost ~100 µs of client CPU on a 2-core box, most of it framework layers per SSE
line; here a socket read is one ``await``, the body's chunked framing is undone in one pass over
what the read returned, and the caller gets every byte that arrived with one timestamp
(``serve_client_cpu`` measures it). http and https (``ssl``); no proxies, no redirects, no HTTP/2.

Timeouts: ``connect_timeout_s`` to open a connection; ``read_timeout_s`` of silence on an open
response (as httpx's read timeout: between bytes, not over the whole body), kept by one timer per
response that is pushed back only when it fires, not on every read.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


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
    """An open response: status and headers read, the body still on the socket."""

    def __init__(self, client: Client, conn: _Conn, status: int, headers: dict[str, str]) -> None:
        self.client = client
        self.conn = conn
        self.status = status
        self.headers = headers
        self._reusable = headers.get("connection", "").lower() != "close"
        self._finished = False

    async def chunks(self) -> AsyncIterator[tuple[bytes, float]]:
        """The body as it arrives: (bytes, perf_counter when the socket read returned them)."""
        reader = self.conn.reader
        watchdog = _Watchdog(self.client.read_timeout_s)
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                dechunk = _Dechunker()
                while not dechunk.done:
                    data = await reader.read(READ_SIZE)
                    watchdog.now = time.perf_counter()
                    if not data:
                        raise HttpError("the server closed the connection mid-response")
                    body = dechunk.feed(data)
                    if body:
                        yield body, watchdog.now
                self._reusable = self._reusable and dechunk.clean
            elif (length := self.headers.get("content-length")) is not None:
                left = int(length)
                while left > 0:
                    data = await reader.read(min(left, READ_SIZE))
                    watchdog.now = time.perf_counter()
                    if not data:
                        raise HttpError("the server closed the connection mid-response")
                    left -= len(data)
                    yield data, watchdog.now
            else:  # the body ends with the connection
                self._reusable = False
                while data := await reader.read(READ_SIZE):
                    watchdog.now = time.perf_counter()
                    yield data, watchdog.now
            self._finished = True
        except asyncio.CancelledError:
            if watchdog.fired:
                raise HttpError(f"ReadTimeout: no byte in {self.client.read_timeout_s:g} s") from None
            raise
        except OSError as exc:
            raise HttpError(f"{type(exc).__name__}: {exc}") from None
        finally:
            watchdog.stop()

    async def read(self) -> bytes:
        return b"".join([data async for data, _ in self.chunks()])

    def close(self) -> None:
        """Back to the pool when the body was read to its end, else the connection is dropped."""
        if self._finished and self._reusable:
            self.client._idle.append(self.conn)
        else:
            self.conn.writer.close()


class _Watchdog:
    """Cancels the task reading a response when ``now`` (the last read's time) is older than the
    timeout; one timer per timeout period however many reads happen."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.now = time.perf_counter()
        self.fired = False
        self.task = asyncio.current_task()
        self.handle = asyncio.get_running_loop().call_later(timeout_s, self._check)

    def _check(self) -> None:
        idle = time.perf_counter() - self.now
        if idle >= self.timeout_s:
            self.fired = True
            if self.task is not None:
                self.task.cancel()
        else:
            self.handle = asyncio.get_running_loop().call_later(self.timeout_s - idle, self._check)

    def stop(self) -> None:
        self.handle.cancel()


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def stale(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing()


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
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=READ_SIZE),
                self.connect_timeout_s,
            )
        except asyncio.TimeoutError:
            raise HttpError(f"ConnectTimeout: {self.host}:{self.port}") from None
        except OSError as exc:
            raise HttpError(f"ConnectError: {exc}") from None
        return _Conn(reader, writer)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send a request and read the response's head; the caller reads the body and calls
        ``close()``. A kept-alive connection the server closed meanwhile is retried once on a new one."""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        message = head.encode("latin-1") + b"\r\n" + body
        while self._idle:
            conn = self._idle.pop()
            if conn.stale:
                conn.writer.close()
                continue
            try:
                return await self._exchange(conn, message)
            except _NoAnswer:
                conn.writer.close()  # closed while idle: the request never reached the server
                break
        conn = await self._connect()
        try:
            return await self._exchange(conn, message)
        except _NoAnswer as exc:
            conn.writer.close()
            raise HttpError(f"RemoteProtocolError: {exc}") from None

    async def _exchange(self, conn: _Conn, message: bytes) -> Response:
        try:
            conn.writer.write(message)
            await conn.writer.drain()
            raw = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _NoAnswer("the server closed the connection without a response") from None
            conn.writer.close()
            raise HttpError("the server closed the connection mid-head") from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _NoAnswer(str(exc)) from None
        except asyncio.TimeoutError:
            conn.writer.close()
            raise HttpError(f"ReadTimeout: no response head in {self.read_timeout_s:g} s") from None
        except (asyncio.LimitOverrunError, OSError) as exc:
            conn.writer.close()
            raise HttpError(f"{type(exc).__name__}: {exc}") from None
        status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            conn.writer.close()
            raise HttpError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return Response(self, conn, int(parts[1]), headers)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A whole GET: (status, body)."""
        resp = await self.request("GET", path, headers=headers)
        try:
            return resp.status, await resp.read()
        finally:
            resp.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()


class _NoAnswer(Exception):
    """The connection ended before a byte of the response: the request can go again elsewhere."""
