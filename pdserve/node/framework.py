"""The node process every role shares: it starts the engine core, serves the request channel
and the internal HTTP plumbing (the roles' engine-side services, node info and refusals, which
both processes use, are in ``pdserve.node.service``).

A node is two processes, as vLLM V1's API server and EngineCore: this one (``NodeState``) serves
HTTP and the request channel, admits, drains and relays token events; the engine core
(``pdserve.node.engine_core``, spawned by ``pdserve.node.core_client``) runs the engine and the
roles' engine-side services. They speak typed messages over ZeroMQ.

The request path (reserve, prefill, token stream, abort) arrives on the request channel
(``pdserve.node.channel``), where each role registers its calls; HTTP serves health, info,
load, metrics and an operator's abort. Both speak msgpack-encoded ``pdserve.messages`` structs;
refusals carry an HTTP status (in the channel's ``Reply``, or as an OpenAI-style JSON error) so
the proxy can pass them on.

Admission and shutdown (the same for every role):

- New work (a reserve, a prefill) is refused with 429 and Retry-After when the node already holds
  ``max_waiting_requests`` queued requests, with 503 while it drains, with 504 when its deadline
  has passed. A request whose deadline passes later is dropped wherever it is, blocks freed.
- SIGTERM (or SIGINT) starts a drain: ``/health`` and ``/internal/load`` answer 503 (the proxy
  stops routing here), new work gets 503, what the node holds runs to its end (streams finish,
  prefills hand off their KV). Then the signal goes on to the server, which exits and stops the
  core. Requests still there after ``shutdown_timeout_s``, or at a second signal, end with an
  error output.
- The core dies with the node (it asks the kernel to kill it when its parent dies); a core that
  dies ends every request of the node with an error and the node exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response

from pdserve import gc_heap
from pdserve.config import EngineConfig, NodeConfig
from pdserve.messages import (
    AbortRequest,
    CoreStats,
    EndAll,
    EndRequest,
    GetStats,
    IsIdle,
    Message,
    NodeInfo,
    NodeLoad,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from pdserve.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry
from pdserve.node.channel import CallRefused, ChannelServer, Peer
from pdserve.node.core_client import CoreClient, Subscriptions
from pdserve.node.service import RETRY_AFTER_S, NodeRefused, NodeService, error_response
from pdserve.prefix_index import redacted

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"


def msgpack_response(msg: Message, status_code: int = 200) -> Response:
    return Response(encode(msg), status_code=status_code, media_type=MSGPACK)


async def read_message(request: Request, kind: type) -> Message:
    body = await request.body()
    try:
        return decode(body, kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HTTPException(status_code=400, detail=f"malformed {kind.__name__}: {e}") from None


FLUSH_TIMEOUT_S = 5.0
"""After a drain ends requests with errors, how long their handlers get to send them."""


def check_token(request: Request, token: str) -> None:
    """401 unless ``Authorization: Bearer <token>``, compared in constant time (no-op without a token)."""
    given = request.headers.get("authorization", "").encode("latin-1")  # as sent on the wire
    if token and not hmac.compare_digest(given, b"Bearer " + token.encode()):
        raise HTTPException(status_code=401, detail="missing or wrong cluster token")


class NodeMetrics:
    """The node's Prometheus metrics; engine figures are read when scraped."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.blocks_total = r.gauge("pdserve_kv_blocks_total", "KV cache blocks of this node.")
        self.blocks_free = r.gauge(
            "pdserve_kv_blocks_free", "KV blocks free or holding evictable prefix cache."
        )
        self.running = r.gauge("pdserve_running_requests", "Requests in the running batch.")
        self.waiting = r.gauge("pdserve_waiting_requests", "Requests queued, including those waiting for KV.")
        self.prompt_tokens = r.counter(
            "pdserve_prompt_tokens_computed_total", "Prompt tokens run through the model on this node."
        )
        self.prefix_hits = r.counter(
            "pdserve_prefix_cache_hit_tokens_total", "Prompt tokens served from this node's prefix cache."
        )
        self.jit_compiles = r.counter(
            "pdserve_jit_compiles_total",
            "Triton kernels compiled by the engine's process; flat after the start-up warm-up (0 on CPU).",
        )
        self.transfer_bytes = r.counter("pdserve_kv_transfer_bytes_total", "KV bytes sent or received.")
        self.transfer_seconds = r.histogram(
            "pdserve_kv_transfer_seconds",
            "From a prefill's first token to the decode node's ack of its KV (what the transfer adds).",
            buckets=LATENCY_BUCKETS,
        )
        self.first_token_seconds = r.histogram(
            "pdserve_node_time_to_first_token_seconds",
            "From a request's arrival on this node (its reserve, or its start on a co-located node) to "
            "its first token event leaving for the proxy: queueing, prefill (here or on a prefill node) "
            "and the KV transfer included.",
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_seconds = r.histogram(
            "pdserve_prefill_seconds",
            "From a prompt's arrival on a prefill node to its first token, queueing included.",
            buckets=LATENCY_BUCKETS,
        )
        self.gc = gc_heap.GcMetrics(r)
        self.simulated = r.gauge(
            "pdserve_simulated",
            "1 when this node's engine is simulated (--model sim:...): step times modelled, not measured.",
        )
        self._last: dict[str, float] = {}

    def _advance(self, counter, key: str, total: float) -> None:
        counter.inc(max(0.0, total - self._last.get(key, 0.0)))
        self._last[key] = total

    def render(self, stats: CoreStats | None) -> str:
        """The metrics text; ``stats`` are the engine core's (None before it started)."""
        if stats is not None:
            self.blocks_total.set(stats.num_blocks)
            self.blocks_free.set(stats.num_free_blocks)
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting + stats.num_waiting_for_kv)
            self._advance(self.prompt_tokens, "prompt", stats.num_prompt_tokens_computed)
            self._advance(self.prefix_hits, "hits", stats.num_prefix_hit_tokens)
            self._advance(self.jit_compiles, "jit", stats.num_jit_compiles)
            self._advance(self.transfer_bytes, "bytes", stats.transfer_bytes)
            if stats.gc is not None:
                self.gc.update("core", stats.gc)
        self.gc.update("node", gc_heap.pauses())
        return self.registry.render()


