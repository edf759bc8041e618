"""KV transfer throughput between two processes: pdserve's transports against raw anchors.

The receiver process holds a real KV cache and reservations for its blocks; the sender
process holds another cache and pushes the same number of bytes as real blocks through
pdserve's senders (``nixl``, ``nccl``, ``zmq``: the receiver accepts all three and each sender
offers one), and, as anchors measured in the same run, through

* raw NCCL ``send``/``recv`` of one contiguous tensor (``init_process_group``; gloo on the CPU),
* a raw NIXL READ of one contiguous registered region (pdserve's nixl backend READs the blocks
  in place, one descriptor per run of blocks contiguous in both caches), the same region READ in
  2 MiB descriptors (a 32-block run of one layer of Llama-3-8B), and a raw NIXL WRITE of it by the
  sending process (which pdserve does not do: the decode node could not stop it),
* one plain TCP connection into a preallocated buffer (CPU).

On a 2-GPU host (sender on cuda:0, receiver on cuda:1; Llama-3-8B's KV shape in bf16)::

    python -m pdserve.benchmarks.kv_transfer --device cuda

writes ``docs/benchmarks/kv_transfer_gpu.json``. On the CPU (SmolLM2-135M's shape in float32;
nccl runs on gloo): ``--device cpu`` (``docs/benchmarks/kv_transfer_cpu.json``), or
``--dry-run`` for a quick smoke test of every path (small sizes, output to a temp file).

On a one-GPU host, ``--device cuda --same-gpu`` puts both processes on cuda:0: nixl only (NCCL
refuses two ranks on one GPU), against a device copy and raw NIXL READ/WRITE between the two
processes. It measures what the protocol costs on a GPU host's CPU, not a link.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import platform
import random
import socket
import sys
import tempfile
import threading
import time

import torch

from pdserve import gc_heap
from pdserve.config import cpu_count
from pdserve.kv_transfer.base import region_bytes

SHAPES = {
    # layers, KV heads, head dim, block size, dtype
    "smollm2-135m": (30, 3, 64, 16, "float32"),
    "llama-3-8b": (32, 8, 128, 16, "bfloat16"),
    "tiny": (2, 1, 8, 16, "float32"),  # 1 KiB slabs: a one-block send is the control path alone
}


def _info(node_id: str, shape: tuple):
    from pdserve.messages import NodeInfo

    layers, heads, head_dim, block, dtype = shape
    return NodeInfo(
        node_id, "decode", "bench", dtype, block, layers, heads, head_dim, "L,NB,2,BS,Hkv,D", "", "", 4096, 1
    )


def _bytes_per_block(shape: tuple) -> int:
    layers, heads, head_dim, block, dtype = shape
    return layers * 2 * block * heads * head_dim * getattr(torch, dtype).itemsize


def _cache(shape: tuple, num_blocks: int, device: str, fill: bool) -> torch.Tensor:
    """[L, NB, 2, BS, Hkv, D], block-major in memory as an engine allocates it (``KVLayout``)."""
    layers, heads, head_dim, block, dtype = shape
    dims = (num_blocks, layers, 2, block, heads, head_dim)
    if fill:
        return torch.randn(dims, device=device).to(getattr(torch, dtype)).transpose(0, 1)
    return torch.zeros(dims, dtype=getattr(torch, dtype), device=device).transpose(0, 1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _nixl_agent(name: str, progress_thread: bool = True):
    """A raw anchor's agent: NIXL's default configuration, its progress thread on or off."""
    from pdserve.kv_transfer.nixl_common import nixl_api

    api = nixl_api()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def _pieces(address: int, nbytes: int, piece: int, device: int) -> list[tuple[int, int, int]]:
    """NIXL descriptors covering ``nbytes`` at ``address`` in pieces of ``piece`` bytes (0: one)."""
    piece = piece or nbytes
    return [(address + o, min(piece, nbytes - o), device) for o in range(0, nbytes, piece)]


def _nixl_run(agent, op: str, local, remote, remote_name: str, stamps: list | None = None) -> str:
    """One NIXL transfer, polled to its end; its final state. ``stamps`` (a list) gets the
    ``time.perf_counter()`` of each step's end: built, posted, over, released."""
    handle = agent.initialize_xfer(op, local, remote, remote_name)
    if stamps is not None:
        stamps.append(time.perf_counter())
    state = agent.transfer(handle)
    if stamps is not None:
        stamps.append(time.perf_counter())
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if stamps is not None:
        stamps.append(time.perf_counter())
    handle.release()
    if stamps is not None:
        stamps.append(time.perf_counter())
    return state


# -- receiver process ------------------------------------------------------------------------------


def _nixl_options(
    slots: tuple[int, int],
    max_desc_bytes: int = 0,
    prepared_max_blocks: int = -1,
    progress_thread: bool = False,
    settle_spin_s: float = -1.0,
):
    """nixl's options with staging slots (number, bytes; 0: the default), READ descriptors of at
    most ``max_desc_bytes`` (0: one per contiguous run), ``prepared_max_blocks`` and
    ``settle_spin_s`` (-1: the defaults) and NIXL's progress thread on or off."""
    from pdserve.kv_transfer import NixlOptions, StagingOptions

    default = StagingOptions()
    staging = StagingOptions(slots[0] or default.num_slots, slots[1] or default.slot_bytes)
    options = NixlOptions(max_desc_bytes=max_desc_bytes, staging=staging, progress_thread=progress_thread)
    if prepared_max_blocks >= 0:
        options = dataclasses.replace(options, prepared_max_blocks=prepared_max_blocks)
    if settle_spin_s >= 0:
        options = dataclasses.replace(options, settle_spin_s=settle_spin_s)
    return options


