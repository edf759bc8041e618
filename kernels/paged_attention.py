"""Causal attention of a step's new tokens over each request's paged KV cache.

One call covers a mixed batch: request ``b`` contributes the query rows
``query_start_loc[b]:query_start_loc[b+1]`` (its ``L_b`` new tokens, whose keys and
values are already written to the cache) and attends over its first ``seq_lens[b]``
cached positions. New token ``i`` sits at position ``seq_lens[b] - L_b + i`` and sees
positions up to its own, so the same call serves a full prefill, a prefill chunk
over cached prefix blocks, and a decode step (``L_b == 1``). GQA: query head ``h``
reads KV head ``h // (Hq // Hkv)``.

The reference gathers each request's blocks into a contiguous tensor (it moves the
whole context once per call) and calls SDPA; decode rows are batched together.
``paged_attention`` is its Triton twin: it reads K/V in place through the block table,
with a flash-attention kernel for prefill/mixed batches and a split-K (flash-decoding)
kernel for pure decode batches; see the comment above the kernels. ``StaticDecodePlan``
makes the decode launch depend on the batch size alone, for CUDA graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.triton_utils import tl, triton


def gather_kv_ref(
    kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each row's first ``max_len`` positions: two [B, Hkv, max_len, D] views."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    ids = block_table[:, :num_blocks].long()
    out = []
    for i in (0, 1):
        x = kv_cache[:, i][ids]  # [B, nb, BS, Hkv, D]: one copy of the context
        out.append(x.flatten(1, 2)[:, :max_len].transpose(1, 2))  # [B, Hkv, S, D] view
    return out[0], out[1]


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert len(seq_lens) == len(query_lens) == block_tables.shape[0]
    out = torch.empty_like(q)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    assert starts[-1] == q.shape[0], "query_lens do not add up to the number of query rows"

    decode = [b for b, n in enumerate(query_lens) if n == 1]
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        lens = torch.tensor([seq_lens[b] for b in decode], device=q.device)
        max_len = max(seq_lens[b] for b in decode)
        k, v = gather_kv_ref(kv_cache, block_tables[decode], max_len)  # [B, Hkv, S, D]
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, S]
        qd = q[rows].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[rows] = o.squeeze(2)

    for b, n in enumerate(query_lens):
        if n == 1 or n == 0:
            continue
        ctx = seq_lens[b]
        k, v = gather_kv_ref(kv_cache, block_tables[b : b + 1], ctx)  # [1, Hkv, ctx, D]
        qb = q[starts[b] : starts[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if n == ctx:
            mask, causal = None, True
        else:
            # Bottom-right aligned causal mask: new token i sits at position ctx - n + i.
            pos = torch.arange(ctx - n, ctx, device=q.device)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None], False
        o = F.scaled_dot_product_attention(
            qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels
#
# Both kernels read K/V straight out of the paged cache: a tile of TILE_N consecutive context
# positions looks up its physical blocks in the block table (TILE_N / BS entries, cached) and
# loads one [TILE_N, D] slab of keys and one of values, D contiguous elements per position. Only
# the query tile, the running max/sum and the fp32 output accumulator stay on chip; scores and
# probabilities never reach memory (flash attention, online softmax in base 2).
#
# GQA packing: the GROUP = Hq // Hkv query heads that share a KV head are processed by the same
# program as extra rows of the query tile (row r = query (r // GROUP_PAD), head (r % GROUP_PAD)),
# so each K/V tile is loaded once per KV head instead of once per query head.
#
# Prefill / mixed kernel: program (q_block, kv_head) takes BLOCK_Q consecutive new tokens of one
# request. Tiles wholly below the diagonal run without a mask; the rest mask bottom-right causal.
# Compute-bound for long prompts: 4 * L * S * D * Hq flops (halved by causality) against
# S * Hkv * D * 2 * itemsize bytes of K/V per query block.
#
# Decode kernel (every request has exactly one new token): the work per request is one
# [GROUP, D] x [D, S] product, memory-bound on reading S * Hkv * D * 2 * itemsize bytes of K/V.
# With few requests there are too few (request, kv_head) programs to fill the GPU, so the
# context is split into partitions handled by parallel programs (flash-decoding); each writes
# its normalised partial output and (max, sum), and a reduce kernel combines the partitions:
# out = sum_p(l_p * 2^(m_p - M) * o_p) / sum_p(l_p * 2^(m_p - M)),  M = max_p m_p.
#
# Eager launches size the partition from the batch's longest context (a host int passed as an
# argument, not a constexpr) and round the split count of the grid up to a power of two, so they
# compile one kernel per power of two however the batch changes. With SPLIT_ON_DEVICE (CUDA
# graphs) the grid is fixed at NUM_SPLITS partitions per request and each program sizes its
# request's partition from seq_len: tile-aligned, at least ``partition`` positions, at most
# NUM_SPLITS of them. Either way programs past the context exit at once and the reduce reads only
# the partitions that were written.
#
# Compiles: triton compiles a kernel per value of each constexpr and, for a plain int argument,
# per "equals 1" and "multiple of 16". Arguments that change with the batch (the number of
# requests, the block table's width, the partition) are therefore ``do_not_specialize``: nothing
# in the kernels gains from knowing them, and the engine's warm-up (``ModelRunner.warm_up``) runs
# every constexpr combination a node can meet before it serves.
# ---------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634
MIN_DOT = 16
"""tl.dot needs at least 16 rows on NVIDIA GPUs: decode pads its GROUP query heads up to this."""
DECODE_TILE_N = 64
DECODE_MIN_PARTITION = 128
"""Context positions one split-K program reads at least (2 tiles): shorter ones cost more than they gain."""
DECODE_MAX_SPLITS = 128
DECODE_PROGRAMS_PER_SM = 4
SMEM_BUDGET = 160 * 1024
"""Bytes of shared memory the software pipeline of the prefill kernel may fill (H100/H200: 227 KiB)."""


@triton.jit
def _find_request(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request owning query block ``q_block``: the last b with start[b] // BLOCK_Q + b <= q_block."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, BLOCK_D] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, base-2 log domain
    q,  # [BLOCK_M, BLOCK_D]
    pos_q,  # [BLOCK_M] context position of each row
    k_base,  # cache + kv_head offset, K half
    v_base,  # cache + kv_head offset, V half
    table_ptr,  # this request's row of the block table
    kv_len,  # positions >= kv_len are masked (MASK_CAUSAL or MASK_LEN only)
    tile_lo,
    tile_hi,
    qk_scale,  # scale * log2(e)
    stride_cache_block,
    stride_cache_pos,
    offs_d,  # [BLOCK_D]
    d_ok,  # [BLOCK_D]
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    MASK_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax attention of the query tile over context tiles [tile_lo, tile_hi)."""
    offs_n = tl.arange(0, TILE_N)
    for j in range(tile_lo, tile_hi):
        pos_k = j * TILE_N + offs_n  # [TILE_N]
        if MASK_LEN:
            k_ok = pos_k < kv_len
            block = tl.load(table_ptr + pos_k // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            block = tl.load(table_ptr + pos_k // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        kv_off = block * stride_cache_block + (pos_k % BLOCK_SIZE) * stride_cache_pos  # [TILE_N]
        # K tile: TILE_N positions x D contiguous elements, read once per KV head and shared by
        # every query row (all GROUP heads) of the program.
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if MASK_CAUSAL:
            visible = pos_k[None, :] <= pos_q[:, None]
            if MASK_LEN:
                visible = visible & k_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        elif MASK_LEN:
            qk = tl.where(k_ok[None, :], qk, float("-inf"))
        # Every row sees context position 0 in the first tile it meets, so m_new is finite and
        # fully masked rows of later tiles just add exp2(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, BLOCK_D]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    cache_ptr,  # [NB, 2, BS, Hkv, D] contiguous
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_pos,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_tile = q_block - (q_start // BLOCK_Q + seq)  # which BLOCK_Q new tokens of this request
    if q_tile * BLOCK_Q >= q_len:  # grid slack: requests get cdiv(L_b, BLOCK_Q) <= the blocks they own
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of the first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] new-token index within the request
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] query head
    row_ok = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    # Padding rows (past the request's last token) act as its last token: never fully masked.
    pos_q = ctx_start + tl.minimum(q_idx, q_len - 1)
    q_row = (q_start + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D], on chip for the whole loop

    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Tiles ending at or before the tile's first query position are visible to every row.
    first_pos = ctx_start + q_tile * BLOCK_Q
    last_pos = ctx_start + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_full = (first_pos + 1) // TILE_N
    num_tiles = tl.cdiv(last_pos + 1, TILE_N)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, pos_q, k_base, v_base, table_ptr, seq_len, 0, num_full, qk_scale,
        stride_cache_block, stride_cache_pos, offs_d, d_ok,
        BLOCK_SIZE, TILE_N, False, False, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, pos_q, k_base, v_base, table_ptr, seq_len, num_full, num_tiles, qk_scale,
        stride_cache_block, stride_cache_pos, offs_d, d_ok,
        BLOCK_SIZE, TILE_N, True, True, DOT_PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_row[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit(do_not_specialize=["partition", "stride_table"])
def _decode_kernel(
    q_ptr,  # [T, Hq, D]
    cache_ptr,  # [NB, 2, BS, Hkv, D] contiguous
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32
    out_ptr,  # [T, Hq, D]; written only when NUM_SPLITS == 1
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32: normalised partial outputs
    part_ml_ptr,  # [B, Hq, NUM_SPLITS, 2] fp32: (max, sum) of each partition, base 2
    qk_scale,
    partition,  # positions per split (the least, with SPLIT_ON_DEVICE), a multiple of TILE_N
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_pos,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # max(MIN_DOT, next_pow2(GROUP)) rows, the rows past GROUP are padding
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_ON_DEVICE: tl.constexpr,  # size the partition from this request's seq_len
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == q_start:  # request without a new token this step
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT_ON_DEVICE:
        partition = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N, partition)
    ctx_lo = split * partition
    if ctx_lo >= seq_len:  # this request's context is shorter than the split count covers
        return
    ctx_hi = tl.minimum(ctx_lo + partition, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_h  # [BLOCK_H]
    io_mask = (offs_h < GROUP)[:, None] & d_ok[None, :]
    q_row = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + q_row * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :], mask=io_mask, other=0.0
    )  # [BLOCK_H, BLOCK_D]
    # The one new token sits at seq_len - 1 and sees the whole context: no causal mask, only
    # the partition's end (which is seq_len in the last partition).
    pos_q = tl.full([BLOCK_H], 0, tl.int32) + seq_len - 1
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, pos_q, k_base, v_base, table_ptr, ctx_hi,
        ctx_lo // TILE_N, tl.cdiv(ctx_hi, TILE_N), qk_scale,
        stride_cache_block, stride_cache_pos, offs_d, d_ok,
        BLOCK_SIZE, TILE_N, False, True, DOT_PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + q_row * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        # Partials: [B, Hq, NUM_SPLITS, D] and [B, Hq, NUM_SPLITS, 2], contiguous.
        part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        h_ok = offs_h < GROUP
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)


