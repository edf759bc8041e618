"""The node's engine core: the engine and the engine-side halves of its roles, in a process of its own.

As vLLM V1's ``EngineCoreProc``: the node process (HTTP and the request channel,
``pdserve.node.framework``) spawns this process (``pdserve.node.core_client``) and talks to it over
two ZeroMQ ipc:// sockets with typed messages (``pdserve.messages``, "node process <-> its engine
core process"): ``CoreCall``s one way, and the other way ``CoreReply``s and one ``StepOutputs`` per
engine step carrying every token event of that step. The engine loop (``EngineLoop``) runs on this
process's main thread; nothing else shares its GIL but the KV transports' threads, the prefix-index
publisher and the reader of the node's commands.

What lives here: ``LLMEngine``; the services' engine-side work (``NodeService``: the prefill
node's KV sender, shipments and lease renewals, the decode node's KV receiver and reservation
table); deadlines; the prefix-index publisher; detokenization and stop strings (in the engine,
as before the split), and the turning of cumulative outputs into ``TokenEvent`` deltas
(``TokenEvents``), so only what changed crosses to the node.

The core dies with the node: it ignores SIGINT/SIGTERM (the node drains and then sends
``Shutdown``), asks the kernel to kill it when its parent dies, and checks its parent besides.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from pdserve import envs, gc_heap, kv_transfer
from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import KVTransferError
from pdserve.messages import (
    CoreCall,
    CoreFailed,
    CoreReady,
    CoreReply,
    CoreStats,
    Count,
    EndAll,
    EndRequest,
    Flag,
    GetStats,
    IsIdle,
    Message,
    NodeInfo,
    NodeLoad,
    Shutdown,
    StepOutputs,
    TransferDone,
    decode,
    encode,
)
from pdserve.node.channel import CallRefused
from pdserve.node.engine_loop import EngineLoop, error_output
from pdserve.node.service import (
    RETRY_AFTER_S,
    NodeRefused,
    NodeService,
    kv_transport_for,
    node_info,
    node_load,
)
from pdserve.node.token_events import TokenEvents
from pdserve.prefix_index import IndexPublisher, NodeRegistration

logger = logging.getLogger(__name__)

DEADLINE_SWEEP_S = 0.05
"""How often the engine loop looks for requests past their deadline."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""The core process's ``sys.setswitchinterval``. The engine thread holds the GIL for most of a busy
step (scheduling, inputs, outputs for a large batch), and every other thread here (the KV
receiver and senders, the command reader) waits up to this long for it at each wake-up; at
Python's default 5 ms a KV send, which takes several wake-ups on each side, queued for tens of
milliseconds behind busy engine threads. On the 2-core box, one round trip between two processes,
each with a thread busy in Python: 10.3 ms p50 at 5 ms, 3.3 ms at 1 ms, 3.1 ms at 0.5 ms (0.13 ms
without the busy threads). The engine thread only yields more often while another thread waits."""

ServicesFactory = Callable[["CoreState"], list[NodeService]]
Handler = Callable[[Any], Any]


class CoreState:
    """The engine core of one node: engine, loop, services, deadlines, and the socket to the node.

    Everything here runs on the engine loop's thread unless a method says otherwise; this is the
    ``state`` the services' engine-side hooks see."""

    def __init__(
        self, engine_config: EngineConfig, node: NodeConfig, send: Callable[[Message], None]
    ) -> None:
        self.engine_config = engine_config
        self.node = node
        self.role = node.role
        self.send = send
        self.services: list[NodeService] = []
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.info: NodeInfo | None = None
        self.publisher: IndexPublisher | None = None
        self.transfer_options: tuple[object, ...] = ()  # --kv-transfer-config's (``start``)
        self.handlers: dict[type, Handler] = {
            EndRequest: self._end_request_call,
            GetStats: self._stats_call,
            IsIdle: lambda msg: Flag(self.is_idle()),
            EndAll: lambda msg: Count(self.end_all(msg.message)),
            Shutdown: self._shutdown_call,
        }
        self.deltas: dict[str, TokenEvents] = {}
        """Request id -> what the node was sent of it (a request without one gets one at its first output)."""
        self.transfers: list[TransferDone] = []
        """KV sends that ended since the last ``StepOutputs``."""
        self._load: NodeLoad | None = None  # the newest snapshot (``_on_idle``)
        self._load_sent: NodeLoad | None = None
        self._deadlines: dict[str, float] = {}  # request id -> unix deadline
        self._next_sweep = 0.0

    # -- start-up ------------------------------------------------------------------------------

    def start(self, make_services: ServicesFactory) -> CoreReady:
        node = self.node
        # The transports' options first: a config they cannot take fails the start before the model loads.
        self.transfer_options = kv_transfer.options_from_config(node.kv_transfer_config)
        publish = bool(node.redis_url)
        engine = self.engine = LLMEngine(self.engine_config, publish)
        node = self.node = kv_transport_for(engine, node)
        self.loop = EngineLoop(engine, self._emit, after_step=self._after_step, on_idle=self._on_idle)
        self.services = make_services(self)
        # Services set up their ends with the unresolved choice (auto, or a preference list): the
        # transport actually used is agreed with each peer at handshake.
        addresses = [s.start(node.kv_transport) for s in self.services]
        transport = kv_transfer.resolve_transport(node.kv_transport)
        info = node_info(engine, node, self.role, transport, next((a for a in addresses if a), ""))
        self.info = msgspec.structs.replace(info, channel_port=node.channel_port)
        for service in self.services:
            self.handlers.update(service.commands())
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
        self._load = self._load_sent = self._node_load()
        return CoreReady(self.info, engine.simulation is not None, self._load_sent)

    @property
    def kv_options(self) -> list[object]:
        """Options for the node's KV transports (``kv_transfer.create_sender``/``create_receiver``):
        those of ``--kv-transfer-config`` and a simulated engine's link; the transports' defaults
        for the rest."""
        sim = self.engine.simulation if self.engine is not None else None
        if sim is None:
            return list(self.transfer_options)
        link = kv_transfer.SimOptions(sim.link.latency_s, sim.link.gbps, sim.kv_bytes_per_block)
        return [*self.transfer_options, link]

    @property
    def transfer_bytes(self) -> int:
        return sum(s.transfer_bytes for s in self.services)

    def stop(self) -> None:
        for service in self.services:
            service.stop()
        if self.publisher is not None:
            self.publisher.stop()

    # -- the node's calls ----------------------------------------------------------------------

    def handle(self, call: CoreCall) -> None:
        """Run one of the node's commands (engine loop) and answer it (unless ``call_id`` is 0)."""
        handler = self.handlers.get(type(call.body))
        try:
            if handler is None:
                raise NodeRefused(404, f"this node does not serve {type(call.body).__name__}", "not_found")
            body = handler(call.body)
        except BaseException as exc:  # noqa: BLE001 - answered
            self._answer_error(call, exc)
            return
        if isinstance(body, Future):  # answered when it resolves (a handshake on a thread)
            body.add_done_callback(lambda f: self.loop.submit(lambda e: self._answer_future(call, f)))
            return
        if call.call_id:
            self.send(CoreReply(call.call_id, body=body))

    def early(self, body: Message) -> None:
        """The services' look at a command as it is read, before the engine loop takes it
        (``NodeService.early``); command-reader thread."""
        for service in self.services:
            try:
                service.early(body)
            except Exception:  # the command still goes to the engine loop
                logger.exception("%s.early failed on %s", type(service).__name__, type(body).__name__)

    def _answer_future(self, call: CoreCall, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            self._answer_error(call, exc)
        elif call.call_id:
            self.send(CoreReply(call.call_id, body=fut.result()))

    def _answer_error(self, call: CoreCall, exc: BaseException) -> None:
        name = type(call.body).__name__
        if isinstance(exc, CallRefused):
            reply = CoreReply(call.call_id, exc.status, None, exc.message, exc.kind, exc.retry_after)
        elif isinstance(exc, ValueError):
            reply = CoreReply(call.call_id, 400, error=str(exc), kind="value_error")
        elif isinstance(exc, KVTransferError):
            reply = CoreReply(call.call_id, 502, error=str(exc), kind="kv_transfer_error")
        else:
            logger.error("engine core command %s failed", name, exc_info=exc)
            reply = CoreReply(call.call_id, 500, error=f"internal error: {type(exc).__name__}: {exc}")
        if call.call_id:
            self.send(reply)
        elif reply.status >= 500:
            logger.warning("engine core command %s failed: %s", name, reply.error)

    def _end_request_call(self, msg: EndRequest) -> None:
        self.end_request(msg.request_id, RequestStatus[msg.status], msg.message)

    def _stats_call(self, msg: GetStats) -> CoreStats:
        # CoreStats carries EngineLoad's fields (the wire type may not import the engine's).
        load = dataclasses.asdict(self.engine.load())
        return CoreStats(**load, transfer_bytes=self.transfer_bytes, gc=gc_heap.pauses())

    def _shutdown_call(self, msg: Shutdown) -> None:
        self.loop.stop()

    # -- the engine loop's hooks ---------------------------------------------------------------

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
        # What /internal/load answers, taken before the step as commands queued prompts: a prompt
        # that one step computes still shows as queued to the routers polling.
        self._load = self._node_load()

    def _publish_block_events(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.engine.take_block_events())

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """One message to the node for this turn: its outputs as token deltas, the sends that
        ended, and the node's load when it changed (what ``/internal/load`` answers)."""
        events = []
        finished = []
        for out in outputs:
            rid = out.request_id
            deltas = self.deltas.get(rid)
            if deltas is None:
                deltas = self.deltas[rid] = TokenEvents()
            events.extend(deltas.events(out))
            if out.finished:
                del self.deltas[rid]
                finished.append(rid)
        transfers, self.transfers = self.transfers, []
        load = self._load
        changed = load != self._load_sent
        if events or finished or transfers or changed:
            self._load_sent = load
            self.send(StepOutputs(events, finished, transfers, load if changed else None))

    # -- requests ------------------------------------------------------------------------------

    def end_request(self, request_id: str, status: RequestStatus, message: str) -> None:
        """End a request wherever it is; the node's subscribers get an error output saying why."""
        engine = self.engine
        known = engine.has_request(request_id) or any(s.holds(request_id) for s in self.services)
        self._deadlines.pop(request_id, None)
        for service in self.services:
            service.forget(request_id)
        engine.abort_request([request_id], status)
        if not known:
            self.deltas.pop(request_id, None)  # reserved, then ended before it produced anything
        if known:
            logger.info("request %s ended: %s", request_id, message)
            self.loop.publish(error_output(request_id, message))

    def _node_load(self) -> NodeLoad:
        """The node's load now: the engine's, with what the services hold outside it as waiting."""
        return node_load(self.engine.load(), sum(x.num_waiting for x in self.services))

    def num_waiting(self) -> int:
        """Requests queued on the node: for the running batch, for their KV, for their stream."""
        load = self._node_load()
        return load.waiting + load.waiting_for_kv

    def check_room(self) -> None:
        """Before queueing a request: raises ``NodeRefused`` (429) when the node already queues
        ``max_waiting_requests``."""
        bound = self.node.max_waiting_requests
        if self.num_waiting() >= bound:
            raise NodeRefused(429, f"the node already queues {bound} requests", "overloaded", RETRY_AFTER_S)

    def track_deadline(self, request_id: str, deadline: float) -> None:
        """Drop the request once ``deadline`` (unix time; 0: none) passes."""
        if deadline:
            self._deadlines[request_id] = deadline

    def _sweep_deadlines(self) -> None:
        now = time.time()
        if not self._deadlines or now < self._next_sweep:
            return
        self._next_sweep = now + DEADLINE_SWEEP_S
        for request_id in [r for r, d in self._deadlines.items() if d <= now]:
            self.end_request(request_id, RequestStatus.FINISHED_ABORTED, "the request's deadline passed")

    def is_idle(self) -> bool:
        """Nothing left in the core that must finish before the node exits."""
        if self.engine.request_ids():
            return False
        return not any(x.busy() or x.held_ids() for x in self.services)

    def end_all(self, message: str) -> int:
        """End every request the core holds with an error output."""
        ids = self.engine.request_ids() + [r for x in self.services for r in x.held_ids()]
        for request_id in dict.fromkeys(ids):
            self.end_request(request_id, RequestStatus.FINISHED_ABORTED, message)
        return len(ids)


# -- the process ----------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this process when its parent dies (Linux); a thread checks besides (the
    parent may have died before the request, or the platform may not have it)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.25)

    threading.Thread(target=watch, name="core-parent-watch", daemon=True).start()


