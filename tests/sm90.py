"""Compile Triton kernels for sm_90 without a GPU, in a subprocess.

The interpreter skips Triton's type checks, layouts and ``tl.dot`` shape rules, so the
kernel tests also compile their launch configurations down to machine code. It has to be
another process: this one's kernels are interpreted objects, which the compiler refuses.
A script body calls ``compile_sm90`` and prints ``compiled`` at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = r'''
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_sm90(kernel, config, ptr_types=None, fp32_args=(), options=None):
    """Pointer args default to ptr_types["*"] (else *bf16); scalars are i32 unless in fp32_args."""
    config = dict(config)
    options = dict(options or {})
    options.update({k: config.pop(k) for k in ("num_warps", "num_stages") if k in config})
    ptr_types = ptr_types or {}
    def ty(name):
        if name in config:
            return "constexpr"
        if name.endswith("_ptr"):
            return ptr_types.get(name, ptr_types.get("*", "*bf16"))
        return "fp32" if name in fp32_args else "i32"
    sig = {name: ty(name) for name in kernel.arg_names}
    # What a launch would specialise on: 16-byte aligned pointers, strides that are multiples of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig[name].startswith("*") or name.startswith("stride")}
    triton.compile(ASTSource(kernel, sig, constexprs=config, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=options)
'''


def compile_for_sm90(body: str) -> None:
    """Run ``body`` after the prelude in a process without the Triton interpreter; assert it compiled."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + body], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
