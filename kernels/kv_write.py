"""Write new keys and values into the paged KV cache by slot mapping.

KV layout (one tensor per layer)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   # [:, 0] keys, [:, 1] values

A slot is ``block_id * block_size + offset``; a negative slot marks a padding token
whose KV is dropped. One layer's block — keys and values together — is one
contiguous region, which is what the KV transports move.
"""

from __future__ import annotations

import torch


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
