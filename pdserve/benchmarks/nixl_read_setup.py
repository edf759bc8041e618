"""What a NIXL READ costs by the way it is built, alone (no pdserve protocol around it): the two ways
the decode node builds its READs (``kv_transfer.nixl_backend``), timed from building the transfer
to its release, blocks ``0..n-1`` of the sender's cache into blocks ``0..n-1`` of the receiver's.

- ``built``: one descriptor per run of blocks, its lists made for the READ (``get_xfer_descs``,
  ``initialize_xfer``): what a READ of more than ``NixlOptions.prepared_max_blocks`` blocks takes;
- ``prepared``: one descriptor per block, taken by index from lists prepared once for the whole
  cache (``make_prepped_xfer``): what a READ of at most that many blocks, or of scattered blocks,
  takes;
- ``built_sleep0`` and ``built_yield``: ``built`` polled as a loop that yields the GIL between its
  polls does: ``time.sleep(0)`` at Linux's default timer slack (50 us), and ``YIELD_S`` after
  ``precise_sleeps`` (the KV receiver's control loop while a READ runs).

Two processes with pdserve's agents (no progress thread, strict sync; the receiver's is progressed
by its polls, the sender's while it waits), caches laid out block-major as the engine's. Each way
is warmed at the exact block count it is timed at; best and median of ``--repeats`` back to back
(the GPU synchronized before each). It answers one question: should a READ's descriptor list be
built or prepared, at which sizes. On CUDA both processes share one GPU (CUDA IPC).

    python -m pdserve.benchmarks.nixl_read_setup --output docs/benchmarks/nixl_read_setup_h200.json
    python -m pdserve.benchmarks.nixl_read_setup --dry-run          # CPU, DRAM over UCX shared memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import shlex
import sys
import threading
import time

import numpy as np
import torch

from pdserve.utils import YIELD_S, precise_sleeps


def _setup(cuda: bool, block_bytes: int, num_blocks: int, fill: bool):
    from pdserve.kv_transfer.nixl_common import NixlOptions, make_agent

    if cuda:
        torch.cuda.set_device(0)
    cache = (
        _pattern(num_blocks * block_bytes // 4, cuda)
        if fill
        else torch.zeros(num_blocks * block_bytes // 4, device="cuda" if cuda else "cpu")
    )
    agent = make_agent("bench", NixlOptions())
    agent.register_memory(cache)
    return cache, agent


def _pattern(numel: int, cuda: bool) -> torch.Tensor:
    """The sender's cache: values the receiver can check what it READ against."""
    return (torch.arange(numel, device="cuda" if cuda else "cpu") % 251).float()


def _sender(conn, cuda: bool, block_bytes: int, num_blocks: int) -> None:
    cache, agent = _setup(cuda, block_bytes, num_blocks, fill=True)
    conn.send((agent.get_agent_metadata(), cache.data_ptr()))
    while not conn.poll(0.001):  # progress UCX (a first connection's wire-up needs the target)
        agent.get_new_notifs()
    conn.recv()


def _units(address: int, block_bytes: int, num_blocks: int) -> np.ndarray:
    return np.array([[address, block_bytes, 0, block_bytes, num_blocks]], dtype=np.uint64)


