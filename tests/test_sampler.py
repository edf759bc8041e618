"""Sampler checks against plain references: numpy float64 and per-row loops, no sampler internals."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from pdserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    apply_filters,
    apply_penalties,
    make_generator,
)
from pdserve.sampling_params import SamplingParams

torch.set_num_threads(1)


# ---------------------------------------------------------------- references


def ref_softmax(z: np.ndarray) -> np.ndarray:
    """Softmax over float64 values; -inf entries get probability 0."""
    finite = np.isfinite(z)
    e = np.zeros_like(z, dtype=np.float64)
    e[finite] = np.exp(z[finite] - z[finite].max())
    return e / e.sum()


def ref_filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Distribution a random row samples from: temperature, min_p, top_k, top_p, one by one."""
    probs = ref_softmax(np.asarray(logits, dtype=np.float64) / p.temperature)
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    if p.top_k > 0:
        keep = np.zeros(len(probs), dtype=bool)
        keep[np.argsort(-probs, kind="stable")[: p.top_k]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if p.top_p < 1.0:
        keep = np.zeros(len(probs), dtype=bool)
        mass = 0.0
        for tok in np.argsort(-probs, kind="stable"):
            keep[tok] = True
            mass += probs[tok]
            if mass >= p.top_p:
                break
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def ref_penalize(logits: np.ndarray, prompt, output, p: SamplingParams) -> np.ndarray:
    """HF repetition penalty over prompt+output, then OpenAI frequency/presence over output."""
    out = np.asarray(logits, dtype=np.float64).copy()
    for tok in set(prompt) | set(output):
        if out[tok] > 0:
            out[tok] /= p.repetition_penalty
        else:
            out[tok] *= p.repetition_penalty
    for tok, count in Counter(output).items():
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


def randn_logits(num_rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def assert_frequencies(samples: list[int], probs: np.ndarray) -> None:
    """Support of the samples equals the reference support; frequencies within ~4.5 sigma."""
    n = len(samples)
    freq = np.bincount(samples, minlength=len(probs)) / n
    support = set(np.flatnonzero(probs))
    assert set(np.flatnonzero(freq)) <= support
    # Every kept token likely to be seen (expected count >= 8) is seen.
    assert {t for t in support if probs[t] * n >= 8} <= set(np.flatnonzero(freq))
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freq - probs) <= 4.5 * sigma + 2e-3), np.abs(freq - probs).max()


def _short(p: SamplingParams) -> str:
    fields = ("temperature", "top_k", "top_p", "min_p")
    return (
        ",".join(f"{f}={getattr(p, f)}" for f in fields if getattr(p, f) != getattr(SamplingParams(), f))
        or "plain"
    )


GREEDY = SamplingParams(temperature=0.0)

FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.7),
    SamplingParams(top_p=0.05),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.6),
]


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("vocab", [37, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(vocab, dtype):
    logits = randn_logits(6, vocab, seed=vocab).to(dtype)
    out = Sampler(eos_token_ids=[])(logits, [row(GREEDY) for _ in range(6)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == np.argmax(logits.float().numpy(), axis=1).tolist()
    assert all(type(t) is int for t in out.token_ids)
    assert out.logprobs == [None] * 6


def test_greedy_seeded_row_does_not_draw():
    gen = make_generator(3)
    before = gen.get_state()
    Sampler([])(randn_logits(1, 37, 0), [row(GREEDY, generator=gen)])
    assert torch.equal(gen.get_state(), before)


def test_empty_batch():
    out = Sampler([])(torch.empty(0, 37), [])
    assert out.token_ids == [] and out.logprobs == []


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler([])(torch.zeros(2, 37), [row(GREEDY)])


def test_input_logits_not_modified():
    logits = randn_logits(3, 37, 1)
    copy = logits.clone()
    rows = [
        row(SamplingParams(repetition_penalty=1.5, min_tokens=2, stop_token_ids=(4,)), [1, 2], [3]),
        row(SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1)),
        row(GREEDY, output=[5]),
    ]
    Sampler([0])(logits, rows)
    assert torch.equal(logits, copy)


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize("vocab", [37, 1000])
def test_apply_filters_matches_reference(vocab):
    # One batch, every row with different params: the per-row tensors must line up.
    logits = randn_logits(len(FILTER_CASES), vocab, seed=11)
    filtered = apply_filters(logits.clone(), FILTER_CASES)
    for i, params in enumerate(FILTER_CASES):
        ref = ref_filtered_probs(logits[i].numpy(), params)
        got = torch.softmax(filtered[i], dim=-1).double().numpy()
        assert np.array_equal(np.isfinite(filtered[i].numpy()), ref > 0), params
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=1e-4)


def test_top_k_larger_than_vocab_keeps_everything():
    logits = randn_logits(1, 37, 2)
    filtered = apply_filters(logits.clone(), [SamplingParams(top_k=100)])
    assert torch.equal(filtered, logits)


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    filtered = apply_filters(logits.clone(), [SamplingParams(top_p=1e-3)])
    assert torch.isfinite(filtered).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("params", FILTER_CASES, ids=_short)
def test_sampled_frequencies_match_reference(params):
    # 3000 identical unseeded rows in one call draw 3000 samples from the shared generator.
    n, vocab = 3000, 37
    logits = randn_logits(1, vocab, seed=5, scale=1.5)
    sampler = Sampler([], seed=1234)
    out = sampler(logits.expand(n, vocab), [row(params) for _ in range(n)])
    assert_frequencies(out.token_ids, ref_filtered_probs(logits[0].numpy(), params))


def test_seeded_rows_sample_the_reference_distribution():
    # 2000 rows, each with its own generator: exercises the per-row draw path.
    n, vocab = 2000, 37
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.85, min_p=0.02, seed=0)
    logits = randn_logits(1, vocab, seed=6, scale=1.5)
    rows = [row(params, generator=make_generator(s)) for s in range(n)]
    out = Sampler([])(logits.expand(n, vocab), rows)
    assert_frequencies(out.token_ids, ref_filtered_probs(logits[0].numpy(), params))


def test_one_generator_over_many_steps_samples_the_reference_distribution():
    vocab = 37
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=9)
    logits = randn_logits(1, vocab, seed=8, scale=1.5)
    sampler, gen = Sampler([]), make_generator(9)
    samples = [sampler(logits, [row(params, generator=gen)]).token_ids[0] for _ in range(1500)]
    assert_frequencies(samples, ref_filtered_probs(logits[0].numpy(), params))


# ---------------------------------------------------------------- penalties

PENALTY_CASES = [
    (SamplingParams(repetition_penalty=1.3), [1, 2, 3, 3], [4, 1]),
    (SamplingParams(repetition_penalty=0.7), [5, 6], [7]),
    (SamplingParams(frequency_penalty=0.4), [1, 2], [2, 2, 2, 9, 9]),
    (SamplingParams(presence_penalty=1.1), [8], [3, 3, 10]),
    (SamplingParams(presence_penalty=-0.5, frequency_penalty=-0.2), [], [0, 0, 36]),
    (
        SamplingParams(repetition_penalty=1.8, frequency_penalty=0.3, presence_penalty=0.6),
        [1, 20],
        [20, 21, 21],
    ),
    (SamplingParams(), [1, 2], [3]),  # no penalties: untouched
]


@pytest.mark.parametrize("vocab", [37, 1000])
def test_apply_penalties_matches_reference(vocab):
    logits = randn_logits(len(PENALTY_CASES), vocab, seed=21)
    rows = [row(p, prompt, output) for p, prompt, output in PENALTY_CASES]
    got = apply_penalties(logits.clone(), rows)
    for i, (params, prompt, output) in enumerate(PENALTY_CASES):
        ref = ref_penalize(logits[i].numpy(), prompt, output, params)
        np.testing.assert_allclose(got[i].double().numpy(), ref, atol=1e-5, rtol=1e-6)


def _greedy_pick(logits_row: list[float], params: SamplingParams, prompt=(), output=()) -> int:
    p = SamplingParams(temperature=0.0, **{k: getattr(params, k) for k in _PENALTY_FIELDS})
    return Sampler([])(torch.tensor([logits_row]), [row(p, prompt, output)]).token_ids[0]


_PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def test_repetition_penalty_flips_argmax_for_positive_and_negative_logits():
    logits = [2.0, 1.5, -3.0, -1.0]
    assert _greedy_pick(logits, SamplingParams()) == 0
    # 2.0 / 2 = 1.0 < 1.5: token 0 (seen in the prompt) loses.
    assert _greedy_pick(logits, SamplingParams(repetition_penalty=2.0), prompt=[0]) == 1
    # Among negatives: -1.0 * 4 = -4.0 < -3.0.
    neg = [-3.0, -1.0]
    assert _greedy_pick(neg, SamplingParams(repetition_penalty=4.0), output=[1]) == 0
    # Penalty < 1 rewards seen tokens: 1.5 / 0.5 = 3.0 > 2.0.
    assert _greedy_pick(logits, SamplingParams(repetition_penalty=0.5), output=[1]) == 1


def test_frequency_and_presence_penalties_flip_argmax():
    logits = [2.0, 1.5, 0.0]
    # frequency: 2.0 - 0.2 * 3 = 1.4 < 1.5; with one occurrence 1.8 stays on top.
    assert _greedy_pick(logits, SamplingParams(frequency_penalty=0.2), output=[0, 0, 0]) == 1
    assert _greedy_pick(logits, SamplingParams(frequency_penalty=0.2), output=[0]) == 0
    # presence: 2.0 - 0.6 = 1.4 regardless of count.
    assert _greedy_pick(logits, SamplingParams(presence_penalty=0.6), output=[0]) == 1
    # prompt tokens do not count for frequency / presence.
    assert _greedy_pick(logits, SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), prompt=[0]) == 0


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_tokens():
    vocab, eos = 37, [0, 2]
    logits = torch.zeros(1, vocab)
    logits[0, [0, 2, 5]] = torch.tensor([9.0, 8.0, 7.0])  # eos, eos, stop token on top
    logits[0, 11] = 6.0
    sampler = Sampler(eos)
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5, 99), ignore_eos=ignore_eos)
        assert sampler(logits, [row(params, output=[1, 1])]).token_ids == [11]
        assert sampler(logits, [row(params, output=[1, 1, 1])]).token_ids == [0]


