"""Parallel sampling (n, best_of), logit_bias and prompt logprobs in the engine.

The scheduler tests drive forks with fake samples and assert exact block sharing; the engine tests
run the random-weight tiny model on the CPU (fast), greedy and seeded, both synchronous and async.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request, RequestStatus
from pdserve.logprobs import best_sequences
from tests.test_scheduler import EOS, make_scheduler, run_to_idle, step


def make_group(request_id: str, prompt: list[int], n: int, max_tokens: int = 4) -> Request:
    """A parent request with ``n - 1`` sequences to fork, as ``LLMEngine`` builds them."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
    parent = Request(request_id, list(prompt), params.for_sequence(0), eos_token_ids=(EOS,))
    parent.pending_forks = [
        Request(f"{request_id}#{j}", list(prompt), params.for_sequence(j), eos_token_ids=(EOS,))
        for j in range(1, n)
    ]
    return parent


# ------------------------------------------------------------------------ scheduler: forks


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    sched = make_scheduler(block_size=4, num_blocks=16)
    parent = make_group("a", list(range(1, 11)), n=3)  # 10 tokens: blocks 0, 1 full, 2 partial
    children = list(parent.pending_forks)
    sched.add_request(parent)

    first = step(sched)
    assert first.rows == [("a", 0, 10, True)]
    assert not parent.pending_forks and parent.output_token_ids == [100]
    # Each child shares the blocks of the prompt's first 9 tokens: 0 and 1 by reference, and
    # gets its own copy of block 2 (tokens 8..9, of which it recomputes token 9).
    shared = sched.kv.req_to_blocks["a"][:2]
    assert [b.ref_cnt for b in shared] == [3, 3]
    own = [sched.kv.get_block_ids(c.request_id) for c in children]
    assert own == [[0, 1, 3], [0, 1, 4]]
    assert all(c.num_computed_tokens == 9 and c.status == RequestStatus.WAITING for c in children)

    second = step(sched)
    assert second.out.block_copies == [(2, 3), (2, 4)]  # made before this step's forward
    assert second.rows == [("a", 10, 1, True), ("a#1", 9, 1, True), ("a#2", 9, 1, True)]
    assert [c.output_token_ids for c in children] == [[100], [100]]

    run_to_idle(sched)
    assert all(len(r.output_token_ids) == 4 for r in (parent, *children))
    assert sched.kv.num_free_blocks == 16
    sched.check_integrity()


def test_block_aligned_prompt_needs_no_copy():
    sched = make_scheduler(block_size=4, num_blocks=16)
    parent = make_group("a", list(range(1, 10)), n=2)  # 9 tokens: the first 8 fill blocks 0 and 1
    child = parent.pending_forks[0]
    sched.add_request(parent)
    step(sched)
    assert sched.kv.get_block_ids(child.request_id) == [0, 1]
    second = step(sched)
    assert second.out.block_copies == []
    assert sched.kv.get_block_ids(child.request_id) == [0, 1, 3]  # its own block for token 8
    run_to_idle(sched)
    assert sched.kv.num_free_blocks == 16


def test_child_without_a_free_block_recomputes_its_prompt():
    sched = make_scheduler(block_size=4, num_blocks=3, max_model_len=12)
    parent = make_group("a", list(range(1, 11)), n=2, max_tokens=2)  # all 3 blocks taken
    child = parent.pending_forks[0]
    sched.add_request(parent)
    step(sched)
    assert child.num_computed_tokens == 0 and not sched.kv.get_block_ids(child.request_id)
    run_to_idle(sched)
    assert len(child.output_token_ids) == 2 and child.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv.num_free_blocks == 3
    sched.check_integrity()


def test_preempted_children_recompute_and_release_shared_blocks():
    sched = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    parent = make_group("a", list(range(1, 11)), n=4, max_tokens=12)
    group = [parent, *parent.pending_forks]
    sched.add_request(parent)
    run_to_idle(sched)  # each step checks integrity
    assert sched.num_preemptions > 0
    assert all(r.output_token_ids == list(range(100, 112)) for r in group)
    assert sched.kv.num_free_blocks == 8


def test_decode_side_fork_shares_landed_blocks():
    sched = make_scheduler(block_size=4, num_blocks=16)
    parent = make_group("a", list(range(1, 11)), n=2)
    child = parent.pending_forks[0]
    landed = sched.reserve_remote(parent)
    assert landed == [0, 1, 2]
    sched.remote_kv_landed("a", 100, None, 0)
    assert sched.kv.get_block_ids(child.request_id) == [0, 1, 3]
    nxt = step(sched)
    assert nxt.out.block_copies == [(2, 3)]
    assert nxt.rows == [("a", 10, 1, True), ("a#1", 9, 1, True)]
    run_to_idle(sched)
    assert sched.kv.num_free_blocks == 16


def test_reserve_keeps_room_for_the_forks():
    sched = make_scheduler(block_size=4, num_blocks=4)
    assert sched.reserve_remote(make_group("a", list(range(1, 11)), n=3)) is None  # 3 + 2 copies > 4
    assert sched.reserve_remote(make_group("b", list(range(1, 11)), n=2)) == [0, 1, 2]


def test_best_sequences_ranks_by_cumulative_logprob():
    assert best_sequences([-3.0, -1.0, -2.0, -1.0], 2) == [1, 3]


# ------------------------------------------------------------------------ engine


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    return LLM(
        "random:tiny",
        device="cpu",
        max_model_len=256,
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=8,
        async_scheduling=request.param,
    )


