"""The prefill node: computes a prompt's KV and first token, pushes the KV into the decode node's blocks.

Per request (a ``PrefillRequest`` call on the request channel, carrying the decode node's landing
descriptor, or without it while the decode node still reserves: a ``PrefillLanding`` call brings it
then, and the prompt is computed meanwhile):

1. Handshake with that decode node's KV receiver once (mismatches are refused then).
2. The engine runs the prompt like any other — batched, chunked, reusing cached prefix
   blocks — with ``max_tokens=1`` and ``hold_blocks``: when its first token is sampled
   the request finishes but keeps its blocks.
3. Right after that step, on the engine thread, the sender takes the blocks (nothing can
   evict them before). The transport may read them in place (nixl), so the service pins them
   in the engine (``LLMEngine.pin_held``) until the sender releases them
   (``KVSendFuture.released``), even if the request is aborted meanwhile; then they stay in the
   prefix cache for later prompts.
   A prompt whose landing has not come yet keeps its blocks after its first token (stage
   ``LANDING``) and ships them when it does; one that waits longer than the KV transfer timeout
   fails and frees them.
4. The sender delivers the KV and the commit (first token, its logprobs, the seeded
   sampler's state, cached-token count) and waits for the decode node's ack; the call's
   reply is that outcome (a ``TransferDone`` from the engine core), as soon as it is known: a send
   to a dead or stuck decode node fails at its timeout, so the proxy can move the request on,
   while its blocks stay pinned until no READ offered to that node can run any more. The proxy
   worker leaving (or an abort) ends the prefill.

``PrefillService`` runs in the node's engine core process (``pdserve.node.engine_core``): the
sender, the shipments and the lease renewals live beside the engine; the call handler
(``add_prefill_calls``) runs in the node process and reaches it through typed commands
(``AddPrefill``, which handshakes with the decode node first, ``LandPrefill`` for a landing that
came later, and ``ClosePrefill``).

Blocks are shipped from the engine step that computes them, right after its forward was
launched (``LLMEngine.add_launch_listener``): on CUDA with one event per layer, so the
transport moves the first layers while the GPU still computes the last ones, and a prompt
prefilled in chunks ships each chunk's full blocks while the next chunk runs. The commit
follows after the step. A preempted prompt's blocks may be reused before such a chunk was
read, so after a preemption its blocks are shipped again from the first one.

Each prompt in flight is one ``Shipment``: where its KV goes and what was shipped, each field
written by one thread. Its decode lease is renewed by a thread of its own (``leases.LeaseKeeper``),
from the moment the landing is read off the node's command socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI

from pdserve import kv_transfer
from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import LaunchedChunk, RequestOutput
from pdserve.kv_transfer import KVHandshakeRefused, KVSendFuture
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import (
    AddPrefill,
    ClosePrefill,
    LandingDescriptor,
    LandPrefill,
    LogprobsMsg,
    PrefillLanding,
    PrefillRequest,
    PrefillResult,
    TransferDone,
)
from pdserve.node.channel import ChannelServer, Peer
from pdserve.node.core_client import CoreRefused
from pdserve.node.framework import NodeState, node_app
from pdserve.node.service import NodeRefused, NodeService
from pdserve.prefill_node.leases import LeaseKeeper
from pdserve.utils import cdiv, wait_at_most

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a shipment is, as the engine thread sees it."""

    ADMITTED = "admitted"
    """The call handler took the prompt; the engine has not queued it yet."""
    PREFILLING = "prefilling"
    """The engine runs the prompt; each launched step ships the blocks it fills (once its landing
    is known)."""
    LANDING = "landing"
    """The first token is out, the blocks are held, the landing descriptor has not come yet: the
    last send starts when it does (``PrefillService.land``)."""
    SENDING = "sending"
    """The first token is out and the last send (with the commit) is in flight: the engine keeps
    the blocks pinned, even through an abort, until the sender releases them."""
    DONE = "done"
    """The send's outcome is known (its blocks are freed once the sender released them too), or
    the request ended before its last send."""


