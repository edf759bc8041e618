"""CUDA graphs for decode: the static split-K launch against the reference, and the engine with
graphs against the engine with ``enforce_eager``.

Without CUDA the static decode launch runs under Triton's interpreter on small shapes (like
``test_kernels_triton.py``) and the CPU engine is checked to capture nothing; the ``gpu``-marked
tests capture real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.cuda_graphs import decode_buckets
from pdserve.kernels import paged_attention as pa
from tests.test_kernels_triton import DECODE_SHAPES, DEVICE, assert_close, make_batch, run_both


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]


def _plan(num_seqs, num_heads, head_dim, num_splits):
    numel = pa.StaticDecodePlan.workspace_numel(num_seqs, num_heads, head_dim, num_splits)
    workspace = torch.full((numel + 7,), float("nan"), device=DEVICE)  # larger than needed: a shared one
    return pa.StaticDecodePlan(num_splits, workspace if numel else None)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_static_decode_matches_ref(num_splits, heads):
    """Partitions sized on the device from each request's own context: short contexts leave most
    splits empty (64), long ones get partitions longer than the minimum (3 splits over 1000)."""
    shapes = [*DECODE_SHAPES, (1000, 1)]
    q, cache, tables = make_batch(shapes, *heads, 32, 16, torch.float32, seed=num_splits)
    plan = _plan(len(shapes), heads[0], 32, num_splits)
    assert_close(*run_both(shapes, q, cache, tables, static=plan))


def test_static_decode_rejects_prefill_and_small_workspace():
    shapes = [(40, 3), (9, 1)]
    q, cache, tables = make_batch(shapes, 4, 2, 16, 16, torch.float32)
    with pytest.raises(AssertionError, match="pure decode"):
        run_both(shapes, q, cache, tables, static=_plan(2, 4, 16, 2))
    shapes = [(40, 1), (9, 1)]
    q, cache, tables = make_batch(shapes, 4, 2, 16, 16, torch.float32)
    with pytest.raises(AssertionError, match="too small"):
        run_both(shapes, q, cache, tables, static=_plan(1, 4, 16, 2))


STATIC_SM90_BODY = """
bf16 = torch.bfloat16
for splits in (1, 64):
    config = pa.decode_config(32, 8, 128, 16, bf16, splits, True)
    compile_sm90(pa._decode_kernel, config, PTR, ("qk_scale",))
compile_sm90(pa._decode_reduce_kernel, pa.reduce_config(128, 64, True), PTR)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_static_decode_compiles_for_sm90():
    """What the interpreter lets through (types of the device-side partition arithmetic)."""
    from tests.sm90 import compile_for_sm90
    from tests.test_kernels_triton import KERNELS_SM90

    compile_for_sm90(KERNELS_SM90 + STATIC_SM90_BODY)


def test_cpu_engine_captures_nothing(tiny_models):
    from pdserve import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama3"]), device="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.engine.runner.graphs is None
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_static_decode_graph_replays_new_contexts(dtype):
    """Llama-3-8B attention shapes: capture one static launch, then replay it over batches whose
    contexts (1 to 8192), lengths and block tables change, as a decode graph sees them."""
    num_seqs, max_len, block_size = 4, 8192, 16
    splits = pa.StaticDecodePlan.num_splits_for(num_seqs, 8, max_len, DEVICE)
    plan = _plan(num_seqs, 32, 128, splits)
    assert splits > 1
    max_blocks = max_len // block_size
    cache = torch.randn(num_seqs * max_blocks + 1, 2, block_size, 8, 128, device=DEVICE).to(dtype)
    q = torch.empty(num_seqs, 32, 128, dtype=dtype, device=DEVICE)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(num_seqs, dtype=torch.int32, device=DEVICE)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    scale = 128**-0.5

    def launch():
        return pa.paged_attention(q, cache, tables, lens, starts, scale, 1, max_len, static=plan)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    rng = random.Random(0)
    for seq_lens in ([1, 8192, 300, 129], [4097, 2, 64, 8000], [1056] * 4):
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        perm = torch.randperm(cache.shape[0] - 1)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
        tables.copy_(perm.to(torch.int32))
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expect = pa.paged_attention_ref(q.float(), cache.float(), tables, seq_lens, [1] * num_seqs, scale)
        assert_close(out, expect)
        rng.shuffle(seq_lens)


def _generate(llm, prompts, max_tokens):
    from pdserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_gpu_graphs_match_eager(tiny_models, arch):
    """Greedy tokens with decode graphs equal those of ``enforce_eager`` for batches of 1, 3, 5 and
    8 requests (buckets 1, 2, 4, 8: 3 and 5 pad, and the batch shrinks as requests finish), with
    contexts past several split-K partitions and block boundaries."""
    from pdserve import LLM

    kwargs = dict(
        dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=512
    )
    graphs = LLM(str(tiny_models[arch]), **kwargs)
    runner = graphs.engine.runner
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    eager = LLM(str(tiny_models[arch]), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None

    rng = random.Random(arch)
    for batch in (1, 3, 5, 8):
        prompts = [[rng.randrange(10, 500) for _ in range(rng.randrange(1, 400))] for _ in range(batch)]
        max_tokens = [rng.randrange(20, 60) for _ in range(batch)]
        assert _generate(graphs, prompts, max_tokens) == _generate(eager, prompts, max_tokens), batch
    assert {1, 3, 5, 8} <= set(replays), sorted(set(replays))
