"""No Triton compile while serving: the engine's warm-up launches every kernel specialization a step
can meet, and ``pdserve_jit_compiles_total`` (``LLMEngine.load().num_jit_compiles``) stays flat
through a varied load after it: prompts of 1 to 2,000 tokens, batches of 1 to ``max_num_seqs``,
requests arriving while others decode (mixed steps), prefix-cache hits, preemption, and the KV
transports' block copies. With CUDA graphs and with ``enforce_eager``.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kernels import triton_utils

EDGE_LENGTHS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513]
EDGE_LENGTHS += [767, 1000, 1023, 1024, 1025, 1500, 1999, 2000]
MAX_NUM_SEQS = 16


def test_compile_hook_counts_and_chains(monkeypatch):
    """The counter sits on triton's ``knobs.runtime.jit_post_compile_hook``, which triton 3.5-3.9
    call after each compile with these keyword arguments; a hook installed before keeps running."""
    triton = pytest.importorskip("triton")
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["key"]))
    monkeypatch.setattr(triton_utils, "_installed", False)
    monkeypatch.setattr(triton_utils, "_num_compiles", triton_utils.num_jit_compiles())  # restored after
    assert triton_utils.count_jit_compiles() and triton_utils.count_jit_compiles()
    before = triton_utils.num_jit_compiles()
    for key in ("a", "b"):
        result = runtime.jit_post_compile_hook(
            key=key, repr="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False
        )
        assert result is None  # a true value from jit_cache_hook would skip the compile
    assert triton_utils.num_jit_compiles() == before + 2
    assert seen == ["a", "b"]


def _prompt(rng: random.Random, length: int, prefix: list[int]) -> list[int]:
    shared = prefix[: min(len(prefix), length - 1)] if rng.random() < 0.4 else []
    return shared + [rng.randrange(10, 49000) for _ in range(length - len(shared))]


def _serve(engine, rng: random.Random) -> int:
    """Waves of 1..MAX_NUM_SEQS requests, each wave added a few steps into the last one; returns
    the number of requests finished."""
    from pdserve import SamplingParams

    prefix = [rng.randrange(10, 49000) for _ in range(700)]
    lengths = EDGE_LENGTHS + [rng.randint(1, 2000) for _ in range(40)]
    rng.shuffle(lengths)
    waves = [1, 2, 3, 5, 8, 13, MAX_NUM_SEQS, MAX_NUM_SEQS, 4, 1]
    finished = 0
    next_id = 0
    for size in waves:
        for _ in range(size):
            length = lengths[next_id % len(lengths)]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                seed=next_id,
                max_tokens=rng.randint(1, 48),
                ignore_eos=True,
            )
            engine.add_request(str(next_id), None, params, prompt_token_ids=_prompt(rng, length, prefix))
            next_id += 1
        for _ in range(rng.randint(1, 6)):  # the next wave arrives while this one decodes
            finished += sum(o.finished for o in engine.step())
    while engine.has_unfinished_requests() or engine.has_work():
        finished += sum(o.finished for o in engine.step())
    return finished


def _copy_blocks_as_the_transports_do(engine, rng: random.Random) -> None:
    from pdserve.kv_transfer.base import block_index, gather_into, scatter_from, stage_blocks

    kv = engine.kv_cache  # [L, NB, 2, BS, Hkv, D]
    num_layers, num_blocks = kv.shape[0], kv.shape[1]
    for n in (1, 2, 3, 7, 16, 33, 100):
        ids = rng.sample(range(num_blocks), n)
        idx = block_index(ids, kv.device)
        for lo, hi in ((0, num_layers), (0, 1), (num_layers - 1, num_layers)):
            out = torch.empty((hi - lo, n, *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
            gather_into(kv[lo:hi], idx, out)
            scatter_from(out, kv[lo:hi], idx)
        stage_blocks(kv, ids)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_triton_compile_after_warm_up(enforce_eager):
    from pdserve import LLM

    llm = LLM(
        "random:tiny",
        dtype="bfloat16",
        device="cuda",
        enforce_eager=enforce_eager,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=512,
        max_model_len=2048 + 64,
        num_kv_blocks=220,  # 3,520 tokens: the big waves preempt
    )
    engine = llm.engine
    assert (engine.runner.graphs is None) == enforce_eager
    warm = engine.load().num_jit_compiles
    rng = random.Random(18)
    assert _serve(engine, rng) == sum([1, 2, 3, 5, 8, 13, MAX_NUM_SEQS, MAX_NUM_SEQS, 4, 1])
    _copy_blocks_as_the_transports_do(engine, rng)
    load = engine.load()
    assert load.num_prefix_hit_tokens > 0
    assert engine.scheduler.num_preemptions > 0
    assert load.num_jit_compiles == warm, f"{load.num_jit_compiles - warm} Triton compiles after warm-up"

    # The counter does move: a row width no model here has is a new specialization (the width is
    # a compile-time constant), one per case: Triton keeps what an earlier case compiled.
    from pdserve.kernels.rmsnorm import rmsnorm

    width = 3001 if enforce_eager else 1237
    rmsnorm(torch.randn(3, width, device="cuda"), torch.ones(width, device="cuda"), 1e-5)
    assert engine.load().num_jit_compiles > warm
