"""The prefill node: computes a prompt's KV and first token, pushes the KV into the decode node's blocks.

Per request (``POST /internal/prefill`` carrying the decode node's landing descriptor):

1. Handshake with that decode node's KV receiver once (mismatches are refused then).
2. The engine runs the prompt like any other — batched, chunked, reusing cached prefix
   blocks — with ``max_tokens=1`` and ``hold_blocks``: when its first token is sampled
   the request finishes but keeps its blocks.
3. Right after that step, on the engine thread, the sender takes the blocks (nothing can
   evict them before). The transport may read them in place (nixl), so the service pins them
   in the engine (``LLMEngine.pin_held``) until the send is over, either way, even if the
   request is aborted meanwhile; then it releases them: they stay in the prefix cache for
   later prompts.
4. The sender delivers the KV and the commit (first token, its logprobs, the seeded
   sampler's state, cached-token count) and waits for the decode node's ack; the HTTP
   reply is that outcome. Closing the HTTP request aborts the prefill.

Blocks are shipped from the engine step that computes them, right after its forward was
launched (``LLMEngine.add_launch_listener``): on CUDA with one event per layer, so the
transport moves the first layers while the GPU still computes the last ones, and a prompt
prefilled in chunks ships each chunk's full blocks while the next chunk runs. The commit
follows after the step. A preempted prompt's blocks may be reused before such a chunk was
read, so after a preemption its blocks are shipped again from the first one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Future

from fastapi import FastAPI, Request

from pdserve import kv_transfer
from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import LaunchedChunk, RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import KVTransferError
from pdserve.messages import (
    KVCommit,
    LandingDescriptor,
    LogprobsMsg,
    PrefillRequest,
    PrefillResult,
)
from pdserve.node.framework import (
    NodeService,
    NodeState,
    check_token,
    msgpack_response,
    node_app,
    read_message,
)
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


class PrefillService(NodeService):
    """Computes prompts whose decode happens on another node, and ships their KV there."""

    def __init__(self, state: NodeState) -> None:
        super().__init__(state)
        self.sender = None
        self._landing: dict[str, LandingDescriptor] = {}  # engine thread only
        self._blocks_sent: dict[str, int] = {}  # engine thread only: leading blocks already shipped
        self._preemptions: dict[str, int] = {}  # engine thread only: preemptions seen while shipping
        # Engine thread only: requests whose last send is in flight (the engine keeps their blocks
        # pinned until it is over).
        self._shipping: set[str] = set()
        # Event loop only: request id -> (decode KV address, next renewal, period).
        self.renewals: dict[str, tuple[str, float, float]] = {}
        self._renewer: asyncio.Task | None = None
        self._handshakes: dict[str, asyncio.Future] = {}
        self.transfers: dict[str, asyncio.Future] = {}  # event-loop only

    def start(self, transport: str) -> str:
        self.sender = kv_transfer.create_sender(transport, cluster_token=self.state.node.cluster_token)
        self.sender.register_kv_cache(self.state.engine.kv_cache)
        self.state.engine.add_launch_listener(self._ship_launched)
        return ""

    def ready(self) -> None:
        self._renewer = asyncio.ensure_future(self._renew_leases())

    @property
    def transfer_bytes(self) -> int:
        return self.sender.bytes_sent if self.sender is not None else 0

    def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        if self.sender is not None:
            self.sender.close()

    async def handshake(self, address: str) -> None:
        """Once per decode node; a refusal is remembered and repeated for every request."""
        fut = self._handshakes.get(address)
        if fut is None or (
            fut.done() and fut.exception() is not None and "refused" not in str(fut.exception())
        ):
            node = self.state.node
            fut = asyncio.ensure_future(
                asyncio.to_thread(self.sender.handshake, address, self.state.info, node.kv_transfer_timeout_s)
            )
            self._handshakes[address] = fut
        await asyncio.shield(fut)

    # -- engine thread -------------------------------------------------------------------------

    def add(self, engine: LLMEngine, msg: PrefillRequest) -> None:
        """Queue the prompt; raises ``NodeRefused`` when the node's queue is full, ValueError for
        a request the engine can never serve."""
        self.state.check_room()
        params = msg.params
        # Only the first token is sampled here; stop strings are the decode node's concern.
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        engine.add_request(
            msg.request_id, None, params, prompt_token_ids=msg.prompt_token_ids, hold_blocks=True
        )
        self._landing[msg.request_id] = msg.landing
        self.state.track_deadline(msg.request_id, msg.deadline)

    def busy(self) -> bool:
        # ``transfers`` belongs to the event loop: one atomic ``len`` read, and it is filled before
        # the request reaches the engine and emptied after its send is over.
        return bool(self._landing or self._shipping or len(self.transfers))

    async def _renew_leases(self) -> None:
        """While a prompt is on this node, renew its decode lease three times per lease length.

        Runs on the event loop, not the engine thread, so long engine steps cannot delay it.
        """
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            due: dict[str, list[str]] = {}
            for request_id, (address, at, period) in list(self.renewals.items()):
                if now >= at:
                    due.setdefault(address, []).append(request_id)
                    self.renewals[request_id] = (address, now + period, period)
            for address, request_ids in due.items():
                self.sender.renew(address, self.state.info, request_ids)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        engine = self.state.engine
        for out in outputs:
            if not out.finished:
                continue
            landing = self._landing.pop(out.request_id, None)
            sent = self._blocks_sent.pop(out.request_id, 0)
            preemptions = self._preemptions.pop(out.request_id, 0)
            src = engine.held_block_ids(out.request_id)
            if landing is None or src is None:
                continue
            if engine.num_preemptions(out.request_id) != preemptions:
                sent = 0  # the blocks shipped early may have been reused before they were read
            completion = out.outputs[0]
            logprobs = completion.logprobs[0] if completion.logprobs else None
            commit = KVCommit(
                request_id=out.request_id,
                first_token=completion.token_ids[0],
                first_logprobs=LogprobsMsg.from_logprobs(logprobs) if logprobs else None,
                generator_state=engine.generator_state(out.request_id),
                num_cached_tokens=out.num_cached_tokens,
            )
            # The transport may read the blocks until the send is over, even after an abort.
            engine.pin_held(out.request_id)
            self._shipping.add(out.request_id)  # until _release
            started = time.monotonic()
            try:
                fut = self.sender.send(
                    landing.kv_address,
                    self.state.info,
                    out.request_id,
                    src[landing.first_block + sent :],
                    landing.block_ids[sent:],
                    commit,
                    self.state.node.kv_transfer_timeout_s,
                )
            except Exception as e:
                fut = Future()
                fut.set_exception(e)
            fut.add_done_callback(lambda f, rid=out.request_id, t=started: self._transfer_done(rid, f, t))

    def _ship_launched(self, chunks: list[LaunchedChunk], layer_events: list | None) -> None:
        """Ship the blocks a launched step fills (a finishing prompt's last, partial one too)."""
        block_size = self.state.engine.config.cache.block_size
        for chunk in chunks:
            request_id = chunk.request_id
            landing = self._landing.get(request_id)
            if landing is None:
                continue
            end = chunk.start + chunk.num_tokens
            filled = cdiv(end, block_size) if end >= chunk.num_prompt_tokens else end // block_size
            ready = min(filled - landing.first_block, len(landing.block_ids))
            sent = self._blocks_sent.get(request_id, 0)
            if chunk.num_preemptions != self._preemptions.get(request_id, 0):
                sent = self._blocks_sent[request_id] = 0  # shipped blocks may be reused before read
                self._preemptions[request_id] = chunk.num_preemptions
            if ready <= sent:
                continue
            first = landing.first_block
            src = chunk.block_ids[first + sent : first + ready]
            try:
                self.sender.send(
                    landing.kv_address,
                    self.state.info,
                    request_id,
                    src,
                    landing.block_ids[sent:ready],
                    None,
                    self.state.node.kv_transfer_timeout_s,
                    layer_events,
                )
            except Exception:  # the commit will report the missing blocks
                logger.exception("sending finished blocks of %s failed", request_id)
            self._blocks_sent[request_id] = ready

    def _transfer_done(self, request_id: str, fut: Future, started: float) -> None:
        if fut.exception() is None:
            self.state.metrics.transfer_seconds.observe(time.monotonic() - started)
        self.state.loop.submit(lambda engine: self._release(engine, request_id))
        self.state.loop.loop.call_soon_threadsafe(self._resolve, request_id, fut)

    def _release(self, engine: LLMEngine, request_id: str) -> None:
        """The send is over: the transport no longer reads the blocks (engine thread)."""
        self._shipping.discard(request_id)
        engine.unpin_held(request_id)
        engine.release_held(request_id)

    def _resolve(self, request_id: str, fut: Future) -> None:
        waiter = self.transfers.pop(request_id, None)
        if waiter is not None and not waiter.done():
            exc = fut.exception()
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(fut.result())

    def forget(self, request_id: str) -> None:
        self._landing.pop(request_id, None)
        self._blocks_sent.pop(request_id, None)
        self._preemptions.pop(request_id, None)
        # A last send in flight keeps its blocks pinned: ``NodeState.end_request`` releases them
        # right after this, the engine only once ``_release`` unpins them.

    def add_routes(self, app: FastAPI) -> None:
        add_prefill_routes(app, self)


def _validate(msg: PrefillRequest, block_size: int) -> str:
    landing = msg.landing
    if landing.request_id != msg.request_id:
        return "landing descriptor belongs to another request"
    if landing.num_prompt_tokens != len(msg.prompt_token_ids):
        n = len(msg.prompt_token_ids)
        return f"landing descriptor is for {landing.num_prompt_tokens} tokens, the prompt has {n}"
    num_blocks = cdiv(len(msg.prompt_token_ids), block_size)
    if not 0 <= landing.first_block < num_blocks:
        return f"landing descriptor starts at block {landing.first_block} of {num_blocks}"
    if len(landing.block_ids) != num_blocks - landing.first_block:
        return (
            f"landing descriptor has {len(landing.block_ids)} blocks for blocks {landing.first_block} to "
            f"{num_blocks - 1} of a {len(msg.prompt_token_ids)}-token prompt"
        )
    return ""


def create_app(engine_config: EngineConfig, node: NodeConfig) -> FastAPI:
    """A prefill node (``--role prefill``)."""
    state = NodeState(engine_config, node)
    state.services.append(PrefillService(state))
    return node_app(state)


def add_prefill_routes(app: FastAPI, service: PrefillService) -> None:
    state = service.state
    node = state.node

    def fail(msg: PrefillRequest, error: str) -> PrefillResult:
        logger.warning("prefill of %s failed: %s", msg.request_id, error)
        return PrefillResult(request_id=msg.request_id, ok=False, error=error)

    @app.post("/internal/prefill")
    async def prefill(request: Request):
        arrived = time.monotonic()
        check_token(request, node.cluster_token)
        msg: PrefillRequest = await read_message(request, PrefillRequest)
        error = _validate(msg, state.engine.config.cache.block_size)
        if error:
            return msgpack_response(fail(msg, error), 500)  # a cluster bug, not the client's
        rid = msg.request_id
        async with state.admission(msg.deadline):  # raises NodeRefused: 429, 503 or 504
            try:
                await service.handshake(msg.landing.kv_address)
            except KVTransferError as e:
                return msgpack_response(fail(msg, str(e)), 502)
            period = max(0.1, (msg.landing.lease_deadline - time.time()) / 3)
            service.renewals[rid] = (msg.landing.kv_address, time.monotonic() + period, period)
            try:
                outputs, transfer = await _add(msg)
            except ValueError as e:
                service.renewals.pop(rid, None)
                return msgpack_response(fail(msg, str(e)), 400)
            except BaseException:
                service.renewals.pop(rid, None)
                raise
        try:
            return await _prefill(msg, outputs, transfer, arrived)
        finally:
            service.renewals.pop(rid, None)

    async def _add(msg: PrefillRequest):
        """Queue the prompt in the engine; its output slot and the future of its KV send."""
        rid = msg.request_id
        outputs = state.loop.subscribe(rid)
        transfer = service.transfers[rid] = asyncio.get_running_loop().create_future()
        try:
            await state.loop.call(lambda e: service.add(e, msg))
        except BaseException as exc:
            state.loop.unsubscribe(rid)
            service.transfers.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError):  # the add may still run: undo it after
                gone = RequestStatus.FINISHED_ABORTED
                state.loop.submit(lambda e: state.end_request(rid, gone, "proxy gone"))
            raise
        return outputs, transfer

    async def _prefill(msg: PrefillRequest, outputs, transfer: asyncio.Future, arrived: float):
        rid = msg.request_id
        try:
            out = await outputs.get()
            state.metrics.prefill_seconds.observe(time.monotonic() - arrived)
            if out.outputs[0].finish_reason == "error":  # ended before its KV was sent: none will be
                service.transfers.pop(rid, None)
                return msgpack_response(fail(msg, str(out.outputs[0].stop_reason)), 500)
            await transfer
        except KVTransferError as e:
            return msgpack_response(fail(msg, str(e)), 502)
        except asyncio.CancelledError:  # the proxy hung up
            service.transfers.pop(rid, None)
            state.loop.submit(lambda e: state.end_request(rid, RequestStatus.FINISHED_ABORTED, "proxy gone"))
            raise
        finally:
            # This handler is the slot's only reader: once it returns, nothing reads the slot, and a
            # slot left behind would hold the node's drain until it expires.
            state.loop.unsubscribe(rid)
        return msgpack_response(
            PrefillResult(request_id=rid, ok=True, num_cached_tokens=out.num_cached_tokens)
        )
