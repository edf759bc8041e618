"""The NIXL KV transport: the decode node READs staged blocks out of the prefill node's memory.

Memory is registered with NIXL's UCX backend once per node: the decode node registers its
whole KV cache, the prefill node a staging arena of slots (VRAM on a GPU, DRAM on the CPU).
A slot holds one (layer, block) region, ``[2, BS, Hkv, D]``, which is contiguous in the cache
too, so a transfer is a list of region descriptors; the lists for every cache region and every
slot of a peer are prepared once (``prep_xfer_dlist``) and a transfer picks them by index
(``make_prepped_xfer``; NIXL merges neighbours).

**READ by the decode node, not WRITE by the prefill node.** The decode node owns the
destination blocks and their lease. It starts each READ only after pinning the reservation
(``ReservationTable.begin``), and ``release`` waits for the READs it started (each bounded by
a deadline, then cancelled), so no byte lands in blocks after they were freed. With WRITE the
decode node could not stop a prefill node whose lease ran out mid-transfer short of
deregistering its whole cache: late bytes would land in blocks already given to another
request. The prefill side pays nothing extra for this: its caller frees the source blocks as
soon as ``send`` returns, so every backend stages them (one device copy, here straight into
arena slots when there is room), and a slot stays untouched until its READ is reported done.

Per chunk (control messages in ``kv_transfer/wire.py`` on the zmq control connection):

1. prefill: blocks staged in arena slots;
2. prefill -> decode ``KVReady`` (request id, transfer id, destination blocks, layers, slots);
3. decode: pin, READ into the reserved blocks, poll until done, failed or past its deadline
   (then cancel), unpin;
4. decode -> prefill a NIXL notification ``KVReadDone`` with the request and transfer ids (and
   the error, if any): the prefill node frees the slots;
5. after the last chunk's notification the commit goes on the control connection.

A chunk that fails or times out fails its request on the prefill side: the commit is never
sent, so its slots can be reused at once (a late READ can only put wrong bytes into blocks of
a request that will never run).

Agent metadata is exchanged inside ``KVSetup``/``KVSetupReply`` on the authenticated control
connection, whose handshake is resent until the listener answers, rather than through NIXL's
own listener. UCX reads ``UCX_TLS`` and ``UCX_NET_DEVICES`` from the environment;
``ucx_net_devices`` (NIXL's ``ucx_devices`` parameter) and ``ucx_tls`` set them per node.
Agents run without NIXL's progress thread (idle, it costs ~40% of a core here): the threads
that wait on transfers and notifications progress UCX as they poll.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer.base import (
    KVTransferError,
    ReceiverPlane,
    ReservationTable,
    SenderPlane,
    SenderSession,
    Staged,
    stage_blocks,
)
from kv_transfer.wire import KVReadDone, KVReady, KVSetup, KVSetupReply
from kv_transfer.zmq_backend import valid_block_ids
from pdserve.messages import decode, encode

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 1 << 30
"""Arena cap: at most this, and at most a quarter of the KV cache (a chunk that does not fit
is staged in plain memory and copied into the arena as slots free up)."""
PIECE_BYTES = 64 << 20
"""Largest READ: bounds how long a lease release may wait for a READ in flight."""
MAX_READ_S = 10.0
"""A READ still running after this long is cancelled (a piece takes milliseconds on any sane link);
it bounds how long the engine thread's ``ReservationTable.release`` can wait."""
POLL_S = 0.0002


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:  # ImportError, or a wheel that cannot load its libraries here
        return False
    return True


