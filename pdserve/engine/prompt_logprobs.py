"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): how likely the
model found each prompt token given the ones before it.

The logits at position ``i`` predict token ``i + 1``, so a step that computes prompt positions
``[start, start + k)`` yields the logprobs of prompt tokens ``start + 1 .. start + k``; the first
prompt token has none. They are read on the host at once (a synchronizing copy): only requests
that ask for them pay for it, and only in the steps that compute their prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.copies import to_device
from pdserve.logprobs import TokenLogprobs


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """logits [K, V] at K consecutive prompt positions, targets the K prompt tokens that follow
    them: each target's raw logprob, rank and the ``num_top`` best alternatives."""
    lp = logits.float().log_softmax(dim=-1)  # [K, V]
    index = to_device(list(targets), torch.long, lp.device).unsqueeze(1)  # [K, 1]
    target_lp = lp.gather(1, index)  # [K, 1]
    rank = (lp > target_lp).sum(dim=-1)  # [K]
    num_top = min(num_top, lp.shape[1])
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], lp[:, :0].long())  # [K, top]
    rows = zip(targets, target_lp[:, 0].tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist())
    return [TokenLogprobs(int(t), v, r + 1, tuple(zip(ids, lps))) for t, v, r, ids, lps in rows]
