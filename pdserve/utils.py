"""Small helpers with one home: maths, process plumbing, thread timing, asyncio waits."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import random
import signal
import socket
import sys
from pathlib import Path

PR_SET_TIMERSLACK = 29  # prctl(2)
TIMER_SLACK_NS = 1000

YIELD_S = 10e-6
"""What a thread that polls in a loop (a READ in flight, an NCCL op) sleeps between its turns, once
``precise_sleeps`` made its sleeps exact: long enough that a thread waiting for the GIL takes it
(with 0, beside such a spinner, a thread of small Python work ran at 0.32 of its speed on the
2-core box; with 10 us at 0.96-1.1, as beside the old 50 us sleeps), short enough that an idle
turn takes ~22-25 us there rather than ~70."""


def precise_sleeps() -> None:
    """End this thread's short sleeps and poll timeouts when asked. Linux lets a thread's timers
    fire up to its timer slack late, 50 us by default: ``time.sleep(0)`` took 56 us on the 2-core
    box (8.6 us with 1 us of slack), and on an H100 host a NIXL READ done in ~40 us was seen at
    ~110 by a poll loop that slept 0 between its polls (``pdserve.benchmarks.nixl_read_setup``
    times both). For threads that poll in a loop; the thread's own setting
    (``prctl(PR_SET_TIMERSLACK)``), a no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)


async def wait_at_most(fut: asyncio.Future, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: no limit) for ``fut``; True if it is done. ``fut`` is
    left running on a timeout and when the waiter is cancelled (``asyncio.shield`` semantics).

    Unlike ``asyncio.wait_for`` on Python 3.10 and 3.11, a cancellation that arrives in the loop
    turn in which ``fut`` completes is never lost: ``wait_for`` then returns the result and the
    caller runs on as if it had not been cancelled (a cancelled prefill call stayed on its node,
    unaborted, until the node's own 30 s limit)."""
    if fut.done():
        return True
    done, _ = await asyncio.wait({fut}, timeout=timeout)
    return bool(done)


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


_EPHEMERAL_DEFAULT = (32768, 60999)
_handed_out: set[int] = set()
_ports = random.SystemRandom()  # not the global generator: processes that seed it alike would pick alike


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; the default elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server this process starts (or tells a child to start).

    Chosen outside the kernel's ephemeral range: a port that ``bind(0)`` hands out is free only
    until the next outgoing connection takes it as its local port, and a cluster with many nodes
    opens many connections between choosing a server's port and that server binding it (seen as
    "Address already in use" when a proxy started beside 16 simulated nodes). A port is not handed
    out twice by one process, so the servers of one cluster never race each other for one either.
    """
    lo, hi = _ephemeral_range()
    ranges = [r for r in ((10000, min(lo, 65536)), (max(hi + 1, 10000), 65536)) if r[1] - r[0] >= 1000]
    for _ in range(200 if ranges else 0):
        a, b = _ports.choice(ranges)
        port = _ports.randrange(a, b)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a machine whose ports outside that range are all taken
        s.bind((host, 0))
        return s.getsockname()[1]
