"""What every node shares: engine start-up, services, node info, prefix-index publishing, the
request channel and the internal HTTP plumbing.

The request path (reserve, prefill, token stream, abort) arrives on the request channel
(``pdserve.node.channel``), where each service registers its calls; HTTP serves health, info,
load, metrics and an operator's abort. Both speak msgpack-encoded ``pdserve.messages`` structs;
refusals carry an HTTP status (in the channel's ``Reply``, or as an OpenAI-style JSON error) so
the proxy can pass them on.

Admission and shutdown (the same for every role):

- New work (a reserve, a prefill) is refused with 429 and Retry-After when the node already holds
  ``max_waiting_requests`` queued requests, with 503 while it drains, with 504 when its deadline
  has passed. A request whose deadline passes later is dropped wherever it is, blocks freed.
- SIGTERM (or SIGINT) starts a drain: ``/health`` and ``/internal/load`` answer 503 (the proxy
  stops routing here), new work gets 503, what the node holds runs to its end (streams finish,
  prefills hand off their KV). Then the signal goes on to the server, which exits. Requests still
  there after ``shutdown_timeout_s``, or at a second signal, end with an error output.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import threading
import time
from collections.abc import Callable

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pdserve import kv_transfer
from pdserve.config import EngineConfig, NodeConfig, Role, dtype_name
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineLoad, RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.messages import AbortRequest, Message, NodeInfo, NodeLoad, decode, encode
from pdserve.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry
from pdserve.node.channel import CallRefused, ChannelServer, Peer
from pdserve.node.engine_loop import EngineLoop, error_output
from pdserve.prefix_index import IndexPublisher, NodeRegistration, redacted

logger = logging.getLogger(__name__)

KV_LAYOUT = "L,NB,2,BS,Hkv,D"
MSGPACK = "application/msgpack"


def node_info(engine: LLMEngine, node: NodeConfig, role: Role, transport: str, kv_address: str) -> NodeInfo:
    arch = engine.arch
    return NodeInfo(
        node_id=node.node_id or f"{role}@{node.host}:{node.port}",
        role=role,
        model_id=engine.source.model_id,
        dtype=dtype_name(engine.config.torch_dtype),
        block_size=engine.config.cache.block_size,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        kv_layout=KV_LAYOUT,
        kv_transport=transport,
        kv_address=kv_address,
        max_model_len=engine.max_model_len,
        vocab_size=arch.vocab_size,
        kv_transports=list(kv_transfer.transport_preferences(node.kv_transport)),
    )


def kv_transport_for(engine: LLMEngine, node: NodeConfig) -> NodeConfig:
    """The node config with its KV transport settled: a simulated engine moves its (tiny) KV over
    the sim transport and nothing else; a real one never does."""
    if engine.simulation is not None:
        if node.kv_transport not in ("auto", "sim"):
            raise ValueError(
                f"a simulated node ({engine.source.model_id}) moves KV over the sim transport only, "
                f"not {node.kv_transport!r}: leave --kv-transport at auto"
            )
        return dataclasses.replace(node, kv_transport="sim")
    if "sim" in kv_transfer.transport_preferences(node.kv_transport):
        raise ValueError("the sim KV transport is for simulated nodes (--model sim:<shape>@<gpu>) only")
    return node


def node_load(load: EngineLoad) -> NodeLoad:
    """The engine's load as the message routers poll (``/internal/load``)."""
    return NodeLoad(
        running=load.num_running,
        waiting=load.num_waiting,
        waiting_for_kv=load.num_waiting_for_kv,
        free_blocks=load.num_free_blocks,
        total_blocks=load.num_blocks,
        pending_prompt_tokens=load.num_pending_prompt_tokens,
    )


def msgpack_response(msg: Message, status_code: int = 200) -> Response:
    return Response(encode(msg), status_code=status_code, media_type=MSGPACK)


def error_response(status_code: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status_code}},
        status_code=status_code,
    )


