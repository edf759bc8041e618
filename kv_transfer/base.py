"""The two halves of the KV transport API (``KVSender``, ``KVReceiver``), the lease table every
receiver validates against, and the block helpers the planes share."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kv_transfer.messages import KVAck, KVCommit
from pdserve.messages import NodeInfo, mismatches

logger = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A transfer or handshake failed; the message says why."""


class KVHandshakeRefused(KVTransferError):
    """The peer answered the handshake or the transport set-up and refused it (incompatible nodes,
    a wrong cluster token, no transport in common): nothing changes that until a node restarts, so
    the sender remembers it for that peer instead of trying again."""


class KVRefused(KVTransferError):
    """The peer answered and refused the request (its lease ran out, its blocks are not reserved,
    a READ of it was refused): the connection is in a known state and stays up."""


def check_compatible(ours: NodeInfo, theirs: NodeInfo) -> list[str]:
    """Human-readable mismatches between two nodes (empty when they may exchange KV)."""
    return [
        f"{name}: {a!r} ({ours.node_id}) vs {b!r} ({theirs.node_id})"
        for name, a, b in mismatches(ours, theirs)
    ]


@dataclass
class _Reservation:
    block_ids: list[int]
    deadline: float
    allowed: frozenset[int]
    lease_s: float
    # What landed: (layer start, layer end, block ids) per write, checked for coverage at commit
    # (one record per write, not one entry per layer and block: a 1 GiB send is 16k of those).
    landed: list[tuple[int, int, Sequence[int]]] = field(default_factory=list)
    error: str = ""
    committed: bool = False

    def num_missing(self, num_layers: int) -> int:
        """(layer, block) units of the reservation no write covered (``ReservationTable._commit``
        answers the usual case, one write of every block in order, before calling this)."""
        landed = self.landed
        if all(start == 0 and end == num_layers for start, end, _ in landed):
            # Every write covered all layers (the common case of a send in one piece): a set will do,
            # which costs a few microseconds where the grid below costs tens.
            covered = set().union(*(block_ids for _, _, block_ids in self.landed))
            return num_layers * sum(1 for b in self.block_ids if b not in covered)
        ids = np.sort(np.asarray(self.block_ids, dtype=np.int64))
        covered = np.zeros((num_layers, len(ids)), dtype=bool)
        for layer_start, layer_end, block_ids in self.landed:
            covered[layer_start:layer_end, np.searchsorted(ids, np.asarray(block_ids, dtype=np.int64))] = True
        return int(covered.size - covered.sum())