def run_core(
    engine_config: EngineConfig,
    node: NodeConfig,
    make_services: ServicesFactory,
    commands_address: str,
    outputs_address: str,
    parent_pid: int,
) -> None:
    """The engine core process's main: start the engine and the services, answer ``CoreReady``
    (or ``CoreFailed``), then run the engine loop until ``Shutdown``."""
    # The node process owns shutdown: a signal to the process group (Ctrl-C, a launcher's SIGTERM)
    # reaches the node, which drains and then stops the core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=envs.PDSERVE_LOG_LEVEL.upper(),
        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s",
        stream=sys.stderr,
    )
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(outputs_address)
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(commands_address)

    def send(msg: Message) -> None:  # the engine loop's thread only (zmq sockets are not thread-safe)
        out.send(encode(msg), copy=False)

    core = CoreState(engine_config, node, send)
    try:
        ready = core.start(make_services)
    except BaseException as exc:  # noqa: BLE001 - reported to the node, which exits
        logger.exception("the engine core failed to start")
        send(CoreFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        out.close()
        ctx.term()
        sys.exit(1)
    # Started: the model, the cache and the services' state stay for the process's life.
    gc_heap.freeze()
    gc_heap.track()
    send(ready)

    def read() -> None:  # a thread of its own: the loop thread never waits on the socket
        while True:
            try:
                data = inbox.recv(copy=False)
            except zmq.ZMQError:
                return
            try:
                call = decode(data.buffer, CoreCall)
            except msgspec.DecodeError:
                logger.exception("bad command from the node")
                continue
            core.early(call.body)
            core.loop.submit(lambda engine, call=call: core.handle(call))

    threading.Thread(target=read, name="core-commands", daemon=True).start()
    try:
        core.loop.run()
    except BaseException as exc:  # noqa: BLE001 - the loop guards its hooks; this is a bug
        logger.exception("the engine loop died")
        send(CoreFailed(f"the engine loop died: {type(exc).__name__}: {exc}"))
        raise
    finally:
        core.stop()
    logger.info("engine core stopped")
    out.close()
    os._exit(0)  # the transports' and reader's threads need no join: the node has stopped using us
