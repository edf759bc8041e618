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


def test_async_scheduling_matches_sync_with_cuda_graphs(tiny_models):
    """bf16 with decode graphs: async scheduling (step N's ids fed to step N+1 on the device, into
    the graphs' static buffer) gives the tokens and logprobs of the synchronous engine."""
    from pdserve import LLM, SamplingParams

    kwargs = dict(dtype="bfloat16", device="cuda", max_num_seqs=8, max_num_batched_tokens=256)
    llm = LLM(str(tiny_models["llama3"]), num_kv_blocks=256, **kwargs)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.graphs is not None
    filled = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda *a: filled.append(a[5] is not None) or run(*a)

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randrange(1, 300))] for _ in range(6)]
    # Lengths known ahead (ignore_eos, max_tokens): both modes run the same batches, step by step.
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 40), ignore_eos=True) for _ in range(3)
    ] + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True, logprobs=1),
    ]

    def generate() -> list:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks and kv.pool.reset_prefix_cache()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    on = generate()
    assert any(filled), "no graph step took its input ids from the device"
    # No stream sync hides anywhere in a step (a pageable copy, .item(), .tolist() of a device
    # tensor): the host waits for the device only on the sampled tokens' copy event.
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert generate() == on
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.async_scheduling = False
    assert generate() == on