async def read_message(request: Request, kind: type) -> Message:
    body = await request.body()
    try:
        return decode(body, kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HTTPException(status_code=400, detail=f"malformed {kind.__name__}: {e}") from None


class NodeRefused(CallRefused):
    """The node does not take this request now: a channel call answers it with its status, an
    HTTP route as an OpenAI-style error (with Retry-After when ``retry_after`` is set)."""

    def __init__(self, status: int, message: str, kind: str, retry_after: float | None = None) -> None:
        super().__init__(status, message, kind, retry_after)

    def response(self) -> JSONResponse:
        r = error_response(self.status, self.message, self.kind)
        if self.retry_after is not None:
            r.headers["retry-after"] = str(max(1, round(self.retry_after)))
        return r


RETRY_AFTER_S = 1.0
"""What a refused caller is told to wait: a queue slot or KV blocks free within about a second."""
DEADLINE_SWEEP_S = 0.05
"""How often the engine thread looks for requests past their deadline."""
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
        self.prefill_seconds = r.histogram(
            "pdserve_prefill_seconds",
            "From a prompt's arrival on a prefill node to its first token, queueing included.",
            buckets=LATENCY_BUCKETS,
        )
        self.simulated = r.gauge(
            "pdserve_simulated",
            "1 when this node's engine is simulated (--model sim:...): step times modelled, not measured.",
        )
        self._last: dict[str, float] = {}

    def _advance(self, counter, key: str, total: float) -> None:
        counter.inc(max(0.0, total - self._last.get(key, 0.0)))
        self._last[key] = total

    def render(self, load: EngineLoad | None, transfer_bytes: int) -> str:
        """The metrics text; ``load`` is the engine's (``LLMEngine.load``), None before it started."""
        if load is not None:
            self.blocks_total.set(load.num_blocks)
            self.blocks_free.set(load.num_free_blocks)
            self.running.set(load.num_running)
            self.waiting.set(load.num_waiting + load.num_waiting_for_kv)
            self._advance(self.prompt_tokens, "prompt", load.num_prompt_tokens_computed)
            self._advance(self.prefix_hits, "hits", load.num_prefix_hit_tokens)
            self._advance(self.jit_compiles, "jit", load.num_jit_compiles)
        self._advance(self.transfer_bytes, "bytes", transfer_bytes)
        return self.registry.render()


class NodeService:
    """One role's part of a node: ``prefill_node.PrefillService`` computes prompts for decode
    nodes, ``decode_node.DecodeService`` takes requests and generates. A ``both`` node runs the
    two on one engine. Hooks marked *engine thread* run between engine steps."""

    def __init__(self, state: NodeState) -> None:
        self.state = state

    def start(self, transport: str) -> str:
        """Set up the service's KV transport end (event loop, engine loaded); returns the
        address peers send KV to, or "" when the service receives none."""
        return ""

    def ready(self) -> None:
        """The node's info is final and the engine loop is about to start (event loop)."""

    def stop(self) -> None: ...

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """After each engine step (engine thread)."""

    def on_idle(self) -> None:
        """Between command batches and steps, also when idle (engine thread)."""

    def forget(self, request_id: str) -> None:
        """Drop the service's own state of a request that is ending (engine thread)."""

    def holds(self, request_id: str) -> bool:
        """The service holds this request outside the engine (engine thread)."""
        return False

    def held_ids(self) -> list[str]:
        """Requests the service holds outside the engine, queued ones included (engine thread)."""
        return []

    @property
    def num_waiting(self) -> int:
        """Requests the service queues outside the engine's scheduler (engine thread)."""
        return 0

    def busy(self) -> bool:
        """Work the node must finish before it exits, beyond the engine's requests and open
        subscriptions: e.g. a KV send in flight (engine thread)."""
        return False

    def add_calls(self, channel: ChannelServer) -> None:
        """Register the service's request-path calls on the node's request channel."""

    @property
    def transfer_bytes(self) -> int:
        return 0


class NodeState:
    """Engine, loop, identity and services of a running node, set up in the app's lifespan."""

    def __init__(self, engine_config: EngineConfig, node: NodeConfig) -> None:
        self.engine_config = engine_config
        self.node = node
        self.role = node.role
        self.services: list[NodeService] = []
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.channel: ChannelServer | None = None
        self.info: NodeInfo | None = None
        self.publisher: IndexPublisher | None = None
        self.load: NodeLoad | None = None  # taken on the engine thread between steps
        self.metrics = NodeMetrics()
        self.draining = False  # event loop: no new work; set once, by the first signal
        self.num_admitting = 0  # event loop: new requests between admission and the engine's answer
        self._drain_now: asyncio.Event | None = None
        self._drain_task: asyncio.Task | None = None
        self._deadlines: dict[str, float] = {}  # engine thread only: request id -> unix deadline
        self._next_sweep = 0.0

    @property
    def transfer_bytes(self) -> int:
        return sum(s.transfer_bytes for s in self.services)

    @property
    def kv_options(self) -> list[object]:
        """Options for the node's KV transports (``kv_transfer.create_sender``/``create_receiver``):
        a simulated engine's link; the transports' defaults otherwise."""
        sim = self.engine.simulation if self.engine is not None else None
        if sim is None:
            return []
        return [kv_transfer.SimOptions(sim.link.latency_s, sim.link.gbps, sim.kv_bytes_per_block)]

    async def start(self) -> None:
        node = self.node
        publish = bool(node.redis_url)
        engine = self.engine = await asyncio.to_thread(LLMEngine, self.engine_config, publish)
        node = self.node = kv_transport_for(engine, node)
        self.metrics.simulated.set(1 if engine.simulation is not None else 0)
        self.loop = EngineLoop(
            engine, asyncio.get_running_loop(), after_step=self._after_step, on_idle=self._on_idle
        )
        # Services set up their ends with the unresolved choice (auto, or a preference list): the
        # transport actually used is agreed with each peer at handshake.
        addresses = [s.start(node.kv_transport) for s in self.services]
        transport = kv_transfer.resolve_transport(node.kv_transport)
        channel = self.channel = ChannelServer(
            node.host, node.channel_port, node.cluster_token, self._streams_lost
        )
        channel.handle(AbortRequest, self._abort_call)
        for service in self.services:
            service.add_calls(channel)
        self.loop.add_flush_hook(channel.flush)
        info = node_info(engine, node, self.role, transport, next((a for a in addresses if a), ""))
        self.info = msgspec.structs.replace(info, channel_port=channel.port)
        channel.node_id = self.info.node_id
        self.load = node_load(engine.load())
        if publish:
            url = f"http://{node.host}:{node.port}"
            self.publisher = IndexPublisher(
                node.redis_url,
                self.info.model_id,
                NodeRegistration(self.info.node_id, self.role, url),
                ttl_s=node.heartbeat_ttl_s,
            )
            self.publisher.start()
        for service in self.services:
            service.ready()
        self.loop.start()
        channel.start()
        where = f" at {self.info.kv_address}" if self.info.kv_address else ""
        index = f"; prefix index at {redacted(node.redis_url)}" if publish else ""
        logger.info("%s node %s ready: KV via %s%s%s", self.role, self.info.node_id, transport, where, index)

    async def close_channel(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    def _streams_lost(self, peer: Peer, request_ids: list[str]) -> None:
        """A proxy worker went away (event loop): its streams' requests end, as their HTTP
        connections closing did."""
        gone = RequestStatus.FINISHED_ABORTED
        for rid in request_ids:
            self.loop.submit(lambda e, rid=rid: self.end_request(rid, gone, "proxy gone"))

    async def _abort_call(self, peer: Peer, msg: AbortRequest) -> None:
        rid = msg.request_id
        await self.loop.call(lambda e: self.end_request(rid, RequestStatus.FINISHED_ABORTED, "aborted"))

    def stop(self) -> None:
        for service in self.services:
            service.stop()
        if self.loop is not None:
            self.loop.stop()
        if self.publisher is not None:
            self.publisher.stop()

    # -- engine thread -------------------------------------------------------------------------

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        for service in self.services:
            service.after_step(outputs)
        if self._deadlines:
            for out in outputs:
                if out.finished:
                    self._deadlines.pop(out.request_id, None)
        self._publish_block_events()

    def _on_idle(self) -> None:
        for service in self.services:
            service.on_idle()
        self._sweep_deadlines()
        self._publish_block_events()
        # A snapshot for /internal/load: answering a poll must not wait for a long step to end.
        self.load = node_load(self.engine.load())

    def _publish_block_events(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.engine.take_block_events())

    def end_request(self, request_id: str, status: RequestStatus, message: str) -> None:
        """End a request wherever it is; its subscribers get an error output saying why."""
        engine = self.engine
        known = engine.has_request(request_id) or any(s.holds(request_id) for s in self.services)
        self._deadlines.pop(request_id, None)
        for service in self.services:
            service.forget(request_id)
        engine.abort_request([request_id], status)
        if known:
            logger.info("request %s ended: %s", request_id, message)
            self.loop.publish(error_output(request_id, message))

    # -- admission and deadlines ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admission(self, deadline: float = 0.0):
        """Around taking new work (event loop): refuses it while draining, past its deadline, or
        while ``max_waiting_requests`` other requests are being admitted (which bounds the engine
        loop's inbox); the engine thread checks the queue itself (``check_room``)."""
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

    def num_waiting(self) -> int:
        """Requests queued on the node: for the running batch, for their KV, for their stream."""
        load = self.engine.load()
        return load.num_waiting + load.num_waiting_for_kv + sum(x.num_waiting for x in self.services)

    def check_room(self) -> None:
        """Before queueing a request (engine thread): raises ``NodeRefused`` (429) when the node
        already queues ``max_waiting_requests``."""
        bound = self.node.max_waiting_requests
        if self.num_waiting() >= bound:
            raise NodeRefused(429, f"the node already queues {bound} requests", "overloaded", RETRY_AFTER_S)

    def track_deadline(self, request_id: str, deadline: float) -> None:
        """Drop the request once ``deadline`` (unix time; 0: none) passes (engine thread)."""
        if deadline:
            self._deadlines[request_id] = deadline

    def _sweep_deadlines(self) -> None:
        now = time.time()
        if not self._deadlines or now < self._next_sweep:
            return
        self._next_sweep = now + DEADLINE_SWEEP_S
        for request_id in [r for r, d in self._deadlines.items() if d <= now]:
            self.end_request(request_id, RequestStatus.FINISHED_ABORTED, "the request's deadline passed")

    # -- draining ------------------------------------------------------------------------------

    def _is_idle(self) -> bool:
        """Nothing left that must finish before the node exits (engine thread; the subscriptions
        are the event loop's, read as one snapshot)."""
        if self.engine.request_ids() or self.loop.num_unfinished:
            return False
        return not any(x.busy() or x.held_ids() for x in self.services)

    def _end_all(self, message: str) -> int:
        """End every request the node holds with an error output (engine thread)."""
        ids = self.engine.request_ids() + [r for x in self.services for r in x.held_ids()]
        for request_id in dict.fromkeys(ids):
            self.end_request(request_id, RequestStatus.FINISHED_ABORTED, message)
        return len(ids)

    def on_signal(self, signum: int, hand_on: Callable[[], None]) -> None:
        """SIGTERM/SIGINT (event loop): the first starts a drain that calls ``hand_on`` (the
        server's own handler) at its end; a second ends the drain's requests at once."""
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
        if self.loop is None:
            return
        timeout = self.node.shutdown_timeout_s
        logger.info("draining: no new work; waiting up to %.0f s for the requests in flight", timeout)
        give_up = time.monotonic() + timeout
        while not await self.loop.call(lambda e: self._is_idle()):
            left = give_up - time.monotonic()
            if left <= 0 or self._drain_now.is_set():
                n = await self.loop.call(lambda e: self._end_all("the node is shutting down"))
                self.loop.fail_subscribers("the node is shutting down")
                logger.warning("drain: ended %d request(s) still in flight", n)
                flush_until = time.monotonic() + FLUSH_TIMEOUT_S
                while time.monotonic() < flush_until and not await self.loop.call(lambda e: self._is_idle()):
                    await asyncio.sleep(0.05)
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drain_now.wait(), min(0.05, left))
        logger.info("drained")


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
        try:
            yield
        finally:
            await state.close_channel()
            state.stop()

    app = FastAPI(title=f"pdserve {state.role} node", lifespan=lifespan)
    app.state.node = state
    add_common_routes(app, state)
    return app


def add_common_routes(app: FastAPI, state: NodeState) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(NodeRefused)
    async def _refused(request: Request, exc: NodeRefused):
        return exc.response()

    @app.get("/health")
    async def health():
        if state.loop is None:
            return error_response(503, "starting", "unavailable")
        if state.draining:
            return error_response(503, "draining", "unavailable")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        # Asked of the engine thread between steps, like any other call into the engine.
        load = await state.loop.call(lambda e: e.load()) if state.loop is not None else None
        return PlainTextResponse(state.metrics.render(load, state.transfer_bytes), media_type=CONTENT_TYPE)

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
        rid = msg.request_id
        await state.loop.call(lambda e: state.end_request(rid, RequestStatus.FINISHED_ABORTED, "aborted"))
        return msgpack_response(msg)
