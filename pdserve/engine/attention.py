"""The attention backend: KV writes and paged attention for one engine step.

``AttentionMetadata`` is built once per step by the model runner and shared by all
layers. Within a layer every new token's KV is written before any attention reads
the cache, so a request may read blocks that another request of the same step has
just filled (prefix-cache hits registered during scheduling).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pdserve.engine.copies import to_device
from pdserve.kernels.kv_write import write_kv_ref
from pdserve.kernels.paged_attention import StaticDecodePlan, paged_attention_ref


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]  # per request: context length after this step
    query_lens: list[int]  # per request: new tokens in this step
    seq_lens_t: torch.Tensor  # [B] int32, on the device
    query_start_loc: torch.Tensor  # [B + 1] int32, on the device: row offsets of each request's queries
    static_decode: StaticDecodePlan | None = None
    """Set by CUDA-graph decode steps: the attention launch must not depend on the contexts. The
    host lists then hold bounds (one query per request, every context ``max_model_len``), not the
    step's values, which live in the device tensors only."""

    @classmethod
    def build(
        cls,
        slot_mapping: list[int] | torch.Tensor,  # a tensor: already on the device
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        device: torch.device,
    ) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        # Queued copies through pinned memory: building a step's metadata never waits for the device.
        return cls(
            slot_mapping=(
                slot_mapping
                if isinstance(slot_mapping, torch.Tensor)
                else to_device(slot_mapping, torch.long, device)
            ),
            block_tables=to_device(block_tables, torch.int32, device),
            seq_lens=seq_lens,
            query_lens=query_lens,
            seq_lens_t=to_device(seq_lens, torch.int32, device),
            query_start_loc=to_device(starts, torch.int32, device),
        )

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its cache, then attends. Implementations must not keep state."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [NB, 2, BS, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        self.write(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    @abstractmethod
    def write(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store each new token's K/V in its cache slot (slot -1: dropped, a padding row)."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, Hq, D]: where the output goes (else a new tensor)
    ) -> torch.Tensor:
        """Attention of each request's new tokens over its context in the cache (written already)."""


class TorchAttentionBackend(AttentionBackend):
    """Plain-torch references from ``kernels/``: the CPU path and the ground truth for Triton."""

    name = "torch"

    def write(self, k, v, kv_cache, slot_mapping):
        write_kv_ref(k, v, kv_cache, slot_mapping)

    def attend(self, q, kv_cache, meta, scale, out=None):
        assert meta.static_decode is None, "the torch references read the host lists of the step"
        o = paged_attention_ref(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_lens, scale)
        return o if out is None else out.copy_(o)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels from ``kernels/``: the CUDA path."""

    name = "triton"

    def write(self, k, v, kv_cache, slot_mapping):
        from pdserve.kernels.kv_write import write_kv

        write_kv(k, v, kv_cache, slot_mapping)

    def attend(self, q, kv_cache, meta, scale, out=None):
        from pdserve.kernels.paged_attention import paged_attention

        return paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens_t,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            out,
            static=meta.static_decode,
        )


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA, the torch references elsewhere."""
    return TritonAttentionBackend() if device.type == "cuda" else TorchAttentionBackend()
