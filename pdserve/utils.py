"""Small helpers with one home: maths, process plumbing."""

from __future__ import annotations

import signal
import sys


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` (``cdiv(0, b) == 0``)."""
    return -(-a // b)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies, even by SIGKILL
    (Linux only; elsewhere nothing), so a killed launcher or supervisor leaves no children behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
