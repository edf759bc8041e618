"""Every Triton launcher in ``kernels/`` against its plain-torch reference, on irregular sizes.

Without CUDA the kernels run under Triton's interpreter on small shapes (fp32 and fp16: the
interpreter's ``tl.dot`` treats bf16 operands as raw uint16, so bf16 is checked on the GPU only).
Without CUDA the launchers' configurations are also compiled for sm_90 (no GPU needed), which
catches what the interpreter lets through: type errors, ``tl.dot`` shape rules, layouts. With CUDA
the same tests run compiled, and the ``gpu``-marked ones add model-sized shapes, bf16, long
contexts and the split-K decode path at 8k.

``triton.jit`` picks interpreted or compiled when a function is *decorated*, reading
``TRITON_INTERPRET`` then (triton 3.4+ through ``knobs.runtime.interpret``, earlier through
``os.getenv``; the launch does not look again). That covers triton's own ``@jit`` helpers too
(``tl.zeros``, ``tl.sum``, ``tl.max``, ``tl.cdiv`` ...), decorated when ``triton.language`` is
first imported. Pytest imports test modules in collection order, and ``tests/test_kernels_ref.py``
and ``pdserve.engine.attention`` import ``kernels.*`` (hence triton) earlier, so setting the variable here
can be too late; conftest.py should set it before anything imports triton. Until then, on CPU this
module swaps the compiled-mode ``@jit`` objects of ``triton.language`` and of our kernel modules
for interpreted ones (:func:`_interpret_kernels`); a no-op when the variable was set in time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import sys  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the kernel tests need triton (the test extra installs it)")

from pdserve.kernels import block_copy, kv_write  # noqa: E402
from pdserve.kernels import paged_attention as pa  # noqa: E402
from tests.sm90 import compile_for_sm90  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _interpret_kernels(*modules: ModuleType) -> None:
    """Replace compiled-mode ``@triton.jit`` objects by interpreted ones, process-wide.

    Covers ``triton.language`` (free functions, and those attached to ``tl.tensor`` as methods)
    and ``modules``. Kernels and triton's helpers look callees up in their module globals at run
    time, and the interpreter recognises ``tl.max``/``tl.sum`` by identity of their combine
    functions, so replacing each module attribute (one replacement per object) is enough. Only
    done without CUDA, where compiled kernels cannot run at all.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replaced: dict[int, InterpretedFunction] = {}
    namespaces = [m for name, m in sys.modules.items() if name.split(".")[:2] == ["triton", "language"]]
    for namespace in [*namespaces, tl.core.tensor, *modules]:
        for name, obj in list(vars(namespace).items()):
            if isinstance(obj, JITFunction):
                if id(obj) not in replaced:
                    replaced[id(obj)] = InterpretedFunction(obj.fn)
                setattr(namespace, name, replaced[id(obj)])


if not ON_GPU:
    _interpret_kernels(kv_write, pa, block_copy)


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs only without CUDA")
def test_kernels_are_interpreted():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    for fn in (tl.zeros, tl.sum, pa._prefill_kernel, pa._attend_tiles, kv_write._write_kv_kernel):
        assert isinstance(fn, InterpretedFunction), f"{fn} is compiled-mode: set TRITON_INTERPRET=1 earlier"


TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
HEADS = [(9, 3), (5, 1), (12, 4)]


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def _write_case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, slot_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # K and V as slices of one fused [T, Hq + 2 Hkv, D] projection: strided tokens, contiguous rows.
    fused = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 4 : 4 + num_kv_heads], fused[:, 4 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    return key.to(DEVICE), value.to(DEVICE), slots.to(slot_dtype).to(DEVICE), cache.to(DEVICE)


def layer_of_block_major(cache: torch.Tensor, num_layers: int = 3, layer: int = 1) -> torch.Tensor:
    """``cache`` [NB, 2, BS, Hkv, D] as one layer's view of a block-major cache (an engine's:
    ``kv_transfer.base.KVLayout``), strided by blocks; the other layers hold noise."""
    whole = torch.randn(cache.shape[0], num_layers, *cache.shape[1:], device=cache.device).to(cache.dtype)
    whole[:, layer] = cache
    return whole.transpose(0, 1)[layer]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_major", [False, True], ids=["layer-view", "block-major-layer-view"])
def test_write_kv_matches_ref(block_size, dtype, slot_dtype, block_major):
    key, value, slots, cache = _write_case(37, 3, 24, block_size, 5, dtype, slot_dtype, seed=block_size)
    cache = cache.to(dtype)
    if block_major:
        cache = layer_of_block_major(cache)
    expect = cache.clone()
    kv_write.write_kv_ref(key, value, expect, slots)
    kv_write.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expect)


