"""The decode node: reserves blocks under a lease, receives KV, runs continuous batches, streams tokens.

Per request (see pdserve/messages.py for the numbered protocol):

1. ``ReserveRequest`` (a call on the request channel): the engine reserves blocks for the prompt
   (``WAITING_FOR_REMOTE_KV``) and the reservation table records them with a deadline;
   the answer is the landing descriptor. Subscribing to the request's outputs happens
   here too, so no token can be produced before someone listens. With ``local_prefill``
   the prompt is queued here instead (a short prompt, most of it cached here, or a
   co-located node): no KV arrives and steps 3-4 do not apply.
2. ``StreamRequest``: the request's token events go to the proxy worker that asked, batched with
   its other streams' events once per engine step. The worker leaving aborts the request.
3. The KV receiver thread validates and writes frames; on commit the engine thread
   moves the request into the batch with its first token.
4. A lease that runs out before the commit, or an abort, releases the reservation
   (late frames are then refused) and frees the blocks; the stream ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI

from pdserve import kv_transfer
from pdserve.config import EngineConfig, NodeConfig, Role
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import ReservationTable
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import (
    LandingDescriptor,
    ReserveRequest,
    StreamRequest,
)
from pdserve.node.channel import ChannelServer, Peer
from pdserve.node.engine_loop import error_output
from pdserve.node.framework import (
    RETRY_AFTER_S,
    NodeRefused,
    NodeService,
    NodeState,
    node_app,
    node_info,
)
from pdserve.node.token_events import TokenEvents
from pdserve.prefill_node.server import PrefillService

logger = logging.getLogger(__name__)

LEASE_EXPIRED = "the prompt's KV did not arrive within its lease"
MAX_LEASE_S = 600.0


class DecodeService(NodeService):
    """Takes requests, receives their prompt KV (or computes it here), generates and streams."""

    def __init__(self, state: NodeState) -> None:
        super().__init__(state)
        self.table: ReservationTable | None = None
        self.receiver = None
        self.holdback: dict[str, int] = {}  # event loop only: text held back near stop strings
        # Engine thread only: local-prefill requests waiting for their stream, with a deadline.
        self.pending_local: dict[str, tuple[ReserveRequest, float]] = {}

    def start(self, transport: str) -> str:
        state = self.state
        engine = state.engine
        self.table = ReservationTable(engine.arch.num_layers)
        node = state.node
        self.receiver = kv_transfer.create_receiver(
            transport,
            host=node.kv_host,
            port=node.kv_port,
            cluster_token=node.cluster_token,
            options=state.kv_options,
        )
        self.receiver.register_kv_cache(engine.kv_cache)
        provisional = node_info(engine, node, state.role, transport, "")
        return self.receiver.start(provisional, self.table, self._on_commit)

    @property
    def transfer_bytes(self) -> int:
        return self.receiver.bytes_received if self.receiver is not None else 0

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    # -- engine thread -------------------------------------------------------------------------

    def reserve(
        self, engine: LLMEngine, msg: ReserveRequest, deadline: float
    ) -> tuple[list[int], int] | None:
        """Reserve blocks for KV computed elsewhere: (the blocks it must land in, the index of the
        prompt block the first of them takes); None when the node has too few free now.

        The prompt's cached prefix here is shared, not sent: only the blocks after it enter the
        reservation table, so no KV message can ever write a block other requests may read.
        Raises ``NodeRefused`` when the node's queue is full."""
        self.state.check_room()
        block_ids = engine.reserve_remote(msg.request_id, msg.prompt_token_ids, msg.params)
        if block_ids is None:
            return None
        first = engine.num_computed_tokens(msg.request_id) // engine.config.cache.block_size
        self.table.add(msg.request_id, block_ids[first:], deadline)
        self.state.track_deadline(msg.request_id, msg.deadline)
        return block_ids[first:], first

    def accept_local(self, engine: LLMEngine, msg: ReserveRequest, deadline: float) -> bool:
        """Take a prompt to be computed here once its stream opens (so no output can come before
        anyone listens); False when the blocks it needs are not free now. Raises ValueError for a
        request the engine can never serve."""
        engine.validate_request(msg.request_id, msg.prompt_token_ids, msg.params)
        self.state.check_room()
        # The prompt, and a block of its own for each forked sequence (parallel sampling).
        num_blocks = engine.blocks_for_tokens(len(msg.prompt_token_ids) + 1) + msg.params.num_sequences - 1
        if num_blocks > engine.num_free_blocks:
            return False
        self.pending_local[msg.request_id] = (msg, deadline)
        self.state.track_deadline(msg.request_id, msg.deadline)
        return True

    def start_local(self, engine: LLMEngine, request_id: str) -> None:
        """The stream of a locally prefilled request is open: queue its prompt."""
        pending = self.pending_local.pop(request_id, None)
        if pending is not None:
            msg = pending[0]
            engine.add_request(request_id, None, msg.params, prompt_token_ids=msg.prompt_token_ids)

    def _on_commit(self, commit: KVCommit) -> None:
        # Receiver thread: hand over to the engine thread.
        self.state.loop.submit(lambda engine: self._landed(engine, commit))

    def _landed(self, engine: LLMEngine, commit: KVCommit) -> None:
        self.table.release(commit.request_id)
        logprobs = commit.first_logprobs.to_logprobs() if commit.first_logprobs else None
        output = engine.remote_kv_landed(
            commit.request_id, commit.first_token, logprobs, commit.generator_state, commit.num_cached_tokens
        )
        if output is not None:
            self.state.loop.publish(output)

    def on_idle(self) -> None:
        for request_id in self.table.expired():
            self.state.end_request(request_id, RequestStatus.FINISHED_ERROR, LEASE_EXPIRED)
        now = time.time()
        for request_id in [r for r, (_, deadline) in self.pending_local.items() if deadline < now]:
            del self.pending_local[request_id]  # its stream never opened
            self.state.loop.publish(error_output(request_id, "the token stream was not opened in time"))

    def forget(self, request_id: str) -> None:
        """Release the reservation first, so late frames are refused before the blocks are freed."""
        self.table.release(request_id)
        self.pending_local.pop(request_id, None)

    def holds(self, request_id: str) -> bool:
        return request_id in self.pending_local

    def held_ids(self) -> list[str]:
        return list(self.pending_local)

    @property
    def num_waiting(self) -> int:
        return len(self.pending_local)

    def add_calls(self, channel: ChannelServer) -> None:
        add_decode_calls(channel, self)


