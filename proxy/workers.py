"""Several proxy worker processes on one port (``pdserve proxy --workers N``).

One proxy process is one Python thread's worth of CPU: it tokenizes, routes and relays every
token of every stream. Workers multiply that, as vLLM's ``--api-server-count`` does:

1. The supervisor (the ``pdserve proxy`` process) first binds the port alone, so a port that is
   taken fails here, before anything starts.
2. It forks the workers. Each runs a whole proxy (tokenizer, router polling the nodes' load, its
   own in-flight counts, the prefix-index client) under uvicorn on a listening socket of its own
   bound with SO_REUSEPORT, and the kernel spreads new connections over them by their addresses.
   (One socket shared by every worker was uneven: asyncio accepts up to a hundred connections per
   wake-up, so a burst of clients landed on one or two workers, measured at 2,828 tok/s with 8
   workers where 19,566 had been reached.) Only processes of the same user can join the port,
   and a second ``pdserve proxy`` on it fails at step 1.
3. ``/metrics`` on any worker answers for all: each worker writes its registry's snapshot into a
   folder of the supervisor's every ``SNAPSHOT_INTERVAL_S`` and right before it answers
   ``/metrics``, which merges every worker's latest snapshot (counters and histograms add up, a
   gauge adds up or takes the largest, ``Gauge.merge``); ``pdserve_proxy_workers`` says how many
   snapshots went in.
4. SIGTERM or SIGINT to the supervisor goes on to every worker, and each drains as a lone proxy
   does (server.py); a second signal goes on too (end the requests now). The supervisor exits
   once every worker has. A worker that dies while serving is started again; one that fails to
   start (nodes unreachable or incompatible) stops them all, with its exit status.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

from pdserve.metrics import Registry, merge_snapshots
from pdserve.proxy.config import ProxyConfig
from pdserve.utils import die_with_parent

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.5
"""How stale another worker's figures on a shared /metrics may be."""
RESTART_DELAY_S = 1.0


class SharedMetrics:
    """A worker's side of the shared /metrics: its snapshot file, and the merge of all of them."""

    def __init__(self, folder: Path, index: int) -> None:
        self.folder = folder
        self.path = folder / f"worker-{index}.json"

    def publish(self, registry: Registry) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(registry.snapshot()))
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one

    def render(self, registry: Registry) -> str:
        self.publish(registry)
        snapshots = []
        for path in sorted(self.folder.glob("worker-*.json")):
            try:
                snapshots.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # a worker gone or restarting: its figures are left out
                continue
        workers = Registry()
        workers.gauge("pdserve_proxy_workers", "Proxy worker processes whose figures this sums.").set(
            len(snapshots)
        )
        return merge_snapshots([*snapshots, workers.snapshot()])


def _socket(config: ProxyConfig) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def check_port(config: ProxyConfig) -> None:
    """Raise OSError when the port is taken (by a listener, SO_REUSEPORT or not)."""
    with _socket(config) as sock:
        sock.bind((config.host, config.port))


def listen(config: ProxyConfig) -> socket.socket:
    """This worker's listening socket, one of the port's SO_REUSEPORT group."""
    sock = _socket(config)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    return sock


def _worker(config: ProxyConfig, index: int, folder: str, log_level: str, ready) -> None:

    from pdserve.proxy.router import ClusterError
    from pdserve.proxy.server import run_loop, serve_async

    # Signals come from the supervisor alone: a process group of its own keeps a Ctrl-C or a
    # launcher's killpg from reaching the worker besides the supervisor's forward (which would make
    # it a second signal: end the requests now); the kernel still stops it if the supervisor dies.
    os.setpgrp()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # uvicorn installs its own once it serves
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    shared = SharedMetrics(Path(folder), index)
    sock = listen(config)
    try:
        run_loop(serve_async(config, log_level, sockets=[sock], shared=shared, ready=ready.set))
    except ClusterError as e:
        raise SystemExit(f"pdserve proxy: {e}") from None


class _Slot:
    """One worker: its process and whether it ever became ready."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: multiprocessing.Process | None = None
        self.ready = None
        self.started = 0.0


def run_workers(config: ProxyConfig, log_level: str = "info") -> int:
    """Serve with ``config.workers`` workers until every one has exited (module docstring);
    returns the exit status."""
    ctx = multiprocessing.get_context("fork")
    check_port(config)
    folder = tempfile.mkdtemp(prefix="pdserve-proxy-metrics-")
    slots = [_Slot(i) for i in range(config.workers)]
    signals = 0

    def start(slot: _Slot) -> None:
        slot.ready = ctx.Event()
        slot.proc = ctx.Process(
            target=_worker,
            args=(config, slot.index, folder, log_level, slot.ready),
            name=f"pdserve-proxy-{slot.index}",
            daemon=False,
        )
        slot.proc.start()
        slot.started = time.monotonic()

    def forward(signum, frame) -> None:
        nonlocal signals
        signals += 1
        for slot in slots:
            if slot.proc is not None and slot.proc.is_alive():
                os.kill(slot.proc.pid, signal.SIGTERM if signals < 3 else signal.SIGKILL)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for slot in slots:
        start(slot)
    logger.info("proxy: %d workers on %s:%d", len(slots), config.host, config.port)
    status = 0
    try:
        while any(s.proc.is_alive() for s in slots):
            time.sleep(0.1)
            for slot in slots:
                proc = slot.proc
                if proc.is_alive() or signals:
                    continue
                if not slot.ready.is_set():  # it never served: the cluster is not servable
                    status = proc.exitcode or 1
                    forward(signal.SIGTERM, None)
                    break
                logger.error("proxy worker %d exited with %s; starting it again", slot.index, proc.exitcode)
                time.sleep(RESTART_DELAY_S)
                start(slot)
        for slot in slots:
            slot.proc.join()
    finally:
        for path in Path(folder).glob("*"):
            path.unlink(missing_ok=True)
        os.rmdir(folder)
    return status