def _receiver(
    conn,
    shape: tuple,
    num_blocks: int,
    device: str,
    transports: str,
    raw_bytes: int,
    max_desc_bytes: int,
    slots: tuple[int, int],
    prepared_max_blocks: int,
    settle_spin_s: float,
    progress_thread: bool,
    raw_progress_thread: bool,
) -> None:
    from pdserve import kv_transfer
    from pdserve.kv_transfer import ReservationTable

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    kv = _cache(shape, num_blocks, device, fill=False)
    table = ReservationTable(shape[0])
    # The decode side builds the READs: it takes the descriptor limit.
    receiver = kv_transfer.create_receiver(
        transports,
        options=[_nixl_options(slots, max_desc_bytes, prepared_max_blocks, progress_thread, settle_spin_s)],
    )
    receiver.register_kv_cache(kv)
    address = receiver.start(_info("bench-decode", shape), table, lambda commit: None)
    gc_heap.freeze()  # as a decode node's engine core does once it has started
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(1)
    conn.send((address, raw.getsockname()[1]))
    buf = torch.empty(raw_bytes, dtype=torch.uint8, device=device)
    nixl = None
    tcp = None
    raw_lock = threading.Lock()  # the raw agent, used by this thread and the raw READ thread
    while True:
        # An anchor agent without its progress thread is progressed while waiting (as pdserve's are).
        while nixl is not None and not raw_progress_thread and not conn.poll(0.001):
            with raw_lock:
                nixl.get_new_notifs()
        cmd = conn.recv()
        if cmd is None:
            break
        kind, arg = cmd
        if kind == "reserve":
            rid, n = arg
            table.add(rid, list(range(n)), time.time() + 120)
            conn.send("ok")
        elif kind == "reserve_many":  # the same blocks for each: (request ids, block ids)
            rids, blocks = arg
            for rid in rids:
                table.add(rid, list(blocks), time.time() + 120)
            conn.send("ok")
        elif kind == "release_many":
            for rid in arg:
                table.release(rid)
            conn.send("ok")
        elif kind == "zmq_echo":  # the anchor of the fixed cost: a thread that answers each message
            conn.send(_start_echo())
        elif kind == "raw_tcp":  # one persistent connection, like pdserve's
            host_buf = memoryview(buf.numpy())
            if tcp is None:
                tcp, _ = raw.accept()
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.send("ready")
            got = 0
            while got < arg:
                k = tcp.recv_into(host_buf[got:arg])
                if k == 0:
                    break
                got += k
            tcp.sendall(b"k")
            conn.send(got)
        elif kind == "nccl_init":
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", arg, is_master=False)
            backend = "nccl" if device.startswith("cuda") else "gloo"
            dist.init_process_group(backend, store=store, rank=1, world_size=2)
            conn.send("ok")
        elif kind == "raw_nccl":
            import torch.distributed as dist

            dist.recv(buf[:arg], src=0)
            _sync(device)
            conn.send("done")
        elif kind == "nixl_init":
            metadata, address_remote, dev = arg
            nixl = _nixl_agent("bench-raw-decode", raw_progress_thread)
            nixl.register_memory(buf)
            remote_name = nixl.add_remote_agent(metadata)
            mem = "VRAM" if device.startswith("cuda") else "DRAM"
            nixl_remote = (remote_name, address_remote, dev, mem)
            read = functools.partial(_raw_read, nixl, raw_lock, buf, nixl_remote)
            # The raw NIXL anchors are asked of a thread that does nothing else, as pdserve's control
            # thread serves only KV messages (this one answers every other command of the benchmark).
            listener = mp_connection.Listener(family="AF_UNIX")
            threading.Thread(
                target=_serve_raw_reads,
                args=(listener, read, None if raw_progress_thread else nixl.get_new_notifs, raw_lock),
                name="raw-nixl",
                daemon=True,
            ).start()
            conn.send((nixl.get_agent_metadata(), buf.data_ptr(), max(buf.get_device(), 0), listener.address))
        elif kind in ("raw_nixl", "raw_nixl_steps"):  # steps: the time stamps of each, sent back too
            conn.send(read(kind, arg))
        elif kind == "probe":  # start stamping (True), or stop and send the stamps back
            if arg:
                probe = _Probe("receiver")
                conn.send("ok")
            else:
                conn.send(probe.close())
        elif kind == "ping":
            conn.send("pong")
    receiver.close()


def _raw_read(nixl, lock: threading.Lock, buf: torch.Tensor, nixl_remote: tuple, kind: str, arg) -> tuple:
    """One raw READ into ``buf`` (a command ``raw_nixl`` or ``raw_nixl_steps``): its state and its
    time alone here, or (steps) the time stamps of each of its steps."""
    nbytes, piece = arg
    remote_name, address_remote, dev, mem = nixl_remote
    start = time.perf_counter()
    stamps = [start] if kind == "raw_nixl_steps" else None
    here = max(buf.get_device(), 0)
    if isinstance(piece, tuple):  # blocks 0..n-1 of a layer-major cache: one descriptor a layer
        layers, src_blocks, n, slab = piece
        local = [(buf.data_ptr() + i * n * slab, n * slab, here) for i in range(layers)]
        source = [(address_remote + i * src_blocks * slab, n * slab, dev) for i in range(layers)]
    else:
        local = _pieces(buf.data_ptr(), nbytes, piece, here)
        source = _pieces(address_remote, nbytes, piece, dev)
    with lock:
        local = nixl.get_xfer_descs(local, mem)
        remote = nixl.get_xfer_descs(source, mem)
        state = _nixl_run(nixl, "READ", local, remote, remote_name, stamps)
    if stamps is not None:
        return state, stamps
    return state, time.perf_counter() - start  # the operation alone, timed here


def _serve_raw_reads(listener, read, progress, lock: threading.Lock) -> None:
    """The raw NIXL anchors' thread: READs asked for on its own connection (and the ping after a
    raw WRITE), nothing else, as pdserve's control thread serves only KV messages; ``progress``
    (an agent without its progress thread) while it waits."""
    conn = listener.accept()
    listener.close()  # one connection, the sender's
    while True:
        while progress is not None and not conn.poll(0.001):
            with lock:
                progress()
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd is None:
            return
        conn.send("pong" if cmd[0] == "ping" else read(*cmd))


# -- sender process (this one) ---------------------------------------------------------------------


class _Asked:
    """A thread of the receiver process, asked on a connection of its own: the raw NIXL anchors'
    thread (``_serve_raw_reads``), or the main one (``_Remote``)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def call(self, kind: str, arg=None, timeout: float = 300):
        self.conn.send((kind, arg))
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the receiver did not answer {kind!r} in {timeout} s")
        return self.conn.recv()


class _Remote(_Asked):
    """The receiver process, through its main thread."""

    def __init__(self, ctx, args) -> None:
        conn, child = ctx.Pipe()
        super().__init__(conn)
        self.proc = ctx.Process(target=_receiver, args=(child, *args), daemon=True)
        self.proc.start()


def _median(times: list[float]) -> float:
    times = sorted(times)
    return times[len(times) // 2]


def _best(times: list[float]) -> float:
    """The fastest of the timed runs (the first, a warm-up at the same size, is left out): what a
    transport can do, with the noise of a shared machine kept out; every figure, pdserve's and the
    anchors', is taken this way, with the median beside it, from runs interleaved round by round."""
    return min(times[1:])