PROMPTS = [{"prompt_token_ids": list(range(3, 14))}, {"prompt_token_ids": [5, 9, 2, 7, 7, 1]}]


def _idle(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not llm.engine._groups and not llm.engine._group_of and not llm.engine._states


def test_greedy_sequences_equal_a_single_request_and_prompt_runs_once(llm):
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    before = llm.engine.num_prompt_tokens_computed
    llm.engine.reset_prefix_cache()
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=4))
    for r, o in zip(ref, out):
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
        assert all(c.token_ids == r.outputs[0].token_ids for c in o.outputs)
    # One prefill per prompt, plus the last prompt token once per forked sequence.
    expected = sum(len(p["prompt_token_ids"]) + 3 for p in PROMPTS)
    assert llm.engine.num_prompt_tokens_computed - before == expected
    _idle(llm)


def test_seeded_sequences_are_reproducible_and_distinct(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, n=3)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1
    # Sequence j draws from seed + j, like a single request with that seed.
    alone = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=13, max_tokens=8, ignore_eos=True))
    assert [o.outputs[2].token_ids for o in a] == [o.outputs[0].token_ids for o in alone]
    _idle(llm)


def test_best_of_returns_the_n_most_likely(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    every = llm.generate(PROMPTS, SamplingParams(**{**params.__dict__, "n": 5, "logprobs": 0}))
    best = llm.generate(PROMPTS, SamplingParams(**{**params.__dict__, "n": 2, "best_of": 5}))
    for e, b in zip(every, best):
        ranked = sorted(e.outputs, key=lambda c: -c.cumulative_logprob)[:2]
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in ranked]
        assert [c.index for c in b.outputs] == [0, 1] and all(c.logprobs is None for c in b.outputs)
    _idle(llm)


def test_abort_of_the_parent_ends_every_sequence(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=3)
    for steps in (0, 3):  # before the fork, and after it
        engine.add_request("g", None, params, prompt_token_ids=list(range(3, 14)))
        for _ in range(steps):
            engine.step()
        assert engine.request_ids() == ["g"] and engine.has_request("g")
        engine.abort_request(["g"])
        while engine.has_work():
            engine.step()
        assert not engine.has_request("g")
        _idle(llm)


def test_logit_bias_bans_and_forces_tokens(llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    first = ref.outputs[0].token_ids[0]
    banned = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={first: -100})
    )[0]
    assert first not in banned.outputs[0].token_ids
    forced = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, logit_bias={42: 100})
    )[0]
    assert forced.outputs[0].token_ids == [42] * 4
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})


def test_prompt_logprobs_agree_with_decode_logprobs_and_skip_the_cache(llm):
    """Teacher forcing: the prompt logprobs of a prompt that ends in a greedy continuation equal the
    logprobs the decode steps reported for those tokens."""
    prompt = PROMPTS[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    gen = llm.generate(PROMPTS[0], params)[0]
    tokens = gen.outputs[0].token_ids
    for _ in range(2):  # the second time its blocks are cached: no hit may skip a position
        out = llm.generate(
            {"prompt_token_ids": prompt + tokens},
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
        )[0]
        assert out.num_cached_tokens == 0
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) + len(tokens) and lps[0] is None
        assert [lp.token_id for lp in lps[1:]] == (prompt + tokens)[1:]
        for lp, dec in zip(lps[len(prompt) :], gen.outputs[0].logprobs):
            assert lp.logprob == pytest.approx(dec.logprob, abs=1e-4)
            assert lp.rank == dec.rank == 1 and len(lp.top) == 2
    _idle(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_forks_on_cuda_with_graphs(async_scheduling):
    """The block copies and prompt logprobs on the device, with CUDA graphs for the decode steps."""
    llm = LLM(
        "random:tiny",
        device="cuda",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(PROMPTS, greedy)
    out = llm.generate(PROMPTS, SamplingParams(**{**greedy.__dict__, "n": 4, "prompt_logprobs": 1}))
    for r, o in zip(ref, out):
        assert all(c.token_ids == r.outputs[0].token_ids for c in o.outputs)
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) and o.prompt_logprobs[0] is None
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, n=3)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, seeded)] == [
        [c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, seeded)
    ]
    _idle(llm)


def test_token_events_give_one_delta_per_sequence_that_moved():
    from pdserve.engine.outputs import CompletionOutput, RequestOutput
    from pdserve.logprobs import TokenLogprobs
    from pdserve.node.token_events import TokenEvents

    def out(texts, finish=(None, None), prompt_logprobs=None):
        outputs = [
            CompletionOutput(j, t, list(range(len(t))), finish_reason=finish[j]) for j, t in enumerate(texts)
        ]
        return RequestOutput("g", None, [1, 2], outputs, all(finish), prompt_logprobs=prompt_logprobs)

    lp = [None, TokenLogprobs(2, -1.0, 1, ())]
    deltas = TokenEvents(hold=1)
    first = deltas.events(out(["ab", ""], prompt_logprobs=lp))
    assert [(e.index, e.text, e.token_ids) for e in first] == [(0, "a", [0, 1])]  # "b" held back
    assert first[0].prompt_logprobs[1].logprob == -1.0
    second = deltas.events(out(["abc", "x"], finish=("stop", None), prompt_logprobs=lp))
    assert [(e.index, e.text, e.finish_reason) for e in second] == [(0, "bc", "stop"), (1, "", None)]
    assert all(e.prompt_logprobs is None for e in second)  # sent once
    last = deltas.events(out(["abc", "xy"], finish=("stop", "length")))
    assert [(e.index, e.text, e.finish_reason) for e in last] == [(1, "xy", "length")]
