"""Small helpers with one home: maths, process plumbing."""

from __future__ import annotations

import signal
import sys
from pathlib import Path


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


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, zombies included (Linux: read from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie (Linux: read from /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