def _agent(role: str, ucx_net_devices: str, ucx_tls: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # UCX reads it when the backend starts, just below
    config = nixl_agent_config(
        enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = nixl_agent(f"pdserve-{role}-{uuid.uuid4().hex[:12]}", config)
    agent.create_backend("UCX", {"ucx_devices": ucx_net_devices} if ucx_net_devices else {})
    return agent


def _on_device(t: torch.Tensor):
    """Make the tensor's CUDA context current on this thread (UCX asks the driver about pointers)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def _device_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


def _regions(base: int, region_bytes: int, count: int, device: int) -> np.ndarray:
    """[count, 3] descriptors (address, length, device) of ``count`` back-to-back regions."""
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(region_bytes)
    descs[:, 1] = region_bytes
    descs[:, 2] = device
    return descs


class SlotArena:
    """First-fit allocator of runs of consecutive slots (thread-safe)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # (start, count), sorted, never adjacent
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return sum(count for _, count in self._free)

    def alloc(self, count: int) -> int | None:
        with self._lock:
            for i, (start, size) in enumerate(self._free):
                if size >= count:
                    if size == count:
                        del self._free[i]
                    else:
                        self._free[i] = (start + count, size - count)
                    return start
        return None

    def free(self, start: int, count: int) -> None:
        with self._lock:
            i = bisect.bisect(self._free, (start, count))
            assert (i == 0 or sum(self._free[i - 1]) <= start) and (
                i == len(self._free) or start + count <= self._free[i][0]
            ), f"slots [{start}, {start + count}) freed twice"
            self._free.insert(i, (start, count))
            if i + 1 < len(self._free) and start + count == self._free[i + 1][0]:
                self._free[i] = (start, count + self._free.pop(i + 1)[1])
            if i > 0 and sum(self._free[i - 1]) == start:
                prev = self._free[i - 1]
                self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])


# -- decode side ---------------------------------------------------------------------------------


@dataclass
class _Remote:
    agent: str  # the sender's agent name
    slots: object  # its arena's prepared descriptor list
    num_slots: int


@dataclass
class _Read:
    handle: object
    remote: _Remote
    msg: KVReady
    deadline: float
    nbytes: int
    cancel_logged: bool = False


