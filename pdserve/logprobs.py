"""A sampled token's logprob, rank and top alternatives: what the sampler reports, the engine
returns and the wire protocol carries (torch-free, like vLLM's ``vllm.logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Where the sampled token sits in the raw model distribution (before any processing)."""

    token_id: int  # the sampled token
    logprob: float  # log_softmax of the unprocessed logits at token_id
    rank: int  # 1 + number of tokens with a strictly higher raw logprob (ties share the best rank)
    top: tuple[tuple[int, float], ...]  # top params.logprobs (token_id, logprob), descending


def best_sequences(cumulative_logprobs: Sequence[float], n: int) -> list[int]:
    """The indices of the ``n`` sequences of highest cumulative logprob, best first (``best_of``;
    ties keep the lower index first)."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: (-cumulative_logprobs[i], i))
    return order[:n]
