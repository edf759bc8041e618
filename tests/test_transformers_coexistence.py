"""Our `pdserve.kernels` package must never be taken for Hugging Face's `kernels` (which
transformers probes), and the GGUF conversion of the default model must keep working beside it.
A source checkout on PYTHONPATH (as on air-gapped GPU hosts) still exposes a top-level folder
named `kernels`, so these run that way."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_transformers_does_not_take_our_kernels_for_hf_kernels():
    """With the checkout's root on sys.path: where Hugging Face's ``kernels`` is not installed,
    transformers does not take ours for it; where it is (transformers 5.25 installs it and imports it
    with its model code), ``import kernels`` after ``import pdserve`` finds it, not ours, and
    transformers' model code imports."""
    code = (
        "import transformers\n"
        "from pdserve import kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert kernels.__file__.startswith(%r), kernels.__file__\n"
        "assert not hasattr(kernels, '__version__')\n"
        "import kernels as top\n"
        "assert is_kernels_available() == HF, (is_kernels_available(), top.__file__)\n"
        "assert not HF or not top.__file__.startswith(%r), top.__file__\n"
        "import transformers.activations\n"
        "from transformers import AutoModelForCausalLM\n"
        "print('ok')\n"
    ).replace("%r", repr(str(ROOT / "kernels")))
    code = f"HF = {_hf_kernels_installed()}\n" + code
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_gguf_conversion_beside_our_kernels(tmp_path):
    """A fresh conversion (own cache dir) with our `kernels` importable, then a load of the result."""
    code = (
        "from pdserve import kernels\n"
        "from pdserve import LLM, SamplingParams\n"
        "llm = LLM(num_threads=1)\n"
        "out = llm.generate('The capital of France is', SamplingParams(temperature=0, max_tokens=4))\n"
        "print(repr(out[0].outputs[0].text))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converting" in proc.stderr
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "Paris" in proc.stdout