class ReservationTable:
    """Leases on reserved blocks, shared by the engine thread and the receiver's threads.

    A transport writes into the cache only while the table says the blocks belong to a live,
    uncommitted reservation, and the engine thread releases a reservation here before it frees
    the blocks. Two ways to write:

    * ``write(..., fn)``: ``fn`` (a local copy) runs under the table's lock, so a frame lands
      either before the release or not at all (zmq, and nccl's scatter from its receive buffer).
    * ``begin`` ... ``end``: for a one-sided transfer the receiver starts and cannot stop at
      will (a NIXL READ into the reserved blocks). ``begin`` pins the reservation; ``release``
      then waits until every pinned transfer of that request has ended, so it never returns
      while bytes may still land in blocks about to be freed. Receivers bound every pinned
      transfer by a deadline after which they cancel it.
    """

    RELEASE_WAIT_S = 120.0
    """Longest ``release`` waits for pinned transfers (receivers cancel theirs well before)."""

    def __init__(self, num_layers: int, clock: Callable[[], float] = time.time) -> None:
        self.num_layers = num_layers
        self._clock = clock
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._table: dict[str, _Reservation] = {}
        self._inflight: dict[str, int] = {}  # request id -> pinned transfers not yet ended
        self._releasing = 0  # ``release`` calls waiting for pinned transfers to end

    def add(self, request_id: str, block_ids: Sequence[int], deadline: float) -> None:
        with self._lock:
            lease_s = max(deadline - self._clock(), 0.0)
            self._table[request_id] = _Reservation(list(block_ids), deadline, frozenset(block_ids), lease_s)

    def renew(self, request_ids: Sequence[str]) -> int:
        """Push the deadlines of live, uncommitted reservations one lease length past now."""
        now = self._clock()
        renewed = 0
        with self._lock:
            for request_id in request_ids:
                r = self._table.get(request_id)
                # A renewal that arrives a little late still counts until the engine thread has
                # expired the reservation (which removes it from the table).
                if r is not None and not r.committed:
                    r.deadline = max(r.deadline, now + r.lease_s)
                    renewed += 1
        return renewed

    def release(self, request_id: str) -> None:
        """Drop the reservation; returns once no transfer can write into its blocks any more."""
        with self._settled:
            self._table.pop(request_id, None)
            if not self._inflight.get(request_id):
                return
            self._releasing += 1
            try:
                ended = self._settled.wait_for(
                    lambda: not self._inflight.get(request_id), self.RELEASE_WAIT_S
                )
            finally:
                self._releasing -= 1
            if not ended:
                logger.error(
                    "KV transfer for %s still in flight after %.0f s", request_id, self.RELEASE_WAIT_S
                )

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._table

    def _check(self, request_id: str, block_ids: Sequence[int], layer_start: int, layer_end: int) -> str:
        """Why a write into these blocks is refused now ("" when it may land). Caller holds the lock."""
        r = self._table.get(request_id)
        if r is None:
            return f"no reservation for request {request_id!r} (expired, aborted or unknown)"
        if r.committed:
            return f"request {request_id!r} was already committed"
        if self._clock() > r.deadline:
            r.error = "lease expired before the KV arrived"
        elif not 0 <= layer_start < layer_end <= self.num_layers:
            r.error = f"layer range [{layer_start}, {layer_end}) outside [0, {self.num_layers})"
        elif not block_ids or not (
            (block_ids if type(block_ids) is list else list(block_ids)) == r.block_ids
            or _distinct_within(block_ids, r.allowed)
        ):
            # (A send of the whole reservation in its order, the usual one, is compared in C, inline
            # on every send's path; its ids are the engine's, distinct and inside the cache, which
            # receivers need not check.)
            r.error = f"block ids {list(block_ids)[:8]} are not all reserved for {request_id!r}, or repeat"
        else:
            return ""
        return r.error

    def write(
        self,
        request_id: str,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        fn: Callable[[], None],
    ) -> str:
        """Run ``fn`` (the copy into the cache) if the frame fits the reservation; returns an error or ""."""
        with self._lock:
            error = self._check(request_id, block_ids, layer_start, layer_end)
            if error:
                return error
            fn()
            self._table[request_id].landed.append((layer_start, layer_end, block_ids))
            return ""

    def begin(self, request_id: str, block_ids: Sequence[int], layer_start: int, layer_end: int) -> str:
        """Pin the reservation for a transfer into these blocks that starts now; "" or why not.

        Every successful ``begin`` must be followed by exactly one ``end`` for the same blocks."""
        with self._lock:
            error = self._check(request_id, block_ids, layer_start, layer_end)
            if not error:
                self._inflight[request_id] = self._inflight.get(request_id, 0) + 1
            return error

    def end(
        self,
        request_id: str,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        error: str = "",
        commit: bool = False,
    ) -> str:
        """The pinned transfer is over: landed (``error`` empty) or failed / cancelled. With
        ``commit`` (the request's last transfer, its commit waiting), the request is then committed
        under the same hold of the lock: ``commit``'s error, or "" once committed; else ""."""
        with self._lock:  # ``_settled``'s lock, taken without the Condition's two Python calls
            left = self._inflight.get(request_id, 0) - 1
            if left > 0:
                self._inflight[request_id] = left
            else:
                self._inflight.pop(request_id, None)
            r = self._table.get(request_id)
            if r is not None and not r.committed:
                if error:
                    r.error = r.error or error
                else:
                    r.landed.append((layer_start, layer_end, block_ids))
            if self._releasing:
                self._settled.notify_all()
            return self._commit(request_id) if commit else ""

    def fail(self, request_id: str, error: str) -> None:
        with self._lock:
            r = self._table.get(request_id)
            if r is not None and not r.error:
                r.error = error

    def commit(self, request_id: str) -> str:
        """Mark complete if every (layer, block) landed and nothing failed; returns an error or ""."""
        with self._lock:
            return self._commit(request_id)

    def _commit(self, request_id: str) -> str:
        """``commit``; the caller holds the lock."""
        r = self._table.get(request_id)
        if r is None:
            return f"no reservation for request {request_id!r} (expired, aborted or unknown)"
        if r.error:
            return r.error
        if self._clock() > r.deadline:
            return "lease expired before the KV arrived"
        if self._inflight.get(request_id):
            return f"request {request_id!r} committed while part of its KV was still in flight"
        # One write of every block in the reservation's order, the usual send: compared in C here,
        # on every send's path, before ``num_missing``'s general count.
        landed = r.landed
        ids = landed[0][2] if len(landed) == 1 and landed[0][:2] == (0, self.num_layers) else None
        if ids is not None and (ids if type(ids) is list else list(ids)) == r.block_ids:
            missing = 0
        else:
            missing = r.num_missing(self.num_layers)
        if missing:
            return f"{missing} of {self.num_layers * len(r.block_ids)} layer-blocks never arrived"
        r.committed = True
        return ""

    def expired(self) -> list[str]:
        """Uncommitted reservations past their deadline."""
        now = self._clock()
        with self._lock:
            return [rid for rid, r in self._table.items() if not r.committed and now > r.deadline]


