"""Interfaces of the KV transports and the lease table they validate against."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pdserve.messages import KVAck, KVCommit, NodeInfo

# Fields two nodes must agree on before any KV moves between them.
COMPAT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_layout")


class KVTransferError(RuntimeError):
    """A transfer or handshake failed; the message says why."""


def check_compatible(ours: NodeInfo, theirs: NodeInfo) -> list[str]:
    """Human-readable mismatches between two nodes (empty when they may exchange KV)."""
    return [
        f"{name}: {getattr(ours, name)!r} ({ours.node_id}) vs {getattr(theirs, name)!r} ({theirs.node_id})"
        for name in COMPAT_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]


@dataclass
class _Reservation:
    block_ids: list[int]
    deadline: float
    allowed: frozenset[int]
    lease_s: float
    written: set[tuple[int, int]] = field(default_factory=set)  # (layer, block id) units landed
    error: str = ""
    committed: bool = False


class ReservationTable:
    """Leases on reserved blocks, shared by the engine thread and the receiver thread.

    The receiver writes a frame only while holding the lock and only into blocks of a
    live, uncommitted reservation; the engine thread releases a reservation under the
    same lock before it frees the blocks. So a frame either lands before the release
    or is refused — never into freed (and possibly reused) blocks.
    """

    def __init__(self, num_layers: int, clock: Callable[[], float] = time.time) -> None:
        self.num_layers = num_layers
        self._clock = clock
        self._lock = threading.Lock()
        self._table: dict[str, _Reservation] = {}

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
        with self._lock:
            self._table.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._table

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
            r = self._table.get(request_id)
            if r is None:
                return f"no reservation for request {request_id!r} (expired, aborted or unknown)"
            if r.committed:
                return f"request {request_id!r} was already committed"
            if self._clock() > r.deadline:
                r.error = "lease expired before the KV arrived"
                return r.error
            if not 0 <= layer_start < layer_end <= self.num_layers:
                r.error = f"layer range [{layer_start}, {layer_end}) outside [0, {self.num_layers})"
                return r.error
            if not block_ids or not set(block_ids) <= r.allowed:
                r.error = f"block ids {list(block_ids)[:8]} are not all reserved for {request_id!r}"
                return r.error
            fn()
            r.written.update((layer, b) for layer in range(layer_start, layer_end) for b in block_ids)
            return ""

    def fail(self, request_id: str, error: str) -> None:
        with self._lock:
            r = self._table.get(request_id)
            if r is not None and not r.error:
                r.error = error

    def commit(self, request_id: str) -> str:
        """Mark complete if every (layer, block) landed and nothing failed; returns an error or ""."""
        with self._lock:
            r = self._table.get(request_id)
            if r is None:
                return f"no reservation for request {request_id!r} (expired, aborted or unknown)"
            if r.error:
                return r.error
            if self._clock() > r.deadline:
                return "lease expired before the KV arrived"
            missing = self.num_layers * len(r.block_ids) - len(r.written)
            if missing:
                return f"{missing} of {self.num_layers * len(r.block_ids)} layer-blocks never arrived"
            r.committed = True
            return ""

    def expired(self) -> list[str]:
        """Uncommitted reservations past their deadline."""
        now = self._clock()
        with self._lock:
            return [rid for rid, r in self._table.items() if not r.committed and now > r.deadline]


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
    ) -> Future[KVAck | None]:
        """Copy the blocks out of the local cache now (the caller may free them once this returns),
        then deliver them. Without a commit, more blocks of the request follow in later calls (a
        prompt sent chunk by chunk while it is computed) and the future resolves to None once
        the frames are out; with one, the future resolves to the peer's ack after it checked that
        every block of the reservation landed. Failures raise ``KVTransferError``; blocks of a
        failed partial send make the final commit fail, so partial KV is never used."""

    @abstractmethod
    def close(self) -> None: ...
