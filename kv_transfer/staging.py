"""Staging slots: where a transport packs fragmented blocks so that they move as one piece.

A request's blocks are seldom consecutive once a cache has turned over (prefix hits, frees in any
order), and a transport that moves (layer, block) slabs in place then needs one descriptor per
slab: 64 KiB each for Llama-3-8B, which NIXL over CUDA IPC moves at 4-7 GB/s on one H100 where
one large descriptor moves 900 (``docs/benchmarks/kv_transfer_same_gpu_h100.json``). Gathering
the blocks into a contiguous slot costs one read and one write of the bytes at memory speed on
each side, and leaves one descriptor per slot.

A ``StagePool`` is one region cut into equal slots, registered once with the transport; a piece
of a send (``stage_pieces``) fits one slot, laid out ``[layers, blocks, 2, BS, Hkv, D]``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import layer_chunks
from pdserve.kv_transfer.options import require


@dataclass(frozen=True)
class StagingOptions:
    """Where a node packs its sends: ``num_slots`` slots of ``slot_bytes`` (registered once).

    Four 64 MiB slots a node (256 MiB): a 2k-token Llama-3-8B prompt (256 MiB of KV) in flight at
    once, in pieces that pipeline the gather, the move and the scatter. Each piece costs ~0.5-0.8
    ms of Python and control messages on the GPU hosts measured, so fewer, larger pieces move more:
    a shuffled 1 GiB send between two processes on one H100 ran at 55 GB/s with 8 x 32 MiB, 64-97
    with 4 x 64 MiB and 96-103 with 2 x 128 MiB (``docs/benchmarks/kv_same_gpu_slots_h100.json``);
    with two slots, two sends would hold every slot."""

    num_slots: int = 4
    slot_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        require(self, positive=("num_slots", "slot_bytes"))


class StagePool:
    """``options.num_slots`` slots of ``options.slot_bytes`` in one tensor on the cache's device;
    thread-safe."""

    def __init__(self, kv: torch.Tensor, options: StagingOptions = StagingOptions()) -> None:
        num_slots, slot_bytes = options.num_slots, options.slot_bytes
        slab = kv[0, 0].numel() * kv.element_size()
        # A slot never needs more than the whole cache (tests run tiny caches), and holds whole slabs.
        slot_bytes = min(slot_bytes, kv.numel() * kv.element_size())
        self.slot_bytes = max(slot_bytes // slab, 1) * slab
        self.num_slots = num_slots
        self.buf = torch.empty(num_slots * self.slot_bytes, dtype=torch.uint8, device=kv.device)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)

    def try_acquire(self) -> int | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def acquire(self, timeout: float) -> int | None:
        try:
            return self._free.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int, kv: torch.Tensor, num_layers: int, num_blocks: int) -> torch.Tensor:
        """Slot ``slot`` as ``[num_layers, num_blocks, 2, BS, Hkv, D]`` of the cache's dtype."""
        nbytes = num_layers * num_blocks * kv[0, 0].numel() * kv.element_size()
        assert nbytes <= self.slot_bytes, (nbytes, self.slot_bytes)
        start = self.offset(slot)
        return self.buf[start : start + nbytes].view(kv.dtype).view(num_layers, num_blocks, *kv.shape[2:])


def stage_pieces(
    num_layers: int, num_blocks: int, slab_bytes: int, slot_bytes: int, chunk_bytes: int = 0
) -> list[tuple[int, int, int, int]]:
    """(layer start, layer end, block start, block end) pieces of a send, each fitting one slot:
    layer chunks of all its blocks (``layer_chunks`` of at most ``chunk_bytes`` when given), or,
    where one layer of them does not fit a slot, one layer of as many blocks as fit."""
    per_layer = num_blocks * slab_bytes
    if per_layer <= slot_bytes:
        limit = min(slot_bytes, chunk_bytes or slot_bytes)
        return [(l0, l1, 0, num_blocks) for l0, l1 in layer_chunks(num_layers, per_layer, limit)]
    blocks = slot_bytes // slab_bytes
    return [
        (layer, layer + 1, b, min(b + blocks, num_blocks))
        for layer in range(num_layers)
        for b in range(0, num_blocks, blocks)
    ]
