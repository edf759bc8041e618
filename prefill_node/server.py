"""The prefill node: computes a prompt's KV and first token, pushes the KV into the decode node's blocks.

Per request (a ``PrefillRequest`` call on the request channel, carrying the decode node's landing
descriptor):

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
   sampler's state, cached-token count) and waits for the decode node's ack; the call's
   reply is that outcome. The proxy worker leaving (or an abort) ends the prefill.

Blocks are shipped from the engine step that computes them, right after its forward was
launched (``LLMEngine.add_launch_listener``): on CUDA with one event per layer, so the
transport moves the first layers while the GPU still computes the last ones, and a prompt
prefilled in chunks ships each chunk's full blocks while the next chunk runs. The commit
follows after the step. A preempted prompt's blocks may be reused before such a chunk was
read, so after a preemption its blocks are shipped again from the first one.

Each prompt in flight is one ``Shipment``: where its KV goes, what was shipped, its lease
renewals and the future its call handler waits on, each field written by one thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from fastapi import FastAPI

from pdserve import kv_transfer
from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import LaunchedChunk, RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import KVHandshakeRefused, KVTransferError
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import (
    LandingDescriptor,
    LogprobsMsg,
    PrefillRequest,
    PrefillResult,
)
from pdserve.node.channel import ChannelServer, Peer
from pdserve.node.framework import (
    NodeRefused,
    NodeService,
    NodeState,
    node_app,
)
from pdserve.node.token_events import logprobs_msgs
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a shipment is, as the engine thread sees it."""

    ADMITTED = "admitted"
    """The call handler took the prompt; the engine has not queued it yet."""
    PREFILLING = "prefilling"
    """The engine runs the prompt; each launched step ships the blocks it fills."""
    SENDING = "sending"
    """The first token is out and the last send (with the commit) is in flight: the engine keeps
    the blocks pinned, even through an abort, until the send is over."""
    DONE = "done"
    """The send is over and the blocks released, or the request ended before its last send."""


@dataclass(eq=False)
class Shipment:
    """One prompt's KV on its way to a decode node, from its admission until its call handler returns.

    Threads: the event loop creates it and owns its membership in ``PrefillService.shipments``
    (it alone adds and removes; the engine thread only looks ids up there). Each field below says
    which thread writes it; the other thread does not read it.
    """

    request_id: str
    landing: LandingDescriptor
    """Where the KV goes: the decode node's blocks and address (never changes)."""
    transfer: asyncio.Future | None = None
    """Event loop: the outcome of the last send, the decode node's ack or a ``KVTransferError``
    (None only where no call handler waits, as in tests that drive the service directly)."""
    renew_at: float = 0.0
    """Event loop: when the decode node's lease is renewed next (``time.monotonic``)."""
    renew_every: float = 0.0
    """Event loop: a third of the lease's length."""
    stage: Stage = Stage.ADMITTED
    """Engine thread (set by the event loop only when created)."""
    num_blocks_sent: int = 0
    """Engine thread: leading landing blocks shipped from launched steps."""
    num_preemptions: int = 0
    """Engine thread: the prompt's preemptions when those blocks were shipped; after another one
    they may have been reused before they were read, and are shipped again."""


