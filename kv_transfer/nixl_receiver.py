"""The decode side of the NIXL transport (``kv_transfer.nixl_backend`` says how it works): the
control thread READs a sender's blocks into reserved ones, in place or packed through staging slots,
pinned in the reservation table until each READ is over."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv_transfer.base import (
    KVLayout,
    ReservationTable,
    block_index,
    coalesce,
    scatter_from,
    valid_block_ids,
)
from pdserve.kv_transfer.messages import (
    KVAck,
    KVCommit,
    KVReadDone,
    KVReady,
    KVSetup,
    KVSetupReply,
    NixlAccept,
    NixlOffer,
)
from pdserve.kv_transfer.nixl_common import (
    CacheEnd,
    NixlOptions,
    device_id,
    mem_type,
    on_device,
)
from pdserve.kv_transfer.plane import Outbox, ReceiverPlane

logger = logging.getLogger(__name__)

POLL_S = 0.0001


def _unit_array(address: int, layout: KVLayout, device: int) -> np.ndarray:
    """A cache's units as one strided NIXL descriptor row (address, length, device, stride, count):
    block-major, its blocks (descriptor ``block`` is every layer of it); layer-major, its (layer,
    block) slabs (descriptor ``layer * NB + block``)."""
    count = layout.num_blocks if layout.block_major else layout.num_blocks * layout.num_layers
    unit = layout.slab * (layout.num_layers if layout.block_major else 1)
    return np.array([[address, unit, device, unit, count]], dtype=np.uint64)


def _prepared(agent, owner: str, slabs: np.ndarray, mem: str):
    """``slabs`` prepared as a NIXL descriptor list of ``owner`` (this agent: NIXL_INIT_AGENT), or
    None where NIXL cannot (READs of those slabs then build their lists each time)."""
    try:
        return agent.prep_xfer_dlist(owner, slabs, mem)
    except Exception as e:
        logger.warning("NIXL could not prepare a descriptor list of %s slabs (%s): built per READ", mem, e)
        return None


def _scattered(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> bool:
    """No block followed by its successor in both caches (so no two slabs of a layer coalesce)."""
    return all(
        s + 1 != s2 or d + 1 != d2
        for s, s2, d, d2 in zip(src_block_ids, src_block_ids[1:], dst_block_ids, dst_block_ids[1:])
    )


def _slab_indices(block_ids: Sequence[int], layer_start: int, layer_end: int, num_blocks: int):
    """Indices into a prepared slab list (``_slab_array``) of layers [layer_start, layer_end) of
    ``block_ids``, layer-major: a list for a few, else an int32 array."""
    if (layer_end - layer_start) * len(block_ids) <= 64:
        return [layer * num_blocks + b for layer in range(layer_start, layer_end) for b in block_ids]
    layers = np.arange(layer_start, layer_end, dtype=np.int64)[:, None] * num_blocks
    return (layers + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """[n, 3] NIXL descriptors (address, length, device)."""
    descs = np.empty((len(offsets), 3), dtype=np.uint64)
    descs[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    descs[:, 1] = lengths
    descs[:, 2] = device
    return descs


@dataclass
class _Remote:
    """A sender's registered cache and staging region."""

    agent: str  # its NIXL agent name
    address: int
    num_blocks: int
    device: int
    mem: str  # DRAM | VRAM
    layout: KVLayout | None = None
    stage_address: int = 0
    stage_bytes: int = 0  # 0: it packs nothing
    units: object = None  # its cache as a prepared descriptor list of units (``_unit_array``)
    by_index: bool = False  # both caches' units prepared and laid out alike (``_unit_indices``)


@dataclass(slots=True)
class _Read:
    handle: object
    peer: bytes  # the sender's control connection, where the KVReadDone goes
    msg: KVReady
    deadline: float
    nbytes: int
    cancel_logged: bool = False
    slot: int = -1  # packed: the staging slot it lands in, then scattered from
    scatter: object = None  # packed: the CUDA event after the scatter (True once done on the CPU)
    seen: str = ""  # its end state ("DONE", "ERR") as the settle spin saw it: ``_poll`` asks no more


