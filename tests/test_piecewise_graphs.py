"""Piecewise CUDA graphs of prefill and mixed steps (``pdserve/engine/piecewise_graphs.py``).

On the CPU the pieces run through their eager stand-ins: the decomposition (pieces between the
attention launches, static buffers, padding rows) against the model's own forward, on the tiny
checkpoints of every architecture. The ``gpu``-marked test captures real graphs and holds the
engine's greedy tokens to those of ``enforce_eager``.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.piecewise_graphs import PiecewiseGraphs, piecewise_buckets
from pdserve.utils import cdiv
from tests.test_cuda_graphs import _generate


def test_piecewise_buckets():
    assert piecewise_buckets(0) == []
    assert piecewise_buckets(8) == [8]
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert piecewise_buckets(600) == [16, 32, 64, 128, 256, 384, 512, 600]


def _step(requests, block_size):
    """Flat inputs and metadata of one step: ``requests`` are (first block, start, new tokens, ids)."""
    ids, positions, slots, tables, seq_lens, query_lens = [], [], [], [], [], []
    for first_block, start, num, tokens in requests:
        end = start + num
        blocks = list(range(first_block, first_block + cdiv(end, block_size)))
        ids += tokens
        positions += range(start, end)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        tables.append(blocks)
        seq_lens.append(end)
        query_lens.append(num)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata.build(slots, tables, seq_lens, query_lens, torch.device("cpu"))
    return ids, positions, slots, meta


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_pieces_match_the_forward(tiny_models, arch):
    """A mixed step (a prompt's first chunk, a later chunk over cached context, decode rows) through
    the pieces equals the model's forward row for row, padded to its bucket or exactly a bucket;
    each layer's KV is written, and ``after_layer`` runs once per layer in order."""
    from pdserve import LLM

    llm = LLM(str(tiny_models[arch]), num_kv_blocks=64, max_num_batched_tokens=256)
    runner = llm.engine.runner
    model, backend, bs = runner.model, runner.backend, runner.block_size
    rng = random.Random(arch)

    def tokens(n):
        return [rng.randrange(10, 490) for _ in range(n)]

    # The context the later rows attend to: 40 tokens in blocks 10.. and 7 in blocks 20.., eagerly.
    context = [(10, 0, 40, tokens(40)), (20, 0, 7, tokens(7))]
    ids, positions, slots, meta = _step(context, bs)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.tensor(positions), meta, backend)
    graphs = PiecewiseGraphs(model, backend, max_tokens=64, device=torch.device("cpu"))
    graphs.capture(eager=True)
    for step in (
        [(0, 0, 21, tokens(21)), (10, 40, 9, tokens(9)), (20, 7, 1, tokens(1))],  # 31 rows: bucket 32
        [(0, 0, 31, tokens(31)), (20, 8, 1, tokens(1))],  # 32 rows: no padding
    ):
        ids, positions, slots, meta = _step(step, bs)
        cache = runner.kv_cache.clone()
        with torch.inference_mode():
            expect = model(torch.tensor(ids), torch.tensor(positions), meta, backend)
        expect_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache)  # the pieces write the step's KV themselves
        layers = []
        with torch.inference_mode():
            assert torch.equal(graphs.load(ids, positions, slots), meta.slot_mapping)
            got = graphs.run(meta, after_layer=layers.append).clone()
        assert layers == list(range(model.arch.num_layers))
        assert got.shape == expect.shape
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.kv_cache, expect_cache, rtol=0, atol=0)


def test_device_inputs_fill_the_padded_ids(tiny_models):
    """Ids that only the device holds (async scheduling) land in their rows before piece 0."""
    from pdserve import LLM

    llm = LLM(str(tiny_models["llama3"]), num_kv_blocks=64, max_num_batched_tokens=128)
    runner = llm.engine.runner
    model, backend, bs = runner.model, runner.backend, runner.block_size
    graphs = PiecewiseGraphs(model, backend, max_tokens=16, device=torch.device("cpu"))
    graphs.capture(eager=True)
    real = [5, 17, 99, 23, 11]
    ids, positions, slots, meta = _step([(0, 0, 5, real)], bs)
    with torch.inference_mode():
        expect = model(torch.tensor(real), torch.tensor(positions), meta, backend).clone()
        placeholder = [5, 0, 99, 0, 11]
        fill = (torch.tensor([1, 3]), torch.tensor([17, 23]))
        graphs.load(placeholder, positions, slots, fill=fill)
        got = graphs.run(meta)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_gpu_piecewise_graphs_match_eager(tiny_models, arch):
    """Greedy tokens with piecewise graphs (prefill and mixed steps of up to 96 tokens: buckets 16,
    32, 64, 96) and decode graphs equal those of ``enforce_eager``: prompts longer than a bucket
    chunked into several steps, requests joining while others decode."""
    from pdserve import LLM

    kwargs = dict(
        dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=96, num_kv_blocks=512
    )
    graphs = LLM(str(tiny_models[arch]), piecewise_graph_max_tokens=96, **kwargs)
    runner = graphs.engine.runner
    assert runner.piecewise is not None and runner.piecewise.buckets == [16, 32, 64, 96]
    runs = []
    run = runner.piecewise.run
    runner.piecewise.run = lambda meta, *a, **k: runs.append(meta.num_tokens) or run(meta, *a, **k)
    eager = LLM(str(tiny_models[arch]), enforce_eager=True, **kwargs)
    assert eager.engine.runner.piecewise is None

    rng = random.Random(arch)
    for batch in (1, 3, 8):
        prompts = [[rng.randrange(10, 490) for _ in range(rng.randrange(1, 300))] for _ in range(batch)]
        max_tokens = [rng.randrange(5, 40) for _ in range(batch)]
        assert _generate(graphs, prompts, max_tokens) == _generate(eager, prompts, max_tokens), batch
    assert runs and max(runs) <= 96 and len(set(runs)) > 3, sorted(set(runs))
