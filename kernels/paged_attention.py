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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
