"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, gated MLP.

Numerics follow transformers' Llama code step for step (float32 norm statistics,
float32 rotary tables), so float32 runs are token-identical to it.

On CUDA, RMSNorm (with or without the residual add) and the rotary embedding run as fused
Triton kernels (``kernels/rmsnorm.py``, ``kernels/rotary.py``) instead of a dozen elementwise
torch kernels each; the CPU code below them is the reference and stays op for op as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.arch import RopeConfig
from pdserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm
from pdserve.kernels.rotary import rotary

FUSED_KERNELS_ON_CUDA = True
"""Use the Triton norm/rotary kernels for CUDA tensors; set False to A/B against eager torch."""


def use_fused_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and FUSED_KERNELS_ON_CUDA


class Linear(nn.Linear):
    """``nn.Linear`` without the random init: weights come from a checkpoint or ``init_random_weights``."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; on CUDA fused and in place over both inputs."""
        if use_fused_kernels(x):
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return fused_add_rmsnorm_ref(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) with a precomputed float32 cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer(
            "cos_sin", torch.empty(max_positions, 2, head_dim, dtype=torch.float32), persistent=False
        )

    def init_table(self) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.cos_sin.device)
        t = torch.arange(self.max_positions, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos_sin.copy_(torch.stack((emb.cos(), emb.sin()), dim=1))

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_fused_kernels(q):
            return rotary(positions, q, k, self.cos_sin, q_out=q, k_out=k)  # in place
        cos_sin = self.cos_sin[positions].to(q.dtype)  # [T, 2, D]
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)  # [T, 1, D]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
