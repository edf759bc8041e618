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

With that root on ``sys.path`` (``python -m`` run in it puts it there, and so does
``PYTHONPATH=<checkout>``), its ``kernels/`` folder would also be the top-level module ``kernels``,
which is Hugging Face's package of that name: transformers 5.25 installs that package and imports
it with its model code. ``_HubKernelsFirst`` makes ``import kernels`` find the installed package
first wherever one is installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
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


class _HubKernelsFirst(importlib.abc.MetaPathFinder):
    """Finds the top-level ``kernels`` on ``sys.path`` without the checkout's root, where that root
    is on it; nothing (the usual finders then) for any other name, or where no other is installed."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "kernels" or path is not None:
            return None
        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != self.root]
        if len(rest) == len(sys.path):  # the root is not on the path: nothing shadows the package
            return None
        return importlib.machinery.PathFinder.find_spec(name, rest)


_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "kv_transfer" / "__init__.py").is_file() and (_checkout / "pyproject.toml").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
    if not any(isinstance(f, _HubKernelsFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _HubKernelsFirst(os.path.realpath(_checkout)))


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
