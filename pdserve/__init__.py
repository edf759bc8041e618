"""pdserve: disaggregated prefill/decode LLM serving.

The offline API mirrors vLLM's::

    from pdserve import LLM, SamplingParams
    llm = LLM(model="default")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text)

Importing ``pdserve`` loads nothing else: the names below are imported on first use, so the
proxy, which never needs torch, does not pay for it.

The design card keeps ``proxy/``, ``prefill_node/``, ``decode_node/``, ``kv_transfer/`` and
``kernels/`` at the repository's top; an install ships them as subpackages of ``pdserve``
(``package-dir`` in pyproject.toml), so site-packages holds ``pdserve`` alone. A checkout used
without installing (``PYTHONPATH=<checkout>``, as on air-gapped GPU hosts) finds them through
the checkout's root, added to this package's search path below.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.sampling_params",
    "StructuredOutputsParams": "pdserve.sampling_params",
    "RequestOutput": "pdserve.engine.outputs",
    "CompletionOutput": "pdserve.engine.outputs",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "kv_transfer" / "__init__.py").is_file() and (_checkout / "pyproject.toml").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