class PrefillService(NodeService):
    """Computes prompts whose decode happens on another node, and ships their KV there."""

    def __init__(self, state: NodeState) -> None:
        super().__init__(state)
        self.sender = None
        self.shipments: dict[str, Shipment] = {}
        """Request id -> its shipment; added and removed on the event loop only (``open``, ``close``)."""
        self._renewer: asyncio.Task | None = None
        self._handshakes: dict[str, asyncio.Future] = {}  # event loop only: decode KV address -> handshake

    def start(self, transport: str) -> str:
        self.sender = kv_transfer.create_sender(
            transport, cluster_token=self.state.node.cluster_token, options=self.state.kv_options
        )
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

    # -- event loop ----------------------------------------------------------------------------

    async def handshake(self, address: str) -> None:
        """Once per decode node; a refusal (``KVHandshakeRefused``) is remembered and repeated for
        every request, other failures are tried again by the next request."""
        fut = self._handshakes.get(address)
        if fut is None or (
            fut.done() and fut.exception() is not None and not isinstance(fut.exception(), KVHandshakeRefused)
        ):
            fut = self._handshakes[address] = asyncio.ensure_future(self._handshake(address))
        await asyncio.shield(fut)

    async def _handshake(self, address: str) -> None:
        timeout = self.state.node.kv_transfer_timeout_s
        await asyncio.to_thread(self.sender.handshake, address, self.state.info, timeout)

    def open(self, msg: PrefillRequest) -> Shipment:
        """Track a prompt from its admission on: its lease is renewed from now. Raises ValueError
        for a request id already in flight here."""
        rid = msg.request_id
        if rid in self.shipments:
            raise ValueError(f"duplicate request id {rid!r}")
        period = max(0.1, (msg.landing.lease_deadline - time.time()) / 3)
        shipment = Shipment(
            rid,
            msg.landing,
            transfer=asyncio.get_running_loop().create_future(),
            renew_at=time.monotonic() + period,
            renew_every=period,
        )
        self.shipments[rid] = shipment
        return shipment

    def close(self, shipment: Shipment) -> None:
        """The prompt's call handler is done with it: its lease is no longer renewed, and the
        outcome of a send still in flight has no one to go to."""
        if self.shipments.get(shipment.request_id) is shipment:
            del self.shipments[shipment.request_id]
        if shipment.transfer is not None and not shipment.transfer.done():
            shipment.transfer.cancel()

    async def _renew_leases(self) -> None:
        """While a prompt is on this node, renew its decode lease three times per lease length.

        Runs on the event loop, not the engine thread, so long engine steps cannot delay it.
        """
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            due: dict[str, list[str]] = {}
            for shipment in list(self.shipments.values()):
                if now >= shipment.renew_at:
                    due.setdefault(shipment.landing.kv_address, []).append(shipment.request_id)
                    shipment.renew_at = now + shipment.renew_every
            for address, request_ids in due.items():
                self.sender.renew(address, self.state.info, request_ids)

    def _resolve(self, shipment: Shipment, fut: Future) -> None:
        """The send is over: its outcome goes to the call handler waiting for it."""
        waiter = shipment.transfer
        if waiter is not None and not waiter.done():
            exc = fut.exception()
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(fut.result())

    # -- engine thread -------------------------------------------------------------------------

    def add(self, engine: LLMEngine, msg: PrefillRequest, shipment: Shipment) -> None:
        """Queue the prompt of a shipment ``open`` made; raises ``NodeRefused`` when the node's
        queue is full, ValueError for a request the engine can never serve."""
        self.state.check_room()
        # Only the first token (of the first sequence) is sampled here; stop strings and the other
        # sequences of a parallel-sampling request are the decode node's concern.
        params = msg.params.for_sequence(0)
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        engine.add_request(
            msg.request_id, None, params, prompt_token_ids=msg.prompt_token_ids, hold_blocks=True
        )
        shipment.stage = Stage.PREFILLING
        self.state.track_deadline(msg.request_id, msg.deadline)

    def busy(self) -> bool:
        # One atomic ``len`` of the event loop's dict: a shipment is there from before its prompt
        # reaches the engine until its handler returns; a send still in flight after that keeps
        # its blocks pinned in the engine, which keeps the node busy too.
        return bool(len(self.shipments))

    def _prefilling(self, request_id: str) -> Shipment | None:
        shipment = self.shipments.get(request_id)
        return shipment if shipment is not None and shipment.stage is Stage.PREFILLING else None

    def after_step(self, outputs: list[RequestOutput]) -> None:
        engine = self.state.engine
        for out in outputs:
            if not out.finished:
                continue
            shipment = self._prefilling(out.request_id)
            if shipment is None:
                continue
            shipment.stage = Stage.DONE  # unless the last send starts below
            src = engine.held_block_ids(out.request_id)
            if src is None:
                continue
            landing = shipment.landing
            sent = shipment.num_blocks_sent
            if engine.num_preemptions(out.request_id) != shipment.num_preemptions:
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
            shipment.stage = Stage.SENDING  # until _release
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
            fut.add_done_callback(lambda f, s=shipment, t=started: self._transfer_done(s, f, t))

    def _ship_launched(self, chunks: list[LaunchedChunk], layer_events: list | None) -> None:
        """Ship the blocks a launched step fills (a finishing prompt's last, partial one too)."""
        block_size = self.state.engine.config.cache.block_size
        for chunk in chunks:
            shipment = self._prefilling(chunk.request_id)
            if shipment is None:
                continue
            landing = shipment.landing
            end = chunk.start + chunk.num_tokens
            filled = cdiv(end, block_size) if end >= chunk.num_prompt_tokens else end // block_size
            ready = min(filled - landing.first_block, len(landing.block_ids))
            if chunk.num_preemptions != shipment.num_preemptions:
                shipment.num_blocks_sent = 0  # shipped blocks may be reused before read
                shipment.num_preemptions = chunk.num_preemptions
            sent = shipment.num_blocks_sent
            if ready <= sent:
                continue
            first = landing.first_block
            try:
                self.sender.send(
                    landing.kv_address,
                    self.state.info,
                    chunk.request_id,
                    chunk.block_ids[first + sent : first + ready],
                    landing.block_ids[sent:ready],
                    None,
                    self.state.node.kv_transfer_timeout_s,
                    layer_events,
                )
            except Exception:  # the commit will report the missing blocks
                logger.exception("sending finished blocks of %s failed", chunk.request_id)
            shipment.num_blocks_sent = ready

    def _transfer_done(self, shipment: Shipment, fut: Future, started: float) -> None:
        # The sender's thread (or the engine thread when the send failed at once).
        if fut.exception() is None:
            self.state.metrics.transfer_seconds.observe(time.monotonic() - started)
        self.state.loop.submit(lambda engine: self._release(engine, shipment))
        self.state.loop.loop.call_soon_threadsafe(self._resolve, shipment, fut)

    def _release(self, engine: LLMEngine, shipment: Shipment) -> None:
        """The send is over: the transport no longer reads the blocks (engine thread)."""
        shipment.stage = Stage.DONE
        engine.unpin_held(shipment.request_id)
        engine.release_held(shipment.request_id)

    def forget(self, request_id: str) -> None:
        # Nothing more is shipped from its steps. A last send in flight keeps its blocks pinned
        # (``NodeState.end_request`` releases them right after this, the engine only at the unpin).
        shipment = self._prefilling(request_id)
        if shipment is not None:
            shipment.stage = Stage.DONE

    def add_calls(self, channel: ChannelServer) -> None:
        add_prefill_calls(channel, self)


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