def run(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and not args.dry_run
    mem = "VRAM" if cuda else "DRAM"
    block_bytes = int(args.block_mib * (1 << 20)) if cuda else 64 << 10
    counts = [int(c) for c in (args.counts or ("1,8,32" if args.dry_run else "1,8,32,128,512")).split(",")]
    num_blocks = max(counts)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(there, cuda, block_bytes, num_blocks), daemon=True)
    proc.start()
    try:
        metadata, src = here.recv()
        dst, agent = _setup(cuda, block_bytes, num_blocks, fill=False)
        remote = agent.add_remote_agent(metadata)
        local_units = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _units(dst.data_ptr(), block_bytes, num_blocks), mem
        )
        remote_units = agent.prep_xfer_dlist(remote, _units(src, block_bytes, num_blocks), mem)

        def finish(handle, pause: float | None = None) -> None:
            state = agent.transfer(handle)
            while state == "PROC":
                if pause is not None:
                    time.sleep(pause)
                state = agent.check_xfer_state(handle)
            assert state == "DONE", state
            handle.release()

        def built(n: int, pause: float | None = None) -> None:
            local = agent.get_xfer_descs(
                np.array([[dst.data_ptr(), n * block_bytes, 0]], dtype=np.uint64), mem
            )
            source = agent.get_xfer_descs(np.array([[src, n * block_bytes, 0]], dtype=np.uint64), mem)
            finish(agent.initialize_xfer("READ", local, source, remote), pause)

        def prepared(n: int) -> None:
            idx = list(range(n))
            finish(agent.make_prepped_xfer("READ", local_units, idx, remote_units, idx))

        def timed(way, n: int, precise: bool = False) -> list[float]:
            """Warm ``way`` at this exact shape, then time it; on a thread of its own (its timer
            slack: Linux's default, or ``precise_sleeps``')."""
            times: list[float] = []

            def body() -> None:
                if precise:
                    precise_sleeps()
                for _ in range(3):
                    way(n)
                for _ in range(args.repeats):
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    way(n)
                    times.append(time.perf_counter() - start)

            thread = threading.Thread(target=body)
            thread.start()
            thread.join()
            return sorted(times)

        # The built READ again, polled as a loop that yields the GIL between its polls would:
        # ``time.sleep(0)`` at the default timer slack, and pdserve's ``YIELD_S`` after
        # ``precise_sleeps`` (the KV receiver's turns while a READ runs).
        ways = (
            ("built", built, False),
            ("prepared", prepared, False),
            ("built_sleep0", lambda n: built(n, 0.0), False),
            ("built_yield", lambda n: built(n, YIELD_S), True),
        )
        rows = []
        for n in counts:
            row = {"blocks": n, "bytes": n * block_bytes}
            for name, way, precise in ways:
                times = timed(way, n, precise)
                row[f"{name}_best_us"] = times[0] * 1e6
                row[f"{name}_median_us"] = times[len(times) // 2] * 1e6
            row["prepared_to_built_median"] = row["prepared_median_us"] / row["built_median_us"]
            rows.append(row)
            print(
                f"{n:5d} blocks ({n * block_bytes >> 20} MiB), medians: "
                f"built {row['built_median_us']:8.1f} us, "
                f"prepared {row['prepared_median_us']:8.1f}; built polled with sleep(0) "
                f"{row['built_sleep0_median_us']:8.1f}, with YIELD_S {row['built_yield_median_us']:8.1f}",
                flush=True,
            )
        moved = counts[-1] * block_bytes // 4  # the last READ's blocks landed, each byte in place
        assert torch.equal(dst[:moved], _pattern(moved, cuda)), "a READ moved the wrong bytes"
    finally:
        here.send(None)
        proc.join(timeout=30)
    from importlib.metadata import version

    nixl = next((version(d) for d in NIXL_DISTS if _has(d)), "")
    return {
        "benchmark": "nixl_read_setup",
        "device": torch.cuda.get_device_name(0) + " (both processes)" if cuda else "cpu (DRAM)",
        "date": datetime.date.today().isoformat(),
        "command": "python -m pdserve.benchmarks.nixl_read_setup " + shlex.join(sys.argv[1:]),
        "versions": {"torch": torch.__version__, "nixl": nixl},
        "what": (
            "one READ of blocks 0..n-1 into blocks 0..n-1 (block-major caches of 2 MiB blocks, "
            "Llama-3-8B's), from building the transfer to its release: 'built' makes its descriptor "
            "lists for the READ (one descriptor, the run), 'prepared' takes one descriptor per block "
            "by index from lists prepared once; 'built_sleep0' / 'built_yield' poll the built READ "
            "with time.sleep(0) at the default timer slack / YIELD_S after precise_sleeps between "
            "polls; each warmed at the block count it is timed at, on a thread of its own"
        ),
        "repeats": args.repeats,
        "results": rows,
    }


NIXL_DISTS = ("nixl-cu13", "nixl-cu12", "nixl")


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="", help="block counts (default 1,8,32,128,512; 1,8,32 dry)")
    p.add_argument("--block-mib", type=float, default=2.0, help="bytes of a block on CUDA (Llama-3-8B: 2)")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--dry-run", action="store_true", help="CPU, 64 KiB blocks, output to a temp file")
    p.add_argument("--output", default="", help="default docs/benchmarks/nixl_read_setup_<cpu|gpu>.json")
    args = p.parse_args(argv)
    result = run(args)
    out = args.output or (
        "/tmp/nixl_read_setup_dry.json"
        if args.dry_run
        else f"docs/benchmarks/nixl_read_setup_{'gpu' if torch.cuda.is_available() else 'cpu'}.json"
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