def test_write_kv_casts_and_loops_over_chunks(monkeypatch):
    # Hkv * D = 5 * 24 = 120 elements moved in chunks of 32 (last one partial); fp16 into fp32.
    monkeypatch.setattr(kv_write, "MAX_CHUNK", 32)
    key, value, slots, cache = _write_case(11, 5, 24, 8, 4, torch.float16, torch.int64, seed=3)
    expect = cache.clone()
    kv_write.write_kv_ref(key, value, expect, slots)
    kv_write.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expect)


def test_write_kv_rejects_bad_layout():
    key, value, slots, cache = _write_case(4, 2, 16, 16, 2, torch.float32, torch.int64, seed=0)
    with pytest.raises(AssertionError):
        kv_write.write_kv(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, slots)
    with pytest.raises(AssertionError):  # cache not one contiguous region
        kv_write.write_kv(key, value, cache[:, :, ::2], slots)


# --------------------------------------------------------------------------------------------
# gather_blocks / scatter_blocks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["whole-region", "split-region"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
def test_block_copy_round_trip(monkeypatch, split, ids_dtype, block_major):
    if split:  # several programs per region, the last part partial (region = 2304 elements)
        monkeypatch.setattr(block_copy, "CHUNK", 512)
        monkeypatch.setattr(block_copy, "_num_programs_wanted", lambda device: 10_000)
    gen = torch.Generator().manual_seed(7)
    if block_major:  # an engine's cache: [L, NB, 2, BS, Hkv, D] over [NB, L, ...] memory
        cache = torch.randn(11, 3, 2, 16, 3, 24, generator=gen).to(DEVICE).transpose(0, 1)
    else:
        cache = torch.randn(3, 11, 2, 16, 3, 24, generator=gen).to(DEVICE)  # [L, NB, 2, BS, Hkv, D]
    ids = torch.tensor([9, 2, 5, 0, 10], dtype=ids_dtype, device=DEVICE)
    buffer = block_copy.gather_blocks(cache, ids)
    assert buffer.is_contiguous()
    assert torch.equal(buffer, block_copy.gather_blocks_ref(cache, ids))

    # Land the buffer in other blocks of another cache, as a decode node does.
    dst_ids = torch.tensor([1, 7, 3, 8, 4], dtype=ids_dtype, device=DEVICE)
    landed, expect = torch.zeros_like(cache), torch.zeros_like(cache)
    block_copy.scatter_blocks(buffer, landed, dst_ids)
    block_copy.scatter_blocks_ref(buffer, expect, dst_ids)
    assert torch.equal(landed, expect)
    assert torch.equal(landed[:, 8], cache[:, 0])