@triton.jit(do_not_specialize=["partition"])
def _decode_reduce_kernel(
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    part_ml_ptr,  # [B, Hq, NUM_SPLITS, 2] fp32
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,  # [T, Hq, D]
    partition,  # as the decode kernel's
    stride_out_t,
    stride_out_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_ON_DEVICE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """Combine one (request, query head)'s partitions: reads NUM_SPLITS * (D + 2) fp32, writes D."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT_ON_DEVICE:  # the decode kernel's partition, sized the same way
        partition = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N, partition)
    num_parts = tl.cdiv(seq_len, partition)  # partitions that were written
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_parts
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m_part = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))  # [SPLITS_PAD]
    l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)  # [SPLITS_PAD]
    weight = tl.where(s_ok, l_part * tl.exp2(m_part - tl.max(m_part, 0)), 0.0)  # [SPLITS_PAD]
    o = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [SPLITS_PAD, BLOCK_D]
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_out_t + head * stride_out_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products, like the reference; 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep grids small


def _pipeline_stages(bytes_per_stage: int, bytes_fixed: int) -> int:
    """Software-pipeline depth whose K/V buffers fit the shared-memory budget (1 to 3)."""
    return max(1, min(3, (SMEM_BUDGET - bytes_fixed) // bytes_per_stage))


def _check_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, out):
    num_tokens, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    assert cache_dim == head_dim, (kv_cache.shape, q.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_size & (block_size - 1) == 0, f"block size {block_size} is not a power of two"
    assert kv_cache[0].is_contiguous(), "a layer's cache [NB, 2, BS, Hkv, D] must have contiguous blocks"
    assert q.stride(2) == 1, f"q's head_dim must be contiguous: {q.stride()}"
    num_seqs = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (block_tables.shape, num_seqs)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, (
        block_tables.dtype,
        block_tables.stride(),
    )
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.is_contiguous()
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), (
        query_start_loc.dtype,
        query_start_loc.shape,
    )
    assert query_start_loc.is_contiguous()
    tensors = (q, kv_cache, block_tables, seq_lens, query_start_loc)
    assert all(t.device == q.device for t in tensors), [t.device for t in tensors]
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, (out.shape, q.shape)
        assert out.stride(2) == 1, f"out's head_dim must be contiguous: {out.stride()}"


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each request after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32: request b's new tokens are rows [start[b], start[b+1])
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, Hq, D], q's dtype
    *,
    num_splits: int | None = None,
    static: StaticDecodePlan | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton twin of :func:`paged_attention_ref`, with the batch described by device tensors.

    ``max_query_len`` and ``max_seq_len`` are host ints (the scheduler knows them) so that
    choosing kernels and grids needs no device sync. ``max_query_len == 1`` runs the split-K
    decode kernel (``num_splits`` context partitions per request; None picks from the batch
    shape and the SM count; ``static`` fixes the launch for CUDA graphs, see
    :class:`StaticDecodePlan`), anything else runs the prefill kernel. The caller guarantees what
    the reference asserts: ``query_start_loc[B] == T``, ``L_b <= seq_lens[b] <= max_seq_len``,
    block tables cover each context.
    """
    _check_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, out)
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    assert 1 <= max_query_len <= max_seq_len, (max_query_len, max_seq_len)
    assert static is None or max_query_len == 1, "a StaticDecodePlan serves pure decode batches only"
    if max_query_len == 1:
        _launch_decode(
            q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len, out, num_splits, static
        )
    else:
        _launch_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out)
    return out


