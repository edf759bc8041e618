"""Pack a request's KV blocks into one contiguous transfer buffer, and unpack them.

The whole cache is one tensor with a view per layer::

    kv_cache_all: [L, NB, 2, BS, Hkv, D]      # [:, b, 0] keys, [:, b, 1] values of block b
    buffer:       [L, n, 2, BS, Hkv, D]       # buffer[:, i] is block block_ids[i], contiguous

One (layer, block) region — ``2 * BS * Hkv * D`` elements, keys then values — is contiguous
in both (the cache's memory may be block-major, as an engine's, or layer-major: the kernel steps
by its strides), so packing is ``L * n`` independent contiguous copies (64 KiB each at Llama-3-8B's
Hkv=8, D=128, BS=16 in bf16). A transport then moves the buffer as one region; the receiver
scatters it into the blocks it reserved, which need not be the sender's block ids.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_utils import tl, triton


def gather_blocks_ref(
    kv_cache_all: torch.Tensor,  # [L, NB, 2, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int
) -> torch.Tensor:  # [L, n, 2, BS, Hkv, D] contiguous
    return kv_cache_all[:, block_ids.long()].contiguous()


def scatter_blocks_ref(
    buffer: torch.Tensor,  # [L, n, 2, BS, Hkv, D]
    kv_cache_all: torch.Tensor,  # [L, NB, 2, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int
) -> None:
    kv_cache_all[:, block_ids.long()] = buffer.to(kv_cache_all.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernel
#
# Program (i, layer, part) copies part ``part`` of the region of (layer, block_ids[i]) in CHUNK
# wide steps: every element is read once and written once, nothing is reused, so this runs at
# copy bandwidth when enough programs are in flight. ``part`` exists for small requests: with
# few blocks a region is split over several programs so that all SMs have work. How many chunks
# a part takes changes with the number of blocks, so it is an argument, not a constexpr (a
# compile per value): a node compiles one gather and one scatter kernel, at warm-up.
# ---------------------------------------------------------------------------------------------

CHUNK = 4096
"""Elements per load/store step: 8 KiB in bf16, 32 elements (four 16-byte vectors) a thread at 4 warps."""
PROGRAMS_PER_SM = 8
"""Enough programs per SM to keep memory busy; regions are split until the grid has this many."""


@triton.jit(do_not_specialize=["chunks_per_part"], do_not_specialize_on_alignment=["ids_ptr"])
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,  # [n] block ids into the cache (a slice of a longer list: any alignment, read one by one)
    stride_src_layer,
    stride_src_block,
    stride_dst_layer,
    stride_dst_block,
    chunks_per_part,  # CHUNK-wide steps per program
    REGION: tl.constexpr,  # 2 * BS * Hkv * D: one (layer, block)'s elements
    CHUNK: tl.constexpr,
    GATHER: tl.constexpr,  # True: cache -> buffer; False: buffer -> cache
    EVEN: tl.constexpr,  # REGION % CHUNK == 0: every step is whole, so no mask and full-width vectors
):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    block = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:  # the cache is indexed by block id, the buffer by position in block_ids
        src_row, dst_row = block, i.to(tl.int64)
    else:
        src_row, dst_row = i.to(tl.int64), block
    src = src_ptr + layer * stride_src_layer + src_row * stride_src_block
    dst = dst_ptr + layer * stride_dst_layer + dst_row * stride_dst_block
    first = part * chunks_per_part
    last = tl.minimum(first + chunks_per_part, (REGION + CHUNK - 1) // CHUNK)
    for c in range(first, last):
        offs = c * CHUNK + tl.arange(0, CHUNK)  # a multiple of CHUNK: aligned, full-width vectors
        if EVEN:
            x = tl.load(src + offs)
            tl.store(dst + offs, x.to(dst_ptr.dtype.element_ty))
        else:
            mask = offs < REGION
            x = tl.load(src + offs, mask=mask)
            tl.store(dst + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _num_programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: fewer is faster


def _launch_copy(
    src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, num_layers: int, gather: bool
) -> None:
    num_ids = block_ids.shape[0]
    if num_ids == 0 or num_layers == 0:
        return
    region = src[0, 0].numel()
    chunk = min(CHUNK, triton.next_power_of_2(region))
    num_chunks = triton.cdiv(region, chunk)
    # Split each region over `parts` programs only when the grid would otherwise be too small.
    parts = min(num_chunks, max(1, triton.cdiv(_num_programs_wanted(src.device), num_ids * num_layers)))
    chunks_per_part = triton.cdiv(num_chunks, parts)
    parts = triton.cdiv(num_chunks, chunks_per_part)
    assert parts <= 65535 and num_layers <= 65535, "grid dimensions 1 and 2 are limited to 65535"
    _copy_blocks_kernel[(num_ids, num_layers, parts)](
        src,
        dst,
        block_ids,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        chunks_per_part,
        REGION=region,
        CHUNK=chunk,
        GATHER=gather,
        EVEN=region % chunk == 0,
        num_warps=4,
    )


def _check(buffer: torch.Tensor, kv_cache_all: torch.Tensor, block_ids: torch.Tensor) -> None:
    assert kv_cache_all.dim() == 6 and kv_cache_all.shape[2] == 2, kv_cache_all.shape
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache_all.shape
    assert block_ids.dim() == 1 and block_ids.dtype in (torch.int32, torch.int64), (
        block_ids.shape,
        block_ids.dtype,
    )
    expect = (num_layers, block_ids.shape[0], 2, block_size, num_kv_heads, head_dim)
    assert tuple(buffer.shape) == expect, (tuple(buffer.shape), expect)
    assert buffer.dtype == kv_cache_all.dtype, (buffer.dtype, kv_cache_all.dtype)
    # Regions are copied as flat runs: both sides must be contiguous (ids may be any order).
    # The cache may be laid out either way (``kv_transfer.base.KVLayout``): its (layer, block) slabs
    # are contiguous, the kernel steps between them by the strides.
    assert kv_cache_all[0, 0].is_contiguous() and buffer.is_contiguous() and block_ids.is_contiguous()
    assert buffer.device == kv_cache_all.device == block_ids.device


def gather_blocks(
    kv_cache_all: torch.Tensor,  # [L, NB, 2, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int32 or int64
    out: torch.Tensor | None = None,  # [L, n, 2, BS, Hkv, D], e.g. a registered transfer buffer
) -> torch.Tensor:  # [L, n, 2, BS, Hkv, D] contiguous
    """Triton twin of :func:`gather_blocks_ref`; writes into ``out`` when given.

    Moves ``2 * L * n * 2 * BS * Hkv * D * itemsize`` bytes (read + write). Block ids are not
    range-checked here (that would sync); callers validate them against the pool.
    """
    num_layers = kv_cache_all.shape[0]
    if out is None:
        out = kv_cache_all.new_empty((num_layers, block_ids.shape[0], *kv_cache_all.shape[2:]))
    _check(out, kv_cache_all, block_ids)
    _launch_copy(kv_cache_all, out, block_ids, num_layers, gather=True)
    return out


def scatter_blocks(
    buffer: torch.Tensor,  # [L, n, 2, BS, Hkv, D]
    kv_cache_all: torch.Tensor,  # [L, NB, 2, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int32 or int64, distinct
) -> None:
    """Triton twin of :func:`scatter_blocks_ref`: ``kv_cache_all[:, block_ids] = buffer``.

    Same byte count as :func:`gather_blocks`. Repeated ids race (which copy wins is undefined,
    as for the reference's index_put).
    """
    _check(buffer, kv_cache_all, block_ids)
    _launch_copy(buffer, kv_cache_all, block_ids, kv_cache_all.shape[0], gather=False)
