"""The plain-torch kernel references against a dense, per-request computation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.kernels.kv_write import write_kv_ref
from pdserve.kernels.paged_attention import paged_attention_ref


def dense_attention(q, k, v, scale):
    """q: [L, Hq, D] at the last L of S positions; k, v: [S, Hkv, D]."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    L, S = q.shape[0], k.shape[0]
    scores = torch.einsum("lhd,shd->hls", q.double(), k.double()) * scale
    pos = torch.arange(S - L, S)[:, None]
    scores = scores.masked_fill(torch.arange(S)[None, :] > pos, -math.inf)
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(9, 3), (5, 1), (4, 4)])
def test_paged_attention_matches_dense(block_size, heads):
    rng = random.Random(block_size * 100 + heads[0])
    torch.manual_seed(block_size + heads[0])
    hq, hkv = heads
    d = 24
    # (context length, new tokens): decodes, full prefills, chunks over a cached prefix
    shapes = [(1, 1), (17, 1), (300, 1), (5, 5), (block_size, block_size), (129, 40), (77, 1), (250, 3)]
    num_blocks = sum(-(-s // block_size) for s, _ in shapes) + 7
    kv_cache = torch.randn(num_blocks, 2, block_size, hkv, d)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, contexts = [], []
    for s, _ in shapes:
        nb = -(-s // block_size)
        tables.append([free.pop() for _ in range(nb)])
        flat = kv_cache[tables[-1]]  # [nb, 2, BS, Hkv, D]
        contexts.append((flat[:, 0].reshape(-1, hkv, d)[:s], flat[:, 1].reshape(-1, hkv, d)[:s]))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(n for _, n in shapes), hq, d)
    scale = d**-0.5
    out = paged_attention_ref(
        q, kv_cache, block_tables, [s for s, _ in shapes], [n for _, n in shapes], scale
    )
    start = 0
    for (_, n), (k, v) in zip(shapes, contexts):
        ref = dense_attention(q[start : start + n], k, v, scale)
        torch.testing.assert_close(out[start : start + n], ref, atol=2e-5, rtol=2e-5)
        start += n


def test_write_kv_by_slot_skips_padding():
    kv_cache = torch.zeros(4, 2, 8, 3, 5)
    k = torch.randn(4, 3, 5)
    v = torch.randn(4, 3, 5)
    slots = torch.tensor([0, 13, -1, 31])
    write_kv_ref(k, v, kv_cache, slots)
    torch.testing.assert_close(kv_cache[0, 0, 0], k[0])
    torch.testing.assert_close(kv_cache[1, 1, 5], v[1])
    torch.testing.assert_close(kv_cache[3, 0, 7], k[3])
    assert int((kv_cache != 0).any(-1).any(-1).sum()) == 3 * 2  # three slots, K and V each