@dataclass(frozen=True)
class StaticDecodePlan:
    """A split-K decode launch that depends on the batch size alone: what a CUDA graph needs.

    ``num_splits`` is fixed for the batch size (enough for the GPU at the longest context the
    graph will see) and each program sizes its own request's partition on the device, so one
    capture serves every context up to ``max_seq_len``. The partial buffers are carved from
    ``workspace`` (flat fp32, allocated once, may be shared by plans that never run at once)
    instead of being allocated per call; it may be None when ``num_splits == 1``.
    """

    num_splits: int
    workspace: torch.Tensor | None = None

    @staticmethod
    def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        """The eager heuristic's split count at the longest context: short contexts use fewer."""
        return _decode_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(device))

    @staticmethod
    def workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
        """fp32 elements of the partials: [B, Hq, splits, D] outputs then [B, Hq, splits, 2] (max, sum)."""
        return 0 if num_splits == 1 else num_seqs * num_heads * num_splits * (head_dim + 2)


def prefill_config(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, max_query_len: int
) -> dict:
    """Constexprs and launch options of ``_prefill_kernel`` (pure: tests compile exactly these)."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    # 128 query rows (tokens x heads of a group) per program for long prompts; fewer when every
    # request is short, but at least MIN_DOT rows for tl.dot.
    rows = 128 if block_d <= 128 else 64
    block_q = max(1, min(rows // group_pad, triton.next_power_of_2(max_query_len)))
    block_q = max(block_q, triton.cdiv(MIN_DOT, group_pad))
    block_m = block_q * group_pad
    tile_n = 64 if block_d <= 128 else 32
    itemsize = dtype.itemsize
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, DOT_PRECISION=_dot_precision(dtype),
        num_warps=8 if block_m >= 128 else 4,
        num_stages=_pipeline_stages(2 * tile_n * block_d * itemsize, block_m * block_d * itemsize),
    )  # fmt: skip


def decode_config(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    split_on_device: bool = False,
) -> dict:
    """Constexprs and launch options of ``_decode_kernel`` (``num_splits``: programs per request)."""
    group = num_heads // num_kv_heads
    block_h = max(MIN_DOT, triton.next_power_of_2(group))
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    itemsize = dtype.itemsize
    return dict(
        GROUP=group, BLOCK_H=block_h, TILE_N=DECODE_TILE_N, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        SPLIT_ON_DEVICE=split_on_device, DOT_PRECISION=_dot_precision(dtype), num_warps=4,
        num_stages=_pipeline_stages(2 * DECODE_TILE_N * block_d * itemsize, block_h * block_d * itemsize),
    )  # fmt: skip


def reduce_config(head_dim: int, num_splits: int, split_on_device: bool = False) -> dict:
    """Constexprs and launch options of ``_decode_reduce_kernel``."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        SPLIT_ON_DEVICE=split_on_device, TILE_N=DECODE_TILE_N, num_warps=4,
    )  # fmt: skip