def _paired_median(ours: list[float], anchor: list[float]) -> float:
    """The median over the timed runs of the anchor's time over ours, each pair from the same round
    (a drift of the host between rounds falls on both alike): the typical ratio, where best to best
    is the most favourable run of each side (on one H200 host it moved by up to 0.3 between
    runs of the same code, a paired median by much less)."""
    pairs = sorted(a / o for o, a in zip(ours[1:], anchor[1:]))
    return pairs[len(pairs) // 2]


def _paired_median_interval(
    ours: list[float], anchor: list[float], resamples: int = 2000
) -> tuple[float, float]:
    """A 95 % interval of ``_paired_median`` (percentile bootstrap over the rounds, seeded): how far
    the run's figure may sit from the typical ratio by the luck of its rounds alone."""
    pairs = [a / o for o, a in zip(ours[1:], anchor[1:])]
    draw = random.Random(len(pairs))
    medians = sorted(sorted(draw.choices(pairs, k=len(pairs)))[len(pairs) // 2] for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _stamped_send(
    sender, address, info, rid: str, src_ids, dst_ids, timeout: float
) -> tuple[float, float, float]:
    """One send with its commit: when ``KVSender.send`` was called, when its outcome (the decode
    node's ack) reached the sender, and when the caller woke, all ``time.perf_counter()``. The
    outcome is stamped by a callback on the thread that resolves the send's future, the sender's
    peer thread, which is where the prefill node takes it: it never blocks on ``result()``, and
    neither does this caller, which waits for the callback instead (blocked on ``result()``, it
    would be woken by the future before the callbacks run: a wake-up the prefill node never pays,
    inside the time). The event and callback are made before the call is stamped: they are this
    benchmark's, not the send's (~5 us of an H200 host's thread, ~8 after idle). The caller's own
    wake-up is a benchmark's cost only."""
    from pdserve.kv_transfer.messages import KVCommit

    stamped = threading.Event()
    outcome = [0.0]

    def stamp(_) -> None:
        outcome[0] = time.perf_counter()
        stamped.set()

    started = time.perf_counter()
    fut = sender.send(address, info, rid, src_ids, dst_ids, KVCommit(rid, 0), timeout, written=True)
    fut.add_done_callback(stamp)
    stamped.wait(timeout + 30)  # the send resolves by its timeout; result() then says how
    woken = time.perf_counter()
    ack = fut.result(0)
    assert ack.ok, ack.error
    return started, outcome[0], woken


def _timed_send(sender, address, info, rid: str, src_ids, dst_ids, timeout: float) -> float:
    """One send timed from ``KVSender.send`` to its outcome reaching the sender (``_stamped_send``;
    the breakdown times the caller's wake-up after it: "sender: ack to the caller")."""
    started, outcome, _ = _stamped_send(sender, address, info, rid, src_ids, dst_ids, timeout)
    return outcome - started


def _time_send(remote, sender, address, shape, n: int, rid: str, src_ids=None) -> float:
    """One pdserve send of ``n`` blocks into reserved blocks 0..n-1 (``_timed_send``). The blocks
    were written long before (``written``, as a prompt's last send after its first token was read
    back)."""
    src_ids = range(n) if src_ids is None else src_ids
    remote.call("reserve", (rid, n))
    return _timed_send(sender, address, _info("bench-prefill", shape), rid, src_ids, range(n), 120)


def _raw_nccl(remote, flat: torch.Tensor, nbytes: int, device: str) -> float:
    import torch.distributed as dist

    _sync(device)
    remote.conn.send(("raw_nccl", nbytes))
    start = time.perf_counter()
    dist.send(flat[:nbytes], dst=1)
    assert remote.conn.recv() == "done"
    return time.perf_counter() - start


def _raw_nixl_read(remote, nbytes: int, piece: int, op_times: list[float], progress=None) -> float:
    """One raw READ by the receiver, timed here to its answer; ``progress`` (an agent without its
    progress thread: its ``get_new_notifs``) runs every millisecond meanwhile, as pdserve's sender
    does, for transports whose READs need the target's help."""
    start = time.perf_counter()
    if progress is None:
        state, op_seconds = remote.call("raw_nixl", (nbytes, piece))
    else:
        remote.conn.send(("raw_nixl", (nbytes, piece)))
        while not remote.conn.poll(0.001):
            progress()
        state, op_seconds = remote.conn.recv()
    seconds = time.perf_counter() - start
    assert state == "DONE", state
    op_times.append(op_seconds)
    return seconds


RAW_STEPS = (
    "anchor: request to the receiver's thread (pickled, the pipe, its wake-up)",
    "anchor: READ built (descriptors, initialize_xfer)",
    "anchor: READ posted (transfer)",
    "anchor: READ running, polled to its end",
    "anchor: READ released",
    "anchor: answer to the sender (pickled, the pipe, its wake-up)",
)
"""The steps of one raw NIXL READ (``_raw_steps_us``), beside pdserve's (``BREAKDOWN``)."""


def _raw_steps_us(remote, nbytes: int, count: int, progress=None) -> dict:
    """Where the raw READ anchor's time goes, as ``_breakdown_us`` for pdserve's sends: p50 and p90
    in microseconds of each of ``RAW_STEPS`` and of the whole, over ``count`` READs of one
    descriptor back to back (after 10 to warm up)."""
    steps: dict[str, list[float]] = {}
    for i in range(count + 10):
        sent = time.perf_counter()
        remote.conn.send(("raw_nixl_steps", (nbytes, 0)))
        while not remote.conn.poll(0.001):
            if progress is not None:
                progress()
        state, stamps = remote.conn.recv()
        answered = time.perf_counter()
        assert state == "DONE", state
        if i < 10:
            continue
        marks = [sent, *stamps, answered]  # woken, built, posted, over, released in between
        spans = [*zip(RAW_STEPS, marks, marks[1:]), ("anchor: the whole READ, to its answer", sent, answered)]
        for what, start, end in spans:
            steps.setdefault(what, []).append(end - start)
    return {what: _p50_p90_us(seconds) for what, seconds in steps.items()}


def _raw_nixl_write(remote, agent, local, target, receiver_name: str) -> float:
    start = time.perf_counter()
    assert _nixl_run(agent, "WRITE", local, target, receiver_name) == "DONE"
    assert remote.call("ping") == "pong"
    return time.perf_counter() - start


def _raw_copy(scratch: torch.Tensor, src: torch.Tensor, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    scratch.copy_(src)
    _sync(device)
    return time.perf_counter() - start


def _raw_tcp(remote, tcp: socket.socket, payload: memoryview, nbytes: int) -> float:
    remote.conn.send(("raw_tcp", nbytes))
    assert remote.conn.recv() == "ready"
    start = time.perf_counter()
    tcp.sendall(payload)
    tcp.recv(1)
    seconds = time.perf_counter() - start
    assert remote.conn.recv() == nbytes
    return seconds


def _p50_p90_us(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"p50": ordered[len(ordered) // 2] * 1e6, "p90": ordered[int(len(ordered) * 0.9)] * 1e6}


def _print_steps(title: str, steps: dict) -> None:
    """A breakdown's steps (``_breakdown_us``, ``_raw_steps_us``) under ``title``, p50 and p90."""
    print(f"{title} (us, p50 / p90):", flush=True)
    for what, us in steps.items():
        print(f"  {what:64s} {us['p50']:8.1f} {us['p90']:8.1f}", flush=True)


def _fixed_cost_us(remote, sender, address, shape, count: int, tag: str, gap_s: float = 0.0) -> dict:
    """The fixed cost of a send: one block from ``KVSender.send`` to the decode side's ack taken on
    the sender (``_timed_send``), ``count`` times in a row (after 10 to warm up), each ``gap_s``
    after the last one ended (a sporadic send: the threads it wakes have gone idle); p50 and p90 in
    microseconds."""
    rids = [f"{tag}-one-{gap_s}-{i}" for i in range(count + 10)]
    remote.call("reserve_many", (rids, [0]))
    info = _info("bench-prefill", shape)
    times = []
    for rid in rids:
        if gap_s:
            time.sleep(gap_s)
        times.append(_timed_send(sender, address, info, rid, [0], [0], 30))
    remote.call("release_many", rids)
    return _p50_p90_us(times[10:])


def _start_echo() -> str:
    """A ROUTER socket whose thread answers every message at once, as the receiver's control
    thread would (polling, then one reply); returns its address."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while True:
            if poller.poll(100):
                frames = sock.recv_multipart(copy=False)
                sock.send_multipart([frames[0], b"ack"])

    threading.Thread(target=serve, name="zmq-echo", daemon=True).start()
    return f"tcp://127.0.0.1:{port}"


def _raw_round_trip_us(remote, count: int, gap_s: float = 0.0) -> dict:
    """The anchor of a send's fixed cost: the same thread hops with nothing else, ``count`` times in
    a row (after 10 to warm up). The caller hands a message to a thread of its own (a queue), which
    sends it on a DEALER socket and waits for the answer (``poll``), from the receiver process's
    thread (``zmq_echo``), then resolves a Future the caller waits on; timed to that moment, as a
    send is (``_timed_send``). What a one-block send costs beyond this is pdserve's protocol; this
    itself is the host's (thread wake-ups, loopback TCP). ``gap_s``: idle time before each, as
    ``_fixed_cost_us``."""
    import queue
    from concurrent.futures import Future

    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(remote.call("zmq_echo", None))
    jobs: queue.Queue = queue.Queue()

    def worker() -> None:
        while (fut := jobs.get()) is not None:
            sock.send(b"x" * 200)
            while not sock.poll(1):
                pass
            sock.recv_multipart(copy=False)
            fut.set_result(time.perf_counter())

    thread = threading.Thread(target=worker, name="raw-round-trip", daemon=True)
    thread.start()
    times = []
    for _ in range(count + 10):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        fut: Future = Future()
        jobs.put(fut)
        times.append(fut.result() - start)
    jobs.put(None)
    thread.join()
    sock.close()
    return _p50_p90_us(times[10:])


# -- where a one-block send's time goes (--breakdown) -------------------------------------------------

BREAKDOWN = (
    ("send", "data_out", "sender: KVSender.send to the data message (with the commit) going out"),
    ("data_out", "data_in", "wire: data message to the receiver's control thread"),
    ("data_out", "woken", "  of it: to the return of the receiver's poll that saw it"),
    ("woken", "data_in", "  of it: that poll's return to the plane's handle"),
    ("data_out", "poll_in", "  the receiver entered that poll after the message left by"),
    ("data_in", "landed", "receiver: READ set up and ended / frames copied in"),
    ("landed", "ack_out", "receiver: commit (lease table, on_commit) and the ack out"),
    ("ack_out", "ack_in", "wire: ack to the sender's peer thread"),
    ("ack_in", "done", "sender: ack to the caller's wake-up (the stamp's event)"),
)
"""(from, to, what) stamps of one send: the processes share ``time.perf_counter`` (CLOCK_MONOTONIC)."""

ON_ONE_THREAD = (
    ("send", "data_out", "CPU of it on its thread: sender, send to the data message out"),
    ("woken", "data_in", "CPU of it on its thread: receiver, poll's return to the plane"),
    ("data_in", "landed", "CPU of it on its thread: receiver, READ set up and ended"),
)
"""Steps that run on one thread (a send put out on the caller's: ``_Peer.post``): the thread's CPU
time over them beside their wall time says whether the thread ran slowly or waited (for the GIL,
for a core)."""

WHOLE = (
    ("send", "ack_out", "send to the commit on the receiver (what TTFT waits for)"),
    ("send", "outcome", "send to its outcome on the sender's peer thread (what is timed)"),
    ("send", "done", "the whole send, to the caller's wake-up"),
)
"""Spans of several steps: the decode node starts the request at its commit; the ack after it only
tells the prefill node that its blocks are free, in a callback on the sender's peer thread (the
outcome: what ``_timed_send`` times); a caller blocked on the future wakes after that."""


class _Probe:
    """Time stamps per request id at the points ``BREAKDOWN`` names, taken by wrapping the methods
    that reach them (a microsecond or two each); ``close`` puts the methods back."""

    def __init__(self, side: str) -> None:

        from pdserve.kv_transfer import control_receiver, control_sender, nixl_receiver, zmq_backend
        from pdserve.kv_transfer.messages import KVAck, KVCommit

        self.stamps: dict[str, dict[str, float]] = {}
        self._undo: list = []
        self.current: str | None = None  # the request of the job the peer thread runs
        host, nixl, zmq_ = (
            control_receiver.ControlReceiver,
            nixl_receiver.NixlReceiverPlane,
            zmq_backend.ZmqReceiverPlane,
        )
        data = lambda a, r: a[1].request_id if not isinstance(a[1], KVCommit) else None  # noqa: E731
        if side == "receiver":
            for plane in (nixl, zmq_):
                self._wrap(plane, "handle", "data_in", data, first=True)
            self._wrap(zmq_, "handle", "landed", data, at_exit=True)
            self._wrap(nixl, "_end", "landed", lambda a, r: a[1].request_id)
            self._wrap(host, "_commit", "ack_out", lambda a, r: a[0].request_id, at_exit=True)
            acked = lambda a, r: a[1].request_id if isinstance(a[1], KVAck) else None  # noqa: E731
            self._wrap(control_receiver._Outbox, "put", "ack_out", acked)
            # Where the data message's trip goes: the receiver's control thread blocked in its wait
            # when it came (``poll_in`` before ``data_out``) or busy then, and from the wait's
            # return to the plane. The last wait before a plane's ``handle`` is the one that saw it.
            wait, probe = host.__dict__["_wait"], self
            probe.last_poll = (0.0, 0.0, 0.0)

            def timed_wait(receiver, timeout_s):
                entered = time.perf_counter()
                try:
                    return wait(receiver, timeout_s)
                finally:
                    probe.last_poll = (entered, time.perf_counter(), time.thread_time())

            host._wait = timed_wait
            self._undo.append((host, "_wait", wait))
            for plane in (nixl, zmq_):
                handle = plane.__dict__["handle"]

                def handled(plane_self, peer, msg, *rest, handle=handle):
                    rid = data((peer, msg), None)
                    if rid is not None and "woken" not in self.stamps.get(rid, ()):
                        entered, woken, cpu = probe.last_poll
                        self.stamps.setdefault(rid, {}).update(
                            poll_in=entered, woken=woken, **{"woken@cpu": cpu}
                        )
                    return handle(plane_self, peer, msg, *rest)

                plane.handle = handled
                self._undo.append((plane, "handle", handle))
        else:
            self._wrap(control_sender.ControlSender, "send", "send", lambda a, r: a[2])
            self._wrap(control_sender._Peer, "_do", "picked", self._job)
            # A send the engine's thread puts on the lane itself (``_Peer.submit``) goes out there.
            self._wrap(control_sender._Peer, "post", "direct", self._posted)
            posted = lambda a, r: a[1] if r is not None else None  # noqa: E731
            self._wrap(control_sender._Peer, "post", "posted", posted, at_exit=True)
            # The first message a job puts on the connection, as it starts (the thread may well be
            # preempted by the process it wakes before the call returns); not a lease renewal that
            # goes out ahead of it (``_Peer._renew_now``).
            self.renewing = False
            renew_now = control_sender._Peer.__dict__["_renew_now"]

            def renewing(peer) -> None:
                self.renewing = True
                try:
                    renew_now(peer)
                finally:
                    self.renewing = False

            control_sender._Peer._renew_now = renewing
            self._undo.append((control_sender._Peer, "_renew_now", renew_now))
            data_out = lambda a, r: None if self.renewing else self.current  # noqa: E731
            self._wrap(control_sender._Peer, "send", "data_out", data_out, first=True)
            ack = lambda a, r: r.request_id if isinstance(r, KVAck) else None  # noqa: E731
            self._wrap(control_sender._Peer, "recv", "ack_in", ack, at_exit=True)

    def _job(self, args, result) -> str | None:
        self.current = args[0].request_id or None
        return self.current

    def _posted(self, args, result) -> str | None:  # ``_Peer.post(info, request_id, ...)``
        self.current = args[1] or None
        return self.current

    def _wrap(self, cls, name: str, key: str, rid_of, at_exit: bool = False, first: bool = False) -> None:
        original = cls.__dict__[name]
        stamps = self.stamps

        def stamp(args, result) -> None:
            now, cpu = time.perf_counter(), time.thread_time()
            rid = rid_of(args, result)
            if rid is not None and not (first and key in stamps.get(rid, ())):
                stamps.setdefault(rid, {}).update({key: now, key + "@cpu": cpu})

        if isinstance(original, staticmethod):
            fn = original.__func__

            def wrapped(*args, **kw):
                if not at_exit:
                    stamp(args, None)
                result = fn(*args, **kw)
                if at_exit:
                    stamp(args, result)
                return result

            setattr(cls, name, staticmethod(wrapped))
        else:

            def wrapped(self, *args, **kw):
                if not at_exit:
                    stamp(args, None)
                result = original(self, *args, **kw)
                if at_exit:
                    stamp(args, result)
                return result

            setattr(cls, name, wrapped)
        self._undo.append((cls, name, original))

    def close(self) -> dict[str, dict[str, float]]:
        for cls, name, original in reversed(self._undo):
            setattr(cls, name, original)
        self._undo = []
        return self.stamps


def _breakdown_us(remote, sender, address, shape, count: int, tag: str, src_ids=(0,)) -> dict:
    """Where a send's time goes: p50 and p90 in microseconds of each step of ``BREAKDOWN`` over
    ``count`` sends (after 10 to warm up), and of the whole send; of blocks ``src_ids`` into blocks
    0..n-1 (one block by default: the fixed cost)."""
    rids = [f"{tag}-probe-{i}" for i in range(count + 10)]
    dst_ids = list(range(len(src_ids)))
    remote.call("reserve_many", (rids, dst_ids))
    info = _info("bench-prefill", shape)
    remote.call("probe", True)
    probe = _Probe("sender")
    try:
        for rid in rids:
            _, outcome, woken = _stamped_send(sender, address, info, rid, list(src_ids), dst_ids, 30)
            probe.stamps[rid].update(outcome=outcome, done=woken)
    finally:
        ours = probe.close()
        theirs = remote.call("probe", False)
    remote.call("release_many", rids)
    steps: dict[str, list[float]] = {}
    for rid in rids[10:]:
        t = {**theirs.get(rid, {}), **ours[rid]}
        for start, end, what in (*BREAKDOWN, *WHOLE):
            if start in t and end in t:
                steps.setdefault(what, []).append(t[end] - t[start])
        for start, end, what in ON_ONE_THREAD if "posted" in t else ():
            if f"{start}@cpu" in t and f"{end}@cpu" in t:
                steps.setdefault(what, []).append(t[f"{end}@cpu"] - t[f"{start}@cpu"])
    result = {what: _p50_p90_us(seconds) for what, seconds in steps.items()}
    # Not a time: how many of the sends went out on the caller's thread (``_Peer.post``), the rest
    # through the peer's thread (which was still finishing the last one, say).
    share = 100 * sum("posted" in ours[rid] for rid in rids[10:]) / max(len(rids) - 10, 1)
    result["sends out on the caller's thread (%, not us)"] = {"p50": share, "p90": share}
    return result


def run(args: argparse.Namespace) -> dict:
    from pdserve import kv_transfer
    from pdserve.kv_transfer import NcclOptions, NixlOptions

    cuda = args.device == "cuda"
    load_average = os.getloadavg()[0]  # other work on the machine moves CPU figures
    if cuda and not args.same_gpu and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs (sender on cuda:0, receiver on cuda:1), or --same-gpu")
    send_dev, recv_dev = ("cuda:0", "cuda:0" if args.same_gpu else "cuda:1") if cuda else ("cpu", "cpu")
    if args.same_gpu and (not cuda or "nccl" in (args.transports or "") or "nccl" in (args.anchors or "")):
        raise SystemExit("--same-gpu is for --device cuda without nccl (NCCL refuses two ranks on one GPU)")
    shape = SHAPES[args.shape or ("llama-3-8b" if cuda else "smollm2-135m")]
    sizes = [int(s) for s in (args.sizes_mib or ("4,16" if args.dry_run else "16,64,256,1024")).split(",")]
    repeats = 1 if args.dry_run else args.repeats
    default = "nixl" if args.same_gpu else "nixl,nccl" if cuda else "nixl,nccl,zmq"
    transports = [
        t for t in (args.transports or default).split(",") if t in kv_transfer.available_transports()
    ]
    anchors = args.anchors or ("copy,nixl" if args.same_gpu else "nccl,nixl" if cuda else "tcp,nixl,nccl")
    block_bytes = _bytes_per_block(shape)
    max_blocks = max(-(-s * (1 << 20) // block_bytes) for s in sizes)
    max_bytes = max_blocks * block_bytes
    ctx = mp.get_context("spawn")
    accepted = ",".join(dict.fromkeys([*transports, "zmq"]))
    max_desc_bytes = int(args.nixl_max_desc_mib * (1 << 20))
    slots = (args.stage_slots, args.stage_slot_mib << 20)
    progress, raw_progress = args.nixl_progress_thread, args.raw_nixl_progress_thread == "on"
    nixl_options = _nixl_options(slots, progress_thread=progress)
    prepared = args.nixl_prepared_max_blocks
    settle_spin_s = args.nixl_settle_spin_us * 1e-6 if args.nixl_settle_spin_us >= 0 else -1.0
    receiver_args = (
        shape,
        max_blocks,
        recv_dev,
        accepted,
        max_bytes,
        max_desc_bytes,
        slots,
        prepared,
        settle_spin_s,
    )
    remote = _Remote(ctx, (*receiver_args, progress, raw_progress))
    if not remote.conn.poll(300):
        raise RuntimeError("the receiver did not start")
    address, raw_port = remote.conn.recv()

    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(send_dev)
    src = _cache(shape, max_blocks, send_dev, fill=True)
    flat = region_bytes(src)

    if args.lanes == "tcp":  # as from another host: the receiver's lane port, not its Unix socket
        from pdserve.kv_transfer.lane import SenderLane

        SenderLane.connect_local = classmethod(lambda cls, name, max_bytes: None)

    def connected(name: str, options):
        sender = kv_transfer.create_sender(name, options=[options])
        sender.register_kv_cache(src)
        sender.handshake(address, _info("bench-prefill", shape), 60)
        return sender

    senders = {name: connected(name, nixl_options) for name in transports}
    # nccl's and nixl's two ways, each forced whatever the sender would pick (CUDA): a sender each.
    forced = {}
    if "nccl" in senders and cuda:
        for mode, threshold in (("direct", 0), ("staged", 1 << 62)):
            forced[f"nccl-{mode}"] = connected("nccl", NcclOptions(direct_min_run_bytes=threshold))
    if "nixl" in senders and cuda:
        for mode, threshold in (("inplace", 1 << 62), ("packed", 0)):
            options = dataclasses.replace(nixl_options, descriptors_per_piece=threshold)
            forced[f"nixl-{mode}"] = connected("nixl", options)

    nixl_anchor = "nixl" in anchors and "nixl" in kv_transfer.available_transports()
    if "nccl" in anchors:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
        remote.conn.send(("nccl_init", store.port))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=2)
        assert remote.conn.recv() == "ok"
    if nixl_anchor:
        agent = _nixl_agent("bench-raw-prefill", raw_progress)
        agent.register_memory(flat)
        reply = remote.call(
            "nixl_init", (agent.get_agent_metadata(), flat.data_ptr(), max(flat.get_device(), 0))
        )
        receiver_metadata, receiver_address, receiver_device, raw_reads = reply
        receiver_name = agent.add_remote_agent(receiver_metadata)
        raw_thread = _Asked(mp_connection.Client(raw_reads, family="AF_UNIX"))
        mem = "VRAM" if cuda else "DRAM"

    gc_heap.freeze()  # as a prefill node's engine core does once it has started
    # The fixed cost of a send, before any size: one block, send to ack, many times in a row; its
    # anchor first, the same thread hops and round trip with nothing else.
    raw_round_trip = _raw_round_trip_us(remote, args.one_block_count)
    p50, p90 = raw_round_trip["p50"], raw_round_trip["p90"]
    print(f"raw round trip through the same threads (anchor): p50 {p50:.0f} us, p90 {p90:.0f} us", flush=True)
    fixed = {}
    # On CUDA also nixl forced in place and packed (which way a one-block send should take).
    timed = {**senders, **{k: v for k, v in forced.items() if k.startswith("nixl")}}
    for name, sender in timed.items():
        fixed[name] = _fixed_cost_us(remote, sender, address, shape, args.one_block_count, name)
        p50, p90 = fixed[name]["p50"], fixed[name]["p90"]
        ratio = p50 / raw_round_trip["p50"]
        print(
            f"fixed cost of a one-block send, {name}: p50 {p50:.0f} us, p90 {p90:.0f} us "
            f"({ratio:.1f}x the anchor)",
            flush=True,
        )
    # The same after an idle gap before each send (a sporadic request's): the threads a send wakes
    # have gone to sleep, and the host's wake-up latency is paid at each hop; the anchor likewise.
    gap_s = args.one_block_gap_ms / 1e3
    after_gap = {}
    if gap_s:
        after_gap["raw_round_trip"] = _raw_round_trip_us(remote, args.one_block_count, gap_s)
        for name, sender in timed.items():
            after_gap[name] = _fixed_cost_us(
                remote, sender, address, shape, args.one_block_count, name, gap_s
            )
        anchor = after_gap["raw_round_trip"]["p50"]
        for name, us in after_gap.items():
            ratio = "" if name == "raw_round_trip" else f" ({us['p50'] / anchor:.1f}x the anchor)"
            print(
                f"after {args.one_block_gap_ms:g} ms idle, {name}: p50 {us['p50']:.0f} us, "
                f"p90 {us['p90']:.0f} us{ratio}",
                flush=True,
            )
    breakdown = {}
    for name, sender in timed.items() if args.breakdown else ():
        if name.split("-")[0] not in ("nixl", "zmq"):
            continue
        breakdown[name] = _breakdown_us(remote, sender, address, shape, args.one_block_count, name)
        _print_steps(f"where a one-block send's time goes, {name}", breakdown[name])

    tcp = None
    rows = []
    for size in sizes:
        n = -(-size * (1 << 20) // block_bytes)
        nbytes = n * block_bytes
        row = {"mib": size, "blocks": n, "bytes": nbytes}

        # Every way of moving the bytes, as a function timing one run (seconds). They run in
        # rounds, each once a round, so that the load of a shared machine falls on all of them
        # alike; the first round warms each up at this exact size and is left out.
        runs: dict = {}
        shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
        count = itertools.count()

        def transport(sender, src_ids=None, tag: str = "", n: int = n, count=count):
            return lambda: _time_send(remote, sender, address, shape, n, f"{tag}-{next(count)}", src_ids)

        for name, sender in senders.items():
            runs[f"pdserve_{name}"] = transport(sender, tag=name)
            # The same blocks taken in a shuffled order: no two consecutive in the source cache.
            runs[f"pdserve_{name}_shuffled"] = transport(sender, shuffled, name + "-s")
        for mode in ("direct", "staged"):  # both of nccl's ways
            if f"nccl-{mode}" in forced:
                runs[f"pdserve_nccl_{mode}"] = transport(forced[f"nccl-{mode}"], tag=mode)
        for mode in ("inplace", "packed"):  # both of nixl's ways, in order and shuffled
            sender = forced.get(f"nixl-{mode}")
            for suffix, ids in (("", None), ("_shuffled", shuffled)) if sender is not None else ():
                runs[f"pdserve_nixl_{mode}{suffix}"] = transport(sender, ids, f"nixl-{mode}{suffix}")
        if "nccl" in anchors:
            runs[f"raw_{'nccl' if cuda else 'gloo'}"] = functools.partial(
                _raw_nccl, remote, flat, nbytes, send_dev
            )
        op_times: dict[str, list[float]] = {}
        if nixl_anchor:
            # READ by the receiver in one descriptor and in 2 MiB ones (a run of 32 blocks per layer
            # of Llama-3-8B), and WRITE by the sender (then a ping, so the receiver knows, as a READ's
            # reply tells the sender).
            # Each asked of the receiver's raw anchor thread (``_serve_raw_reads``), which serves
            # nothing else; raw_nixl_read_warm: the one-descriptor READ asked of the receiver's
            # main thread instead, which also takes every reservation the benchmark makes (one
            # right before each pdserve send), so that it is woken twice as often as any other
            # thread and found awake: the anchor of the earlier sessions' runs, for comparison.
            pieces = [("raw_nixl_read", 0, raw_thread), ("raw_nixl_read_2mib", 2 << 20, raw_thread)]
            if cuda:  # blocks 0..n-1 READ as out of a layer-major cache, raw: one descriptor a layer
                layers = (shape[0], max_blocks, n, block_bytes // shape[0])
                pieces.append(("raw_nixl_read_layers", layers, raw_thread))
            pieces.append(("raw_nixl_read_warm", 0, remote))
            for label, piece, served_by in pieces:
                runs[label] = functools.partial(
                    _raw_nixl_read,
                    served_by,
                    nbytes,
                    piece,
                    op_times.setdefault(label, []),
                    None if raw_progress else agent.get_new_notifs,
                )
            local = agent.get_xfer_descs(_pieces(flat.data_ptr(), nbytes, 0, max(flat.get_device(), 0)), mem)
            target = agent.get_xfer_descs(_pieces(receiver_address, nbytes, 0, receiver_device), mem)
            runs["raw_nixl_write"] = functools.partial(
                _raw_nixl_write, raw_thread, agent, local, target, receiver_name
            )
        if "copy" in anchors and cuda:  # one device copy of the same bytes (the same-GPU ceiling)
            scratch = torch.empty(nbytes, dtype=torch.uint8, device=send_dev)
            runs["raw_copy"] = functools.partial(_raw_copy, scratch, flat[:nbytes], send_dev)
        if "tcp" in anchors and not cuda:
            # The same bytes out of the source cache into a preallocated buffer, on one connection
            # kept open (as pdserve's is).
            if tcp is None:
                tcp = socket.create_connection(("127.0.0.1", raw_port))
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            runs["raw_tcp"] = functools.partial(
                _raw_tcp, remote, tcp, memoryview(flat[:nbytes].numpy()), nbytes
            )
        times: dict[str, list[float]] = {key: [] for key in runs}
        # The first round (the warm-up, left out) in the order above; each later one in an order of
        # its own (seeded): a run that always came first in its round found the threads it wakes
        # asleep behind the anchors' work every time, and its best run was never a warm one.
        # ``--burst``: each way's turn in a timed round is that many runs in a row, every one timed.
        order = random.Random(size)
        for round_ in range(repeats + 1):
            keys = list(runs)
            if round_:
                order.shuffle(keys)
            for key in keys:
                for _ in range(args.burst if round_ else 1):
                    times[key].append(runs[key]())
        if "raw_nixl_read" in op_times:  # the READ alone, without the request to the receiver and its answer
            times["raw_nixl_read_op"] = op_times["raw_nixl_read"]
        for key, taken in times.items():
            row[f"{key}_gb_s"] = nbytes / _best(taken) / 1e9
            row[f"{key}_median_gb_s"] = nbytes / _median(taken[1:]) / 1e9
        runs.clear()
        scratch = None
        measured = [
            k[len("pdserve_") : -len("_gb_s")]
            for k in row
            if k.startswith("pdserve_") and not k.endswith("_median_gb_s")
        ]
        for name in measured:
            for anchor in (
                "raw_nccl",
                "raw_gloo",
                "raw_nixl_read",
                "raw_nixl_read_warm",
                "raw_nixl_read_op",
                "raw_nixl_read_layers",
                "raw_nixl_write",
                "raw_copy",
                "raw_tcp",
            ):
                if f"{anchor}_gb_s" in row:
                    row[f"ratio_{name}_to_{anchor}"] = row[f"pdserve_{name}_gb_s"] / row[f"{anchor}_gb_s"]
        rows.append(row)
        figures = ", ".join(
            f"{k[:-5]} {v:.2f}" for k, v in row.items() if k.endswith("_gb_s") and "_median" not in k
        )
        print(f"{size:5d} MiB ({n} blocks), GB/s (best of {repeats}): {figures}", flush=True)
        # The anchor each transport is held to (every ratio is in the JSON).
        own = {"zmq": "raw_tcp", "nixl": "raw_nixl_read", "nccl": "raw_nccl" if cuda else "raw_gloo"}
        ratios = ", ".join(
            f"{k[6:]} {v:.2f}"
            for k, v in row.items()
            if k.startswith("ratio_") and k.endswith("_to_" + own.get(k[6:].split("_")[0], ""))
        )
        print(f"{size:5d} MiB ratios (best to best): {ratios}", flush=True)
        paired = []
        for name in measured:
            anchor = own.get(name.split("_")[0], "")
            if anchor in times and f"pdserve_{name}" in times:
                ratio = _paired_median(times[f"pdserve_{name}"], times[anchor])
                low, high = _paired_median_interval(times[f"pdserve_{name}"], times[anchor])
                row[f"ratio_{name}_to_{anchor}_paired_median"] = ratio
                row[f"ratio_{name}_to_{anchor}_paired_median_95"] = [low, high]
                paired.append(f"{name}_to_{anchor} {ratio:.2f} [{low:.2f}, {high:.2f}]")
        print(
            f"{size:5d} MiB ratios (median of pairs from the same round, 95 % interval): {', '.join(paired)}",
            flush=True,
        )
        if args.keep_samples:  # every timed run, for a reading of the distributions
            row["samples_us"] = {key: [round(t * 1e6, 1) for t in taken[1:]] for key, taken in times.items()}
        if "raw_nixl_read_warm" in times and "pdserve_nixl" in times:
            ratio = _paired_median(times["pdserve_nixl"], times["raw_nixl_read_warm"])
            row["ratio_nixl_to_raw_nixl_read_warm_paired_median"] = ratio
            print(
                f"{size:5d} MiB nixl to raw_nixl_read_warm (the READ asked of the benchmark's busiest "
                f"thread): best to best {row['ratio_nixl_to_raw_nixl_read_warm']:.2f}, "
                f"median of pairs {ratio:.2f}",
                flush=True,
            )
        # Where a send of this size spends its time, in order and shuffled, the way each transport
        # picks for itself (what the fixed cost cannot tell: what grows with the blocks).
        for name, sender in senders.items() if args.breakdown else ():
            if name not in ("nixl", "zmq"):
                continue
            for order, ids in (("in_order", range(n)), ("shuffled", shuffled)):
                key = f"{name}_{order}"
                steps = _breakdown_us(remote, sender, address, shape, args.size_breakdown_count, key, ids)
                row.setdefault("breakdown_us", {})[key] = steps
                _print_steps(f"{size:5d} MiB: where a send's time goes, {name} {order}", steps)
        if args.breakdown and nixl_anchor:  # the raw READ's steps beside them, back to back as they are
            notifs = None if raw_progress else agent.get_new_notifs
            steps = _raw_steps_us(raw_thread, nbytes, args.size_breakdown_count, notifs)
            row.setdefault("breakdown_us", {})["raw_nixl_read"] = steps
            _print_steps(f"{size:5d} MiB: where the raw NIXL READ's time goes", steps)

    if tcp is not None:
        tcp.close()
    if nixl_anchor:
        raw_thread.conn.send(None)
    remote.conn.send(None)
    remote.proc.join(timeout=30)
    for sender in [*senders.values(), *forced.values()]:
        sender.close()
    if "nccl" in anchors:
        import torch.distributed as dist

        dist.destroy_process_group()

    if cuda and args.same_gpu:
        device = f"1 x {torch.cuda.get_device_name(0)} (sender and receiver processes both on cuda:0)"
    elif cuda:
        names = {torch.cuda.get_device_name(i) for i in range(2)}
        device = f"2 x {' / '.join(sorted(names))} (sender cuda:0, receiver cuda:1)"
    else:
        device = f"cpu: {platform.processor() or platform.machine()}, {cpu_count()} cores, loopback"
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": __import__("zmq").__version__,
    }
    if "nixl" in kv_transfer.available_transports():
        from pdserve.kv_transfer.nixl_common import nixl_version

        versions["nixl"] = nixl_version()
    if cuda:
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    layers, heads, head_dim, block, dtype = shape
    result = {
        "benchmark": "kv_transfer",
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "pdserve.benchmarks.kv_transfer", *sys.argv[1:]]),
        "dry_run": args.dry_run,
        "load_average_1m_at_start": load_average,
        "versions": versions,
        "env": {
            k: os.environ[k]
            for k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
            if k in os.environ
        },
        "kv_shape": {
            "layers": layers,
            "kv_heads": heads,
            "head_dim": head_dim,
            "block_size": block,
            "dtype": dtype,
            "bytes_per_block": block_bytes,
        },
        "what": "pdserve_<t>: time from KVSender.send (for staged nccl, copying the blocks out of the cache "
        "included, for zmq gathering those it does not send in place; nixl READs them in place, direct "
        "nccl sends them in place) to the decode "
        "side's ack after every block landed in its reserved slots taken on the sender (stamped in a "
        "callback on the thread that resolves the send's future, where the prefill node takes it; a "
        "caller blocked on result() wakes later: the breakdown times that), through transport t, "
        "blocks 0..n-1 "
        "into reserved blocks 0..n-1 (runs consecutive in both caches); pdserve_<t>_shuffled: the "
        "source blocks in a shuffled order (no two consecutive); pdserve_nccl_direct / _staged: nccl "
        "forced to one of its two ways (pdserve_nccl: the one it picks, NcclOptions.direct_min_run_bytes); "
        "raw_nccl (raw_gloo on the CPU): dist.send of one contiguous tensor until the receiver synced "
        "its recv; "
        "raw_nixl_read: one NIXL READ of one contiguous registered region, started by the receiver "
        "at the sender's request and timed by the sender to the receiver's answer (pickled, over a "
        "Unix socket of its own), on a thread of the receiver that serves the raw NIXL anchors and "
        "nothing else, as pdserve's control thread serves only KV messages (all raw_nixl_* but _warm "
        "are asked of it); raw_nixl_read_warm: the same READ asked of the receiver's main thread "
        "instead, over the benchmark's pipe, the thread that also takes every reservation (one right "
        "before each pdserve send) and so is found awake more often than any other (the anchor of "
        "the runs before session 23; on one H200 at 16 MiB, 126 us best against 206 on a thread "
        "that served only that READ, in the same run; alike within the noise, 123-168 against "
        "100-185 us, once the thread serves all the raw NIXL anchors); "
        "raw_nixl_read_op: the warm READ timed inside the receiver, the "
        "operation alone; the raw anchors' agents run NIXL's progress thread (its default) unless "
        "raw_nixl_progress_thread is false, pdserve's only where nixl_progress_thread is true; "
        "(_2mib: the region in 2 MiB descriptors; _layers, on CUDA: blocks 0..n-1 READ as out of a "
        "layer-major cache, one descriptor per layer, raw); raw_nixl_write: one NIXL WRITE of it by "
        "the sender, "
        "then a ping to the receiver; raw_copy (--same-gpu): one device copy of the bytes; "
        "pdserve_nixl_inplace / _packed: nixl forced to READ the blocks in place (one descriptor per run: "
        "the caches are block-major, as an engine's) or to pack them into staging slots (gather, one "
        "READ a slot, scatter); pdserve_nixl: the "
        "way it picks (NixlOptions.descriptors_per_piece); "
        "raw_tcp: one persistent socket, sendall out of the source cache into recv_into a preallocated "
        "buffer, then a one-byte reply. Each size runs once to warm up, then `repeats` times: GB/s = "
        "bytes / the fastest run (pdserve's and every anchor's alike; *_median_gb_s: the median run), "
        "ratio_* of those; every way runs once a round, the rounds in a row, each round after the "
        "first in an order of its own (shuffled, seeded by the size); with burst > 1 each way's turn "
        "is that many runs in a row, each timed (all of them count for best and median). "
        "one_block_send_us: the fixed cost of a send, one block from KVSender.send to "
        "the ack taken on the sender (as above), p50 and p90 of one_block_count sends in a row; "
        "raw_round_trip_us, its anchor: the same "
        "thread hops with nothing else (the caller hands a message to a thread, which sends it on a "
        "DEALER socket and polls for the answer of a thread in the receiver process, then resolves a "
        "Future the caller waits on, timed to that moment), as many times in a row: what the host "
        "costs (thread wake-ups, "
        "loopback TCP); one_block_breakdown_us (--breakdown): "
        "the same sends again, time-stamped at each step of the protocol in both processes (by "
        "wrapping the methods that reach it, ~1-2 us a stamp), p50 and p90 of each step; "
        "one_block_after_gap_us (--one-block-gap-ms): the anchor and the one-block sends again, each "
        "after that much idle time (the threads they wake gone to sleep, as between sporadic requests); "
        "results[].breakdown_us (--breakdown): the same for size_breakdown_count sends of each size, "
        "in order and shuffled, by the transport's own choice of way.",
        "repeats": repeats,
        "burst": args.burst,
        "lanes": args.lanes,
        "one_block_count": args.one_block_count,
        "one_block_send_us": fixed,
        "raw_round_trip_us": raw_round_trip,
        "one_block_breakdown_us": breakdown,
        "one_block_gap_ms": args.one_block_gap_ms,
        "one_block_after_gap_us": after_gap,
        "size_breakdown_count": args.size_breakdown_count,
        "nixl_max_desc_bytes": max_desc_bytes,
        "nixl_prepared_max_blocks": prepared if prepared >= 0 else NixlOptions().prepared_max_blocks,
        "nixl_settle_spin_s": settle_spin_s if settle_spin_s >= 0 else NixlOptions().settle_spin_s,
        "nixl_progress_thread": progress,
        "raw_nixl_progress_thread": raw_progress,
        "nccl_direct_min_run_bytes": NcclOptions().direct_min_run_bytes,
        "nixl_descriptors_per_piece": NixlOptions().descriptors_per_piece,
        "staging_slots": [nixl_options.staging.num_slots, nixl_options.staging.slot_bytes],
        "results": rows,
    }
    out = args.output or (
        os.path.join(tempfile.gettempdir(), "kv_transfer_dry_run.json")
        if args.dry_run
        else f"docs/benchmarks/kv_transfer_{'gpu' if cuda else 'cpu'}.json"
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes-mib", default="", help="default 16,256,1024 (4,16 with --dry-run)")
    p.add_argument("--transports", default="", help="pdserve transports to time (default: all available)")
    p.add_argument(
        "--anchors", default="", help="raw anchors: nccl, nixl, tcp, copy (default: nccl,nixl on cuda)"
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="", help="KV shape (default by device)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per size (after a warm-up round); best run taken"
    )
    p.add_argument(
        "--burst",
        type=int,
        default=1,
        help="runs of each way in a row at its turn of a round (1: each follows the other ways' work, "
        "the threads it wakes asleep; 3: the later ones find them awake, as under load)",
    )
    p.add_argument(
        "--one-block-count", type=int, default=200, help="one-block sends timed for the fixed cost (p50, p90)"
    )
    p.add_argument(
        "--one-block-gap-ms",
        type=float,
        default=0.0,
        help="also time the one-block sends (and their anchor) each after this much idle time; 0: not",
    )
    p.add_argument(
        "--nixl-max-desc-mib",
        type=float,
        default=0,
        help="cut nixl READ descriptors to at most this size (default 0: one per contiguous run)",
    )
    p.add_argument(
        "--nixl-prepared-max-blocks",
        type=int,
        default=-1,
        help="the decode side's NixlOptions.prepared_max_blocks (default -1: its default)",
    )
    p.add_argument(
        "--nixl-settle-spin-us",
        type=float,
        default=-1,
        help="the decode side's NixlOptions.settle_spin_s, in us (default -1: its default)",
    )
    p.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="pdserve's nixl agents run NIXL's progress thread (NixlOptions.progress_thread; default off)",
    )
    p.add_argument(
        "--raw-nixl-progress-thread",
        choices=("on", "off"),
        default="on",
        help="the raw NIXL anchors' agents run NIXL's progress thread (on: NIXL's default config)",
    )
    p.add_argument(
        "--stage-slots", type=int, default=0, help="staging slots a node (default: StagingOptions)"
    )
    p.add_argument(
        "--stage-slot-mib", type=int, default=0, help="MiB a staging slot (default: StagingOptions)"
    )
    p.add_argument(
        "--same-gpu",
        action="store_true",
        help="both processes on cuda:0 (one-GPU hosts; nixl over CUDA IPC, no nccl): protocol costs",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each step of a send (nixl, zmq) in both processes: one block, then each size",
    )
    p.add_argument(
        "--size-breakdown-count", type=int, default=30, help="sends of each size timed by --breakdown"
    )
    p.add_argument(
        "--lanes",
        choices=("local", "tcp"),
        default="local",
        help="sessions' lanes: through the receiver's Unix socket, as on one host (local), or its TCP "
        "port, as from another host (tcp: raw_tcp's path)",
    )
    p.add_argument(
        "--keep-samples",
        action="store_true",
        help="write every timed run of each size into the JSON (results[].samples_us), not only the figures",
    )
    p.add_argument("--dry-run", action="store_true", help="small sizes, one repeat, output to a temp file")
    p.add_argument("--output", default="", help="default docs/benchmarks/kv_transfer_<cpu|gpu>.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
