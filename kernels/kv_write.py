"""Write new keys and values into the paged KV cache by slot mapping.

KV layout (one tensor per layer)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   # [:, 0] keys, [:, 1] values

A slot is ``block_id * block_size + offset``; a negative slot marks a padding token
whose KV is dropped. One layer's block — keys and values together — is one
contiguous region, which is what the KV transports move.

``write_kv_ref`` is the plain-torch version the CPU engine runs; ``write_kv`` is its Triton
twin for CUDA (one program per token, see below).
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_utils import tl, triton


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernel
#
# One program per token. A token's keys are ``Hkv * D`` contiguous elements in ``key`` and land
# as ``Hkv * D`` contiguous elements at ``kv_cache[block, 0, offset]`` (values likewise at
# ``[block, 1, offset]``), so each program is two wide contiguous copies: it reads
# ``2 * Hkv * D`` elements and writes as many, nothing else. Padding tokens (negative slot) read
# only their slot. Llama-3-8B (Hkv=8, D=128, bf16): 4 KiB read + 4 KiB written per token.
# ---------------------------------------------------------------------------------------------

MAX_CHUNK = 2048
"""Elements one program moves per load/store; a token's K (or V) larger than this is looped over."""


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D], each token's [Hkv, D] contiguous
    value_ptr,  # [T, Hkv, D], each token's [Hkv, D] contiguous
    cache_ptr,  # [NB, 2, BS, Hkv, D] contiguous
    slot_ptr,  # [T] int32 or int64
    stride_key_t,
    stride_value_t,
    stride_cache_block,
    stride_cache_kv,
    BLOCK_SIZE: tl.constexpr,
    HD: tl.constexpr,  # Hkv * D: the elements of one token's K (or V)
    CHUNK: tl.constexpr,  # power of two, <= MAX_CHUNK
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: its KV is dropped
        return
    # [block, 0, offset] of the cache is HD contiguous elements; [block, 1, offset] is
    # stride_cache_kv further on.
    k_dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * HD
    v_dst = k_dst + stride_cache_kv
    k_src = key_ptr + t * stride_key_t
    v_src = value_ptr + t * stride_value_t
    for start in tl.static_range(0, HD, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < HD
        k = tl.load(k_src + cols, mask=mask)
        v = tl.load(v_src + cols, mask=mask)
        tl.store(k_dst + cols, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + cols, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32 or int64
) -> None:
    """Triton twin of :func:`write_kv_ref`: same arguments, same result, in place.

    Slots must lie inside the cache (``slot < NB * BS``); like any index in a kernel they are not
    range-checked here, because that would cost a device sync per layer.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, two, block_size, cache_heads, cache_dim = kv_cache.shape
    assert two == 2 and (cache_heads, cache_dim) == (num_kv_heads, head_dim), (key.shape, kv_cache.shape)
    assert value.shape == key.shape, (value.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert key.dtype == value.dtype, (key.dtype, value.dtype)
    assert kv_cache[0].is_contiguous(), "a layer's cache [NB, 2, BS, Hkv, D] must have contiguous blocks"
    assert block_size & (block_size - 1) == 0, f"block size {block_size} is not a power of two"
    # Tokens may be strided (a slice of a fused QKV output); one token's [Hkv, D] may not.
    for name, x in (("key", key), ("value", value)):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, f"{name} rows must be contiguous: {x.stride()}"
    assert slot_mapping.is_contiguous()
    assert key.device == value.device == kv_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    hd = num_kv_heads * head_dim
    chunk = min(triton.next_power_of_2(hd), MAX_CHUNK)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        BLOCK_SIZE=block_size,
        HD=hd,
        CHUNK=chunk,
        num_warps=4,
    )
