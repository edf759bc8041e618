"""What prefill and decode nodes share: engine start-up, node info, the internal HTTP plumbing.

Internal APIs speak msgpack-encoded ``pdserve.messages`` structs; errors come back as
OpenAI-style JSON bodies with a 4xx/5xx status so the proxy can pass them on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pdserve.config import EngineConfig, NodeConfig, dtype_name
from pdserve.engine import LLMEngine
from pdserve.engine_loop import EngineLoop
from pdserve.messages import Message, NodeInfo, NodeLoad, decode, encode
from pdserve.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry

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
    )


def node_load(engine: LLMEngine) -> NodeLoad:
    s = engine.scheduler
    return NodeLoad(
        running=len(s.running),
        waiting=len(s.waiting),
        waiting_for_kv=len(s.remote),
        free_blocks=s.kv.num_free_blocks,
        total_blocks=s.kv.pool.num_blocks,
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
    if token and request.headers.get("authorization") != f"Bearer {token}":
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


class NodeState:
    """Engine, loop and identity of a running node, set up in the app's lifespan."""

    def __init__(self, engine_config: EngineConfig, node: NodeConfig, role: str) -> None:
        self.engine_config = engine_config
        self.node = node
        self.role = role
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.info: NodeInfo | None = None
        self.metrics = NodeMetrics()

    @property
    def transfer_bytes(self) -> int:
        """KV bytes this node's transport moved; roles override."""
        return 0

    async def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    async def start_engine(self, **loop_hooks) -> LLMEngine:
        self.engine = await asyncio.to_thread(LLMEngine, self.engine_config)
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop(), **loop_hooks)
        return self.engine


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
        return msgpack_response(await state.loop.call(node_load))
