"""Neox-style rotary embedding (rotate_half) of q and k, reading a float32 cos/sin table.

With ``x1, x2`` the two halves of a head and ``cos, sin`` the table row of the token's position
(cast to the input dtype first, as transformers and :class:`pdserve.engine.models.layers.RotaryEmbedding`
do)::

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)

In eager torch that is a gather, a cast, two slices, a negation, a cat, two multiplies and an add
per tensor, each a kernel reading and writing ``[T, H, D]``. Here one program per token reads its
table row (``2 * D`` float32) and its q and k heads once and writes them once, in place or into
given outputs.

Every product and the sum are rounded to the input dtype one at a time, in the reference's order,
and the launch turns off fused multiply-add contraction: the result is bitwise the reference's in
float32, float16 and bfloat16.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_utils import tl, triton


def rotary_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_pos, 2, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin[positions].to(q.dtype)  # [T, 2, D]
    cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)  # [T, 1, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------------------------------
# Triton kernel
#
# One program per token: all its heads as one [BLOCK_H, HALF] tile per half. Llama-3-8B (Hq=32,
# Hkv=8, D=128, bf16): 8 KiB of q and 2 KiB of k read and written, 1 KiB of table read.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src_h,
    stride_dst_h,
    num_heads,
    c1,  # [1, HALF] cos of the first half, in the input dtype
    c2,
    s1,
    s2,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = src_ptr + heads * stride_src_h + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = dst_ptr.dtype.element_ty
    # out[:HALF] = x1 * cos1 + (-x2) * sin1;  out[HALF:] = x2 * cos2 + x1 * sin2; each op rounded.
    a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
    b1 = ((-x2).to(tl.float32) * s1).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
    dst = dst_ptr + heads * stride_dst_h + cols
    tl.store(dst, (a1 + b1).to(dtype), mask=mask)
    tl.store(dst + HALF, (a2 + b2).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # [T] int32 or int64
    cos_sin_ptr,  # [max_pos, 2, D] float32, contiguous
    q_ptr,  # [T, Hq, D], rows contiguous
    k_ptr,  # [T, Hkv, D], rows contiguous
    q_out_ptr,
    k_out_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_q_out_t,
    stride_q_out_h,
    stride_k_out_t,
    stride_k_out_h,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # D / 2, a power of two
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    row = cos_sin_ptr + pos * (4 * HALF)
    # The table is float32; the reference casts it to the input dtype before multiplying.
    dtype = q_out_ptr.dtype.element_ty
    c1 = tl.load(row + cols).to(dtype).to(tl.float32)
    c2 = tl.load(row + HALF + cols).to(dtype).to(tl.float32)
    s1 = tl.load(row + 2 * HALF + cols).to(dtype).to(tl.float32)
    s2 = tl.load(row + 3 * HALF + cols).to(dtype).to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_q_t,
        q_out_ptr + t * stride_q_out_t,
        stride_q_h,
        stride_q_out_h,
        num_q_heads,
        c1,
        c2,
        s1,
        s2,
        HALF,
        BLOCK_HQ,
    )
    _rotate_heads(
        k_ptr + t * stride_k_t,
        k_out_ptr + t * stride_k_out_t,
        stride_k_h,
        stride_k_out_h,
        num_kv_heads,
        c1,
        c2,
        s1,
        s2,
        HALF,
        BLOCK_HKV,
    )


def rotary(
    positions: torch.Tensor,  # [T] int32 or int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_pos, 2, D] float32
    q_out: torch.Tensor | None = None,  # [T, Hq, D]; pass q itself to rotate in place
    k_out: torch.Tensor | None = None,  # [T, Hkv, D]; pass k itself to rotate in place
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`rotary_ref`; returns ``(q_out, k_out)``, new tensors where not given.

    Tokens and heads may be strided (q and k sliced out of a fused QKV output); each head's ``D``
    elements must be contiguous. Positions must lie inside the table; they are not range-checked,
    because that would cost a device sync per layer.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    num_kv_heads = k.shape[1]
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} is not a power of two"
    assert cos_sin.shape[1:] == (2, head_dim), (cos_sin.shape, head_dim)
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous(), (cos_sin.dtype, cos_sin.stride())
    assert positions.shape == (num_tokens,) and positions.is_contiguous(), positions.shape
    assert positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert q.dtype == k.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        q.dtype,
        k.dtype,
    )
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    assert q_out.shape == q.shape and k_out.shape == k.shape, (q_out.shape, k_out.shape)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype, (q_out.dtype, k_out.dtype)
    for name, x in (("q", q), ("k", k), ("q_out", q_out), ("k_out", k_out)):
        assert x.stride(2) == 1, f"{name} heads must be contiguous: {x.stride()}"
        assert x.device == q.device == cos_sin.device == positions.device, name
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        positions,
        cos_sin,
        q,
        k,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        num_q_heads,
        num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
        enable_fp_fusion=False,  # no a * b + c -> fma: keeps the reference's roundings
    )
    return q_out, k_out
