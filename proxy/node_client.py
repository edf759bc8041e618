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
from collections.abc import AsyncIterator
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


def _error_body(response: httpx.Response, body: bytes) -> object:
    """The error body as data: JSON ``{"error": {...}}``, or a msgpack message such as a failed
    PrefillResult (``{"error": "..."}``); None when it is neither."""
    try:
        if response.headers.get("content-type", "").startswith(MSGPACK):
            return msgspec.msgpack.decode(body)
        return json.loads(body)
    except (ValueError, msgspec.DecodeError):
        return None


def _error_from_response(url: str, response: httpx.Response, body: bytes) -> NodeError:
    message = response.reason_phrase
    error_type = ""
    data = _error_body(response, body)
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
    if "retry-after" in response.headers:
        with suppress(ValueError):
            retry_after = float(response.headers["retry-after"])
    return NodeError(url, message, response.status_code, error_type, retry_after=retry_after)


def _transport_error(url: str, exc: Exception) -> NodeError:
    connect_failed = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    kind = type(exc).__name__
    return NodeError(url, f"{kind}: {exc}" if str(exc) else kind, connect_failed=connect_failed)


class NodeClient:
    """One node's internal API, over a shared ``httpx.AsyncClient``."""

    def __init__(self, url: str, http: httpx.AsyncClient, cluster_token: str = "") -> None:
        self.url = url.rstrip("/")
        self.http = http
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
        """
        url = self.url + "/internal/stream"
        req = self.http.build_request(
            "POST",
            url,
            content=encode(request),
            headers=self.headers,
            timeout=httpx.Timeout(None, connect=min(5.0, timeout)),
        )
        try:
            # The read timeout would also bound the gap between frames; bound only the headers.
            response = await _wait_headers(self.http, req, timeout)
        except httpx.HTTPError as exc:
            raise _transport_error(url, exc) from exc
        try:
            if response.status_code != 200:
                body = await response.aread()
                raise _error_from_response(url, response, body)
            yield _read_events(url, response)
        finally:
            await response.aclose()


async def _wait_headers(http: httpx.AsyncClient, req: httpx.Request, timeout: float) -> httpx.Response:
    try:
        return await asyncio.wait_for(http.send(req, stream=True), timeout)
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"no response headers within {timeout:g} s", request=req) from None


async def _read_events(url: str, response: httpx.Response) -> AsyncIterator[TokenEvent]:
    reader = FrameReader(TokenEvent)
    try:
        async for chunk in response.aiter_raw():
            for event in reader.feed(chunk):
                yield event
    except httpx.HTTPError as exc:
        raise _transport_error(url, exc) from exc
    except (msgspec.DecodeError, ValueError) as exc:
        raise NodeError(url, f"bad token stream from node: {exc}", 200) from exc