class KVSendFuture(Future[KVAck | None]):
    """What ``KVSender.send`` returns: two signals, since a send may fail before its blocks are free.

    * The future itself: the send's outcome (the ack, None for a send without a commit, or a
      ``KVTransferError``), at the latest at the send's timeout: the caller fails or retries the
      request then.
    * ``released``: resolves (always with None) once the transport can no longer read the source
      blocks; only then may the caller reuse them. It resolves with the outcome, or right after it,
      except when the send fails while data may still move on its own: nixl after a timeout or a
      dead peer, once every READ the decode node was offered on that connection is past the time it
      was given (a late READ could otherwise read blocks given to another request). A sender
      releases its sends to one peer in the order it took them, so a send's ``released`` also
      covers the earlier sends of its request (chunks whose futures nobody waits for)."""

    def __init__(self) -> None:
        super().__init__()
        self.released: Future[None] = Future()

    @classmethod
    def failed(cls, error: BaseException) -> KVSendFuture:
        """A send that failed before any of its data left: both signals at once."""
        fut = cls()
        fut.set_exception(error)
        fut.released.set_result(None)
        return fut


def call_at(when: float, fn: Callable[[], None]) -> None:
    """Run ``fn`` at ``time.monotonic()`` ``when``: here and now if that is past, else on a timer
    thread of its own (for rare events: a connection given up with transfers that may still run)."""
    delay = when - time.monotonic()
    if delay <= 0:
        fn()
        return
    timer = threading.Timer(delay, fn)
    timer.daemon = True
    timer.start()


