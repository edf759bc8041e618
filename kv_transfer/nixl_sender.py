"""The prefill side of the NIXL transport (``kv_transfer.nixl_backend`` says how it works): a
session offers each send's blocks for the decode node's READs, in place or packed into staging
slots, and keeps them until the READs are over."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.kv_transfer.base import (
    KVLayout,
    KVRefused,
    KVTransferError,
    Staged,
    block_index,
    call_at,
    gather_into,
    in_place,
    layer_chunks,
    num_regions,
    slab_bytes,
)
from pdserve.kv_transfer.messages import (
    KVCommit,
    KVMessage,
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
from pdserve.kv_transfer.plane import ControlLink, SenderPlane, SenderSession
from pdserve.kv_transfer.staging import stage_pieces
from pdserve.messages import encode


class NixlSenderPlane(CacheEnd, SenderPlane):
    name = "nixl"

    def __init__(self, options: NixlOptions = NixlOptions()) -> None:
        self.options = options
        self._xfer_ids = itertools.count(1)
        self._lock = threading.Lock()  # peer threads connect concurrently
        self._remotes: set[str] = set()

    def register(self, kv: torch.Tensor) -> None:
        self.take_cache(kv, "prefill")
        self.packs_here = kv.is_cuda or self.options.pack_on_cpu  # where ``packs`` may say yes

    def offer(self) -> NixlOffer:
        kv = self.kv
        return NixlOffer(
            agent=self.agent.name,
            metadata=self.agent.get_agent_metadata(),
            cache=(kv.data_ptr(), kv.shape[0], kv.shape[1], slab_bytes(kv), device_id(kv)),
            block_major=self.layout.block_major,
            mem=mem_type(kv),
            stage=(self.pool.buf.data_ptr(), self.pool.buf.numel()),
        )

    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> Staged:
        # The blocks stay in the registered cache: read in place, or packed into staging slots by
        # ``deliver`` as their layers are written.
        return in_place(kv, block_ids, layer_events, written)

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> NixlSession:
        accept = reply.accept if isinstance(reply.accept, NixlAccept) else NixlAccept()
        with self._lock:
            if accept.agent not in self._remotes:
                self.agent.add_remote_agent(accept.metadata)
                self._remotes.add(accept.agent)
        return NixlSession(self, link, same_gpu=bool(self.gpu) and accept.gpu == self.gpu)

    def progress(self) -> None:
        """Progress UCX here, for transports whose READs need the target's help (TCP; not CUDA IPC,
        RDMA or CMA), and for a first connection's wire-up."""
        self.agent.get_new_notifs()


def packs(
    kv: torch.Tensor,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    pieces: int,
    options: NixlOptions = NixlOptions(),
    layout: KVLayout | None = None,
) -> bool:
    """Whether a send is packed into ``pieces`` staging slots rather than read in place: on CUDA,
    when in place it would take more than ``descriptors_per_piece`` descriptors (``num_regions``:
    one per run of blocks consecutive in both caches, per layer and run layer-major) for each
    piece. Never on the CPU (unless ``pack_on_cpu``), where a descriptor costs little beside
    copying the bytes twice more. ``layout``: the cache's (``KVLayout.of``), when known already."""
    if not (kv.is_cuda or options.pack_on_cpu):
        return False
    layout = layout or KVLayout.of(kv)
    limit = options.descriptors_per_piece * pieces
    # At most a descriptor per block (block-major), per (layer, block) layer-major: a send of few
    # blocks, the usual one, cannot pack, and its runs need not be cut (``num_regions``).
    if len(src_block_ids) * (1 if layout.block_major else layout.num_layers) <= limit:
        return False
    return num_regions(src_block_ids, dst_block_ids, 0, kv.shape[0], layout) > limit


READ_MARGIN_S = 0.5
"""A KVReady gives the decode node the send's time left less this (at most a tenth of it) for its
READ: a READ still running then fails before the sender stops waiting for the ack, so a commit
that waited behind it is refused before the sender may give the source blocks back."""


class _Offered(NamedTuple):
    """A READ offered to the decode node and not yet reported over (a tuple: one is made per send,
    on the caller's path, where a frozen dataclass's ``__init__`` costs a microsecond)."""

    slot: int  # the staging slot it reads (-1: in place)
    read_until: float  # time.monotonic() here when the decode node's time for it ends