class NixlReceiverPlane(ReceiverPlane):
    name = "nixl"

    def __init__(self, ucx_net_devices: str = "", ucx_tls: str = "") -> None:
        super().__init__()
        self.ucx_net_devices = ucx_net_devices
        self.ucx_tls = ucx_tls
        self._remotes: dict[str, _Remote] = {}  # sender agent -> its arena (kept across reconnects)
        self._sessions: dict[bytes, _Remote] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress_until = 0.0

    def start(self, kv: torch.Tensor, table: ReservationTable, outbox, on_commit, host: str) -> None:
        self.kv, self.table = kv, table
        self.num_layers, self.num_blocks = kv.shape[0], kv.shape[1]
        self.region_bytes = kv[0, 0].numel() * kv.element_size()
        with _on_device(kv):
            self.agent = _agent("decode", self.ucx_net_devices, self.ucx_tls)
            self._registered = self.agent.register_memory(kv)  # the whole cache, once
        regions = _regions(
            kv.data_ptr(), self.region_bytes, self.num_layers * self.num_blocks, _device_id(kv)
        )
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", regions, _mem_type(kv))
        self._thread = threading.Thread(target=self._run, name="kv-nixl-reader", daemon=True)
        self._thread.start()

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        address, slot_bytes, num_slots, device = msg.nixl_arena
        if not msg.nixl_metadata or num_slots <= 0:
            return KVSetupReply(ok=False, error="the sender offered nixl without agent metadata")
        if slot_bytes != self.region_bytes:
            error = (
                f"nixl staging slots of {slot_bytes} bytes; this node's KV regions have {self.region_bytes}"
            )
            return KVSetupReply(ok=False, error=error)
        with self._lock:
            remote = self._remotes.get(msg.nixl_agent)
            if remote is None:
                name = self.agent.add_remote_agent(msg.nixl_metadata)
                name = name.decode() if isinstance(name, bytes) else name
                slots = self.agent.prep_xfer_dlist(
                    name, _regions(address, slot_bytes, num_slots, device), msg.nixl_mem
                )
                remote = self._remotes[msg.nixl_agent] = _Remote(name, slots, num_slots)
                self.agent.make_connection(name)  # now, rather than at the first READ
            self._sessions[peer] = remote
        metadata = self.agent.get_agent_metadata()
        return KVSetupReply(ok=True, transport="nixl", nixl_agent=self.agent.name, nixl_metadata=metadata)

    def handle(self, peer: bytes, msg: KVReady) -> None:
        with self._lock:
            remote = self._sessions.get(peer)
        self._jobs.put((remote, msg))

    def drop(self, peer: bytes) -> None:
        with self._lock:
            self._sessions.pop(peer, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=MAX_READ_S)

    # -- reader thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        with _on_device(self.kv):
            self._serve()

    def _serve(self) -> None:
        inflight: list[_Read] = []
        while not self._stop.is_set():
            # Without a progress thread, notifications leave only while UCX is progressed: keep
            # doing so for a while after sending one (a first one may wait for its connection).
            idle_wait = 0.005 if time.monotonic() < self._progress_until else 0.1
            try:
                while True:
                    job = self._jobs.get(timeout=idle_wait) if not inflight else self._jobs.get_nowait()
                    self._start(*job, inflight)
                    if not inflight:
                        break
            except queue.Empty:
                pass
            if not inflight and time.monotonic() < self._progress_until:
                self.agent.get_new_notifs()  # progresses UCX; nothing is expected from senders
            for read in list(inflight):
                if self._poll(read):
                    inflight.remove(read)
            if inflight:
                time.sleep(POLL_S)
        while inflight:  # shutting down: cancel what is left, and unpin it
            for read in list(inflight):
                read.deadline = 0.0
                if self._poll(read):
                    inflight.remove(read)
            time.sleep(POLL_S)

    def _start(self, remote: _Remote | None, msg: KVReady, inflight: list[_Read]) -> None:
        num_layers, n = msg.layer_end - msg.layer_start, len(msg.block_ids)
        if remote is None:
            error = "KVReady on a connection without a nixl session"
        elif not valid_block_ids(msg.block_ids, self.num_blocks):
            error = "KVReady names invalid or repeated block ids"
        elif num_layers <= 0 or msg.slot_start < 0 or msg.slot_start + num_layers * n > remote.num_slots:
            error = f"KVReady names slots outside the sender's arena of {remote.num_slots}"
        else:
            error = self.table.begin(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end)
        if error:
            self.table.fail(msg.request_id, error)
            self._notify(remote, msg, error)
            return
        # Local region (layer, block) is descriptor layer * NB + block; remote slots are layer-major.
        layers = np.arange(msg.layer_start, msg.layer_end, dtype=np.int64)[:, None]
        local = (layers * self.num_blocks + np.asarray(msg.block_ids, dtype=np.int64)[None, :]).reshape(-1)
        remote_idx = np.arange(msg.slot_start, msg.slot_start + num_layers * n, dtype=np.int64)
        try:
            handle = self.agent.make_prepped_xfer(
                "READ", self._local, local.astype(np.int32), remote.slots, remote_idx.astype(np.int32)
            )
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("the transfer was refused")
        except Exception as e:
            error = f"NIXL READ could not start: {e}"
            self.table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, error)
            self._notify(remote, msg, error)
            return
        deadline = time.monotonic() + min(max(msg.timeout_s, 0.0), MAX_READ_S)
        inflight.append(_Read(handle, remote, msg, deadline, num_layers * n * self.region_bytes))

    def _poll(self, read: _Read) -> bool:
        """Check one READ; True once it is over (and unpinned)."""
        state = self.agent.check_xfer_state(read.handle)
        if state == "PROC" and time.monotonic() < read.deadline:
            return False
        try:
            read.handle.release()  # cancels a READ still in progress, or raises if it cannot
        except Exception as e:
            if state == "PROC":
                if not read.cancel_logged:
                    logger.warning("cannot cancel a NIXL READ for %s yet: %s", read.msg.request_id, e)
                    read.cancel_logged = True
                return False
        msg = read.msg
        error = {"DONE": "", "PROC": "NIXL READ timed out"}.get(state, "NIXL READ failed (peer gone?)")
        self.table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, error)
        if not error:
            self.bytes_received += read.nbytes
        self._notify(read.remote, msg, error)
        return True

    def _notify(self, remote: _Remote | None, msg: KVReady, error: str) -> None:
        if remote is None:
            return
        self._progress_until = time.monotonic() + 2.0
        try:
            self.agent.send_notif(remote.agent, encode(KVReadDone(msg.request_id, msg.xfer_id, error)))
        except Exception as e:  # the sender went away; it times out on its own
            logger.warning("cannot notify NIXL peer %s: %s", remote.agent, e)


