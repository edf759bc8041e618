"""Async client of a node's internal API (msgpack bodies, optional cluster bearer token).

Every call raises ``NodeError`` on failure: ``status`` is the node's HTTP status, or 0 when
the node could not be reached (``connect_failed`` tells whether the request surely never
arrived, which makes it safe to send elsewhere). Cancelling a call closes its connection,
which the nodes treat as an abort of that request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress

import httpx
import msgspec

from pdserve.messages import (
    AbortRequest,
    FrameReader,
    LandingDescriptor,
    Message,
    NodeInfo,
    NodeLoad,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    StreamRequest,
    T,
    TokenEvent,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
CONTROL_TIMEOUT_S = 10.0
"""Bound of calls that should answer at once (info, load, health, abort, reserve, stream headers)."""


class NodeError(Exception):
    """A node call failed; ``status`` 0 means no HTTP answer (connection error, timeout)."""

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


def make_http_client() -> httpx.AsyncClient:
    """One pooled client for all nodes. No total timeout: each call passes its own bound."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=5.0),
        # Each in-flight request holds one decode stream and one prefill call open.
        # Idle connections are dropped before the nodes' uvicorn closes them (its keep-alive is 5 s):
        # a request sent on a connection the server is closing fails with ReadError, and a
        # reserve or stream cannot be resent blindly.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=4.0),
        trust_env=False,  # never send cluster traffic through an HTTP(S)_PROXY from the environment
    )


def _error_body(headers: Mapping[str, str], body: bytes) -> object:
    """The error body as data: JSON ``{"error": {...}}``, or a msgpack message such as a failed
    PrefillResult (``{"error": "..."}``); None when it is neither."""
    try:
        if headers.get("content-type", "").startswith(MSGPACK):
            return msgspec.msgpack.decode(body)
        return json.loads(body)
    except (ValueError, msgspec.DecodeError):
        return None


def _error_from_response(url: str, response: httpx.Response, body: bytes) -> NodeError:
    return _error_from_parts(url, response.status_code, response.reason_phrase, response.headers, body)


def _error_from_parts(
    url: str, status: int, reason: str, headers: Mapping[str, str], body: bytes
) -> NodeError:
    message = reason
    error_type = ""
    data = _error_body(headers, body)
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or message)
        error_type = str(err.get("type") or "")
    elif isinstance(err, str) and err:
        message = err
    elif isinstance(data, dict) and isinstance(data.get("detail"), str):  # FastAPI's HTTPException
        message = data["detail"]
    elif data is None and body:
        message = body[:1000].decode("utf-8", "replace")
    retry_after = None
    if "retry-after" in headers:
        with suppress(ValueError):
            retry_after = float(headers["retry-after"])
    return NodeError(url, message, status, error_type, retry_after=retry_after)


def _transport_error(url: str, exc: Exception) -> NodeError:
    connect_failed = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    kind = type(exc).__name__
    return NodeError(url, f"{kind}: {exc}" if str(exc) else kind, connect_failed=connect_failed)


