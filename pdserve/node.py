"""What every node shares: engine start-up, services, node info, prefix-index publishing, the
internal HTTP plumbing.

Internal APIs speak msgpack-encoded ``pdserve.messages`` structs; errors come back as
OpenAI-style JSON bodies with a 4xx/5xx status so the proxy can pass them on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kv_transfer
from pdserve.config import EngineConfig, NodeConfig, dtype_name
from pdserve.engine import LLMEngine
from pdserve.engine_loop import EngineLoop, error_output
from pdserve.messages import AbortRequest, Message, NodeInfo, NodeLoad, decode, encode
from pdserve.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry
from pdserve.outputs import RequestOutput
from pdserve.prefix_index import IndexPublisher, NodeRegistration, redacted
from pdserve.request import RequestStatus

logger = logging.getLogger(__name__)

KV_LAYOUT = "L,NB,2,BS,Hkv,D"
MSGPACK = "application/msgpack"


def node_info(engine: LLMEngine, node: NodeConfig, role: str, transport: str, kv_address: str) -> NodeInfo:
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


def node_load(engine: LLMEngine) -> NodeLoad:
    s = engine.scheduler
    return NodeLoad(
        running=len(s.running),
        waiting=len(s.waiting),
        waiting_for_kv=len(s.remote),
        free_blocks=s.kv.num_free_blocks,
        total_blocks=s.kv.pool.num_blocks,
        pending_prompt_tokens=engine.num_pending_prompt_tokens(),
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
        self.transfer_bytes = r.counter("pdserve_kv_transfer_bytes_total", "KV bytes sent or received.")
        self.transfer_seconds = r.histogram(
            "pdserve_kv_transfer_seconds",
            "Time to move one request's KV, send to ack.",
            buckets=LATENCY_BUCKETS,
        )
        self._last: dict[str, float] = {}

    def _advance(self, counter, key: str, total: float) -> None:
        counter.inc(max(0.0, total - self._last.get(key, 0.0)))
        self._last[key] = total

    def render(self, engine: LLMEngine | None, transfer_bytes: int) -> str:
        if engine is not None:
            s = engine.scheduler
            self.blocks_total.set(s.kv.pool.num_blocks)
            self.blocks_free.set(s.kv.num_free_blocks)
            self.running.set(len(s.running))
            self.waiting.set(len(s.waiting) + len(s.remote))
            self._advance(self.prompt_tokens, "prompt", engine.num_prompt_tokens_computed)
            self._advance(self.prefix_hits, "hits", s.num_prefix_hit_tokens)
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

    def add_routes(self, app: FastAPI) -> None: ...

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
        self.info: NodeInfo | None = None
        self.publisher: IndexPublisher | None = None
        self.load: NodeLoad | None = None  # taken on the engine thread between steps
        self.metrics = NodeMetrics()

    @property
    def transfer_bytes(self) -> int:
        return sum(s.transfer_bytes for s in self.services)

    async def start(self) -> None:
        node = self.node
        publish = bool(node.redis_url)
        engine = self.engine = await asyncio.to_thread(LLMEngine, self.engine_config, publish)
        self.loop = EngineLoop(
            engine, asyncio.get_running_loop(), after_step=self._after_step, on_idle=self._on_idle
        )
        # Services set up their ends with the unresolved choice (auto, or a preference list): the
        # transport actually used is agreed with each peer at handshake.
        addresses = [s.start(node.kv_transport) for s in self.services]
        transport = kv_transfer.resolve_transport(node.kv_transport)
        self.info = node_info(engine, node, self.role, transport, next((a for a in addresses if a), ""))
        self.load = node_load(engine)
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
        where = f" at {self.info.kv_address}" if self.info.kv_address else ""
        index = f"; prefix index at {redacted(node.redis_url)}" if publish else ""
        logger.info("%s node %s ready: KV via %s%s%s", self.role, self.info.node_id, transport, where, index)

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
        self._publish_block_events()

    def _on_idle(self) -> None:
        for service in self.services:
            service.on_idle()
        self._publish_block_events()
        # A snapshot for /internal/load: answering a poll must not wait for a long step to end.
        self.load = node_load(self.engine)

    def _publish_block_events(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.engine.take_block_events())

    def end_request(self, request_id: str, status: RequestStatus, message: str) -> None:
        """End a request wherever it is; its subscribers get an error output saying why."""
        for service in self.services:
            service.forget(request_id)
        engine = self.engine
        known = request_id in engine.scheduler.requests or request_id in engine.scheduler.held
        engine.abort_request([request_id], status)
        if known:
            logger.info("request %s ended: %s", request_id, message)
            self.loop.publish(error_output(request_id, message))


def node_app(state: NodeState) -> FastAPI:
    """The FastAPI app of a node: starts and stops it with the server, and serves the shared routes."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title=f"pdserve {state.role} node", lifespan=lifespan)
    app.state.node = state
    add_common_routes(app, state)
    for service in state.services:
        service.add_routes(app)
    return app


def add_common_routes(app: FastAPI, state: NodeState) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if state.loop is None:
            return error_response(503, "starting", "unavailable")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            state.metrics.render(state.engine, state.transfer_bytes), media_type=CONTENT_TYPE
        )

    @app.get("/internal/info")
    async def info(request: Request):
        check_token(request, state.node.cluster_token)
        return msgpack_response(state.info)

    @app.get("/internal/load")
    async def load(request: Request):
        check_token(request, state.node.cluster_token)
        return msgpack_response(state.load)

    @app.post("/internal/abort")
    async def abort(request: Request):
        check_token(request, state.node.cluster_token)
        msg: AbortRequest = await read_message(request, AbortRequest)
        rid = msg.request_id
        await state.loop.call(lambda e: state.end_request(rid, RequestStatus.FINISHED_ABORTED, "aborted"))
        return msgpack_response(msg)
