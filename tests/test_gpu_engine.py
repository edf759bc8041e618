"""GPU: the engine on CUDA (Triton attention) is token-identical to transformers in float32."""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_hf_equivalence import PROMPT_LENGTHS, _strip_eos

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_tiny_fp32_on_cuda_matches_transformers(tiny_models, arch):
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams

    rng = random.Random(arch)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in PROMPT_LENGTHS]
    llm = LLM(
        str(tiny_models[arch]),
        dtype="float32",
        device="cuda",
        max_num_seqs=3,
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.3,
    )
    assert llm.engine.runner.backend.name == "triton"
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=20)
        )
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).cuda().eval()
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False)
            ref.append(y[0, len(ids) :].tolist())
    assert [_strip_eos(t, 7) for t in ours] == ref
