"""What a node's two processes share: the roles' engine-side services (``NodeService``, run in
the engine core), the node's info and load as the cluster sees them, and how either process
refuses a request (``NodeRefused``).

The node process (``pdserve.node.framework``) and the engine core (``pdserve.node.engine_core``)
both build on this; neither is imported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from pdserve import kv_transfer
from pdserve.config import NodeConfig, Role, dtype_name
from pdserve.messages import NodeInfo, NodeLoad
from pdserve.node.channel import CallRefused

if TYPE_CHECKING:  # the node process does not need the engine: it runs in the core's process
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import EngineLoad, RequestOutput

KV_LAYOUT = "L,NB,2,BS,Hkv,D block-major"


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


def node_load(load: EngineLoad, held: int = 0) -> NodeLoad:
    """The engine's load as routers see it (``/internal/load``, every channel reply); ``held``:
    requests the node's services queue outside the engine (a local prefill waiting for its
    stream), which wait too."""
    return NodeLoad(
        running=load.num_running,
        waiting=load.num_waiting + held,
        waiting_for_kv=load.num_waiting_for_kv,
        free_blocks=load.num_free_blocks,
        total_blocks=load.num_blocks,
        pending_prompt_tokens=load.num_pending_prompt_tokens,
    )


def error_response(status_code: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status_code}},
        status_code=status_code,
    )


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


class NodeService:
    """One role's engine-side part of a node, run in the node's engine core process
    (``pdserve.node.engine_core``): ``prefill_node.PrefillService`` computes prompts for decode
    nodes, ``decode_node.DecodeService`` takes requests and generates. A ``both`` node runs the two
    on one engine. ``state`` is the core's ``CoreState``; every hook runs on the engine loop's
    thread, between engine steps, unless it says otherwise. The role's request-channel calls run
    in the node process and reach the service through the typed commands it registers
    (``commands``)."""

    def __init__(self, state) -> None:
        self.state = state

    def start(self, transport: str) -> str:
        """Set up the service's KV transport end (engine loaded); returns the address peers send
        KV to, or "" when the service receives none."""
        return ""

    def ready(self) -> None:
        """The node's info is final and the engine loop is about to start."""

    def stop(self) -> None: ...

    def commands(self) -> dict[type, Callable]:
        """The node's commands (``pdserve.messages`` types) this service answers: each handler
        takes the message and returns the reply's body (a ``concurrent.futures.Future`` of it when
        the answer comes later), or raises ``NodeRefused``/ValueError."""
        return {}

    def early(self, body) -> None:
        """On the thread that reads the node's commands, as ``body`` arrives, before the engine loop
        takes it (between steps): for what must not wait for a step (a prefill node's lease
        renewals). Quick and thread-safe; must not raise."""

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """After each engine step."""

    def on_idle(self) -> None:
        """Between command batches and steps, also when idle."""

    def forget(self, request_id: str) -> None:
        """Drop the service's own state of a request that is ending."""

    def holds(self, request_id: str) -> bool:
        """The service holds this request outside the engine."""
        return False

    def held_ids(self) -> list[str]:
        """Requests the service holds outside the engine, queued ones included."""
        return []

    @property
    def num_waiting(self) -> int:
        """Requests the service queues outside the engine's scheduler."""
        return 0

    def busy(self) -> bool:
        """Work the node must finish before it exits, beyond the engine's requests: e.g. a KV send
        in flight, or a prefill whose call handler has not returned yet."""
        return False

    @property
    def transfer_bytes(self) -> int:
        return 0
