"""Environment variables pdserve reads: debug toggles and paths only, declared here and nowhere else."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


PDSERVE_CACHE_DIR: str = os.environ.get("PDSERVE_CACHE_DIR", "")
"""Where the converted default model and other derived files are kept (default ~/.cache/pdserve)."""

PDSERVE_LOG_LEVEL: str = os.environ.get("PDSERVE_LOG_LEVEL", "INFO")
"""Log level of pdserve's loggers."""

PDSERVE_ALLOW_LONG_MAX_MODEL_LEN: bool = _flag("PDSERVE_ALLOW_LONG_MAX_MODEL_LEN")
"""Allow max_model_len beyond the model's max_position_embeddings (output quality is then undefined)."""

PDSERVE_CHECK_INTEGRITY: bool = _flag("PDSERVE_CHECK_INTEGRITY")
"""Run BlockPool.check_integrity() after every engine step (slow; for debugging leaks)."""

PDSERVE_CLUSTER_TOKEN: str = os.environ.get("PDSERVE_CLUSTER_TOKEN", "")
"""The cluster token when --cluster-token is not given (keeps it out of `ps` and shell history)."""
