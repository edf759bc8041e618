"""Fused RMSNorm (+ residual add) and rotary kernels against their plain-torch references.

Without CUDA the kernels run under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET``
before anything imports triton) on small irregular shapes in float32, and are compiled for sm_90
in a subprocess to catch what the interpreter lets through. The interpreted kernels also run
inside the whole model on the CPU (the CUDA code path forced on), which must still give
transformers' greedy tokens. With CUDA the ``gpu``-marked tests cover bf16/fp16/fp32 at model
sizes; the fused path in the model on CUDA is checked by tests/test_gpu_engine.py (it is the
default there).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.models.arch import RopeConfig
from pdserve.engine.models.layers import RotaryEmbedding
from pdserve.kernels import rmsnorm as rn
from pdserve.kernels import rotary as rt
from tests.sm90 import compile_for_sm90

pytest.importorskip("triton", reason="the kernel tests need triton (the test extra installs it)")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs only without CUDA")
def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    for fn in (rn._rmsnorm_kernel, rt._rotary_kernel, rt._rotate_heads):
        assert isinstance(fn, InterpretedFunction), f"{fn} is compiled-mode: set TRITON_INTERPRET=1 earlier"


def assert_close(got, expect):
    assert got.dtype == expect.dtype and got.shape == expect.shape, (got.dtype, expect.dtype, got.shape)
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), expect.float(), atol=tol, rtol=tol)


def _norm_weight(n, dtype, gen):
    return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEVICE)


# --------------------------------------------------------------------------------------------
# rmsnorm / fused_add_rmsnorm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [576, 64, 100])
def test_rmsnorm_matches_ref(n):
    gen = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(7, n, generator=gen)).to(DEVICE)
    w = _norm_weight(n, torch.float32, gen)
    assert_close(rn.rmsnorm(x, w, 1e-6), rn.rmsnorm_ref(x, w, 1e-6))


@pytest.mark.parametrize("heads", [(9, 3), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 100])
def test_rmsnorm_per_head_on_strided_slices(heads, head_dim):
    """Qwen3's q/k norm: heads sliced out of a fused QKV output (strided tokens and heads)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    w = _norm_weight(head_dim, torch.float32, gen)
    for x in (q, k):
        got = rn.rmsnorm(x, w, 1e-5)
        assert got.is_contiguous()
        assert_close(got, rn.rmsnorm_ref(x, w, 1e-5))


@pytest.mark.parametrize("n", [576, 64, 100])
def test_fused_add_rmsnorm_matches_ref_in_place(n):
    gen = torch.Generator().manual_seed(n + 1)
    x, residual = torch.randn(2, 5, n, generator=gen).to(DEVICE)
    w = _norm_weight(n, torch.float32, gen)
    expect_out, expect_res = rn.fused_add_rmsnorm_ref(x, residual, w, 1e-5)
    out, res = rn.fused_add_rmsnorm(x, residual, w, 1e-5)
    assert out is x and res is residual  # in place
    assert torch.equal(res, expect_res)  # the same one rounding of the sum
    assert_close(out, expect_out)


def test_norm_launchers_reject_bad_layout():
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(AssertionError):
        rn.rmsnorm(x.t().contiguous().t(), w, 1e-6)
    with pytest.raises(AssertionError):
        rn.rmsnorm(x, torch.ones(31, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError):
        rn.fused_add_rmsnorm(x, torch.randn(4, 32, device=DEVICE).half(), w, 1e-6)


# --------------------------------------------------------------------------------------------
# rotary
# --------------------------------------------------------------------------------------------


def _rotary_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, pos_dtype, seed):
    """q and k as slices of one fused QKV output; the model's llama3-scaled table."""
    gen = torch.Generator().manual_seed(seed)
    rope = RopeConfig(theta=500000.0, type="llama3", factor=8.0, original_max_position_embeddings=64)
    rotary = RotaryEmbedding(head_dim, 300, rope)
    rotary.init_table()
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(pos_dtype)
    return positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), rotary.cos_sin.to(DEVICE)