class NixlReceiverPlane(CacheEnd, ReceiverPlane):
    """Runs on the receiver's control thread (with the cache's device current): a KVReady starts
    its READ at once (``handle``), and every turn of the control loop checks the READs in flight
    (``poll``), so a READ's end is answered without a thread hand-off. While READs run, the
    control loop spins, each turn yielding the GIL for ``pdserve.utils.YIELD_S`` (a sleep made
    exact by ``precise_sleeps``: at Linux's default timer slack a turn took ~60 us longer than
    the READ needed); that is also what progresses UCX (no progress thread). A send's last READ
    is first polled in a tight loop for up to ``NixlOptions.settle_spin_s`` (``_settle``).

    A packed READ lands in a slot of this node's staging pool and is scattered from there into the
    reserved blocks (on its own CUDA stream); the reservation stays pinned until the scatter is
    done. A packed KVReady that finds no free slot waits for one, unpinned, until its timeout."""

    name = "nixl"
    messages = (KVReady,)
    handles_commit = True  # a commit waits here for the READs of its request still running
    lane = True  # its messages are small: after set-up they take the session's lane

    def __init__(self, options: NixlOptions = NixlOptions()) -> None:
        super().__init__()
        self.options = options
        self._remotes: dict[str, _Remote] = {}  # sender agent -> its cache (kept across reconnects)
        self._sessions: dict[bytes, _Remote] = {}
        self._inflight: list[_Read] = []
        self._waiting: collections.deque[tuple[bytes, KVReady, float]] = collections.deque()
        self._commits: list[tuple[bytes, KVCommit]] = []  # commits waiting for their READs to end
        self.stream: torch.cuda.Stream | None = None  # the scatters' (``start``, on a GPU)

    def start(
        self,
        kv: torch.Tensor,
        table: ReservationTable,
        outbox: Outbox,
        on_commit: Callable[[KVCommit], None],
        host: str,
    ) -> None:
        self.table, self.outbox, self.on_commit = table, outbox, on_commit
        self.num_layers, self.num_blocks = kv.shape[0], kv.shape[1]
        self.take_cache(kv, "decode")
        with on_device(kv):
            # Every unit (block or slab) of the cache as one prepared list, once (see the docstring).
            units = _unit_array(kv.data_ptr(), self.layout, device_id(kv))
            self._units = _prepared(self.agent, "NIXL_INIT_AGENT", units, mem_type(kv))

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        offer = msg.offer(NixlOffer) or NixlOffer()
        address, num_layers, num_blocks, slab, device = offer.cache
        stage_address, stage_bytes = offer.stage
        if not offer.metadata or not offer.agent or not address or num_blocks <= 0:
            return KVSetupReply(ok=False, error="the sender offered nixl without agent metadata and cache")
        if not 0 < address < 1 << 64 or not 0 <= device < 1 << 16 or offer.mem not in ("DRAM", "VRAM"):
            error = f"the sender's nixl cache is not valid memory: {offer.mem} at {address:#x} on {device}"
            return KVSetupReply(ok=False, error=error)
        if stage_bytes and not (0 < stage_address < stage_address + stage_bytes < 1 << 64):
            error = (
                f"the sender's nixl staging region is not valid memory: {stage_bytes} B at {stage_address:#x}"
            )
            return KVSetupReply(ok=False, error=error)
        if (num_layers, slab) != (self.num_layers, self.slab_bytes):
            error = (
                f"nixl KV layout mismatch: the sender's cache has {num_layers} layers of {slab}-byte "
                f"block slabs, this node's {self.num_layers} of {self.slab_bytes}"
            )
            return KVSetupReply(ok=False, error=error)
        remote = self._remotes.get(offer.agent)
        if remote is None:
            name = self.agent.add_remote_agent(offer.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            layout = KVLayout(num_layers, num_blocks, slab, offer.block_major)
            remote = _Remote(name, address, num_blocks, device, offer.mem, layout, stage_address, stage_bytes)
            self.agent.make_connection(name)  # now, rather than at the first READ
            remote.units = _prepared(self.agent, name, _unit_array(address, layout, device), offer.mem)
            remote.by_index = (
                self._units is not None
                and remote.units is not None
                and layout.block_major == self.layout.block_major
            )
            self._remotes[offer.agent] = remote
        self._sessions[peer] = remote
        accept = NixlAccept(agent=self.agent.name, metadata=self.agent.get_agent_metadata(), gpu=self.gpu)
        return KVSetupReply(ok=True, transport="nixl", accept=accept)

    def handle(self, peer: bytes, msg: KVReady | KVCommit, payload: Sequence) -> str:
        if isinstance(msg, KVCommit):
            self._commits.append((peer, msg))
            self._settle_commits()
            return ""
        if msg.commit is not None:
            # The send's last READ, with its commit: the commit waits here first, so that the end of
            # this READ (or its refusal) is told by the ack alone.
            self._commits.append((peer, msg.commit))
        try:
            if msg.src_offset >= 0 and self._waiting:
                self._queue(peer, msg)  # behind the packed READs already waiting for a slot
            else:
                self._start(peer, self._sessions.get(peer), msg)
        except Exception:  # nothing a peer sends may stop the control thread
            logger.exception("KVReady for %r could not be handled", getattr(msg, "request_id", "?"))
            self.table.fail(msg.request_id, "the KVReady could not be handled")
        if msg.commit is not None:
            self._settle()
        return ""

    def _settle(self) -> None:
        """A send's last READ was just started: ack it now if it ends soon. A small one on the CPU
        ended inside ``transfer``; on a GPU, the only READ in flight is polled in a tight loop for
        up to ``settle_spin_s`` first."""
        spin = self.options.settle_spin_s
        if spin > 0 and self.stream is not None and len(self._inflight) == 1 and not self._waiting:
            read = self._inflight[0]
            if read.slot < 0:  # in place (a packed READ's scatter follows it: not worth a spin)
                check, until = self.agent.check_xfer_state, time.perf_counter() + spin
                try:
                    while (state := check(read.handle)) == "PROC" and time.perf_counter() < until:
                        pass
                    if state != "PROC":
                        read.seen = state
                except Exception:  # ``poll`` deals with a READ whose state cannot be read
                    pass
                # Over (the usual send: landed, committed and acked): taken here, not through a
                # turn of ``poll`` (four Python calls fewer on every send's path).
                if read.seen and self._poll_safely(read):
                    del self._inflight[0]
                    if not self._commits:
                        return
        self.poll()

    def poll(self) -> bool:
        if self._inflight:
            self._inflight = [read for read in self._inflight if not self._poll_safely(read)]
        while self._waiting:  # packed READs waiting for a slot: start what now fits, in order
            peer, msg, deadline = self._waiting[0]
            if time.monotonic() > deadline:
                self._waiting.popleft()
                self.table.fail(msg.request_id, "no staging slot came free in time")
                self._reply(peer, msg, "no staging slot came free in time")
            elif self._start(peer, self._sessions.get(peer), msg, queued=True):
                self._waiting.popleft()
            else:
                break
        if self._commits:
            self._settle_commits()
        return bool(self._inflight or self._waiting)

    def _settle_commits(self) -> None:
        """Commit (and ack) every waiting commit whose request has no READ left running or waiting
        for a slot: the sender sends its commit right behind its KVReadys, without waiting for
        them, and the ack tells it both that the KV landed and that its blocks are no longer read."""
        busy = {(r.peer, r.msg.request_id) for r in self._inflight} if self._inflight else ()
        if self._waiting:
            busy = {*busy, *((peer, msg.request_id) for peer, msg, _ in self._waiting)}
        waiting = []
        for peer, commit in self._commits:
            if (peer, commit.request_id) in busy:
                waiting.append((peer, commit))
                continue
            self._ack(peer, commit, self.table.commit(commit.request_id))
        self._commits = waiting

    def _ack(self, peer: bytes, commit: KVCommit, error: str) -> None:
        """The request's commit was taken ("") or refused (why): start it, and answer the sender."""
        if not error:
            self.on_commit(commit)
        if self.outbox is not None:
            self.outbox.put(peer, KVAck(request_id=commit.request_id, ok=not error, error=error))

    def drop(self, peer: bytes) -> None:
        """Its READs in flight run on to their end or deadline; its commits still waiting for them
        are never taken (the sender gave up on them, and may give their blocks back any time)."""
        self._sessions.pop(peer, None)
        for _, commit in [c for c in self._commits if c[0] == peer]:
            self.table.fail(commit.request_id, "the sender's connection closed before its KV landed")
        self._commits = [c for c in self._commits if c[0] != peer]

    def close(self) -> None:
        """After the control thread stopped: cancel what is left, and unpin it."""
        self.outbox = None  # the control connection is gone: nobody to answer
        self._waiting.clear()
        self._commits = []
        for read in self._inflight:
            read.deadline = 0.0
        give_up = time.monotonic() + self.options.max_read_s
        with on_device(self.kv):
            while self.poll() and time.monotonic() < give_up:
                time.sleep(POLL_S)

    # -- on the control thread ---------------------------------------------------------------------

    def _read_deadline(self, msg: KVReady) -> float:
        """When a READ (or its wait for a staging slot) is given up: the sender's timeout, bounded."""
        return time.monotonic() + min(max(msg.timeout_s, 0.0), self.options.max_read_s)

    def _queue(self, peer: bytes, msg: KVReady) -> None:
        self._waiting.append((peer, msg, self._read_deadline(msg)))

    def _packed_bytes(self, msg: KVReady) -> int:
        return (msg.layer_end - msg.layer_start) * len(msg.dst_block_ids) * self.slab_bytes

    def _poll_safely(self, read: _Read) -> bool:
        """``_poll``, and nothing may stop the control thread. A READ whose state cannot be read stays
        pinned until its deadline and then ends as failed once its cancel went through, never
        before: bytes may still be landing in the reserved blocks."""
        try:
            return self._poll(read)
        except Exception as e:
            if not read.cancel_logged:
                logger.warning("polling the NIXL READ for %s failed: %s", read.msg.request_id, e)
                read.cancel_logged = True
            if time.monotonic() < read.deadline:
                return False
            if read.scatter is None:
                try:
                    read.handle.release()
                except Exception:
                    return False
            elif read.scatter is not True and self.stream is not None:
                self.stream.synchronize()  # a scatter is still writing: wait it out
            self._end(read.peer, read.msg, read.slot, f"NIXL READ failed: {e}")
            return True

    def _refusal(self, remote: _Remote | None, msg: KVReady) -> str:
        """Why this READ must not start ("" when it may): it may only ever land in blocks reserved
        for ``msg.request_id``, from blocks inside the sender's registered cache (or staging region)."""
        if remote is None:
            return "KVReady on a connection without a nixl session"
        if not math.isfinite(msg.timeout_s):
            return f"KVReady with a timeout of {msg.timeout_s}"
        # The destination blocks: the reservation table's ``begin`` refuses any not reserved for the
        # request, or named twice.
        if not 0 <= msg.layer_start < msg.layer_end <= self.num_layers:
            return f"KVReady names layers [{msg.layer_start}, {msg.layer_end}) of {self.num_layers}"
        if msg.src_offset >= 0:
            nbytes = self._packed_bytes(msg)
            if nbytes > self.pool.slot_bytes:
                return (
                    f"a packed KVReady of {nbytes} bytes exceeds this node's {self.pool.slot_bytes}-byte slot"
                )
            if msg.src_offset + nbytes > remote.stage_bytes:
                return f"a packed KVReady reaches past the sender's {remote.stage_bytes}-byte staging region"
        else:
            if len(msg.src_block_ids) != len(msg.dst_block_ids):
                return f"KVReady names {len(msg.src_block_ids)} source blocks for {len(msg.dst_block_ids)}"
            if not valid_block_ids(msg.src_block_ids, remote.num_blocks):
                return f"KVReady names source blocks outside the sender's cache of {remote.num_blocks}"
        return ""

    def _start(self, peer: bytes, remote: _Remote | None, msg: KVReady, queued: bool = False) -> bool:
        """Start the READ, or refuse it; False only when a packed one must wait for a slot."""
        error = self._refusal(remote, msg)
        slot = -1
        if not error and msg.src_offset >= 0:
            slot = self.pool.try_acquire()
            if slot is None:
                if not queued:
                    self._queue(peer, msg)
                return False
        if not error:
            error = self.table.begin(msg.request_id, msg.dst_block_ids, msg.layer_start, msg.layer_end)
        if error:
            if slot >= 0:
                self.pool.release(slot)
            logger.warning("refusing a NIXL READ for %r: %s", msg.request_id[:64], error)
            self.table.fail(msg.request_id, error)
            self._reply(peer, msg, error)
            return True
        try:  # pinned from here: every way out ends the pin
            kv, handle = self.kv, None
            if slot >= 0:
                nbytes = self._packed_bytes(msg)
                at = self.pool.buf.data_ptr() + self.pool.offset(slot)
                local = np.array([[at, nbytes, device_id(kv)]], dtype=np.uint64)
                at = remote.stage_address + msg.src_offset
                source = np.array([[at, nbytes, remote.device]], dtype=np.uint64)
            elif (indices := self._unit_indices(remote, msg)) is not None:
                # One descriptor per unit, taken by index from the lists prepared once (no list built
                # for the READ): scattered blocks, or few (``_unit_indices``).
                nbytes = (msg.layer_end - msg.layer_start) * len(msg.dst_block_ids) * self.slab_bytes
                local, source = indices
                handle = self.agent.make_prepped_xfer("READ", self._units, local, remote.units, source)
            else:
                src, dst, lengths = coalesce(
                    msg.src_block_ids,
                    msg.dst_block_ids,
                    msg.layer_start,
                    msg.layer_end,
                    remote.layout,
                    self.layout,
                    self.options.max_desc_bytes,
                )
                nbytes = int(lengths.sum())
                local = _descs(kv.data_ptr(), dst, lengths, device_id(kv))
                source = _descs(remote.address, src, lengths, remote.device)
            if handle is None:
                local = self.agent.get_xfer_descs(local, mem_type(kv))
                source = self.agent.get_xfer_descs(source, remote.mem)
                handle = self.agent.initialize_xfer("READ", local, source, remote.agent)
            if self.agent.transfer(handle) == "ERR":
                handle.release()
                raise RuntimeError("the transfer was refused")
        except Exception as e:
            self._end(peer, msg, slot, f"NIXL READ could not start: {e}")
            return True
        self._inflight.append(_Read(handle, peer, msg, self._read_deadline(msg), nbytes, slot=slot))
        return True

    def _unit_indices(self, remote: _Remote, msg: KVReady):
        """(local, remote) indices into the prepared unit lists of a READ that is one descriptor per
        unit (whole blocks block-major, slabs layer-major): both caches laid out alike, block-major
        every layer, and its blocks scattered (no two consecutive in both caches: one descriptor per
        unit either way) or, block-major, at most ``prepared_max_blocks`` of them; None otherwise
        (``coalesce`` then builds its list)."""
        if not remote.by_index:
            return None
        l0, l1 = msg.layer_start, msg.layer_end
        if self.layout.block_major:
            if l0 or l1 != self.num_layers:
                return None
            if len(msg.dst_block_ids) > self.options.prepared_max_blocks and not _scattered(
                msg.src_block_ids, msg.dst_block_ids
            ):
                return None
            return msg.dst_block_ids, msg.src_block_ids  # the message's own lists (NIXL copies them)
        if not _scattered(msg.src_block_ids, msg.dst_block_ids):
            return None
        local = _slab_indices(msg.dst_block_ids, l0, l1, self.num_blocks)
        return local, _slab_indices(msg.src_block_ids, l0, l1, remote.num_blocks)

    def _poll(self, read: _Read) -> bool:
        """Check one READ (and a packed one's scatter); True once it is over (and unpinned)."""
        if read.scatter is not None:  # packed, landed in its slot: the scatter runs
            if read.scatter is not True and not read.scatter.query():
                if time.monotonic() < read.deadline:
                    return False
                self.stream.synchronize()  # a scatter does not hang: let it finish, then unpin
            self.bytes_received += read.nbytes
            self._end(read.peer, read.msg, read.slot, "")
            return True
        state = read.seen or self.agent.check_xfer_state(read.handle)
        if state == "DONE" and read.slot < 0 and time.monotonic() <= read.deadline:
            # Landed in place, in time: unpinned, committed and acked first; the handle, which reads
            # nothing any more, is given back after that, off the ack's path.
            self.bytes_received += read.nbytes
            self._end(read.peer, read.msg, -1, "")
            try:
                read.handle.release()
            except Exception as e:
                logger.warning("releasing a finished NIXL READ for %s failed: %s", read.msg.request_id, e)
            return True
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
        error = {"DONE": "", "PROC": "NIXL READ timed out"}.get(state, "NIXL READ failed (peer gone?)")
        if not error and time.monotonic() > read.deadline:
            # The sender may have stopped waiting (its deadline follows this one closely) and
            # given the source blocks back: what landed now may be stale, so it never commits.
            error = "NIXL READ ended past its deadline"
        if not error and read.slot >= 0:
            read.scatter = self._scatter(read)
            return self._poll(read)
        if not error:
            self.bytes_received += read.nbytes
        self._end(read.peer, read.msg, read.slot, error)
        return True

    def _scatter(self, read: _Read):
        """Copy a packed READ's slot into its reserved blocks (still pinned); the CUDA event after
        the copy, or True once done on the CPU."""
        msg, kv = read.msg, self.kv
        buf = self.pool.view(read.slot, kv, msg.layer_end - msg.layer_start, len(msg.dst_block_ids))
        layers = kv[msg.layer_start : msg.layer_end]
        if self.stream is None:
            scatter_from(buf, layers, block_index(msg.dst_block_ids, kv.device))
            return True
        with torch.cuda.stream(self.stream):
            # The ids' copy to the device on this stream too: on the default one it would wait for
            # the decode engine's step.
            scatter_from(buf, layers, block_index(msg.dst_block_ids, kv.device))
            event = torch.cuda.Event()
            event.record()
        return event

    def _end(self, peer: bytes, msg: KVReady, slot: int, error: str) -> None:
        """The READ (and scatter) is over: unpin, free its slot, tell the sender (``_reply``). The
        request's last READ that landed with its commit waiting (the usual send: one READ, the
        commit inside its KVReady) is committed as it is unpinned, under one hold of the table's
        lock, and acked at once; any other commit waits for ``_settle_commits``."""
        commits = self._commits
        if error:
            commit = None
        elif len(commits) == 1 and len(self._inflight) <= 1 and not self._waiting:  # the usual send
            commit = commits[0]  # (``_last_read``'s answer then, without the call)
            commit = commit if commit[0] == peer and commit[1].request_id == msg.request_id else None
        else:
            commit = self._last_read(peer, msg)
        outcome = self.table.end(
            msg.request_id, msg.dst_block_ids, msg.layer_start, msg.layer_end, error, commit is not None
        )
        if slot >= 0:
            self.pool.release(slot)
        if commit is None:
            self._reply(peer, msg, error)
            return
        self._commits.remove(commit)
        self._ack(peer, commit[1], outcome)

    def _last_read(self, peer: bytes, msg: KVReady) -> tuple[bytes, KVCommit] | None:
        """The commit waiting for ``msg``'s request (peer, commit) when this is its last READ: none
        other running (``_inflight`` may still hold this one) or waiting for a slot; else None."""
        rid = msg.request_id
        commit = next((c for c in self._commits if c[0] == peer and c[1].request_id == rid), None)
        if commit is None or any(
            r.msg is not msg and r.peer == peer and r.msg.request_id == rid for r in self._inflight
        ):
            return None
        if self._waiting and any(p == peer and m.request_id == rid for p, m, _ in self._waiting):
            return None
        return commit

    def _reply(self, peer: bytes, msg: KVReady, error: str) -> None:
        """Tell the sender the READ is over: it may reuse the source blocks from now on; unless the
        request's commit already waits here: its ack then tells the sender that every READ of the
        request is over (it has offered them all), and an error reaches it through the ack."""
        if any(p == peer and c.request_id == msg.request_id for p, c in self._commits):
            return
        if self.outbox is not None:
            self.outbox.put(peer, KVReadDone(msg.request_id, msg.xfer_id, error))
