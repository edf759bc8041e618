"""triton for the kernel modules, or a stand-in where it is not installed; and a count of JIT compiles.

**Where triton comes from.** CUDA (and ROCm) builds of torch depend on triton, so a GPU host has
it; pdserve does not depend on it itself, and a CPU-only install (torch's CPU wheel) has none. The
CPU engine runs the plain-torch ``*_ref`` functions beside each kernel and never launches one, so
the kernel modules import ``triton`` and ``tl`` from here: the real modules when triton is
installed, else stand-ins that let ``@triton.jit`` define the kernels and raise a clear error if
one is launched or a launcher asks triton for anything. vLLM does the same
(``vllm/triton_utils/importing.py``).

**Compiles while serving.** Triton compiles a kernel for every new specialization of its
arguments: each ``tl.constexpr`` value, and for a plain int argument whether it equals 1 or is a
multiple of 16 (unless the kernel lists it in ``do_not_specialize``), and its width (i32 or i64).
A compile takes 0.1-2 s on the engine thread, so the engine's warm-up runs every specialization
a node can meet (``ModelRunner.warm_up``) and :func:`num_jit_compiles` counts the compiles of this
process through triton's ``knobs.runtime.jit_post_compile_hook`` (triton 3.5 to 3.9 call it
once per compile, after the in-memory kernel cache missed, with keyword arguments only), so that
a node can show ``pdserve_jit_compiles_total`` and a test can check that the count stands still
after warm-up.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

MISSING = (
    "triton is not installed: pdserve's Triton kernels run on CUDA, where torch's CUDA builds "
    "install triton; on the CPU the engine runs the plain-torch references"
)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # torch's CPU wheel does not bring triton
    HAS_TRITON = False

    class _UnlaunchableKernel:
        """What ``@triton.jit`` makes of a kernel without triton: it exists, it cannot launch."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")
            self.__doc__ = getattr(fn, "__doc__", None)

        def __getitem__(self, grid: Any):
            raise ModuleNotFoundError(f"cannot launch {self.__name__}: {MISSING}")

    class _MissingTriton(ModuleType):
        def jit(self, fn: Any = None, **options: Any):
            if fn is None:  # @triton.jit(do_not_specialize=...)
                return _UnlaunchableKernel
            return _UnlaunchableKernel(fn)

        def __getattr__(self, name: str):
            raise ModuleNotFoundError(f"triton.{name}: {MISSING}")

    class _MissingLanguage(ModuleType):
        def __getattr__(self, name: str):
            raise ModuleNotFoundError(f"triton.language.{name}: {MISSING}")

    triton = _MissingTriton("triton")
    tl = _MissingLanguage("triton.language")


_lock = threading.Lock()
_num_compiles = 0
_installed = False


def num_jit_compiles() -> int:
    """Triton kernels compiled in this process since :func:`count_jit_compiles` (0 without triton).

    A compile here is a miss of a kernel's in-memory cache, i.e. a specialization this process had
    not launched before; it counts whether triton then built the binary or loaded it from its
    on-disk cache (``~/.triton/cache``), which is what makes restarts quick.
    """
    return _num_compiles


def count_jit_compiles() -> bool:
    """Start counting compiles (idempotent); False where triton, or its compile hook, is missing.

    Chains to a hook someone installed before (a profiler's) and leaves its return value alone.
    """
    global _installed
    if not HAS_TRITON:
        return False
    try:
        from triton import knobs  # 3.4+; jit.py reads knobs.runtime's hooks at every compile
    except ImportError:
        return False
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_post_compile_hook"):
        return False
    with _lock:
        if _installed:
            return True
        previous = runtime.jit_post_compile_hook

        def on_compile(**kwargs: Any):
            global _num_compiles
            with _lock:
                _num_compiles += 1
            if previous is not None:
                return previous(**kwargs)
            return None

        runtime.jit_post_compile_hook = on_compile
        _installed = True
    return True