@dataclass(eq=False)
class Shipment:
    """One prompt's KV on its way to a decode node, from its admission until its call handler returns.

    Threads (all in the engine core process): the engine loop creates it and owns its membership
    in ``PrefillService.shipments`` (``open``, ``close``). Each field below says which thread
    writes it."""

    request_id: str
    landing: LandingDescriptor | None
    """Engine loop: where the KV goes, the decode node's blocks and address; None until a landing
    sent after the prompt comes (then never changes)."""
    stage: Stage = Stage.ADMITTED
    """Engine loop."""
    num_blocks_sent: int = 0
    """Engine loop: leading landing blocks shipped from launched steps."""
    num_preemptions: int = 0
    """Engine loop: the prompt's preemptions when those blocks were shipped; after another one
    they may have been reused before they were read, and are shipped again."""
    commit: KVCommit | None = None
    """Engine loop: the last send's commit (first token, sampler state), from the prompt's last step."""


class PrefillService(NodeService):
    """Computes prompts whose decode happens on another node, and ships their KV there."""

    RENEW_TICK_S = 0.05
    UNCONFIRMED_LEASE_S = 60.0
    """A landing read off the command socket is renewed this long at most before the engine loop
    takes it (``LeaseKeeper``); it confirms or drops it well before, unless the core is stuck."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.sender = None
        self.shipments: dict[str, Shipment] = {}
        """Request id -> its shipment; added and removed on the engine loop only (``open``, ``close``)."""
        self.leases = LeaseKeeper(self.UNCONFIRMED_LEASE_S)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._handshakes: dict[str, Future] = {}  # engine loop only: decode KV address -> handshake
        self._awaiting_handshake: set[str] = set()  # engine loop only: prompts added once it ends
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")

    def start(self, transport: str) -> str:
        self.sender = kv_transfer.create_sender(
            transport,
            cluster_token=self.state.node.cluster_token,
            options=self.state.kv_options,
            connections=self.state.node.kv_send_connections,
        )
        self.sender.register_kv_cache(self.state.engine.kv_cache)
        self.state.engine.add_launch_listener(self._ship_launched)
        return ""

    def ready(self) -> None:
        self._renewer = threading.Thread(target=self._renew_leases, name="lease-renewer", daemon=True)
        self._renewer.start()

    @property
    def transfer_bytes(self) -> int:
        return self.sender.bytes_sent if self.sender is not None else 0

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()

    def commands(self) -> dict:
        return {
            AddPrefill: self._add_call,
            LandPrefill: self._land_call,
            ClosePrefill: lambda msg: self.close(msg.request_id),
        }

    def early(self, body) -> None:
        """A landing's lease is renewed from when its command is read, not when the engine loop
        takes it (``leases``)."""
        if isinstance(body, AddPrefill):
            landing = body.msg.landing
        elif isinstance(body, LandPrefill):
            landing = body.landing
        else:
            landing = None
        if landing is not None:
            self.leases.keep(landing, confirmed=False)

    # -- engine loop ---------------------------------------------------------------------------

    def handshake(self, address: str) -> Future:
        """Once per decode node, on a thread; a refusal (``KVHandshakeRefused``) is remembered and
        repeated for every request, other failures are tried again by the next request."""
        fut = self._handshakes.get(address)
        if fut is None or (
            fut.done() and fut.exception() is not None and not isinstance(fut.exception(), KVHandshakeRefused)
        ):
            timeout = self.state.node.kv_transfer_timeout_s
            fut = self._handshakes[address] = self._pool.submit(
                self.sender.handshake, address, self.state.info, timeout
            )
        return fut

    def _add_call(self, call: AddPrefill) -> Future | None:
        """The node's prefill: handshake with its decode node first (once per node; one call, not
        two, so a prompt costs one round trip to the core), then open its shipment and queue it
        (``_after_handshake``); a prompt ended (``forget``, ``close``) while it waits is not added."""
        msg = call.msg
        if msg.landing is None:  # it follows (``_land_call``): the prompt starts now
            self._open_and_add(msg)
            return None
        rid = msg.request_id
        self._awaiting_handshake.add(rid)

        def still_wanted() -> bool:
            if rid not in self._awaiting_handshake:
                return False
            self._awaiting_handshake.discard(rid)
            return True

        return self._after_handshake(
            msg.landing.kv_address, rid, still_wanted, lambda: self._open_and_add(msg)
        )

    def _after_handshake(
        self, address: str, rid: str, still_wanted: Callable[[], bool], then: Callable[[], None]
    ) -> Future | None:
        """Run ``then`` (engine loop) once the handshake with the decode node at ``address``
        succeeded and the prompt is ``still_wanted``: at once (None) when that handshake already
        ended, raising its failure; else when it ends, answering the returned Future."""
        shaken = self.handshake(address)

        def run() -> None:
            if not still_wanted():
                self.leases.drop(rid)
                why = f"prefill {rid!r} ended before its decode node's handshake did"
                raise NodeRefused(499, why, "cancelled")
            if shaken.exception() is not None:
                self.leases.drop(rid)
                raise shaken.exception()
            then()

        if shaken.done():
            run()
            return None
        answer: Future = Future()

        def finish(engine: LLMEngine) -> None:
            try:
                run()
            except BaseException as exc:  # noqa: BLE001 - the answer carries it
                answer.set_exception(exc)
            else:
                answer.set_result(None)

        shaken.add_done_callback(lambda _: self.state.loop.submit(finish))
        return answer

    def _open_and_add(self, msg: PrefillRequest) -> None:
        shipment = self.open(msg)  # its lease is renewed from now on
        try:
            self.add(self.state.engine, msg, shipment)
        except BaseException:
            self.close(msg.request_id)
            raise

    def open(self, msg: PrefillRequest) -> Shipment:
        """Track a prompt from its admission on: its lease is renewed from now. Raises ValueError
        for a request id already in flight here."""
        rid = msg.request_id
        if rid in self.shipments:
            raise ValueError(f"duplicate request id {rid!r}")
        shipment = self.shipments[rid] = Shipment(rid, None)
        if msg.landing is not None:
            self._set_landing(shipment, msg.landing)
        return shipment

    def _set_landing(self, shipment: Shipment, landing: LandingDescriptor) -> None:
        self.leases.keep(landing, confirmed=True)  # renewed already if its command was read
        shipment.landing = landing

    def _land_call(self, call: LandPrefill) -> Future | None:
        """A landing that came after its prompt (``PrefillLanding``): handshake with its decode
        node first (once per node), then ``land`` (``_after_handshake``); 404 when no prompt of
        that id awaits a landing here."""
        landing = call.landing
        rid = landing.request_id
        shipment = self.shipments.get(rid)

        def still_wanted() -> bool:
            return (
                self.shipments.get(rid) is shipment
                and shipment.landing is None
                and shipment.stage is not Stage.DONE
            )

        if shipment is None or not still_wanted():
            if shipment is None or shipment.landing is None:  # else: renewed for its own landing
                self.leases.drop(rid)
            raise NodeRefused(404, f"no prefill of {rid!r} awaits a landing here", "not_found")
        return self._after_handshake(
            landing.kv_address, rid, still_wanted, lambda: self.land(shipment, landing)
        )

    def land(self, shipment: Shipment, landing: LandingDescriptor) -> None:
        """The shipment's landing is known: its lease is renewed from now, the blocks its next
        launched steps fill are shipped, and if its first token is out already the last send
        starts now."""
        self._set_landing(shipment, landing)
        if shipment.stage is Stage.LANDING:
            self._send_last(self.state.engine, shipment)

    def close(self, request_id: str) -> None:
        """The prompt's call handler is done with it: its lease is no longer renewed, and the
        outcome of a send still in flight has no one to go to. Blocks held for a landing that
        never came are freed."""
        self._awaiting_handshake.discard(request_id)
        self.leases.drop(request_id)
        shipment = self.shipments.pop(request_id, None)
        if shipment is not None and shipment.stage is Stage.LANDING:
            shipment.stage = Stage.DONE
            self.state.engine.release_held(request_id)

    def _renew_leases(self) -> None:
        """While a prompt is on this node, renew its decode lease three times per lease length
        (``leases``). A thread of its own, not the engine loop, so long engine steps cannot delay it."""
        while not self._stop.wait(self.RENEW_TICK_S):
            for address, request_ids in self.leases.due().items():
                try:
                    self.sender.renew(address, self.state.info, request_ids)
                except Exception:
                    logger.exception("renewing leases at %s failed", address)

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
        # A shipment is there from before its prompt reaches the engine until its handler returns
        # (``ClosePrefill``); a send still in flight after that keeps its blocks pinned in the
        # engine, which keeps the node busy too.
        return bool(self.shipments)

    def _prefilling(self, request_id: str, *stages: Stage) -> Shipment | None:
        shipment = self.shipments.get(request_id)
        wanted = stages or (Stage.PREFILLING,)
        return shipment if shipment is not None and shipment.stage in wanted else None

    def after_step(self, outputs: list[RequestOutput]) -> None:
        engine = self.state.engine
        for out in outputs:
            if not out.finished:
                continue
            shipment = self._prefilling(out.request_id)
            if shipment is None:
                continue
            shipment.stage = Stage.DONE  # unless the last send starts (or waits) below
            if engine.held_block_ids(out.request_id) is None:
                continue
            completion = out.outputs[0]
            logprobs = completion.logprobs[0] if completion.logprobs else None
            shipment.commit = KVCommit(
                request_id=out.request_id,
                first_token=completion.token_ids[0],
                first_logprobs=LogprobsMsg.from_logprobs(logprobs) if logprobs else None,
                generator_state=engine.generator_state(out.request_id),
                num_cached_tokens=out.num_cached_tokens,
            )
            if shipment.landing is None:
                shipment.stage = Stage.LANDING  # the blocks stay held until it comes (``land``)
                continue
            self._send_last(engine, shipment)

    def _send_last(self, engine: LLMEngine, shipment: Shipment) -> None:
        """Start the last send of a prompt whose first token is out: the blocks not shipped yet
        (all of them after a preemption), with the commit."""
        rid, landing = shipment.request_id, shipment.landing
        src = engine.held_block_ids(rid)
        if src is None:
            shipment.stage = Stage.DONE
            return
        sent = shipment.num_blocks_sent
        if engine.num_preemptions(rid) != shipment.num_preemptions:
            sent = 0  # the blocks shipped early may have been reused before they were read
        # The transport may read the blocks until it releases them, even after an abort.
        engine.pin_held(rid)
        shipment.stage = Stage.SENDING  # until _finish
        started = time.monotonic()
        try:
            # The first token was read back, so the forward that wrote the prompt's last blocks is
            # done (``written``): the send does not wait for the next step, which async scheduling
            # has queued on the stream already.
            fut = self.sender.send(
                landing.kv_address,
                self.state.info,
                rid,
                src[landing.first_block + sent :],
                landing.block_ids[sent:],
                shipment.commit,
                self.state.node.kv_transfer_timeout_s,
                written=True,
            )
        except Exception as e:
            fut = KVSendFuture.failed(e)
        fut.add_done_callback(lambda f, s=shipment, t=started: self._transfer_done(s, f, t))
        fut.released.add_done_callback(lambda _, rid=rid: self._released(rid))

    def _ship_launched(self, chunks: list[LaunchedChunk], layer_events: list | None) -> None:
        """Ship the blocks a launched step fills (a finishing prompt's last, partial one too)."""
        block_size = self.state.engine.config.cache.block_size
        for chunk in chunks:
            shipment = self._prefilling(chunk.request_id)
            if shipment is None or shipment.landing is None:
                continue  # without a landing yet, its last send takes every block
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
        # The sender's thread (or the engine loop when the send failed at once).
        seconds = time.monotonic() - started
        self.state.loop.submit(lambda engine: self._finish(engine, shipment, fut, seconds))

    def _finish(self, engine: LLMEngine, shipment: Shipment, fut: Future, seconds: float) -> None:
        """The send's outcome is known: it goes to the call handler in the node process, and the
        blocks are released, to be freed (or kept as prefix cache) once the sender released them
        too (``_released``; often the same moment)."""
        shipment.stage = Stage.DONE
        engine.release_held(shipment.request_id)
        exc = fut.exception()
        error = "" if exc is None else (str(exc) or type(exc).__name__)
        self.state.transfers.append(TransferDone(shipment.request_id, error, seconds))

    def _released(self, request_id: str) -> None:
        """The transport can no longer read the blocks (any thread): unpin them on the engine loop.
        Comes with or after the outcome, so the blocks are freed then."""
        self.state.loop.submit(lambda engine: engine.unpin_held(request_id))

    def forget(self, request_id: str) -> None:
        self._awaiting_handshake.discard(request_id)
        # Nothing more is shipped from its steps. A last send in flight keeps its blocks pinned
        # (``NodeState.end_request`` releases them right after this, the engine only at the unpin;
        # blocks held for a landing it releases at once).
        shipment = self._prefilling(request_id, Stage.PREFILLING, Stage.LANDING)
        if shipment is not None:
            shipment.stage = Stage.DONE


def core_services(state) -> list[NodeService]:
    """The engine-side service of a prefill node, built in its engine core process."""
    return [PrefillService(state)]


def create_app(engine_config: EngineConfig, node: NodeConfig) -> FastAPI:
    """A prefill node (``--role prefill``)."""
    return node_app(NodeState(engine_config, node, core_services, [add_prefill_calls]))


@dataclass
class _Awaited:
    """A prefill call that came without its landing (node process, event loop only)."""

    num_prompt_tokens: int
    sent: asyncio.Future
    """Done once the prompt's ``AddPrefill`` went to the engine core, which takes commands in order:
    a ``LandPrefill`` sent after it is taken after it (and its lease renewed from when it is read
    there, however long the engine loop's step: ``prefill_node.leases``); cancelled if the call
    ended before."""
    arrived: asyncio.Future
    """Done once its landing came and went to the engine core (or was refused here): the prefill
    call's landing timeout waits for this, what the proxy owes, not for the engine loop, which
    takes the landing between steps (the lease renewed from when the core read it), however long
    those take; cancelled if the call ended before."""
    landed: asyncio.Future
    """Done once the engine core took its landing (``LandPrefill``); an exception if the core
    refused it; cancelled if the call ended before."""


def add_prefill_calls(channel: ChannelServer, state: NodeState) -> None:
    """The prefill role's calls on the request channel (node process): ``PrefillRequest``, and
    ``PrefillLanding`` for one that came without its landing."""
    awaiting: dict[str, _Awaited] = {}

    def fail(msg: PrefillRequest, status: int, error: str) -> NodeRefused:
        logger.warning("prefill of %s failed: %s", msg.request_id, error)
        return NodeRefused(status, error, "prefill_failed")

    async def prefill(peer: Peer, msg: PrefillRequest) -> PrefillResult:
        """Answers once the KV is committed on the decode node (or failed)."""
        arrived = time.monotonic()
        rid = msg.request_id
        num_tokens = len(msg.prompt_token_ids)
        if msg.landing is not None:
            error = _validate(msg.landing, rid, num_tokens, state.info.block_size)
            if error:
                raise fail(msg, 500, error)  # a cluster bug, not the client's
            awaited = None
        else:
            if rid in awaiting:
                raise fail(msg, 400, f"duplicate request id {rid!r}")
            # Registered before this handler first waits: its landing's call, right behind it on
            # the channel, finds it.
            loop = asyncio.get_running_loop()
            futures = (loop.create_future() for _ in range(3))
            awaited = awaiting[rid] = _Awaited(num_tokens, *futures)
        try:
            async with state.admission(msg.deadline):  # raises NodeRefused: 429, 503 or 504
                if rid in state.transfers:
                    raise fail(msg, 400, f"duplicate request id {rid!r}")
                sub = state.subs.subscribe(rid)
                transfer = state.transfers[rid] = asyncio.get_running_loop().create_future()
                try:
                    # Handshakes with the decode node (once), then opens its shipment: the lease
                    # is renewed. Without a landing: opens the shipment only.
                    added = state.core.submit(AddPrefill(msg))
                    if awaited is not None:
                        awaited.sent.set_result(None)
                    await added
                except BaseException as exc:
                    _forget(rid, transfer)
                    if isinstance(exc, asyncio.CancelledError):  # the add may still run: undo it after
                        state.end_request(rid, "proxy gone")
                        state.core.send(ClosePrefill(rid))
                    if isinstance(exc, CoreRefused) and exc.kind == "kv_transfer_error":
                        raise fail(msg, 502, exc.message) from None
                    if isinstance(exc, CoreRefused) and exc.kind == "value_error":
                        raise fail(msg, 400, exc.message) from None
                    raise
            try:
                return await _prefill(msg, sub, transfer, arrived, awaited)
            finally:
                _forget(rid, transfer)
                state.core.send(ClosePrefill(rid))
        finally:
            if awaited is not None:
                if awaiting.get(rid) is awaited:
                    del awaiting[rid]
                awaited.sent.cancel()  # no-ops once done
                awaited.arrived.cancel()
                awaited.landed.cancel()

    def _forget(rid: str, transfer: asyncio.Future) -> None:
        # This handler is the subscription's only reader: once it returns, nothing reads it, and
        # one left behind would hold the node's drain until it expires.
        state.subs.unsubscribe(rid)
        if state.transfers.get(rid) is transfer:
            del state.transfers[rid]

    async def _prefill(
        msg: PrefillRequest, sub, transfer: asyncio.Future, arrived: float, awaited: _Awaited | None
    ) -> PrefillResult:
        rid = msg.request_id
        try:
            events = await sub.wait_finished()
            state.metrics.prefill_seconds.observe(time.monotonic() - arrived)
            failed = next((e for e in events if e.finish_reason == "error"), None)
            if failed is not None or not events:  # ended before its KV was sent: none will be
                raise fail(msg, 500, failed.error if failed is not None else "the prefill produced no token")
            if awaited is not None and not awaited.landed.done():
                # The first token is out and the blocks are held for the landing: not forever, and
                # not past the request's deadline (which stopped counting at the first token).
                limit = state.node.kv_transfer_timeout_s
                if msg.deadline:
                    limit = min(limit, max(0.0, msg.deadline - time.time()))
                if not await wait_at_most(awaited.arrived, limit):
                    state.end_request(rid, "its landing descriptor never came")
                    why = f"no landing descriptor came within {limit:.3g} s of the first token"
                    raise fail(msg, 504, why) from None
                # It came: the engine loop takes it between steps, its lease renewed meanwhile
                # for as long as the lease keeper renews one it has not taken.
                limit = PrefillService.UNCONFIRMED_LEASE_S
                if msg.deadline:
                    limit = min(limit, max(0.0, msg.deadline - time.time()))
                if not await wait_at_most(awaited.landed, limit):
                    state.end_request(rid, "the engine core did not take its landing")
                    raise fail(msg, 504, f"the engine core did not take the landing within {limit:.3g} s")
            if awaited is not None and awaited.landed.exception() is not None:
                state.end_request(rid, "its landing was refused")
                raise fail(msg, 502, str(awaited.landed.exception()))
            done: TransferDone = await transfer
            if done.error:
                raise fail(msg, 502, done.error)
        except asyncio.CancelledError:  # the proxy left (or aborted the call)
            state.end_request(rid, "proxy gone")
            raise
        prompt_logprobs = next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None)
        return PrefillResult(
            request_id=rid,
            ok=True,
            num_cached_tokens=events[-1].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    async def land(peer: Peer, msg: PrefillLanding) -> None:
        """Answers once the engine core took the landing (handshake included): the KV is on its way."""
        landing = msg.landing
        rid = landing.request_id
        awaited = awaiting.get(rid)
        if awaited is None or awaited.arrived.done():
            raise NodeRefused(404, f"no prefill of {rid!r} awaits a landing here", "not_found")
        error = _validate(landing, rid, awaited.num_prompt_tokens, state.info.block_size)
        if error:
            logger.warning("landing of %s refused: %s", rid, error)
            refuse(awaited, error)  # the prefill fails at once, not at its landing timeout
            raise NodeRefused(500, error, "prefill_failed")  # a cluster bug, not the client's
        if not awaited.sent.done():
            await wait_at_most(awaited.sent, None)  # this call's own cancellation is not swallowed
            if awaited.sent.cancelled():  # the prefill ended before its AddPrefill went out
                raise NodeRefused(404, f"the prefill of {rid!r} ended before its landing came", "not_found")
        try:
            taken = state.core.submit(LandPrefill(landing))
            if not awaited.arrived.done():  # cancelled if the prefill call ended meanwhile
                awaited.arrived.set_result(None)
            await taken
        except CoreRefused as exc:
            refuse(awaited, exc.message)
            raise
        if not awaited.landed.done():
            awaited.landed.set_result(None)

    def refuse(awaited: _Awaited, why: str) -> None:
        if not awaited.arrived.done():
            awaited.arrived.set_result(None)
        if not awaited.landed.done():
            awaited.landed.set_exception(RuntimeError(why))
            awaited.landed.exception()  # retrieved here too: the prefill call may be gone

    channel.handle(PrefillRequest, prefill)
    channel.handle(PrefillLanding, land)


def _validate(landing: LandingDescriptor, request_id: str, num_prompt_tokens: int, block_size: int) -> str:
    if landing.request_id != request_id:
        return "landing descriptor belongs to another request"
    if landing.num_prompt_tokens != num_prompt_tokens:
        n = landing.num_prompt_tokens
        return f"landing descriptor is for {n} tokens, the prompt has {num_prompt_tokens}"
    num_blocks = cdiv(num_prompt_tokens, block_size)
    if not 0 <= landing.first_block < num_blocks:
        return f"landing descriptor starts at block {landing.first_block} of {num_blocks}"
    if len(landing.block_ids) != num_blocks - landing.first_block:
        return (
            f"landing descriptor has {len(landing.block_ids)} blocks for blocks {landing.first_block} to "
            f"{num_blocks - 1} of a {num_prompt_tokens}-token prompt"
        )
    return ""