class NodeClient:
    """One node's internal API, over a shared ``httpx.AsyncClient``."""

    def __init__(self, url: str, http: httpx.AsyncClient, cluster_token: str = "") -> None:
        self.url = url.rstrip("/")
        self.http = http
        parts = urllib.parse.urlsplit(self.url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._netloc = parts.netloc
        self._ssl = True if parts.scheme == "https" else None  # the default context, as httpx
        self.headers = {"content-type": MSGPACK, "accept": MSGPACK}
        if cluster_token:
            self.headers["authorization"] = f"Bearer {cluster_token}"

    def __repr__(self) -> str:
        return f"NodeClient({self.url})"

    async def _call(
        self, method: str, path: str, msg: Message | None, kind: type[T] | None, timeout: float | None
    ) -> T | None:
        url = self.url + path
        try:
            response = await self.http.request(
                method,
                url,
                content=encode(msg) if msg is not None else None,
                headers=self.headers,
                timeout=httpx.Timeout(timeout, connect=min(5.0, timeout or 5.0)),
            )
        except httpx.HTTPError as exc:
            raise _transport_error(url, exc) from exc
        if response.status_code != 200:
            raise _error_from_response(url, response, response.content)
        if kind is None:
            return None
        try:
            return decode(response.content, kind)
        except msgspec.DecodeError as exc:
            raise NodeError(url, f"bad {kind.__name__} from node: {exc}", response.status_code) from exc

    async def info(self, timeout: float = CONTROL_TIMEOUT_S) -> NodeInfo:
        return await self._call("GET", "/internal/info", None, NodeInfo, timeout)

    async def load(self, timeout: float = CONTROL_TIMEOUT_S) -> NodeLoad:
        return await self._call("GET", "/internal/load", None, NodeLoad, timeout)

    async def health(self, timeout: float = 2.0) -> bool:
        try:
            response = await self.http.get(self.url + "/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def abort(self, request_id: str, timeout: float = 5.0) -> None:
        await self._call("POST", "/internal/abort", AbortRequest(request_id), None, timeout)

    async def reserve(self, request: ReserveRequest, timeout: float = CONTROL_TIMEOUT_S) -> LandingDescriptor:
        return await self._call("POST", "/internal/reserve", request, LandingDescriptor, timeout)

    async def prefill(self, request: PrefillRequest, timeout: float | None) -> PrefillResult:
        """Runs until the KV is committed to the decode node (or failed); ``timeout`` bounds each read."""
        return await self._call("POST", "/internal/prefill", request, PrefillResult, timeout)

    @asynccontextmanager
    async def stream(
        self, request: StreamRequest, timeout: float = CONTROL_TIMEOUT_S
    ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        """Open the token stream; entering returns once the node has answered with headers.

        ``timeout`` bounds the wait for the headers only; reads wait as long as the caller lets
        them. Leaving the block early closes the connection, which aborts the request there.

        The stream runs on a connection of its own, read with asyncio's stream reader rather than
        httpx: every token event of every stream passes here, and httpx/httpcore (anyio wrappers,
        h11 events, pool upkeep) cost about a quarter of a busy proxy's CPU on this path alone.
        """
        url = self.url + "/internal/stream"
        body = encode(request)
        head = [f"POST /internal/stream HTTP/1.1\r\nhost: {self._netloc}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in self.headers.items()]
        head.append(f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=self._ssl), min(5.0, timeout)
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise NodeError(url, f"{type(exc).__name__}: {exc}", connect_failed=True) from exc
        try:
            writer.write("".join(head).encode("latin-1") + body)
            try:
                status, reason, headers = await asyncio.wait_for(_read_head(reader), timeout)
            except asyncio.TimeoutError:
                raise NodeError(url, f"ReadTimeout: no response headers within {timeout:g} s") from None
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                raise NodeError(url, f"{type(exc).__name__}: {exc}") from exc
            if status != 200:
                try:
                    data = await asyncio.wait_for(_read_body(reader, headers), timeout)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                    data = b""
                raise _error_from_parts(url, status, reason, headers, data)
            yield _read_events(url, reader, headers)
        finally:
            writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    """Status line and headers of an HTTP/1.1 response (header names lower-cased)."""
    line = await reader.readuntil(b"\r\n")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP response: {line[:80]!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    """A whole (error) body: chunked, by content-length, or up to the close."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return b"".join([chunk async for chunk in _chunks(reader)])
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked body; raises IncompleteReadError if the connection ends first."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return
        chunk = await reader.readexactly(size + 2)
        yield chunk[:-2]


async def _read_events(
    url: str, reader: asyncio.StreamReader, headers: Mapping[str, str]
) -> AsyncIterator[TokenEvent]:
    frames = FrameReader(TokenEvent)
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            async for chunk in _chunks(reader):
                for event in frames.feed(chunk):
                    yield event
        else:
            while chunk := await reader.read(1 << 16):
                for event in frames.feed(chunk):
                    yield event
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        # The node (or the link) went away mid-stream: unreachable, as httpx's RemoteProtocolError was.
        raise NodeError(url, f"{type(exc).__name__}: {exc}") from exc
    except (msgspec.DecodeError, ValueError) as exc:
        raise NodeError(url, f"bad token stream from node: {exc}", 200) from exc
