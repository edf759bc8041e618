"""Turn one step's logits into tokens: masking, penalties, filters, sampling and logprobs.

The order follows vLLM v1's sampler:

1. raw logprobs (float32 ``log_softmax`` of the unprocessed logits), only if some row asks;
2. a float32 copy of the logits; ``min_tokens`` masks eos and stop tokens; ``logit_bias`` is added;
3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
4. greedy rows: argmax of the penalized logits;
5. random rows: temperature, min_p, top_k, top_p (removed tokens become -inf), softmax,
   then one draw per row with the exponential trick (``argmax(probs / q)``, ``q ~ Exp(1)``);
6. one device->host transfer of the sampled ids and logprobs, started without waiting for it:
   ``Sampler.sample`` returns a ``PendingSample`` whose ``token_ids`` stay on the device (the
   next step reads them there under async scheduling) and whose ``get()`` waits for the copy.

No step of it reads device values on the host: index lists go up through pinned memory
(``copies.py``), so the host can prepare the next step while this one runs.

Reproducibility: a seeded row draws exactly ``V`` exponentials from its own generator per
step and every other operation is row-local, so the same seed gives the same tokens wherever
the row sits and whatever else is in the batch. Unseeded rows share the sampler's generator
and carry no such promise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.copies import HostCopy, to_device
from pdserve.logprobs import TokenLogprobs
from pdserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One request's row of the logits in this step.

    ``generator`` is the request's own generator when it is seeded (see ``make_generator``);
    ``None`` draws from the sampler's shared generator. ``num_pending_outputs`` counts output
    tokens sampled by steps still in flight (async scheduling): they count for ``min_tokens``
    but are not in ``output_token_ids`` yet, so a row with penalties must have none.
    ``output_token_ids`` starts with a resumed request's earlier output (the prompt's last
    ``params.resumed_tokens``: the penalties count it), which ``min_tokens`` does not count (the
    proxy lowered it by as much).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    num_pending_outputs: int = 0

    @property
    def num_output_tokens(self) -> int:
        resumed = min(self.params.resumed_tokens, len(self.prompt_token_ids))
        return len(self.output_token_ids) - resumed + self.num_pending_outputs


@dataclass(frozen=True)
class SamplerOutput:
    """Python values for the whole batch; index i belongs to rows[i]."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per seeded request, kept across steps.

    Put it on the device the logits live on; otherwise each step's draws are copied over.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Set eos and ``stop_token_ids`` to -inf in rows with fewer than ``min_tokens`` outputs.

    eos is masked even when ``ignore_eos`` is set. Ids outside ``[0, V)`` cannot be sampled
    and are skipped. Modifies ``logits`` [N, V] in place and returns it.
    """
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        if row.num_output_tokens >= row.params.min_tokens:
            continue
        for tok in {*eos_token_ids, *row.params.stop_token_ids}:
            if 0 <= tok < vocab:
                row_idx.append(i)
                tok_idx.append(tok)
    if row_idx:
        index = to_device([row_idx, tok_idx], torch.long, logits.device)  # [2, M]
        logits[index[0], index[1]] = _NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to the logits of the token ids it names (OpenAI's
    ``logit_bias``; ids outside ``[0, V)`` are skipped). Modifies ``logits`` [N, V] in place."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        for tok, b in (row.params.logit_bias or {}).items():
            if 0 <= tok < vocab:
                row_idx.append(i)
                tok_idx.append(tok)
                bias.append(b)
    if row_idx:
        index = to_device([row_idx, tok_idx], torch.long, logits.device)  # [2, M]
        values = to_device(bias, torch.float32, logits.device)  # [M]
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    return logits


def _bin_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts[i, t] = occurrences of token t in seqs[i]; ids outside [0, V) are dropped. [M, V]"""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [M]
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)  # [T]
    row = torch.repeat_interleave(torch.arange(len(seqs)), lengths)  # [T]
    valid = (flat >= 0) & (flat < vocab)
    keys = (row * vocab + flat)[valid]  # [T'] flat index into [M, V]
    if device.type != "cpu":
        keys = keys.pin_memory().to(device, non_blocking=True)
    return torch.bincount(keys, minlength=len(seqs) * vocab).view(len(seqs), vocab)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty, as in vLLM / HF.

    Repetition covers tokens in the prompt or the output: a positive logit is divided by the
    penalty, a non-positive one multiplied. Frequency subtracts ``fp * count_in_output``;
    presence subtracts ``pp`` once per token present in the output. Only rows with
    ``params.has_penalties`` are touched. Modifies ``logits`` [N, V] float32 in place and
    returns it.

    Cost: the prompt and output ids of penalized rows are flattened on the host each step.
    """
    idx = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not idx:
        return logits
    assert all(rows[i].num_pending_outputs == 0 for i in idx), "penalties need every output token"
    device, vocab = logits.device, logits.shape[1]
    sub = [rows[i].params for i in idx]
    idx_t = to_device(idx, torch.long, device)  # [M]
    values = to_device(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in sub], torch.float32, device
    )  # [M, 3]
    rep, freq, pres = (v.unsqueeze(1) for v in values.unbind(1))  # each [M, 1]

    x = logits.index_select(0, idx_t)  # [M, V]
    output_counts = _bin_counts([rows[i].output_token_ids for i in idx], vocab, device)  # [M, V]
    if any(p.repetition_penalty != 1.0 for p in sub):
        prompt_counts = _bin_counts([rows[i].prompt_token_ids for i in idx], vocab, device)
        seen = (prompt_counts > 0) | (output_counts > 0)  # [M, V]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= freq * output_counts.to(x.dtype)
    x -= pres * (output_counts > 0).to(x.dtype)
    logits.index_copy_(0, idx_t, x)
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose prob is below ``min_p * max_prob``. logits [R, V], min_p [R]."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Keep the k largest logits (and any tied with the k-th). top_k [R], 0 = off; max_k >= all k."""
    top = logits.topk(max_k, dim=-1).values  # [R, max_k], descending
    kth = top.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))  # [R, 1]
    kth = kth.masked_fill_((top_k == 0).unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < kth, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest set of top tokens whose mass reaches top_p. top_p [R], inf = off.

    A token is kept iff the mass of the tokens ranked above it is below top_p, so the top
    token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    cumsum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    mass_before = torch.zeros_like(cumsum)
    mass_before[:, 1:] = cumsum[:, :-1]
    remove_sorted = mass_before >= top_p.unsqueeze(1)  # [R, V], in sorted order
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
    logits.masked_fill_(remove, _NEG_INF)


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p on random (non-greedy) rows.

    Each filter renormalizes over what the previous ones kept; removed tokens become -inf.
    Filters no row asks for are skipped. Modifies ``logits`` [R, V] float32 in place (row i
    belongs to params[i]) and returns it.
    """
    assert not any(p.greedy for p in params), "greedy rows have no temperature to divide by"
    device, vocab = logits.device, logits.shape[1]

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)  # [R]

    if any(p.temperature != 1.0 for p in params):
        logits.div_(per_row([p.temperature for p in params], torch.float32).unsqueeze(1))
    if any(p.min_p > 0.0 for p in params):
        _apply_min_p(logits, per_row([p.min_p for p in params], torch.float32))
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        _apply_top_k(logits, per_row(top_k, torch.long), max(top_k))
    if any(p.top_p < 1.0 for p in params):
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        _apply_top_p(logits, per_row(top_p, torch.float32))
    return logits


class Sampler:
    """Picks one token per row of a step's logits; see the module docstring for the order.

    Holds only the shared generator for unseeded rows; per-request state (generator, token
    ids) comes in with each ``SamplingRow``.
    """

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0, device: torch.device | str = "cpu"):
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.generator = make_generator(seed, device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """``sample`` and wait for its result on the host."""
        return self.sample(logits, rows).get()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSample:
        """logits: [N, V] (any float dtype, any device), row i of logits belongs to rows[i].

        Queues the sampling and the copy of its result to the host, and returns without
        waiting for either. ``logits`` is not modified. Per-row generators advance; nothing
        else is mutated.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        lp_idx = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if lp_idx:
            raw_logprobs = _select_rows(logits, lp_idx).float().log_softmax(dim=-1)  # [L, V]

        x = logits.to(torch.float32, copy=True)  # [N, V]
        apply_min_tokens(x, rows, self.eos_token_ids)
        apply_logit_bias(x, rows)
        apply_penalties(x, rows)
        sampled = self._sample(x, rows)  # [N] int64
        return PendingSample.start(sampled, rows, lp_idx, raw_logprobs)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Greedy rows take the argmax, random rows are filtered and drawn. x [N, V] -> [N]."""
        num_rows, vocab = x.shape
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_idx:
            return x.argmax(dim=-1)
        all_random = len(random_idx) == num_rows
        r_logits = x if all_random else _select_rows(x, random_idx)  # [R, V]
        apply_filters(r_logits, [rows[i].params for i in random_idx])
        probs = r_logits.softmax(dim=-1)  # [R, V]
        q = self._exponentials([rows[i].generator for i in random_idx], vocab, x.device)  # [R, V]
        drawn = probs.div_(q).argmax(dim=-1)  # [R]
        if all_random:
            return drawn
        sampled = x.argmax(dim=-1)  # [N]; the random rows' entries are replaced next
        return sampled.index_copy_(0, to_device(random_idx, torch.long, x.device), drawn)

    def _exponentials(
        self, generators: Sequence[torch.Generator | None], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise [R, V]: unseeded rows in one draw from the shared generator, each seeded
        row exactly V draws from its own (the reproducibility contract)."""
        shared = [i for i, g in enumerate(generators) if g is None]
        q = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
        if shared:
            draws = torch.empty(len(shared), vocab, dtype=torch.float32, device=self.generator.device)
            draws = draws.exponential_(generator=self.generator).to(device)  # [S, V]
            if len(shared) == len(generators):
                q = draws
            else:
                q.index_copy_(0, to_device(shared, torch.long, device), draws)
        for i, gen in enumerate(generators):
            if gen is not None:
                row = torch.empty(vocab, dtype=torch.float32, device=gen.device)
                q[i] = row.exponential_(generator=gen).to(device)
        # exponential_ may return exactly 0; keep probs / q finite so zero-prob tokens stay at 0.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _select_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx] as a new tensor, or t itself when idx covers every row in order."""
    if len(idx) == t.shape[0]:
        return t
    return t.index_select(0, to_device(idx, torch.long, t.device))


@dataclass(frozen=True)
class PendingSample:
    """One step's sampled tokens: on the device at once, on the host once ``get()`` returns.

    Everything the host needs comes back in one transfer (``HostCopy``): the ids alone, or,
    when some row asks for logprobs, one float64 tensor that holds token ids and ranks exactly
    and float32 logprobs without rounding.
    """

    token_ids: torch.Tensor  # [N] int64 on the sampling device: what the next step reads
    copy: HostCopy
    logprobs_rows: tuple[int, ...]  # rows that asked for logprobs, in order
    logprobs_counts: tuple[int, ...]  # params.logprobs of those rows, capped at the vocabulary
    num_top: int  # top entries per logprobs row in the transfer

    @classmethod
    def start(
        cls,
        sampled: torch.Tensor,  # [N] int64
        rows: Sequence[SamplingRow],
        lp_idx: list[int],
        raw_logprobs: torch.Tensor | None,  # [L, V], rows lp_idx
    ) -> PendingSample:
        if raw_logprobs is None:
            return cls(sampled, HostCopy(sampled), (), (), 0)
        vocab = raw_logprobs.shape[1]
        num_top = min(max(rows[i].params.logprobs for i in lp_idx), vocab)
        tokens = _select_rows(sampled, lp_idx).unsqueeze(1)  # [L, 1]
        token_lp = raw_logprobs.gather(1, tokens)  # [L, 1]
        rank = (raw_logprobs > token_lp).sum(dim=-1, keepdim=True) + 1  # [L, 1]
        top_lp, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [L, K] each, descending
        packed = torch.cat([token_lp.double(), rank.double(), top_ids.double(), top_lp.double()], dim=1)
        flat = torch.cat([sampled.double(), packed.flatten()])  # [N + L * (2 + 2K)]
        counts = tuple(min(rows[i].params.logprobs, vocab) for i in lp_idx)
        return cls(sampled, HostCopy(flat), tuple(lp_idx), counts, num_top)

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def synchronize(self) -> None:
        """Wait until the step's sampling has run on the device (``get`` reads it then)."""
        self.copy.synchronize()

    def get(self) -> SamplerOutput:
        """The step's tokens and logprobs as Python values (waits for the copy)."""
        host = self.copy.wait().tolist()
        num_rows = self.num_rows
        if not self.logprobs_rows:
            return SamplerOutput(token_ids=host, logprobs=[None] * num_rows)
        token_ids = [int(t) for t in host[:num_rows]]
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        num_top = self.num_top
        width = 2 + 2 * num_top
        for j, (i, n) in enumerate(zip(self.logprobs_rows, self.logprobs_counts)):
            rec = host[num_rows + j * width : num_rows + (j + 1) * width]
            ids, lps = rec[2 : 2 + num_top], rec[2 + num_top :]
            logprobs[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=rec[0],
                rank=int(rec[1]),
                top=tuple((int(ids[k]), lps[k]) for k in range(n)),
            )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
