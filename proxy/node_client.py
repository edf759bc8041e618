"""Async client of one node: info, load and health over HTTP (msgpack bodies, optional cluster
bearer token); the request path (reserve, prefill, stream, abort) over the node's request
channel (pdserve.proxy.channel), opened once the node's info says where it listens.

Every call raises ``NodeError`` on failure: ``status`` is the node's (HTTP) status, or 0 when
the node could not be reached (``connect_failed`` tells whether the request surely never
arrived, which makes it safe to send elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping
from contextlib import suppress

import httpx
import msgspec

from pdserve.messages import (
    LandingDescriptor,
    Message,
    NodeInfo,
    NodeLoad,
    PrefillLanding,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    StreamRequest,
    T,
    decode,
    encode,
)
from pdserve.proxy.channel import CONTROL_TIMEOUT_S, NodeChannel, NodeError, StreamSink

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"


def make_http_client() -> httpx.AsyncClient:
    """One pooled client for all nodes. No total timeout: each call passes its own bound."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=5.0),
        # Only polls and info travel here. Idle connections are dropped before the nodes' uvicorn
        # closes them (its keep-alive is 5 s).
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=8, keepalive_expiry=4.0),
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
    """One node: HTTP control calls over a per-node ``httpx.AsyncClient``, the request path over
    its ``NodeChannel``."""

    def __init__(self, url: str, http: httpx.AsyncClient, cluster_token: str = "") -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.cluster_token = cluster_token
        self._host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
        self.headers = {"content-type": MSGPACK, "accept": MSGPACK}
        if cluster_token:
            self.headers["authorization"] = f"Bearer {cluster_token}"
        self.channel: NodeChannel | None = None
        self.on_load: Callable[[NodeLoad], None] | None = None  # given each load a reply carries

    def __repr__(self) -> str:
        return f"NodeClient({self.url})"

    async def use_info(self, info: NodeInfo) -> None:
        """Open (or, after the node restarted elsewhere, reopen) the request channel ``info`` names."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        address = f"tcp://{host}:{info.channel_port}"
        if self.channel is not None and self.channel.address == address:
            return
        old = self.channel
        self.channel = NodeChannel(self.url, address, self.cluster_token, on_load=self.on_load)
        if old is not None:
            await old.close()

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.http.aclose()

    def _channel(self) -> NodeChannel:
        if self.channel is None:  # the router reads a node's info before it routes to it
            raise NodeError(self.url, "the node's request channel is not known yet", connect_failed=True)
        return self.channel

    async def _call(self, method: str, path: str, msg: Message | None, kind: type[T], timeout: float) -> T:
        url = self.url + path
        try:
            response = await self.http.request(
                method,
                url,
                content=encode(msg) if msg is not None else None,
                headers=self.headers,
                timeout=httpx.Timeout(timeout, connect=min(5.0, timeout)),
            )
        except httpx.HTTPError as exc:
            raise _transport_error(url, exc) from exc
        if response.status_code != 200:
            raise _error_from_response(url, response, response.content)
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
        await self._channel().abort(request_id, timeout)

    async def reserve(self, request: ReserveRequest, timeout: float = CONTROL_TIMEOUT_S) -> LandingDescriptor:
        return await self._channel().reserve(request, timeout)

    async def prefill(
        self, request: PrefillRequest, timeout: float | None = None, sent: asyncio.Future | None = None
    ) -> PrefillResult:
        """Runs until the KV is committed to the decode node (or failed); ``sent`` resolves once
        the call is on the wire (``NodeChannel.call``)."""
        return await self._channel().prefill(request, timeout, sent)

    async def land(self, request: PrefillLanding, timeout: float | None = CONTROL_TIMEOUT_S) -> None:
        """The landing of a prefill sent without one (``NodeChannel.land``)."""
        await self._channel().land(request, timeout)

    def stream(
        self,
        request: StreamRequest,
        sink: StreamSink,
        timeout: float = CONTROL_TIMEOUT_S,
        num_sequences: int = 1,
    ):
        """The request's token stream, handed to ``sink`` (``NodeChannel.stream``)."""
        return self._channel().stream(request, sink, timeout, num_sequences)