AddCalls = Callable[[ChannelServer, "NodeState"], None]
"""Registers a role's request-channel calls (node process) on the channel."""


class NodeState:
    """The node process of a running node: the request channel, admission, subscriptions, drain
    and the client of its engine core process, set up in the app's lifespan.

    ``make_services`` (a module-level function, sent to the core process) builds the roles'
    engine-side services there; ``add_calls`` register the roles' calls on the channel here."""

    def __init__(
        self,
        engine_config: EngineConfig,
        node: NodeConfig,
        make_services: Callable[[object], list[NodeService]],
        add_calls: list[AddCalls],
    ) -> None:
        self.engine_config = engine_config
        self.node = node
        self.role = node.role
        self.make_services = make_services
        self.add_calls = add_calls
        self.core: CoreClient | None = None
        self.channel: ChannelServer | None = None
        self.info: NodeInfo | None = None
        self.load: NodeLoad | None = None  # the core's newest report
        self.metrics = NodeMetrics()
        self.subs = Subscriptions(self.metrics.first_token_seconds.observe)
        self.transfers: dict[str, asyncio.Future] = {}
        """Prefill request id -> the outcome of its last KV send (``TransferDone``)."""
        self.started = False
        self.draining = False  # no new work; set once, by the first signal
        self.num_admitting = 0  # new requests between admission and the core's answer
        self._drain_now: asyncio.Event | None = None
        self._drain_task: asyncio.Task | None = None

    async def start(self) -> None:
        node = self.node
        channel = self.channel = ChannelServer(
            node.host, node.channel_port, node.cluster_token, self._streams_lost, load=lambda: self.load
        )
        node = self.node = dataclasses.replace(node, channel_port=channel.port)
        core = self.core = CoreClient(self._on_outputs, self._core_died)
        ready = await core.start(self.engine_config, node, self.make_services)
        self.info = ready.info
        self.load = ready.load
        self.metrics.simulated.set(1 if ready.simulated else 0)
        channel.node_id = self.info.node_id
        channel.handle(AbortRequest, self._abort_call)
        for add in self.add_calls:
            add(channel, self)
        channel.start()
        self.started = True
        where = f" at {self.info.kv_address}" if self.info.kv_address else ""
        index = f"; prefix index at {redacted(node.redis_url)}" if node.redis_url else ""
        logger.info(
            "%s node %s ready: KV via %s%s%s; engine core in process %d",
            self.role,
            self.info.node_id,
            self.info.kv_transport,
            where,
            index,
            core.process.pid,
        )

    async def close_channel(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def stop(self) -> None:
        if self.core is not None:
            await self.core.close(Shutdown())

    def end_request(self, request_id: str, message: str) -> None:
        """Abort a request in the core, not waiting for it (a peer that left, a handler cancelled)."""
        self.core.send(EndRequest(request_id, "FINISHED_ABORTED", message))

    def _on_outputs(self, msg: StepOutputs) -> None:
        """A turn of the engine loop: its events go to their subscriptions (and out on the channel,
        one message per peer), the sends that ended to their prefill calls."""
        self.subs.deliver(msg)
        for done in msg.transfers:
            if not done.error:
                self.metrics.transfer_seconds.observe(done.seconds)
            waiter = self.transfers.pop(done.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(done)
        if msg.load is not None:
            self.load = msg.load
        self.channel.flush()

    def _core_died(self, why: str) -> None:
        """The engine core is gone: the node exits at once. To the proxy that is a node that died
        (its connection drops), so it migrates the node's streams and retries its calls elsewhere,
        instead of failing them with errors or waiting for a node that cannot answer."""
        self.core.remove_files()
        logger.critical("the node's engine core is gone (%s); the node exits", why)
        _exit_now(1)

    def _streams_lost(self, peer: Peer, request_ids: list[str]) -> None:
        """A proxy worker went away: its streams' requests end, as their HTTP connections closing did."""
        for rid in request_ids:
            self.end_request(rid, "proxy gone")

    async def _abort_call(self, peer: Peer, msg: AbortRequest) -> None:
        await self.core.call(EndRequest(msg.request_id, "FINISHED_ABORTED", "aborted"))

    # -- admission -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admission(self, deadline: float = 0.0):
        """Around taking new work: refuses it while draining, past its deadline, or while
        ``max_waiting_requests`` other requests are being admitted (which bounds the core's
        inbox); the core checks its queue itself (``CoreState.check_room``)."""
        if self.draining:
            raise NodeRefused(503, "the node is shutting down", "unavailable", RETRY_AFTER_S)
        if deadline and deadline <= time.time():
            raise NodeRefused(504, "the request's deadline passed before the node took it", "timeout")
        if self.num_admitting >= self.node.max_waiting_requests:
            raise NodeRefused(429, "the node's admission queue is full", "overloaded", RETRY_AFTER_S)
        self.num_admitting += 1
        try:
            yield
        finally:
            self.num_admitting -= 1

    # -- draining ------------------------------------------------------------------------------

    async def _is_idle(self) -> bool:
        """Nothing left that must finish before the node exits: no open subscription here, nothing
        in the core."""
        if self.subs.num_unfinished:
            return False
        return (await self.core.call(IsIdle())).value

    def on_signal(self, signum: int, hand_on: Callable[[], None]) -> None:
        """SIGTERM/SIGINT: the first starts a drain that calls ``hand_on`` (the server's own
        handler) at its end; a second ends the drain's requests at once."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then(hand_on))
        elif self._drain_now is not None:
            logger.warning("second signal: ending the requests left now")
            self._drain_now.set()

    async def _drain_then(self, hand_on: Callable[[], None]) -> None:
        try:
            await self.drain()
        except Exception:
            logger.exception("drain failed")
        finally:
            hand_on()

    async def drain(self) -> None:
        """Refuse new work, let the node's requests finish (at most ``shutdown_timeout_s``), end
        what is left with an error output, and give handlers a moment to send it."""
        self.draining = True
        self._drain_now = asyncio.Event()
        if not self.started or self.core.gone:
            return
        timeout = self.node.shutdown_timeout_s
        logger.info("draining: no new work; waiting up to %.0f s for the requests in flight", timeout)
        give_up = time.monotonic() + timeout
        while not await self._is_idle():
            left = give_up - time.monotonic()
            if left <= 0 or self._drain_now.is_set():
                message = "the node is shutting down"
                n = (await self.core.call(EndAll(message))).value
                self.subs.fail_all(message)
                self.channel.flush()
                logger.warning("drain: ended %d request(s) still in flight", n)
                flush_until = time.monotonic() + FLUSH_TIMEOUT_S
                while time.monotonic() < flush_until and not await self._is_idle():
                    await asyncio.sleep(0.05)
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drain_now.wait(), min(0.05, left))
        logger.info("drained")


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)


def install_drain_handlers(state: NodeState) -> None:
    """Route SIGTERM/SIGINT to ``NodeState.on_signal`` (main thread only), handing each on to the
    handler found (the server's) once the drain ends."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def hand_on(sig: int = sig, previous=previous) -> None:
            if callable(previous):
                previous(sig, None)
            else:  # SIG_DFL or SIG_IGN: let the default action happen
                signal.signal(sig, previous)
                signal.raise_signal(sig)

        def handler(signum, frame, hand_on=hand_on) -> None:
            loop.call_soon_threadsafe(state.on_signal, signum, hand_on)

        signal.signal(sig, handler)


def node_app(state: NodeState) -> FastAPI:
    """The FastAPI app of a node: starts and stops it with the server, and serves the shared routes."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        install_drain_handlers(state)
        # Started (the drain handlers need the process's main thread: this app is its process's).
        gc_heap.freeze()
        gc_heap.track()
        try:
            yield
        finally:
            await state.close_channel()
            await state.stop()

    app = FastAPI(title=f"pdserve {state.role} node", lifespan=lifespan)
    app.state.node = state
    add_common_routes(app, state)
    return app


def add_common_routes(app: FastAPI, state: NodeState) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(CallRefused)
    async def _refused(request: Request, exc: CallRefused):
        return NodeRefused(exc.status, exc.message, exc.kind, exc.retry_after).response()

    @app.get("/health")
    async def health():
        if not state.started:
            return error_response(503, "starting", "unavailable")
        if state.core.gone:
            return error_response(503, f"engine core gone: {state.core.gone}", "unavailable")
        if state.draining:
            return error_response(503, "draining", "unavailable")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        # Asked of the engine core between steps, like any other call into the engine.
        stats = await state.core.call(GetStats()) if state.started else None
        return PlainTextResponse(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/internal/info")
    async def info(request: Request):
        check_token(request, state.node.cluster_token)
        return msgpack_response(state.info)

    @app.get("/internal/load")
    async def load(request: Request):
        check_token(request, state.node.cluster_token)
        if state.draining:  # routers take a node that does not report its load for one that is down
            return error_response(503, "draining", "unavailable")
        return msgpack_response(state.load)

    @app.post("/internal/abort")
    async def abort(request: Request):
        check_token(request, state.node.cluster_token)
        msg: AbortRequest = await read_message(request, AbortRequest)
        await state.core.call(EndRequest(msg.request_id, "FINISHED_ABORTED", "aborted"))
        return msgpack_response(msg)
