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
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import ReservationTable
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import (
    LandingDescriptor,
    Reserve,
    Reserved,
    ReserveRequest,
    StartLocal,
    StreamRequest,
    TokenEvent,
)
from pdserve.node.channel import ChannelServer, Peer
from pdserve.node.core_client import CoreRefused
from pdserve.node.engine_loop import error_output
from pdserve.node.framework import NodeState, node_app
from pdserve.node.service import RETRY_AFTER_S, NodeRefused, NodeService, node_info
from pdserve.node.token_events import TokenEvents
from pdserve.prefill_node.server import PrefillService, add_prefill_calls

logger = logging.getLogger(__name__)

LEASE_EXPIRED = "the prompt's KV did not arrive within its lease"
MAX_LEASE_S = 600.0


class DecodeService(NodeService):
    """Takes requests, receives their prompt KV (or computes it here), generates and streams."""

    def __init__(self, state: NodeState) -> None:
        super().__init__(state)
        self.table: ReservationTable | None = None
        self.receiver = None
        # Local-prefill requests waiting for their stream, with a deadline.
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
            lane_port=node.kv_lane_port,
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

    def commands(self) -> dict:
        return {
            Reserve: self._reserve_call,
            StartLocal: lambda msg: self.start_local(self.state.engine, msg.request_id),
        }

    def _reserve_call(self, call: Reserve) -> Reserved:
        """The node's reserve (or local-prefill) call: the request's stream holds back text that
        could still become a stop string (``TokenEvents``), from its first output on."""
        msg = call.msg
        engine = self.state.engine
        if call.local:
            reserved = ([], 0) if self.accept_local(engine, msg, call.lease_deadline) else None
        else:
            reserved = self.reserve(engine, msg, call.lease_deadline)
        if reserved is None:
            return Reserved(False)
        hold = max((len(s) for s in msg.params.stop), default=1) - 1
        self.state.deltas[msg.request_id] = TokenEvents(hold)
        return Reserved(True, reserved[0], reserved[1])

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
        # Receiver thread: hand over to the engine loop.
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


def core_services(state) -> list[NodeService]:
    """The engine-side services of a decode node, or of a co-located one (``--role both``), built
    in its engine core process."""
    services: list[NodeService] = [DecodeService(state)]
    if state.node.role == Role.BOTH:
        services.append(PrefillService(state))
    return services


def create_app(engine_config: EngineConfig, node: NodeConfig) -> FastAPI:
    """A decode node (``--role decode``), or with ``--role both`` a co-located node that also
    prefills: it serves whole requests itself and can take either half for other nodes."""
    calls = [add_decode_calls] + ([add_prefill_calls] if node.role == Role.BOTH else [])
    return node_app(NodeState(engine_config, node, core_services, calls))


def add_decode_calls(channel: ChannelServer, state: NodeState) -> None:
    """The decode role's calls on the request channel (node process)."""

    async def reserve(peer: Peer, msg: ReserveRequest) -> LandingDescriptor:
        lease = min(max(msg.lease_s, 0.1), MAX_LEASE_S)
        deadline = time.time() + lease
        rid = msg.request_id
        async with state.admission(msg.deadline):  # raises NodeRefused: 429, 503 or 504
            state.subs.subscribe(rid)
            try:
                reserved: Reserved = await state.core.call(Reserve(msg, deadline, msg.local_prefill))
            except CoreRefused as e:
                state.subs.unsubscribe(rid)
                if e.kind == "value_error":
                    raise NodeRefused(400, e.message, "invalid_request_error") from None
                raise
            except BaseException as exc:
                state.subs.unsubscribe(rid)
                if isinstance(exc, asyncio.CancelledError):  # the reserve may still run: undo it after
                    state.end_request(rid, "proxy gone")
                raise
        if not reserved.ok:
            state.subs.unsubscribe(rid)
            message = "decode node has no free KV blocks for this prompt now"
            raise NodeRefused(503, message, "overloaded", RETRY_AFTER_S)
        return LandingDescriptor(
            request_id=rid,
            node_id=state.info.node_id,
            kv_address=state.info.kv_address,
            block_ids=reserved.block_ids,
            first_block=reserved.first_block,
            num_prompt_tokens=len(msg.prompt_token_ids),
            lease_deadline=0.0 if msg.local_prefill else deadline,
            local_prefill=msg.local_prefill,
        )

    async def stream(peer: Peer, msg: StreamRequest) -> None:
        """From now on the request's events go to ``peer``, batched per step."""
        rid = msg.request_id
        sub = state.subs.attach(rid)
        if sub is None:
            raise NodeRefused(404, f"no reserved request {rid!r} to stream", "not_found")
        peer.streams.add(rid)  # from here on, the peer leaving ends the request
        try:
            await state.core.call(StartLocal(rid))
        except asyncio.CancelledError:
            state.end_request(rid, "proxy gone")
            raise

        def sink(event: TokenEvent) -> None:
            channel.add_event(peer, event)

        def finished() -> None:
            peer.streams.discard(rid)
            state.subs.unsubscribe(rid)  # (a final output that came before us left it there)

        had_unread = bool(sub.events) or sub.finished
        sub.set_sink(sink, finished)
        if had_unread:
            channel.flush()

    channel.handle(ReserveRequest, reserve)
    channel.handle(StreamRequest, stream)