class NixlSession(SenderSession):
    """Offers READs on the session's lane (the control connection where it has none). The READs
    offered and not yet reported over (``KVReadDone``) are the session's ``pending``, whatever send
    offered them: reports the control host receives while it waits for an ack come here too
    (``received``)."""

    def __init__(self, plane: NixlSenderPlane, link: ControlLink, same_gpu: bool = False) -> None:
        self.plane = plane
        self.peer = link
        self.same_gpu = same_gpu  # the peer's cache is on this cache's GPU: no READ during a forward
        self.progress = plane.progress
        self._pending: dict[int, _Offered] = {}  # xfer id -> the READ
        self._error = ""  # the first refusal among the pending READs' reports

    carries_commit = True  # inside the send's last KVReady

    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> Callable[[float], None]:
        """Offer the blocks for READs, a chunk of layers as soon as the kernels that wrote it are
        done (all layers at once without per-layer events, or when the peer's cache is on this GPU:
        ``same_gpu``), in place or packed into staging slots
        (``packs``), the last KVReady with ``commit``, and return: the decode node commits behind its
        own READs. The returned function waits until the peer reported every READ over
        (``KVReadDone``; raises KVRefused if one was refused); after the ack it returns at once."""
        src, dst, num_layers = staged.block_ids, dst_block_ids, self.plane.layout.num_layers
        self._error = ""
        pieces, chunks = self._plan(staged, dst)
        if pieces:
            self._deliver_packed(request_id, staged, dst, pieces, deadline, commit)
            return self._finish
        for l0, l1 in chunks:
            staged.wait(l1)
            self._offer(
                request_id, -1, src, dst, l0, l1, deadline, commit=commit if l1 == num_layers else None
            )
        return self._finish

    def _plan(self, staged: Staged, dst: Sequence[int]) -> tuple[list, list[tuple[int, int]]]:
        """How ``deliver`` sends: the pieces of a packed send (``_pieces``), else no pieces and the
        layer chunks READ in place (per-layer events: chunks follow the layers as they finish; not
        on one GPU, nor out of a block-major cache: the docstring)."""
        plane = self.plane
        num_layers = plane.layout.num_layers
        layer_wise = len(staged.ready) > 1 and not self.same_gpu and not plane.layout.block_major
        pieces = self._pieces(staged.block_ids, dst, layer_wise)
        if pieces:
            return pieces, []
        if layer_wise:
            return [], layer_chunks(num_layers, len(dst) * plane.slab_bytes, plane.options.layer_chunk_bytes)
        return [], [(0, num_layers)]

    def _pieces(self, src: Sequence[int], dst: Sequence[int], layer_wise: bool) -> list:
        """The staging pieces of a send that packs (``packs``, with as many descriptors as its pieces
        allow), else []. Packing is first considered as one piece: more pieces only allow more
        descriptors, so a send of few runs (the usual one) skips cutting its pieces."""
        plane, layout = self.plane, self.plane.layout
        if not (plane.packs_here and packs(plane.kv, src, dst, 1, plane.options, layout)):
            return []
        chunk_bytes = plane.options.layer_chunk_bytes if layer_wise else 0
        pieces = stage_pieces(
            layout.num_layers, len(dst), plane.slab_bytes, plane.pool.slot_bytes, chunk_bytes
        )
        return pieces if packs(plane.kv, src, dst, len(pieces), plane.options, layout) else []

    def post(
        self,
        request_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit,
    ) -> Callable[[float], None] | None:
        """One KVReady, with the commit: the blocks READ in place in one READ (written: no layer
        chunks), none of the session's READs pending, and the send not one that packs
        (``_pieces``); None otherwise."""
        plane = self.plane
        if self._pending or (
            # ``packs``' first test inline (a send of few blocks, the usual one, cannot pack)
            plane.packs_here
            and len(src_block_ids) * (1 if plane.layout.block_major else plane.layout.num_layers)
            > plane.options.descriptors_per_piece
            and self._pieces(src_block_ids, dst_block_ids, False)
        ):
            return None
        self._error = ""
        num_layers = self.plane.layout.num_layers
        self._offer(request_id, -1, src_block_ids, dst_block_ids, 0, num_layers, deadline, commit=commit)
        return self._finish

    def _offer(
        self,
        request_id: str,
        slot: int,
        src: list[int],
        dst: list[int],
        layer_start: int,
        layer_end: int,
        deadline: float,
        src_offset: int = -1,
        commit: KVCommit | None = None,
    ) -> None:
        """Send one KVReady, with the READ's time to run (the send's time left less ``READ_MARGIN_S``,
        at most a tenth of it); pending until reported
        (or, with the commit, until the ack)."""
        now = time.monotonic()
        left = max(deadline - now, 0.0)
        timeout = max(left - min(READ_MARGIN_S, left / 10), 0.0)
        xfer_id = next(self.plane._xfer_ids)
        msg = KVReady(request_id, xfer_id, src, dst, layer_start, layer_end, timeout, src_offset, commit)
        self._pending[xfer_id] = _Offered(slot, now + timeout)
        self.peer.send([encode(msg)], deadline)

    def _finish(self, until: float) -> None:
        if self._pending or self._error:  # (after the ack, the usual case: neither)
            self._drain(until, "")

    def received(self, msg: KVMessage) -> None:
        if isinstance(msg, KVReadDone):
            self._done(msg)

    def acked(self) -> None:
        """The decode node answered the commit only once no READ of the request was left, and
        reports no READ that ends after the commit arrived: every pending one is over."""
        for read in self._pending.values():
            if read.slot >= 0:
                self.plane.pool.release(read.slot)
        self._pending.clear()

    def _done(self, done: KVReadDone) -> bool:
        """A READ is over: free its slot; False for a report of none pending (a transfer given up)."""
        if done.xfer_id not in self._pending:
            return False
        slot = self._pending.pop(done.xfer_id).slot
        if slot >= 0:
            self.plane.pool.release(slot)
        self._error = self._error or done.error
        return True

    def _deliver_packed(
        self,
        request_id: str,
        staged: Staged,
        dst: list[int],
        pieces: list,
        deadline: float,
        commit: KVCommit | None,
    ) -> None:
        """Per piece (``stage_pieces``): take a free slot (taking the peer's reports of earlier
        pieces while none is free), gather the piece into it once its layers are written, offer it
        for one READ, the last with ``commit``. A slot is free again once the peer reported its READ
        over. Where a refusal stops the pieces early, the commit goes alone (the peer refuses it)."""
        plane, kv = self.plane, self.plane.kv
        with on_device(kv), _stream(plane.stream):
            idx = block_index(staged.block_ids, kv.device)
            for i, (l0, l1, b0, b1) in enumerate(pieces):
                slot = self._take_slot(deadline)
                if slot is None:  # a piece was refused: offer no more
                    break
                try:
                    staged.wait(l1)
                    gather_into(kv[l0:l1], idx[b0:b1], plane.pool.view(slot, kv, l1 - l0, b1 - b0))
                    if plane.stream is not None:
                        plane.stream.synchronize()  # gathered before the peer reads the slot
                except BaseException:
                    plane.pool.release(slot)
                    raise
                last = commit if i == len(pieces) - 1 else None
                self._offer(request_id, slot, [], dst[b0:b1], l0, l1, deadline, plane.pool.offset(slot), last)
                if last is not None:
                    return
        if commit is not None:
            self.peer.send([encode(commit)], deadline)

    def _take_slot(self, deadline: float) -> int | None:
        """A free staging slot: while none is, wait for this session's READs to end (None once one
        was refused), or, when it has none in flight, for other sends to give one back."""
        pool = self.plane.pool
        while True:
            if self._error:
                return None
            slot = pool.try_acquire()
            if slot is not None:
                return slot
            if self._pending:
                self._wait_one(deadline)
                continue
            slot = pool.acquire(min(deadline - time.monotonic(), 0.01))
            if slot is not None:
                return slot
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"no nixl staging slot came free in time for KV peer {self.peer.address}"
                )

    def _wait_one(self, deadline: float) -> None:
        """Wait until one of the pending READs is reported over."""
        while not self._done(self.peer.recv(deadline, KVReadDone, idle=self.plane.progress)):
            pass  # late reports of transfers given up

    def _drain(self, deadline: float, error: str) -> None:
        """Wait for every READ offered to be over, even after one was refused: the send ends (and
        the caller may reuse the blocks, this plane the slots) only once none can read them any
        more. Raises KVRefused with the first refusal."""
        while self._pending:
            self._wait_one(deadline)
        error = error or self._error
        self._error = ""
        if error:
            raise KVRefused(f"KV peer {self.peer.address} refused a NIXL READ: {error}")

    def close(self) -> float:
        """The connection is gone with READs not reported over: each ends on the decode node by the
        time it was given (failed, if it is still running then; never later than ``max_read_s``),
        so their blocks and slots are free only after that, plus ``READ_MARGIN_S`` for the trip of
        the KVReady. Returns at once with that time (now when nothing is pending), and gives the
        slots back then, on a timer. A decode node that is gone or stuck says nothing more, so the
        wait is never cut short."""
        now = time.monotonic()
        if not self._pending:
            return now
        read_until = max(read.read_until for read in self._pending.values())
        free_at = min(read_until, now + self.plane.options.max_read_s) + READ_MARGIN_S
        slots = [read.slot for read in self._pending.values() if read.slot >= 0]
        self._pending.clear()
        pool = self.plane.pool

        def give_back() -> None:
            for slot in slots:
                pool.release(slot)

        call_at(free_at, give_back)
        return free_at


def _stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