def test_gather_blocks_into_given_buffer_fp16_block8():
    cache = torch.randn(2, 6, 2, 8, 1, 16).half().to(DEVICE)
    ids = torch.tensor([5, 3], device=DEVICE)
    out = torch.full((2, 2, 2, 8, 1, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    assert block_copy.gather_blocks(cache, ids, out=out) is out
    assert torch.equal(out, block_copy.gather_blocks_ref(cache, ids))
    block_copy.scatter_blocks(out[:, :0], cache, ids[:0])  # no blocks: a no-op


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


def make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, device=DEVICE):
    """A paged cache holding one context per ``(seq_len, query_len)`` in shuffled blocks.

    Blocks past each context's end (the rest of its last block, and spare blocks) hold random
    values too, so reading a masked position changes the result.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s, _ in shapes) + 3
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s, _ in shapes]
    width = max(len(t) for t in tables) + 1  # one spare column: the table is wider than any context
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim, generator=gen)
    return q.to(dtype).to(device), cache.to(dtype).to(device), block_tables.to(device)


def run_both(shapes, q, cache, block_tables, launch=None, **kwargs):
    """(Triton output, reference output on fp32 copies of the same inputs)."""
    seq_lens = [s for s, _ in shapes]
    query_lens = [n for _, n in shapes]
    scale = q.shape[-1] ** -0.5
    expect = pa.paged_attention_ref(q.float(), cache.float(), block_tables, seq_lens, query_lens, scale)
    starts = torch.tensor([0, *query_lens], device=q.device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    out = torch.full_like(q, float("nan"))  # every row must be written
    if launch is None:
        got = pa.paged_attention(
            q, cache, block_tables, lens, starts, scale, max(query_lens), max(seq_lens), out, **kwargs
        )
        assert got is out
    else:
        launch(q, cache, block_tables, lens, starts, scale, max(query_lens), out)
    return out, expect


def assert_close(got, expect):
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), expect, atol=tol, rtol=tol)


DECODE_SHAPES = [(1, 1), (17, 1), (300, 1), (64, 1), (77, 1), (129, 1), (2, 1), (250, 1)]
# Decodes, full prefills (one exactly a block, one below a tile), chunks over a cached prefix
# (one ending mid-block), a request without new tokens this step, and a long chunk.
MIXED_SHAPES = [(1, 1), (5, 5), (32, 32), (129, 40), (77, 1), (250, 3), (40, 0), (300, 1), (97, 70)]


@pytest.mark.parametrize("block_size, num_splits", [(16, 5), (32, 1)])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_ref(block_size, num_splits, heads):
    """One pass over each context, or five partitions per request plus the reduce."""
    q, cache, tables = make_batch(DECODE_SHAPES, *heads, 32, block_size, torch.float32, seed=block_size)
    assert_close(*run_both(DECODE_SHAPES, q, cache, tables, num_splits=num_splits))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_batch_matches_ref(block_size, heads):
    q, cache, tables = make_batch(MIXED_SHAPES, *heads, 32, block_size, torch.float32, seed=heads[0])
    got, expect = run_both(MIXED_SHAPES, q, cache, tables)
    assert_close(got, expect)


@pytest.mark.parametrize("heads", [(9, 3), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_layer_views_of_a_block_major_cache_match_ref(heads):
    """An engine's cache is block-major: each layer's view is strided by blocks (``layer_of_block_major``)."""
    for shapes, seed, kw in ((MIXED_SHAPES, 3, {}), (DECODE_SHAPES, 4, {"num_splits": 3})):
        q, cache, tables = make_batch(shapes, *heads, 32, 16, torch.float32, seed=seed)
        strided = layer_of_block_major(cache)
        assert not strided.is_contiguous()
        assert_close(*run_both(shapes, q, strided, tables, **kw))


@pytest.mark.parametrize("block_size", [8, 64])
def test_other_block_sizes(block_size):
    q, cache, tables = make_batch(MIXED_SHAPES, 5, 1, 16, block_size, torch.float32, seed=1)
    assert_close(*run_both(MIXED_SHAPES, q, cache, tables))
    q, cache, tables = make_batch(DECODE_SHAPES, 5, 1, 16, block_size, torch.float32, seed=2)
    assert_close(*run_both(DECODE_SHAPES, q, cache, tables, num_splits=3))


def test_prefill_kernel_on_decode_rows():
    """The prefill kernel alone also serves L_b == 1 (decode rows of a mixed batch)."""
    q, cache, tables = make_batch(DECODE_SHAPES, 9, 3, 32, 16, torch.float32, seed=5)
    assert_close(*run_both(DECODE_SHAPES, q, cache, tables, launch=pa._launch_prefill))


def test_fp16_and_head_dim_24():
    q, cache, tables = make_batch(MIXED_SHAPES, 5, 1, 24, 16, torch.float16, seed=9)
    assert_close(*run_both(MIXED_SHAPES, q, cache, tables))
    q, cache, tables = make_batch(DECODE_SHAPES, 5, 1, 24, 16, torch.float16, seed=10)
    assert_close(*run_both(DECODE_SHAPES, q, cache, tables, num_splits=4))


def test_strided_q_and_out():
    """q as a slice of a fused QKV projection; out as a slice of a wider buffer."""
    shapes = [(33, 3), (20, 1), (70, 18)]
    q, cache, tables = make_batch(shapes, 9, 3, 16, 16, torch.float32, seed=11)
    fused = torch.randn(q.shape[0], 9 + 6, 16, device=DEVICE)
    fused[:, :9] = q
    q = fused[:, :9]
    wide = torch.full((q.shape[0], 12, 16), float("nan"), device=DEVICE)
    out = wide[:, 2:11]
    starts = torch.tensor([0, 3, 4, 22], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([33, 20, 70], dtype=torch.int32, device=DEVICE)
    pa.paged_attention(q, cache, tables, lens, starts, 0.25, 18, 70, out)
    expect = pa.paged_attention_ref(q, cache, tables, [33, 20, 70], [3, 1, 18], 0.25)
    assert_close(out, expect)
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 11:]).all()


def test_decode_partition_heuristic():
    # Few programs: split until the GPU has ~4 per SM, partitions of >= 128 positions (tile multiples).
    assert pa.decode_partition(1, 8, 8192, 132) == (64, 128)
    assert pa.decode_partition(1, 8, 1000, 132) == (8, 128)
    # Enough (request, kv head) programs already: no split.
    assert pa.decode_partition(64, 8, 4096, 132)[0] == 2
    assert pa.decode_partition(128, 8, 4096, 132) == (1, 4096)
    assert pa.decode_partition(4, 8, 100, 132) == (1, 128)


# --------------------------------------------------------------------------------------------
# Compiled mode without a GPU: the interpreter skips Triton's type checks, layouts and tl.dot
# shape rules, so also compile the launchers' configurations for sm_90 (front end, MLIR, ptxas).
# In a subprocess: this process's kernels are interpreted objects, which the compiler refuses.
# --------------------------------------------------------------------------------------------

KERNELS_SM90 = r"""
from pdserve.kernels import block_copy, kv_write, paged_attention as pa

PTR = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "slot_ptr": "*i64",
       "ids_ptr": "*i64", "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32"}