def add_prefill_calls(channel: ChannelServer, service: PrefillService) -> None:
    state = service.state

    def fail(msg: PrefillRequest, status: int, error: str) -> NodeRefused:
        logger.warning("prefill of %s failed: %s", msg.request_id, error)
        return NodeRefused(status, error, "prefill_failed")

    async def prefill(peer: Peer, msg: PrefillRequest) -> PrefillResult:
        """Answers once the KV is committed on the decode node (or failed)."""
        arrived = time.monotonic()
        error = _validate(msg, state.engine.config.cache.block_size)
        if error:
            raise fail(msg, 500, error)  # a cluster bug, not the client's
        async with state.admission(msg.deadline):  # raises NodeRefused: 429, 503 or 504
            try:
                await service.handshake(msg.landing.kv_address)
            except KVTransferError as e:
                raise fail(msg, 502, str(e)) from None
            try:
                shipment = service.open(msg)  # its lease is renewed from now on
            except ValueError as e:
                raise fail(msg, 400, str(e)) from None
            try:
                outputs = await _add(msg, shipment)
            except ValueError as e:
                service.close(shipment)
                raise fail(msg, 400, str(e)) from None
            except BaseException:
                service.close(shipment)
                raise
        try:
            return await _prefill(msg, outputs, shipment.transfer, arrived)
        finally:
            service.close(shipment)

    async def _add(msg: PrefillRequest, shipment: Shipment):
        """Queue the prompt in the engine; its output slot."""
        rid = msg.request_id
        outputs = state.loop.subscribe(rid)
        try:
            await state.loop.call(lambda e: service.add(e, msg, shipment))
        except BaseException as exc:
            state.loop.unsubscribe(rid)
            if isinstance(exc, asyncio.CancelledError):  # the add may still run: undo it after
                gone = RequestStatus.FINISHED_ABORTED
                state.loop.submit(lambda e: state.end_request(rid, gone, "proxy gone"))
            raise
        return outputs

    async def _prefill(msg: PrefillRequest, outputs, transfer: asyncio.Future, arrived: float):
        rid = msg.request_id
        try:
            out = await outputs.get()
            state.metrics.prefill_seconds.observe(time.monotonic() - arrived)
            if out.outputs[0].finish_reason == "error":  # ended before its KV was sent: none will be
                raise fail(msg, 500, str(out.outputs[0].stop_reason))
            await transfer
        except KVTransferError as e:
            raise fail(msg, 502, str(e)) from None
        except asyncio.CancelledError:  # the proxy left (or aborted the call)
            state.loop.submit(lambda e: state.end_request(rid, RequestStatus.FINISHED_ABORTED, "proxy gone"))
            raise
        finally:
            # This handler is the slot's only reader: once it returns, nothing reads the slot, and a
            # slot left behind would hold the node's drain until it expires.
            state.loop.unsubscribe(rid)
        prompt_logprobs = None if out.prompt_logprobs is None else logprobs_msgs(out.prompt_logprobs)
        return PrefillResult(
            request_id=rid,
            ok=True,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    channel.handle(PrefillRequest, prefill)