def test_min_tokens_is_per_row_and_holds_for_random_rows():
    vocab, eos = 37, [3]
    logits = randn_logits(1, vocab, seed=4)
    logits[0, 3] = 8.0  # eos would be picked almost always
    n = 500
    under = SamplingParams(min_tokens=1)
    rows = [row(under) if i % 2 == 0 else row(GREEDY) for i in range(n)]
    out = Sampler(eos, seed=2)(logits.expand(n, vocab), rows)
    assert all(t != 3 for t in out.token_ids[0::2])
    assert all(t == 3 for t in out.token_ids[1::2])


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_with_rank_and_sorted_top(dtype):
    vocab = 1000
    logits = randn_logits(5, vocab, seed=31, scale=3.0).to(dtype)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(SamplingParams(temperature=0.7, top_k=50, repetition_penalty=1.3, logprobs=3), [1, 2, 3], [4]),
        row(SamplingParams(temperature=1.0, logprobs=0)),
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=20), [], []),
    ]
    # Make the penalized greedy row's raw argmax a seen token so its rank is not 1.
    rows[4].output_token_ids.append(int(logits[4].float().argmax()))
    out = Sampler([], seed=3)(logits, rows)
    assert out.logprobs[3] is None
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            continue
        ref = torch.log_softmax(logits[i].float(), dim=-1).double().numpy()  # raw distribution
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert isinstance(lp, TokenLogprobs) and lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[tok], abs=1e-6)
        assert lp.rank == 1 + int(np.sum(ref > ref[tok]))
        # Tie-safe (bf16 logits repeat): the values are the n largest, each id carries its own.
        ids, values = [t for t, _ in lp.top], [v for _, v in lp.top]
        assert len(ids) == len(set(ids)) == r.params.logprobs
        np.testing.assert_allclose(values, np.sort(ref)[::-1][: r.params.logprobs], atol=1e-6)
        np.testing.assert_allclose(ref[ids], values, atol=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        assert all(type(t) is int and type(v) is float for t, v in lp.top)
    assert out.logprobs[0].rank == 1
    assert out.logprobs[4].rank > 1
    assert out.logprobs[2].top == ()


def test_logprobs_top_n_capped_at_vocab():
    out = Sampler([])(randn_logits(1, 7, 0), [row(SamplingParams(temperature=0.0, logprobs=20))])
    assert len(out.logprobs[0].top) == 7


# ---------------------------------------------------------------- reproducibility


def _seeded_sequence(seed: int, position: int, others: list[SamplingParams], steps: int = 12) -> list[int]:
    """Tokens a seeded row produces over ``steps`` steps, sitting at ``position`` among ``others``."""
    vocab = 1000
    params = SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=0.5, seed=seed)
    target = row(params, prompt=[1, 2, 3], generator=make_generator(seed))
    target_logits = torch.Generator().manual_seed(77)  # the model's output for the target
    other_logits = torch.Generator().manual_seed(len(others) * 10 + position)
    other_rows = [row(p, generator=make_generator(p.seed) if p.seed is not None else None) for p in others]
    sampler = Sampler([0], seed=position + 100)  # the shared generator differs too
    for _ in range(steps):
        batch = other_rows[:position] + [target] + other_rows[position:]
        logits = torch.randn(len(others), vocab, generator=other_logits) * 2
        mine = torch.randn(1, vocab, generator=target_logits) * 2
        logits = torch.cat([logits[:position], mine, logits[position:]])
        out = sampler(logits, batch)
        target.output_token_ids.append(out.token_ids[position])
        for r, tok in zip(other_rows, out.token_ids[:position] + out.token_ids[position + 1 :]):
            r.output_token_ids.append(tok)
    return target.output_token_ids


def test_same_seed_same_tokens_across_batches_and_positions():
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=5),  # same seed, different stream object
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=1.5, seed=123, repetition_penalty=1.2),
    ]
    alone = _seeded_sequence(5, 0, [])
    assert _seeded_sequence(5, 0, []) == alone
    assert _seeded_sequence(5, 2, others) == alone
    assert _seeded_sequence(5, 4, others) == alone
    assert _seeded_sequence(5, 1, others[2:]) == alone
    assert _seeded_sequence(6, 0, []) != alone


def test_shared_generator_is_seeded_by_the_sampler():
    logits = randn_logits(8, 1000, 0)
    rows = [row(SamplingParams()) for _ in range(8)]

    def three_steps(seed: int) -> list[list[int]]:
        sampler = Sampler([], seed=seed)
        return [sampler(logits, rows).token_ids for _ in range(3)]

    assert three_steps(1) == three_steps(1)
    assert three_steps(1) != three_steps(2)


# ---------------------------------------------------------------- mixed batches


def test_mixed_greedy_and_random_rows():
    vocab, n = 37, 8
    logits = randn_logits(n, vocab, seed=41)
    random_params = SamplingParams(temperature=1.0, top_k=3)
    rows = [row(GREEDY) if i % 3 == 0 else row(random_params) for i in range(n)]
    sampler = Sampler([], seed=9)
    seen: dict[int, set[int]] = {i: set() for i in range(n)}
    for _ in range(30):
        out = sampler(logits, rows)
        for i, tok in enumerate(out.token_ids):
            seen[i].add(tok)
    for i in range(n):
        top3 = set(np.argsort(-logits[i].numpy())[:3].tolist())
        if i % 3 == 0:
            assert seen[i] == {int(logits[i].argmax())}
        else:
            assert seen[i] <= top3 and len(seen[i]) > 1


def test_exponential_trick_never_picks_a_removed_token():
    # A nearly one-hot distribution with top_k=1: whatever the noise, only the top token.
    logits = torch.full((64, 1000), -5.0)
    logits[:, 17] = 0.0
    out = Sampler([], seed=0)(logits, [row(SamplingParams(top_k=1)) for _ in range(64)])
    assert set(out.token_ids) == {17}