def _launch_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    config = prefill_config(num_heads, num_kv_heads, head_dim, block_size, q.dtype, max_query_len)
    # Request b owns query blocks start[b] // BLOCK_Q + b .. + cdiv(L_b, BLOCK_Q) - 1.
    grid = (num_tokens // config["BLOCK_Q"] + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        **config,
    )  # fmt: skip


def decode_partition(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, partition) for split-K decode: enough programs for ``DECODE_PROGRAMS_PER_SM``
    per SM, each reading at least ``DECODE_MIN_PARTITION`` positions; partition is a multiple of
    the tile."""
    return _partition(_decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms), max_seq_len)


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
    most = triton.cdiv(max_seq_len, DECODE_MIN_PARTITION)
    return max(1, min(want, most, DECODE_MAX_SPLITS))


def _partition(num_splits: int, max_seq_len: int) -> tuple[int, int]:
    partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), DECODE_TILE_N) * DECODE_TILE_N
    return triton.cdiv(max_seq_len, partition), partition


def eager_decode_plan(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, num_splits: int | None = None
) -> tuple[int, int]:
    """(programs per request, partition) of an eager decode launch: the split count of
    :func:`decode_partition` (or ``num_splits``), rounded up to a power of two so that batches of
    every shape meet at most 8 constexpr values; the programs past the last partition exit at once."""
    if num_splits is None:
        needed, partition = decode_partition(num_seqs, num_kv_heads, max_seq_len, num_sms)
    else:
        assert num_splits >= 1, num_splits
        needed, partition = _partition(num_splits, max_seq_len)
    return triton.next_power_of_2(needed), partition


def eager_decode_warm_up_lens(num_kv_heads: int, max_model_len: int, device: torch.device) -> list[int]:
    """Context lengths, one per split count of the grid, whose one-request eager decode launches
    compile every decode kernel that eager decode batches up to ``max_model_len`` can meet.

    Every batch's split count ``v`` (before rounding) is at most what one request reaches, and one
    request of ``DECODE_MIN_PARTITION * v`` positions gets exactly ``v``: so these cover them all.
    """
    lens: dict[int, int] = {}
    num_sms = _num_sms(device)
    for v in range(1, DECODE_MAX_SPLITS + 1):
        seq_len = min(v * DECODE_MIN_PARTITION, max_model_len)
        lens.setdefault(eager_decode_plan(1, num_kv_heads, seq_len, num_sms)[0], seq_len)
        if seq_len == max_model_len:
            break
    return sorted(lens.values())


def _launch_decode(
    q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len, out, num_splits, static
):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    split_on_device = static is not None
    if static is not None:
        assert num_splits is None, "a StaticDecodePlan fixes num_splits"
        num_splits, partition = static.num_splits, DECODE_MIN_PARTITION
    else:
        num_splits, partition = eager_decode_plan(
            num_seqs, num_kv_heads, max_seq_len, _num_sms(q.device), num_splits
        )
    if num_splits > 1:
        part_out, part_ml = _partials(num_seqs, num_heads, head_dim, num_splits, q.device, static)
    else:  # the decode kernel writes `out` directly; the partial pointers are unused
        part_out = part_ml = out
    config = decode_config(
        num_heads, num_kv_heads, head_dim, block_size, q.dtype, num_splits, split_on_device
    )
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_ml,
        scale * LOG2E, partition,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        **config,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_ml, seq_lens, query_start_loc, out, partition, out.stride(0), out.stride(1),
            **reduce_config(head_dim, num_splits, split_on_device),
        )  # fmt: skip


def _partials(num_seqs, num_heads, head_dim, num_splits, device, static):
    """Split-K partial buffers: [B, Hq, splits, D] outputs and [B, Hq, splits, (max, sum)], fp32."""
    if static is None:
        f32 = dict(dtype=torch.float32, device=device)
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, **f32)
        return part_out, part_ml
    numel = num_seqs * num_heads * num_splits * head_dim
    need = StaticDecodePlan.workspace_numel(num_seqs, num_heads, head_dim, num_splits)
    ws = static.workspace
    assert ws is not None and ws.dtype == torch.float32 and ws.device == device and ws.numel() >= need, (
        "the plan's workspace is missing or too small",
        None if ws is None else (ws.dtype, ws.device, ws.numel()),
        need,
    )
    assert ws.is_contiguous()
    part_out = ws[:numel].view(num_seqs, num_heads, num_splits, head_dim)
    part_ml = ws[numel:need].view(num_seqs, num_heads, num_splits, 2)
    return part_out, part_ml
