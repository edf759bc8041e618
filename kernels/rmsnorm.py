"""RMSNorm, and residual add + RMSNorm, in one pass over each row.

Numerics are those of transformers' ``LlamaRMSNorm``: statistics in float32, the normalised row
rounded to the input dtype, then multiplied by the weight::

    h = x.float();  h = h * rsqrt(mean(h ** 2) + eps);  out = weight * h.to(x.dtype)

The fused variant first forms ``residual = x + residual`` in the input dtype (one rounding, like
torch's add), then normalises that sum, as vLLM's ``fused_add_rms_norm`` does. In eager torch the
two together are about eight elementwise kernels, each reading and writing the row from HBM; here
one program per row reads ``x`` (and ``residual``) once, keeps the row in registers, and writes the
result once: 2 (plain) or 4 (fused) row-sized HBM transfers instead of ~15.

``rmsnorm_ref`` and ``fused_add_rmsnorm_ref`` are the plain-torch versions the CPU engine's
numerics are checked against; ``rmsnorm`` and ``fused_add_rmsnorm`` are their Triton twins for
CUDA. The only numerical difference is the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_utils import tl, triton


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., N]
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); the sum is rounded to the input dtype first."""
    residual = x + residual
    return rmsnorm_ref(residual, weight, eps), residual


# ---------------------------------------------------------------------------------------------
# Triton kernel
#
# One program per row (per (token, head) row for the per-head q/k norm of Qwen3). The whole row
# is one block of BLOCK_N >= N elements in registers: Llama-3-8B's N = 4096 is 16 KiB in float32,
# 16 values per thread at 8 warps. Nothing is looped, so the fused kernel can write its outputs
# over its inputs (each program reads its whole row before writing it).
# ---------------------------------------------------------------------------------------------

MAX_N = 65536
"""Widest row one program holds; wider hidden sizes than any model's."""


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, H, N] rows of N contiguous elements
    res_ptr,  # [T, N] residual (FUSED only), rows contiguous
    w_ptr,  # [N]
    out_ptr,  # [T, H, N]
    res_out_ptr,  # [T, N] new residual (FUSED only)
    stride_x_t,
    stride_x_h,
    stride_res_t,
    stride_out_t,
    stride_out_h,
    stride_res_out_t,
    num_heads,  # H: rows per token (1 for the hidden-state norms)
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FUSED: tl.constexpr,  # add the residual first and store the sum
):
    row = tl.program_id(0).to(tl.int64)
    t = row // num_heads
    h = row % num_heads
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + cols, mask=mask, other=0.0)
    if FUSED:
        r = tl.load(res_ptr + t * stride_res_t + cols, mask=mask, other=0.0)
        # The sum is rounded to the input dtype before the norm reads it, as torch's add does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_res_out_t + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    rstd = tl.rsqrt(var + eps)
    # Normalised row rounded to the input dtype, then times the weight in the output dtype
    # (a product of two bf16/fp16 values is exact in float32, so one rounding as in torch).
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out_t + h * stride_out_h + cols, out, mask=mask)


def _num_warps(block_n: int) -> int:
    return 1 if block_n <= 256 else 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), (weight.shape, x.shape)
    assert weight.device == x.device, (weight.device, x.device)
    assert n <= MAX_N, f"row of {n} elements is wider than MAX_N={MAX_N}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of :func:`rmsnorm_ref` for ``x`` of ``[T, N]`` or ``[T, H, N]``.

    Rows may be strided (q or k heads sliced out of a fused QKV output) but each row's ``N``
    elements must be contiguous. Returns a new contiguous tensor of ``x``'s shape, in the dtype
    ``weight * x`` would have.
    """
    assert x.dim() in (2, 3), x.shape
    assert x.stride(-1) == 1, f"rows must be contiguous: {x.stride()}"
    _check_weight(x, weight)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, N]
    num_tokens, num_heads, n = x3.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    if out.numel() == 0:
        return out
    block_n = triton.next_power_of_2(n)
    _rmsnorm_kernel[(num_tokens * num_heads,)](
        x3,
        x3,  # no residual
        weight,
        out3,
        out3,  # no residual
        x3.stride(0),
        x3.stride(1),
        0,
        out3.stride(0),
        out3.stride(1),
        0,
        num_heads,
        eps,
        N=n,
        BLOCK_N=block_n,
        FUSED=False,
        num_warps=_num_warps(block_n),
    )
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`fused_add_rmsnorm_ref`, **in place**: returns ``(x, residual)`` with
    ``residual`` overwritten by ``x + residual`` and ``x`` by the normalised sum.

    In place like vLLM's ``fused_add_rms_norm``: a decode step allocates nothing here, and the
    caller's ``x`` (an o_proj / down_proj output) is dead after the call anyway.
    """
    assert x.dim() == 2 and x.shape == residual.shape, (x.shape, residual.shape)
    assert x.dtype == residual.dtype, (x.dtype, residual.dtype)
    assert x.dtype == torch.promote_types(x.dtype, weight.dtype), (x.dtype, weight.dtype)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1, (x.stride(), residual.stride())
    assert x.device == residual.device
    _check_weight(x, weight)
    num_tokens, n = x.shape
    if x.numel() == 0:
        return x, residual
    block_n = triton.next_power_of_2(n)
    _rmsnorm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        x,
        residual,
        x.stride(0),
        0,
        residual.stride(0),
        x.stride(0),
        0,
        residual.stride(0),
        1,
        eps,
        N=n,
        BLOCK_N=block_n,
        FUSED=True,
        num_warps=_num_warps(block_n),
    )
    return x, residual
