"""Acceptance: prefix-cache hits and preemption by recompute leave greedy output unchanged."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

SYSTEM = (
    "You are a meticulous assistant for a shipping company. Answer briefly, cite the policy "
    "section you rely on, and never invent tracking numbers. Policies: 1. Parcels over 30 kg "
    "ship as freight. 2. Refunds take five business days. 3. Lost parcels are investigated for "
    "ten days before a claim opens. 4. Customs fees are paid by the receiver. "
)
QUESTIONS = [
    "How long does a refund take?",
    "Who pays customs fees?",
    "My parcel weighs 42 kg. How does it ship?",
    "When can I open a claim for a lost parcel?",
    "Can you give me a tracking number?",
    "What is policy 1?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _chat_prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
    return out


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(
        str(default_model_dir), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=256
    )
    prompts = _chat_prompts(llm)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in outs)
    return prompts, _tokens(outs)


def test_prefix_cache_hits_keep_tokens(default_model_dir, reference):
    prompts, expected = reference
    assert len(prompts[0]["prompt_token_ids"]) > 96
    llm = LLM(str(default_model_dir), dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=256)
    kv = llm.engine.scheduler.kv
    first = llm.generate(prompts, GREEDY)
    sched = llm.engine.scheduler
    hits_after_first = sched.num_prefix_hit_tokens
    second = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected
    assert _tokens(second) == expected
    # The second pass finds every prompt's full blocks (all but the last token) in the cache.
    for out, prompt in zip(second, prompts):
        n = len(prompt["prompt_token_ids"])
        assert out.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert sched.num_prefix_hit_tokens - hits_after_first == sum(o.num_cached_tokens for o in second)
    assert kv.num_free_blocks == kv.pool.num_blocks
    kv.check_integrity()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_forced_preemption_keeps_tokens(default_model_dir, reference, async_scheduling):
    prompts, expected = reference
    # 20 blocks x 16 tokens cannot hold six ~130-token prompts plus 24 outputs each at once.
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        num_kv_blocks=20,
        max_model_len=320,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == expected
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
