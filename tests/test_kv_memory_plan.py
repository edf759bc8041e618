"""The KV cache's share of a GPU (``pdserve.engine.memory``): the arithmetic and the refusals, on
figures; the GPU test checks what an engine really holds against its share."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from pdserve.engine.memory import GIB, KVMemoryPlan, check_free, size_kv_cache

MIB = 1 << 20


def plan(**kw) -> KVMemoryPlan:
    base = dict(
        device="cuda:0",
        total=80 * GIB,
        utilization=0.5,
        weights=16 * GIB,
        activations=2 * GIB,
        graphs=512 * MIB,
        bytes_per_block=2 * MIB,
    )
    return KVMemoryPlan(**{**base, **kw})


def test_the_cache_gets_the_share_less_weights_activations_and_graphs():
    p = plan()
    assert p.requested == 40 * GIB
    assert p.kv_bytes == 40 * GIB - 16 * GIB - 2 * GIB - 512 * MIB
    assert size_kv_cache(p) == p.kv_bytes // (2 * MIB) == 11_008
    # The graphs' memory comes out of the cache, not on top of the share.
    assert size_kv_cache(plan(graphs=0)) - size_kv_cache(p) == 256
    assert "0.50 GiB CUDA graphs" in p.describe() and "11008 blocks" in p.describe()


def test_a_share_that_leaves_nothing_for_the_cache_is_refused_with_its_figures():
    with pytest.raises(ValueError, match=r"no memory left for the KV cache .*16.00 GiB weights"):
        size_kv_cache(plan(utilization=0.2))
    with pytest.raises(ValueError, match="no memory left"):  # less than one block
        size_kv_cache(plan(weights=40 * GIB - 2 * GIB - 512 * MIB - MIB))


def test_a_share_larger_than_the_free_memory_is_refused_at_start_up():
    # 30 GiB used by another process: 50 free, this process holds 2 already.
    check_free("cuda:0", 80 * GIB, 48 * GIB, 2 * GIB, 0.6)  # 48 GiB asked of 50: fits
    figures = r"has 50.00 GiB of 80.00 GiB .*30.00 GiB used by other .*\(64.00 GiB\)"
    with pytest.raises(ValueError, match=figures):
        check_free("cuda:0", 80 * GIB, 48 * GIB, 2 * GIB, 0.8)


def test_the_samplers_worst_case_runs_on_a_full_batch(tiny_models):
    """What sizing runs on CUDA (``LLMEngine._sample_worst_case``) samples every row, one of them
    greedy without logprobs (a mixed batch makes the sampler copy rows out: on one H100 at 128 rows,
    874 MiB above the logits against 660 for rows all alike); run here on the CPU, where sizing
    does not need it, so that a change to the sampler cannot break a GPU engine's start-up unseen."""
    from pdserve import LLM

    llm = LLM(str(tiny_models["llama3"]), num_kv_blocks=16, max_model_len=256, max_num_seqs=8)
    engine = llm.engine
    seen = []
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, rows: seen.append(rows) or sample(logits, rows)
    engine._sample_worst_case(torch.randn(8, engine.arch.vocab_size))
    assert [len(rows) for rows in seen] == [8]
    params = [row.params for row in seen[0]]
    assert [p.greedy for p in params] == [True] + [False] * 7
    assert [p.logprobs for p in params] == [None] + [20] * 7


def test_prompt_logprobs_go_in_slices_of_max_num_seqs_rows():
    """A chunk's prompt logprobs ([rows, vocab] float tensors) are computed max_num_seqs rows at a
    time, which the sizing's worst-case sampler run outweighs, with the same figures as at once."""
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.prompt_logprobs import prompt_logprobs

    runner = object.__new__(ModelRunner)  # only the config and the model's lm head are used
    runner.config = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_num_seqs=4))
    head = torch.randn(8, 50)
    seen = []
    runner.model = types.SimpleNamespace(compute_logits=lambda h: seen.append(len(h)) or h @ head)
    hidden = torch.randn(14, 8)
    request = types.SimpleNamespace(
        request_id="r",
        num_prompt_tokens=14,
        prompt_token_ids=list(range(14)),
        sampling_params=types.SimpleNamespace(prompt_logprobs=3),
    )
    step = types.SimpleNamespace(scheduled=[types.SimpleNamespace(request=request, start=2, num_tokens=12)])
    into: list = []
    runner._prompt_logprobs(step, hidden, [2], into)
    assert seen == [4, 4, 3]  # positions 2..12 predict tokens 3..13
    ((rid, first, got),) = into
    expect = prompt_logprobs(hidden[2:13] @ head, list(range(3, 14)), 3)
    assert (rid, first, len(got)) == ("r", 3, 11)
    for g, e in zip(got, expect):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (e.token_id, e.rank, [t for t, _ in e.top])
        assert g.logprob == pytest.approx(e.logprob, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_needs_no_more_than_its_share_of_the_gpu():
    """What the engine keeps alive at its peak while it serves long prompts and a full batch of
    sampled requests (weights, the KV cache, activations, the sampler's rows), with the CUDA graphs'
    pools, fits ``gpu_memory_utilization`` (Llama-3-8B's shape, random weights) within 64 MiB; the
    graphs hold about what the cache was sized with. (What the allocator caches beyond that, it
    gives back when an allocation needs it.) On one H100: 9 MiB over; 223 with the sampler's worst
    case a batch of rows all alike (a mixed batch copies rows out), which fails here; 800 with the
    sizing before, which counted neither the graphs nor the sampler."""
    from pdserve import LLM, SamplingParams

    util, seqs = 0.35, 128
    llm = LLM("random:llama-3-8b", device="cuda", gpu_memory_utilization=util, max_num_seqs=seqs)
    runner = llm.engine.runner
    plan = runner.memory_plan
    total = torch.cuda.mem_get_info()[1]
    assert plan is not None and plan.total == total and plan.graphs > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * n} for i, n in enumerate((3000, 700, 64, 9))]
    prompts += [{"prompt_token_ids": [100 + i] * 20} for i in range(seqs - 4)]
    torch.cuda.reset_peak_memory_stats()
    out = llm.generate(prompts, [greedy] * 4 + [sampled] * (seqs - 4))
    assert [len(o.outputs[0].token_ids) for o in out] == [8] * seqs
    torch.cuda.synchronize()
    peak, share = torch.cuda.max_memory_allocated(), int(total * util)
    figures = (peak / GIB, share / GIB, plan.activations / MIB, plan.graphs / MIB, runner.graph_bytes / MIB)
    del llm, runner, out
    gc.collect()
    torch.cuda.empty_cache()
    assert peak + figures[-1] * MIB <= share + 64 * MIB, figures
    assert abs(figures[-1] - figures[-2]) <= max(figures[-2] / 4, 8), figures
