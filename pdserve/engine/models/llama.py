"""Decoder-only transformer of the Llama family, over a paged KV cache.

One implementation serves Llama 2/3, SmolLM2, Mistral (no sliding window),
Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); ``ArchConfig`` says which
parts are on. Tokens of all requests in a step are flattened into one ``[T]``
batch; the attention backend finds each request's rows through the metadata.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.models.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    use_fused_kernels,
)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by all layers, not a parameter owner
        self.kv_cache: torch.Tensor | None = None  # [NB, 2, BS, Hkv, D], bound by the model runner

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.project(x, positions)
        return self.output(backend.forward(q, k, v, self.kv_cache, meta, self.scale))

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``: projected, normed (Qwen3), rotated."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:  # [T, Hq, D] -> [T, hidden]
        return self.o_proj(o.reshape(o.shape[0], self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)

    def forward(self, x, positions, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embedding, or the last layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream ``hidden`` is still to be added to
        positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style: each residual add rides in the next norm's kernel (``residual`` is None
        for the first layer, whose input is the embedding itself).

        Returns ``(mlp output, residual stream before it)``; the caller's next norm adds them.
        The sums are the same additions, in the same dtype, as in :meth:`forward`.
        """
        q, k, v, residual = self.pre_attention(hidden, residual, positions)
        attn = self.self_attn
        return self.post_attention(backend.forward(q, k, v, attn.kv_cache, meta, attn.scale), residual)

    def pre_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The fused path up to the attention: ``(q, k, v, residual stream)``."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward_add(hidden, residual)
        return (*self.self_attn.project(hidden, positions), residual)

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path from the attention's output ``o`` [T, Hq, D]: ``(mlp output, residual)``."""
        hidden = self.self_attn.output(o)
        hidden, residual = self.post_attention_layernorm.forward_add(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(arch, rotary) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` returns final hidden states for every new token; ``compute_logits`` projects rows."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, max_positions)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        assert len(kv_caches) == len(self.model.layers)
        for layer, cache in zip(self.model.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """``after_layer(i)`` runs once layer i's kernels (its KV writes among them) are queued."""
        x = self.model.embed_tokens(input_ids)
        if use_fused_kernels(x):
            return self._forward_fused(x, positions, meta, backend, after_layer)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, meta, backend)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(x)

    def _forward_fused(self, x, positions, meta, backend, after_layer) -> torch.Tensor:
        """The CUDA path: residual adds fused into the norms (same sums, one kernel per norm)."""
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer.forward_fused(x, residual, positions, meta, backend)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm.forward_add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()
