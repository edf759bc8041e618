"""Environment variables pdserve reads: debug toggles and paths only, declared here and nowhere else;
and the UCX variables pdserve sets for NIXL, decided here and written once (``set_up_ucx``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping


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

PDSERVE_NO_GC_FREEZE: bool = _flag("PDSERVE_NO_GC_FREEZE")
"""Leave a started process's heap in the garbage collector's passes (``pdserve.gc_heap.freeze``):
to compare its pauses, or to find what a frozen object kept alive."""

PDSERVE_CLUSTER_TOKEN: str = os.environ.get("PDSERVE_CLUSTER_TOKEN", "")
"""The cluster token when --cluster-token is not given (keeps it out of `ps` and shell history)."""


# -- UCX (read by UCX itself, under NIXL) ---------------------------------------------------------
#
# UCX takes its settings from the environment only: NIXL's UCX backend passes on no UCX variables
# (its parameters are ucx_devices, num_workers and ucx_error_handling_mode; ucx_devices carries the
# nixl transport's ``ucx_net_devices``). So the variables pdserve needs are decided here, from the
# operator's environment and the transport's options, and written once per process, before its
# first NIXL agent (UCX context) is created: at the node's start-up, where the transport registers
# its cache. Nothing else in pdserve writes os.environ.

UCX_CUDA_IPC_GET_ZCOPY_DEFAULT = "on"
"""UCX leaves CUDA IPC READs (get_zcopy) off where it finds no NVLink ("auto"): on PCIe-only hosts,
and between two processes on one GPU, VRAM READs then crawl through a staging pipeline (0.5 GB/s
measured on one H100, where a WRITE took 780 GB/s). The decode node READs, so pdserve turns them on
unless the operator set UCX_CUDA_IPC_ENABLE_GET_ZCOPY."""

_ucx_lock = threading.Lock()
_ucx_set_up: dict[str, str] | None = None


def ucx_environment(ucx_tls: str = "", environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The UCX variables to add to ``environ`` (default: this process's) for pdserve's NIXL agents:
    UCX_TLS when ``ucx_tls`` is given (the nixl transport's option, which wins over the operator's),
    and UCX_CUDA_IPC_ENABLE_GET_ZCOPY unless the operator chose it. Decides; writes nothing."""
    environ = os.environ if environ is None else environ
    wanted = {}
    if ucx_tls and environ.get("UCX_TLS") != ucx_tls:
        wanted["UCX_TLS"] = ucx_tls
    if "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in environ:
        wanted["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = UCX_CUDA_IPC_GET_ZCOPY_DEFAULT
    return wanted


def set_up_ucx(ucx_tls: str = "") -> None:
    """Write ``ucx_environment(ucx_tls)`` into the environment, once per process, before the first
    UCX context is created; later calls change nothing (and one asking for another UCX_TLS than
    the first raises: the process's agents share one UCX set-up)."""
    global _ucx_set_up
    with _ucx_lock:
        if _ucx_set_up is None:
            _ucx_set_up = {"tls": ucx_tls}
            os.environ.update(ucx_environment(ucx_tls))
        elif ucx_tls and ucx_tls != _ucx_set_up["tls"]:
            raise ValueError(
                f"UCX was set up with UCX_TLS={_ucx_set_up['tls'] or '(unset)'} in this process; "
                f"{ucx_tls} cannot follow"
            )