@pytest.mark.parametrize("heads", [(9, 3), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_rotary_matches_ref(heads, head_dim, pos_dtype):
    positions, q, k, cos_sin = _rotary_case(11, *heads, head_dim, torch.float32, pos_dtype, seed=head_dim)
    expect_q, expect_k = rt.rotary_ref(positions, q, k, cos_sin)
    got_q, got_k = rt.rotary(positions, q, k, cos_sin)  # out of place
    assert torch.equal(got_q, expect_q) and torch.equal(got_k, expect_k)
    assert not torch.equal(q, expect_q)
    got_q, got_k = rt.rotary(positions, q, k, cos_sin, q_out=q, k_out=k)  # in place, strided
    assert got_q is q and got_k is k
    assert torch.equal(q, expect_q) and torch.equal(k, expect_k)


def test_rotary_matches_module_on_cpu():
    """The reference is the CPU path of ``RotaryEmbedding.forward``, op for op."""
    positions, q, k, cos_sin = _rotary_case(6, 5, 1, 32, torch.float32, torch.int64, seed=3)
    rotary = RotaryEmbedding(32, 300, RopeConfig(theta=500000.0, type="llama3", factor=8.0))
    rotary.cos_sin.copy_(cos_sin.cpu())
    expect_q, expect_k = rotary(positions.cpu(), q.cpu(), k.cpu())
    got_q, got_k = rt.rotary_ref(positions.cpu(), q.cpu(), k.cpu(), cos_sin.cpu())
    assert torch.equal(got_q, expect_q) and torch.equal(got_k, expect_k)


def test_rotary_rejects_bad_layout():
    positions, q, k, cos_sin = _rotary_case(4, 5, 1, 16, torch.float32, torch.int64, seed=0)
    with pytest.raises(AssertionError):  # head_dim not contiguous
        rt.rotary(positions, q.transpose(1, 2).contiguous().transpose(1, 2), k, cos_sin)
    with pytest.raises(AssertionError):  # table in the wrong dtype
        rt.rotary(positions, q, k, cos_sin.half())


# --------------------------------------------------------------------------------------------
# The CUDA code path of the model (fused adds carried vLLM-style), on CPU through the interpreter
# --------------------------------------------------------------------------------------------


def _force_fused_path(monkeypatch):
    from pdserve.engine.models import layers, llama

    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(llama, "use_fused_kernels", lambda x: True)


@pytest.mark.skipif(ON_GPU, reason="the GPU test below runs the compiled kernels in the model")
@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_fused_model_path_matches_transformers_interpreted(monkeypatch, tiny_models, arch):
    from tests.test_hf_equivalence import _strip_eos, hf_greedy, pdserve_greedy

    rng = random.Random(arch)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (3, 9, 20)]
    ref = hf_greedy(tiny_models[arch], prompts, 6)
    _force_fused_path(monkeypatch)
    calls = []
    real = rn._rmsnorm_kernel
    monkeypatch.setattr(rn, "_rmsnorm_kernel", _Counting(real, calls))
    ours = pdserve_greedy(tiny_models[arch], prompts, 6)
    assert calls, "the fused kernels did not run"
    assert [_strip_eos(t, 7) for t in ours] == ref


class _Counting:
    """Wraps a kernel to record its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


# --------------------------------------------------------------------------------------------
# Compiled mode without a GPU (see tests/test_kernels_triton.py): compile for sm_90
# --------------------------------------------------------------------------------------------

FUSED_SM90 = r"""
from pdserve.kernels import rmsnorm as rn, rotary as rt

for dtype in ("bf16", "fp16", "fp32"):
    for n in (4096, 576, 100):
        block = triton.next_power_of_2(n)
        for fused in (False, True):
            compile_sm90(rn._rmsnorm_kernel, dict(N=n, BLOCK_N=block, FUSED=fused),
                         {"*": "*" + dtype}, ("eps",), dict(num_warps=rn._num_warps(block)))
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64), (5, 1, 16)):
        config = dict(HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
                      BLOCK_HKV=triton.next_power_of_2(hkv))
        for pos in ("*i64", "*i32"):
            ptrs = {"*": "*" + dtype, "pos_ptr": pos, "cos_sin_ptr": "*fp32"}
            compile_sm90(rt._rotary_kernel, config, ptrs, ("eps",), dict(num_warps=4, enable_fp_fusion=False))
print("compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile and run the kernels")
def test_fused_kernels_compile_for_sm90():
    compile_for_sm90(FUSED_SM90)


# --------------------------------------------------------------------------------------------
# GPU: model sizes, bf16 / fp16 / fp32, and the model's fused path against transformers
# --------------------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [4096, 5120, 576, 100])
@pytest.mark.parametrize("num_tokens", [1, 37, 2048])
def test_gpu_norms(dtype, n, num_tokens):
    gen = torch.Generator().manual_seed(n + num_tokens)
    x, residual = (4 * torch.randn(2, num_tokens, n, generator=gen)).to(dtype).to(DEVICE)
    w = _norm_weight(n, dtype, gen)
    assert_close(rn.rmsnorm(x, w, 1e-5), rn.rmsnorm_ref(x, w, 1e-5))
    expect_out, expect_res = rn.fused_add_rmsnorm_ref(x, residual, w, 1e-5)
    out, res = rn.fused_add_rmsnorm(x.clone(), residual.clone(), w, 1e-5)
    assert torch.equal(res, expect_res)
    assert_close(out, expect_out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_rotary_is_bitwise_ref(dtype, heads, head_dim):
    positions, q, k, cos_sin = _rotary_case(1031, *heads, head_dim, dtype, torch.int64, seed=head_dim)
    expect_q, expect_k = rt.rotary_ref(positions, q, k, cos_sin)
    got_q, got_k = rt.rotary(positions, q, k, cos_sin, q_out=q, k_out=k)
    assert torch.equal(got_q, expect_q) and torch.equal(got_k, expect_k)


@pytest.mark.gpu
def test_gpu_per_head_norm_bf16():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(513, 32 + 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = _norm_weight(128, torch.bfloat16, gen)
    for x in (qkv[:, :32], qkv[:, 32:40]):
        assert_close(rn.rmsnorm(x, w, 1e-6), rn.rmsnorm_ref(x, w, 1e-6))