class KVReceiver(ABC):
    """Decode side: receives blocks into reserved slots of the registered cache."""

    name: str

    @abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """``kv_cache``: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def start(self, info: NodeInfo, table: ReservationTable, on_commit: Callable[[KVCommit], None]) -> str:
        """Start serving; returns the address senders connect to. ``on_commit`` runs on the receiver
        thread after a request's reservation was committed, and must only hand the commit over."""

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    """Prefill side: sends a request's blocks into a peer's reserved blocks."""

    name: str

    @abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None: ...

    @abstractmethod
    def renew(self, address: str, info: NodeInfo, request_ids: Sequence[str]) -> None:
        """Ask the peer to extend the leases of requests this node still works on (no reply)."""

    @abstractmethod
    def handshake(self, address: str, info: NodeInfo, timeout: float) -> NodeInfo:
        """Exchange ``NodeInfo`` with the peer at ``address``; raises ``KVTransferError`` on mismatch."""

    @abstractmethod
    def send(
        self,
        address: str,
        info: NodeInfo,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        commit: KVCommit | None,
        timeout: float,
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> KVSendFuture:
        """Deliver the blocks ``src_block_ids`` of the local cache into the peer's reserved
        ``dst_block_ids``. The caller keeps the source blocks unchanged until the returned future's
        ``released`` resolves, which may be later than the outcome after a failure
        (``KVSendFuture``): a transport may read them in place (nixl) rather than copy them out here
        (zmq, nccl). Without a commit, more blocks of the request follow in later calls (a prompt sent
        chunk by chunk while it is computed) and the future resolves to None once the blocks are
        out (for nixl: read by the peer); with one, it resolves to the peer's ack after it checked
        that every block of the reservation landed. Failures raise ``KVTransferError``; blocks of a
        failed partial send make the final commit fail, and a request whose send failed is never
        committed, so partial KV is never used; and blocks are reused only once ``released``, so
        no late READ of a peer that missed the failure can carry another request's KV into a
        request it then commits.

        On CUDA the blocks may still be being written by kernels queued on the current stream:
        the send waits for them. ``layer_events`` (one CUDA event per layer, after which that
        layer of the blocks is written) lets a transport that moves blocks in place start on the
        first layers while the last ones are computed; without them it waits for everything
        queued so far. ``written``: the caller knows the kernels that wrote the blocks are done (it
        read back a later result of their stream: a prompt's first token), so the send waits for
        nothing; with async scheduling the stream may already hold the next step, which the send
        would otherwise wait for."""

    @abstractmethod
    def close(self) -> None: ...


@dataclass
class Staged:
    """A send's source blocks as its transport moves them: ``tensor`` [L, n, 2, BS, Hkv, D] when
    copied out of the cache (zmq, nccl; None for nixl, which reads ``block_ids`` in place).

    On CUDA, ``ready`` holds events after which layers are readable: the copy runs in layer chunks,
    each followed by an event, so a transport can start moving the first layers while the last
    ones are still being gathered; an in-place send has one event, recorded after the kernels
    that wrote the blocks."""

    tensor: torch.Tensor | None
    block_ids: list[int] = field(default_factory=list)
    ready: list[tuple[int, object]] = field(default_factory=list)  # (layer end, CUDA event), in order

    def event(self, layer_end: int | None = None):
        """The event after which layers [0, layer_end) (default: all) are staged; None on the CPU."""
        for end, event in self.ready:
            if layer_end is not None and end >= layer_end:
                return event
        return self.ready[-1][1] if self.ready else None

    def wait(self, layer_end: int | None = None) -> None:
        """Block until layers [0, layer_end) (default: all) are staged."""
        event = self.event(layer_end)
        if event is not None:
            event.synchronize()


@dataclass(frozen=True)
class KVLayout:
    """Where each (layer, block) slab ``[2, BS, Hkv, D]`` of a cache lies in its one memory region.

    Every cache is indexed ``[L, NB, 2, BS, Hkv, D]``; in memory it is either **block-major** (the
    engine's: a block's slabs of every layer follow one another, so a block is one contiguous
    ``L * slab`` bytes and a run of consecutive blocks one region, whatever the layer count) or
    **layer-major** (a layer's slabs of every block follow one another: a block is ``L`` pieces).
    Slab number ``index(layer, block)`` starts at byte ``index * slab`` of the region."""

    num_layers: int
    num_blocks: int
    slab: int  # bytes
    block_major: bool

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVLayout:
        """The layout of ``kv``; ValueError unless it is one region laid out one of the two ways."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(f"a KV cache is [L, NB, 2, BS, Hkv, D], got {tuple(kv.shape)}")
        slab = kv[0, 0].numel() * kv.element_size()
        if kv.is_contiguous():  # also when L or NB is 1, where the two layouts are one
            return cls(kv.shape[0], kv.shape[1], slab, False)
        if kv.transpose(0, 1).is_contiguous():
            return cls(kv.shape[0], kv.shape[1], slab, True)
        raise ValueError(f"a KV cache must be one region, layer- or block-major; strides {kv.stride()}")

    def index(self, layer: int, block: int) -> int:
        return block * self.num_layers + layer if self.block_major else layer * self.num_blocks + block

    def whole(self, layer_start: int, layer_end: int) -> bool:
        """Whether ``[layer_start, layer_end)`` is every layer."""
        return layer_start == 0 and layer_end == self.num_layers


def region_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The cache's whole memory region as a 1-D uint8 tensor (either layout)."""
    base = kv.transpose(0, 1) if KVLayout.of(kv).block_major else kv
    return base.reshape(-1).view(torch.uint8)


def run_regions(
    runs: Sequence[tuple[int, int]], layer_start: int, layer_end: int, layout: KVLayout
) -> list[tuple[int, int]]:
    """(first slab, slab count) of the regions that hold layers [layer_start, layer_end) of the
    runs ``(first block, count)`` of consecutive blocks, in the order a sender frames them and a
    receiver of the same layout reads them back: block-major, a run of every layer is one region
    and otherwise each block one region; layer-major, each (layer, run) one region, layer by layer."""
    layers = layer_end - layer_start
    if layout.block_major:
        if layout.whole(layer_start, layer_end):
            return [(b * layers, c * layers) for b, c in runs]
        return [(layout.index(layer_start, b + i), layers) for b, c in runs for i in range(c)]
    return [(layer * layout.num_blocks + b, c) for layer in range(layer_start, layer_end) for b, c in runs]


def coalesce(
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    layer_start: int,
    layer_end: int,
    src: KVLayout,
    dst: KVLayout,
    max_bytes: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets in the source cache, in the destination cache, and lengths of the regions that
    move layers [layer_start, layer_end) of ``src_block_ids[i]`` into ``dst_block_ids[i]``, as few
    as the two layouts allow (``KVLayout``); ``max_bytes`` (if set) caps their length.

    Runs are cut once per send from the block lists (``block_runs``, no numpy: this is on the
    critical path of every transfer, and a handful of numpy calls on tiny arrays costs more than
    the loop). Both block-major: one region per run (every layer) or per block (a layer range).
    Both layer-major: one per (layer, run), a run that ends both caches' layers continuing into
    the next layer when that layer's first run starts at block 0 of both. Layouts that differ (no
    two nodes of one cluster: ``NodeInfo.kv_layout``) get one region per slab, merged where
    consecutive in both."""
    assert src.slab == dst.slab and src.num_layers == dst.num_layers, (src, dst)
    slab = src.slab
    runs = block_runs(src_block_ids, dst_block_ids)
    src_list: list[int] = []
    dst_list: list[int] = []
    count_list: list[int] = []
    if src.block_major and dst.block_major:
        for s, d, c in runs:
            if src.whole(layer_start, layer_end):
                src_list.append(s * src.num_layers)
                dst_list.append(d * dst.num_layers)
                count_list.append(c * src.num_layers)
                continue
            for i in range(c):
                src_list.append(src.index(layer_start, s + i))
                dst_list.append(dst.index(layer_start, d + i))
                count_list.append(layer_end - layer_start)
    else:
        mixed = src.block_major != dst.block_major
        for layer in range(layer_start, layer_end):
            for s, d, c in ((s + i, d + i, 1) for s, d, n in runs for i in range(n)) if mixed else runs:
                s, d = src.index(layer, s), dst.index(layer, d)
                if count_list and src_list[-1] + count_list[-1] == s and dst_list[-1] + count_list[-1] == d:
                    count_list[-1] += c  # continues the previous region on both sides
                else:
                    src_list.append(s)
                    dst_list.append(d)
                    count_list.append(c)
    src_at = np.array(src_list, dtype=np.int64)
    dst_at = np.array(dst_list, dtype=np.int64)
    counts = np.array(count_list, dtype=np.int64)
    cap = max(1, max_bytes // slab) if max_bytes else 0
    if cap and counts.max() > cap:  # cut long regions into pieces of ``cap`` slabs
        pieces = -(-counts // cap)
        first = np.repeat(np.arange(len(counts)), pieces)
        k = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number in run
        src_at = src_at[first] + k * cap
        dst_at = dst_at[first] + k * cap
        counts = np.minimum(np.repeat(counts, pieces) - k * cap, cap)
    return src_at * slab, dst_at * slab, counts * slab


def num_regions(
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    layer_start: int,
    layer_end: int,
    layout: KVLayout,
) -> int:
    """How many regions ``coalesce`` makes of a send between two caches of ``layout`` (layer-major:
    at most; runs continuing into the next layer merge), without making them."""
    runs = block_runs(src_block_ids, dst_block_ids)
    if layout.block_major:
        return len(runs) if layout.whole(layer_start, layer_end) else len(src_block_ids)
    return (layer_end - layer_start) * len(runs)


def slab_bytes(kv: torch.Tensor) -> int:
    """Bytes of one (layer, block) slab ``[2, BS, Hkv, D]`` of a cache ``[L, NB, 2, BS, Hkv, D]``."""
    return kv[0, 0].numel() * kv.element_size()


def _distinct_within(block_ids: Sequence[int], allowed: frozenset[int]) -> bool:
    """``block_ids`` are distinct and each one of ``allowed``."""
    ids = set(block_ids)
    return len(ids) == len(block_ids) and ids <= allowed


def consecutive(block_ids: Sequence[int]) -> bool:
    """Whether ``block_ids`` is a run ``k, k + 1, ...`` (empty: no). Checked by one list comparison in
    C rather than a Python loop (512 ids: 7 us against 35 for ``block_runs``' loop on a 2-core box):
    a prompt's blocks, freshly allocated, usually are one run on both nodes."""
    n = len(block_ids)
    if not n or block_ids[-1] - block_ids[0] != n - 1:
        return False
    first = block_ids[0]
    ids = block_ids if isinstance(block_ids, list) else list(block_ids)
    return ids == list(range(first, first + n))


def block_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source start, destination start, count) of the runs of blocks consecutive on both sides.

    Once per send on each side, on the critical path: one run on both sides is recognized without a
    loop (``consecutive``); otherwise the open run lives in three locals, not in a tuple rebuilt per
    block (4x faster at 512 blocks in order, 88 -> 21 us on a 2-core box)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
    if consecutive(src_block_ids) and consecutive(dst_block_ids):
        return [(src_block_ids[0], dst_block_ids[0], len(src_block_ids))]
    runs: list[tuple[int, int, int]] = []
    pairs = zip(src_block_ids, dst_block_ids, strict=True)
    first = next(pairs, None)
    if first is None:
        return runs
    (s0, d0), n = first, 1
    for s, d in pairs:
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


STAGE_CHUNK_BYTES = 64 << 20
"""Staging on CUDA is cut into layer chunks of about this size (one kernel and event each)."""


def layer_chunks(num_layers: int, bytes_per_layer: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of at most ``chunk_bytes`` (at least one layer each)."""
    step = max(1, chunk_bytes // max(bytes_per_layer, 1))
    return [(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)


def select_blocks(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``kv[:, idx]`` (some layers of a cache, ``[layers, n, 2, BS, Hkv, D]``, a view of a new
    block-major tensor), indexing the blocks' dimension outermost: ``index_select`` along dim 1 of a
    block-major cache takes ~70x longer on the CPU (264 vs 3.8 ms for 40 blocks of SmolLM2)."""
    return kv.transpose(0, 1).index_select(0, idx).transpose(0, 1)


def gather_into(kv: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = kv[:, idx]`` (``kv``: some layers of a cache, ``out``: ``[layers, n, 2, BS, Hkv,
    D]``); on CUDA the Triton copy, queued on the current stream."""
    if kv.is_cuda:
        from pdserve.kernels.block_copy import gather_blocks

        gather_blocks(kv, idx, out=out)
    else:
        out.copy_(select_blocks(kv, idx))


def scatter_from(buf: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> None:
    """``kv[:, idx] = buf``; on CUDA the Triton copy, queued on the current stream."""
    if kv.is_cuda:
        from pdserve.kernels.block_copy import scatter_blocks

        scatter_blocks(buf, kv, idx)
    else:
        kv.index_copy_(1, idx, buf)


_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of the cache's device (one per device and process) for reading blocks known to be
    written (``written``, or their events waited for on the host): such reads then never queue
    behind what the engine's stream holds (the next step's forward)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams.setdefault(index, torch.cuda.Stream(device))
    return stream


def stage_blocks(kv: torch.Tensor, block_ids: Sequence[int], written: bool = False) -> Staged:
    """Gather ``block_ids`` of every layer into a new tensor on the cache's device: behind the
    work queued on the current stream (what wrote them), or, ``written``, on a side stream."""
    if not kv.is_cuda:
        return Staged(select_blocks(kv, block_index(block_ids, kv.device)).contiguous(), list(block_ids))
    stream = side_stream(kv.device) if written else torch.cuda.current_stream(kv.device)
    with torch.cuda.stream(stream):
        # The ids' copy to the device too: on the engine's stream it would wait for what that holds.
        idx = block_index(block_ids, kv.device)
        out = kv.new_empty((kv.shape[0], len(idx), *kv.shape[2:]))
        staged = Staged(out, list(block_ids))
        bytes_per_layer = out[0].numel() * out.element_size()
        for start, end in layer_chunks(kv.shape[0], bytes_per_layer, STAGE_CHUNK_BYTES):
            gather_into(kv[start:end], idx, out[start:end])
            event = torch.cuda.Event()
            event.record()
            staged.ready.append((end, event))
    return staged


def copy_to_cpu(kv: torch.Tensor, block_ids: Sequence[int]) -> Staged:
    """The blocks copied out of the cache into one CPU tensor ``[L, n, 2, BS, Hkv, D]`` (the zmq
    plane's staging, and any send's before a plane is agreed: a plane agreed on later moves that
    copy, or, reading in place, the blocks themselves)."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
    return Staged(select_blocks(kv, idx).contiguous().cpu(), list(block_ids))


def valid_block_ids(block_ids: Sequence[int], num_blocks: int) -> bool:
    """Non-empty, distinct, each in [0, num_blocks): a frame never names a block twice or one
    outside the cache (the reservation table then checks they are the request's). A run of
    consecutive ids is all three at once when its ends are in range."""
    n = len(block_ids)
    if n and block_ids[-1] - block_ids[0] == n - 1:  # ``consecutive``, inline (on every send's path)
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        if ids == list(range(ids[0], ids[0] + n)):
            return ids[0] >= 0 and ids[-1] < num_blocks
    return (
        bool(block_ids)
        and len(block_ids) <= num_blocks
        and len(set(block_ids)) == len(block_ids)
        and 0 <= min(block_ids) <= max(block_ids) < num_blocks
    )


def in_place(
    kv: torch.Tensor, block_ids: Sequence[int], layer_events: Sequence | None = None, written: bool = False
) -> Staged:
    """The blocks left where they are, for a transport that reads them out of the registered cache;
    on CUDA with the events after which each layer is written (``layer_events``), or else one
    after the work queued so far on the current stream (what wrote them); nothing to wait for when
    they are ``written`` (``KVSender.send``)."""
    staged = Staged(None, list(block_ids))
    if written:
        return staged
    if kv.is_cuda and layer_events:
        assert len(layer_events) == kv.shape[0], f"{len(layer_events)} layer events for {kv.shape[0]} layers"
        staged.ready = [(i + 1, event) for i, event in enumerate(layer_events)]
    elif kv.is_cuda:
        with torch.cuda.device(kv.device):
            event = torch.cuda.Event()
            event.record()
        staged.ready.append((kv.shape[0], event))
    return staged