"""

KERNELS_SM90_BODY = r"""
bf16 = torch.bfloat16
for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
    compile_sm90(pa._prefill_kernel, pa.prefill_config(hq, hkv, d, 16, bf16, 2048), PTR, ("qk_scale",))
    compile_sm90(pa._decode_kernel, pa.decode_config(hq, hkv, d, 16, bf16, 32), PTR, ("qk_scale",))
compile_sm90(pa._decode_kernel, pa.decode_config(32, 8, 128, 16, bf16, 1), PTR, ("qk_scale",))
compile_sm90(pa._decode_reduce_kernel, pa.reduce_config(128, 32), PTR)
compile_sm90(kv_write._write_kv_kernel, dict(BLOCK_SIZE=16, HD=1024, CHUNK=1024), PTR)
for gather in (True, False):
    for region in (32768, 3000):
        config = dict(REGION=region, CHUNK=4096, GATHER=gather, EVEN=region % 4096 == 0)
        compile_sm90(block_copy._copy_blocks_kernel, config, PTR)
print("compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    compile_for_sm90(KERNELS_SM90 + KERNELS_SM90_BODY)


# --------------------------------------------------------------------------------------------
# GPU: model-sized shapes, bf16, long contexts
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_write_kv_and_block_copy(block_size, dtype):
    key, value, slots, cache = _write_case(4099, 8, 128, block_size, 600, dtype, torch.int64, seed=1)
    cache = cache.to(dtype)
    expect = cache.clone()
    kv_write.write_kv_ref(key, value, expect, slots)
    kv_write.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expect)

    for whole in (
        torch.randn(4, 300, 2, block_size, 8, 128, device=DEVICE).to(dtype),
        torch.randn(300, 4, 2, block_size, 8, 128, device=DEVICE).to(dtype).transpose(0, 1),  # block-major
    ):
        _gpu_block_copy(whole)
    key, value, slots, cache = _write_case(999, 8, 128, block_size, 200, dtype, torch.int64, seed=2)
    cache = layer_of_block_major(cache.to(dtype), num_layers=4, layer=3)
    expect = cache.clone()
    kv_write.write_kv_ref(key, value, expect, slots)
    kv_write.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expect)


def _gpu_block_copy(whole: torch.Tensor) -> None:
    for n in (1, 3, 257):
        ids = torch.randperm(300, device=DEVICE)[:n]
        buffer = block_copy.gather_blocks(whole, ids)
        assert torch.equal(buffer, block_copy.gather_blocks_ref(whole, ids))
        landed, expect = torch.zeros_like(whole), torch.zeros_like(whole)
        block_copy.scatter_blocks(buffer, landed, ids)
        block_copy.scatter_blocks_ref(buffer, expect, ids)
        assert torch.equal(landed, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (12, 4), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_paged_attention_bf16(block_size, heads, head_dim):
    mixed = [(1, 1), (4096, 4096), (4100, 1), (3072 + 1024, 1024), (1333, 77), (2049, 1), (513, 513)]
    q, cache, tables = make_batch(mixed, *heads, head_dim, block_size, torch.bfloat16, seed=block_size)
    assert_close(*run_both(mixed, q, cache, tables))
    decode = [(4097, 1), (1, 1), (2000, 1), (31, 1), (4096, 1)]
    q, cache, tables = make_batch(decode, *heads, head_dim, block_size, torch.bfloat16, seed=head_dim)
    for num_splits in (None, 1, 7):
        assert_close(*run_both(decode, q, cache, tables, num_splits=num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_split_k_8k(dtype):
    """Llama-3-8B attention shape at 8k context: the default split (batch 1 and 2 -> many
    partitions), no split, and the prefill kernel on the same rows all agree with the reference."""
    shapes = [(8192, 1), (8000, 1)]
    q, cache, tables = make_batch(shapes, 32, 8, 128, 16, dtype, seed=8)
    num_splits, _ = pa.decode_partition(2, 8, 8192, pa._num_sms(DEVICE))
    assert num_splits > 1
    for splits in (None, 1):
        assert_close(*run_both(shapes, q, cache, tables, num_splits=splits))
    assert_close(*run_both(shapes, q, cache, tables, launch=pa._launch_prefill))