# -- prefill side --------------------------------------------------------------------------------


class NixlSenderPlane(SenderPlane):
    name = "nixl"

    def __init__(self, staging_bytes: int = 0, ucx_net_devices: str = "", ucx_tls: str = "") -> None:
        self.staging_bytes = staging_bytes
        self.ucx_net_devices = ucx_net_devices
        self.ucx_tls = ucx_tls
        self._xfer_ids = itertools.count(1)
        self._notifs: dict[str, dict[int, str]] = {}  # peer agent -> transfer id -> error ("" = done)
        self._notif_lock = threading.Lock()
        self._remotes: set[str] = set()

    def register(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.slot_bytes = kv[0, 0].numel() * kv.element_size()
        cache_bytes = kv.numel() * kv.element_size()
        staging = self.staging_bytes or min(DEFAULT_STAGING_BYTES, cache_bytes // 4)
        num_slots = max(kv.shape[0], staging // self.slot_bytes)  # at least one block of every layer
        self.arena = torch.empty((num_slots, *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        self.slots = SlotArena(num_slots)
        with _on_device(kv):
            self.agent = _agent("prefill", self.ucx_net_devices, self.ucx_tls)
            self._registered = self.agent.register_memory(self.arena)
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    def setup_fields(self) -> dict:
        return {
            "nixl_agent": self.agent.name,
            "nixl_metadata": self.agent.get_agent_metadata(),
            "nixl_arena": (
                self.arena.data_ptr(),
                self.slot_bytes,
                self.slots.num_slots,
                _device_id(self.arena),
            ),
            "nixl_mem": _mem_type(self.arena),
        }

    def stage(self, kv: torch.Tensor, block_ids: Sequence[int]) -> Staged:
        num_layers, n = kv.shape[0], len(block_ids)
        start = self.slots.alloc(num_layers * n)
        if start is None:  # the arena is busy: stage in plain memory, copied in as slots free up
            return stage_blocks(kv, block_ids)
        out = self.arena[start : start + num_layers * n].view(num_layers, n, *kv.shape[2:])
        staged = stage_blocks(kv, block_ids, out=out)
        staged.slot_start = start
        staged.release = functools.partial(self.slots.free, start, num_layers * n)
        return staged

    def connect(self, peer, setup: KVSetup, reply: KVSetupReply, deadline: float) -> NixlSession:
        with self._notif_lock:
            if reply.nixl_agent not in self._remotes:
                self.agent.add_remote_agent(reply.nixl_metadata)
                self._remotes.add(reply.nixl_agent)
        return NixlSession(self, peer, reply.nixl_agent)

    def take_notifs(self, agent: str) -> dict[int, str]:
        """Transfer id -> error of the READs ``agent`` reported done since the last call."""
        with self._notif_lock:
            for name, messages in self.agent.get_new_notifs().items():
                box = self._notifs.setdefault(name, {})
                for raw in messages:
                    try:
                        done = decode(raw, KVReadDone)
                    except Exception:
                        logger.warning("dropping a malformed NIXL notification from %s", name)
                        continue
                    box[done.xfer_id] = done.error
            return self._notifs.pop(agent, {})


class NixlSession(SenderSession):
    def __init__(self, plane: NixlSenderPlane, peer, agent: str) -> None:
        self.plane = plane
        self.peer = peer
        self.agent = agent

    def deliver(self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float) -> None:
        plane = self.plane
        num_layers, n = staged.tensor.shape[:2]
        cap = max(1, min(PIECE_BYTES // plane.slot_bytes, plane.slots.num_slots // 2))
        pending: dict[int, tuple[int, int, bool]] = {}  # transfer id -> (slot start, count, slots ours)
        try:
            if staged.slot_start >= 0:  # already in the arena, [L, n] layer-major
                step = max(1, cap // n)
                for l0 in range(0, num_layers, step):
                    l1 = min(l0 + step, num_layers)
                    staged.wait(l1)  # these layers are gathered (later ones may still be running)
                    xfer_id = self._ready(
                        request_id, dst_block_ids, l0, l1, staged.slot_start + l0 * n, deadline
                    )
                    pending[xfer_id] = (0, 0, False)  # the arena run goes back with the staged job
            else:
                for l0, l1, j0, j1 in _pieces(num_layers, n, cap):
                    count = (l1 - l0) * (j1 - j0)
                    start = self._alloc(count, pending, deadline)
                    xfer_id = next(plane._xfer_ids)
                    pending[xfer_id] = (start, count, True)
                    self._copy_in(staged.tensor[l0:l1, j0:j1], start, staged.event(l1))
                    self._ready(request_id, dst_block_ids[j0:j1], l0, l1, start, deadline, xfer_id)
            while pending:
                self._collect(pending, deadline)
        finally:
            for start, count, ours in pending.values():
                if ours:
                    plane.slots.free(start, count)

    def _ready(
        self, rid: str, dst: list[int], l0: int, l1: int, slot_start: int, deadline: float, xfer_id: int = 0
    ) -> int:
        """Tell the peer that a piece is staged; returns its transfer id."""
        xfer_id = xfer_id or next(self.plane._xfer_ids)
        left = max(deadline - time.monotonic(), 0.0)
        self.peer.send([encode(KVReady(rid, xfer_id, list(dst), l0, l1, slot_start, left))], deadline)
        return xfer_id

    def _alloc(self, count: int, pending: dict, deadline: float) -> int:
        while True:
            start = self.plane.slots.alloc(count)
            if start is not None:
                return start
            self._collect(pending, deadline)  # waits a little when nothing of ours finished

    def _copy_in(self, part: torch.Tensor, start: int, staged_event) -> None:
        plane = self.plane
        dst = plane.arena[start : start + part.shape[0] * part.shape[1]].view(part.shape)
        if plane.stream is None:
            dst.copy_(part)
            return
        with torch.cuda.stream(plane.stream):
            if staged_event is not None:
                plane.stream.wait_event(staged_event)
            dst.copy_(part, non_blocking=True)
        plane.stream.synchronize()

    def _collect(self, pending: dict[int, tuple[int, int, bool]], deadline: float) -> bool:
        """Take the peer's notifications; frees the slots of finished READs. True if any finished."""
        done = self.plane.take_notifs(self.agent)
        finished = False
        for xfer_id, error in done.items():
            entry = pending.pop(xfer_id, None)
            if entry is None:
                continue  # a late report of a transfer already given up
            finished = True
            if entry[2]:
                self.plane.slots.free(entry[0], entry[1])
            if error:
                raise KVTransferError(f"KV peer {self.peer.address} refused a NIXL READ: {error}")
        if not finished:
            if time.monotonic() > deadline:
                raise KVTransferError(f"no reply from KV peer {self.peer.address} in time (NIXL READ)")
            time.sleep(POLL_S)
        return finished

    def close(self) -> None:
        pass


def _pieces(num_layers: int, n: int, cap: int) -> list[tuple[int, int, int, int]]:
    """(layer start, layer end, block start, block end) pieces of at most ``cap`` regions each."""
    if n <= cap:
        step = cap // n
        return [(l0, min(l0 + step, num_layers), 0, n) for l0 in range(0, num_layers, step)]
    return [(layer, layer + 1, j, min(j + cap, n)) for layer in range(num_layers) for j in range(0, n, cap)]
