"""Acceptance: greedy output is token-identical to transformers' generate (float32, CPU).

Eight or more prompts of 3 to 600 tokens go in together with max_num_seqs=3 and a token
budget of 64, so requests queue and long prompts are prefilled in chunks.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams

PROMPT_LENGTHS = [3, 9, 40, 77, 128, 200, 333, 600]
MAX_NEW_TOKENS = 20

_TEXT = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or "
    "for chalk and slate, with or without the aid of tables. Digital computing is intimately "
    "tied to the representation of numbers. But long before abstractions like the number arose, "
    "there were mathematical concepts to serve the purposes of civilization. "
)


def hf_greedy(folder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def pdserve_greedy(folder, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_num_seqs=3,
        max_num_batched_tokens=64,
        **kwargs,
    )
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
    )
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def _strip_eos(tokens: list[int], eos: int) -> list[int]:
    # HF stops after eos and never pads a batch of one; keep everything up to and including eos.
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_smollm2_matches_transformers(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text_ids = tok.encode(_TEXT * 12)
    assert len(text_ids) > max(PROMPT_LENGTHS)
    prompts = [text_ids[i * 7 : i * 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]
    ours = pdserve_greedy(default_model_dir, prompts, MAX_NEW_TOKENS)
    ref = hf_greedy(default_model_dir, prompts, MAX_NEW_TOKENS)
    assert ours == ref


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_tiny_random_models_match_transformers(tiny_models, arch):
    rng = random.Random(arch)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in PROMPT_LENGTHS]
    ref = hf_greedy(tiny_models[arch], prompts, MAX_NEW_TOKENS)
    for async_scheduling in (False, True):
        ours = pdserve_greedy(tiny_models[arch], prompts, MAX_NEW_TOKENS, async_scheduling=async_scheduling)
        assert [_strip_eos(t, 7) for t in ours] == ref, f"async_scheduling={async_scheduling}"