def create_app(engine_config: EngineConfig, node: NodeConfig) -> FastAPI:
    """A decode node (``--role decode``), or with ``--role both`` a co-located node that also
    prefills: it serves whole requests itself and can take either half for other nodes."""
    state = NodeState(engine_config, node)
    state.services.append(DecodeService(state))
    if node.role == Role.BOTH:
        state.services.append(PrefillService(state))
    return node_app(state)


def add_decode_calls(channel: ChannelServer, service: DecodeService) -> None:
    state = service.state
    holdback = service.holdback

    async def reserve(peer: Peer, msg: ReserveRequest) -> LandingDescriptor:
        lease = min(max(msg.lease_s, 0.1), MAX_LEASE_S)
        deadline = time.time() + lease
        async with state.admission(msg.deadline):  # raises NodeRefused: 429, 503 or 504
            state.loop.subscribe(msg.request_id)
            try:
                if msg.local_prefill:
                    taken = await state.loop.call(lambda e: service.accept_local(e, msg, deadline))
                    reserved = ([], 0) if taken else None
                else:
                    reserved = await state.loop.call(lambda e: service.reserve(e, msg, deadline))
            except ValueError as e:
                state.loop.unsubscribe(msg.request_id)
                raise NodeRefused(400, str(e), "invalid_request_error") from None
            except BaseException:
                state.loop.unsubscribe(msg.request_id)
                raise
        if reserved is None:
            state.loop.unsubscribe(msg.request_id)
            message = "decode node has no free KV blocks for this prompt now"
            raise NodeRefused(503, message, "overloaded", RETRY_AFTER_S)
        holdback[msg.request_id] = max((len(s) for s in msg.params.stop), default=1) - 1
        return LandingDescriptor(
            request_id=msg.request_id,
            node_id=state.info.node_id,
            kv_address=state.info.kv_address,
            block_ids=reserved[0],
            first_block=reserved[1],
            num_prompt_tokens=len(msg.prompt_token_ids),
            lease_deadline=0.0 if msg.local_prefill else deadline,
            local_prefill=msg.local_prefill,
        )

    async def stream(peer: Peer, msg: StreamRequest) -> None:
        """From now on the request's outputs go to ``peer`` as token events, batched per step."""
        rid = msg.request_id
        slot = state.loop.attach(rid)
        if slot is None:
            raise NodeRefused(404, f"no reserved request {rid!r} to stream", "not_found")
        hold = holdback.pop(rid, 0)
        peer.streams.add(rid)  # from here on, the peer leaving ends the request
        try:
            await state.loop.call(lambda e: service.start_local(e, rid))
        except asyncio.CancelledError:
            state.loop.submit(lambda e: state.end_request(rid, RequestStatus.FINISHED_ABORTED, "proxy gone"))
            raise

        deltas = TokenEvents(hold)

        def sink(out: RequestOutput) -> None:
            for event in deltas.events(out):
                channel.add_event(peer, event)
            if out.finished:
                peer.streams.discard(rid)
                state.loop.unsubscribe(rid)  # (a final output that came before us left it there)

        unread = slot.take()
        slot.sink = sink
        if unread is not None:
            sink(unread)
            channel.flush()

    channel.handle(ReserveRequest, reserve)
    channel.handle(StreamRequest, stream)
