"""nccl, nixl and zmq moving VRAM blocks between two processes (GPU only).

The sender runs here on cuda:0; the receiver runs in a spawned process on cuda:1 (nixl and zmq
also on one GPU, nixl through CUDA IPC; nccl needs two, as NCCL refuses two ranks on one device).
zmq gathers the blocks on the device chunk by chunk and copies each chunk to the host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from pdserve import kv_transfer
from pdserve.kv_transfer import KVTransferError, ReservationTable
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import NodeInfo

pytestmark = pytest.mark.gpu

L, NB, BS, H, D = 4, 32, 16, 8, 128  # Llama-3-8B's block shape, fewer layers; 256 KiB per block in bf16
DTYPE = torch.bfloat16


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, "decode", "m", "bfloat16", BS, L, H, D, "LNB2SHD", "", "", 64, 100)


def _devices(name: str) -> tuple[str, str]:
    if torch.cuda.device_count() >= 2:
        return "cuda:0", "cuda:1"
    if name == "nccl":
        pytest.skip("nccl needs two GPUs")
    return "cuda:0", "cuda:0"


def _serve(name: str, device: str, conn) -> None:
    torch.cuda.set_device(device)
    dst = torch.zeros(NB, L, 2, BS, H, D, dtype=DTYPE, device=device).transpose(0, 1)  # an engine's layout
    table = ReservationTable(L)
    commits: list[str] = []
    receiver = kv_transfer.create_receiver(name)
    receiver.register_kv_cache(dst)
    conn.send(receiver.start(info("decode-0"), table, lambda c: commits.append(c.request_id)))
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        op, rid, blocks, lease_s = cmd
        if op == "reserve":
            table.add(rid, blocks, time.time() + lease_s)
            conn.send("ok")
        elif op == "blocks":  # the listed blocks as they are now, and the commits so far
            torch.cuda.synchronize()
            conn.send((dst[:, blocks].cpu(), list(commits), receiver.bytes_received))
    receiver.close()


class Remote:
    def __init__(self, name: str, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(name, device, child), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the receiver did not start"
        self.address = self.conn.recv()

    def call(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(60)
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(timeout=20)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(timeout=10)


@pytest.fixture(params=["nixl", "nixl-packed", "nccl", "nccl-direct", "zmq"])
def gpu_pair(request):
    name = request.param
    options = ()
    if name == "nccl-direct":  # every send straight from cache to cache, whatever its runs
        options = (kv_transfer.NcclOptions(direct_min_run_bytes=0),)
        name = "nccl"
    if name == "nixl-packed":  # every send gathered into staging slots, READ, scattered
        options = (kv_transfer.NixlOptions(descriptors_per_piece=0),)
        name = "nixl"
    if name not in kv_transfer.available_transports():
        pytest.skip(f"{name} is not available here")
    send_dev, recv_dev = _devices(name)
    torch.cuda.set_device(send_dev)
    remote = Remote(name, recv_dev)
    src = torch.randn(NB, L, 2, BS, H, D, device=send_dev).to(DTYPE).transpose(0, 1)  # block-major
    sender = kv_transfer.create_sender(name, options=options)
    sender.register_kv_cache(src)
    yield name, src, remote, sender
    sender.close()
    remote.close()


def test_vram_blocks_land_in_reserved_slots(gpu_pair):
    name, src, remote, sender = gpu_pair
    p = info("prefill-0")
    remote.call("reserve", "r1", [30, 3, 17, 8, 9], 30)
    assert sender.send(remote.address, p, "r1", [0, 1], [30, 3], None, 30).result() is None  # a chunk
    ack = sender.send(remote.address, p, "r1", [5, 6, 7], [17, 8, 9], KVCommit("r1", 1), 30).result()
    assert ack.ok
    got, commits, received = remote.call("blocks", "", [30, 3, 17, 8, 9], 0)
    assert torch.equal(got, src[:, [0, 1, 5, 6, 7]].cpu()) and commits == ["r1"]
    assert received == sender.bytes_sent == 5 * L * src[0, 0].numel() * src.element_size()
    assert sender._peers[remote.address].transport == name


def test_vram_many_requests_and_a_refusal(gpu_pair):
    _, src, remote, sender = gpu_pair
    p = info("prefill-0")
    for i in range(8):
        dst = [2 * i, 2 * i + 1]
        remote.call("reserve", f"m{i}", dst, 30)
        assert sender.send(remote.address, p, f"m{i}", [i, 31 - i], dst, KVCommit(f"m{i}", i), 30).result().ok
    got, _, _ = remote.call("blocks", "", list(range(16)), 0)
    want = torch.stack([src[:, b] for i in range(8) for b in (i, 31 - i)], dim=1).cpu()
    assert torch.equal(got, want)
    remote.call("reserve", "bad", [20], 30)
    with pytest.raises(KVTransferError, match="not all reserved"):
        sender.send(remote.address, p, "bad", [0, 1], [20, 21], KVCommit("bad", 1), 30).result()


def test_receiver_killed_fails_in_time(gpu_pair):
    """The send fails at its timeout, though the send before it was given 30 s; its blocks are
    released (``KVSendFuture.released``) only once no READ offered can run (nixl: the time the
    decode node was given for it, 1.8 s, plus the margin), the others' at once."""
    name, _, remote, sender = gpu_pair
    p = info("prefill-0")
    remote.call("reserve", "ok", [1], 30)
    assert sender.send(remote.address, p, "ok", [0], [1], KVCommit("ok", 1), 30).result().ok
    os.kill(remote.proc.pid, signal.SIGKILL)
    remote.proc.join(timeout=10)
    start = time.monotonic()
    fut = sender.send(remote.address, p, "lost", [2], [3], KVCommit("lost", 1), 2.0)
    with pytest.raises(KVTransferError):
        fut.result()
    failed_after = time.monotonic() - start
    assert failed_after < 3.0
    assert fut.released.result(timeout=15) is None
    released_after = time.monotonic() - start
    if name == "nixl":
        from pdserve.kv_transfer.nixl_sender import READ_MARGIN_S

        assert released_after >= 1.8 + READ_MARGIN_S - 0.05
    assert released_after < 10


def test_auto_agrees_on_nixl_or_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    want = kv_transfer.auto_transports()[0]
    assert want in ("nixl", "nccl")
    torch.cuda.set_device("cuda:0")
    remote = Remote("auto", "cuda:1")
    src = torch.randn(NB, L, 2, BS, H, D, device="cuda:0").to(DTYPE).transpose(0, 1)
    sender = kv_transfer.create_sender("auto")
    sender.register_kv_cache(src)
    try:
        remote.call("reserve", "a", [4], 30)
        assert sender.send(remote.address, info("p"), "a", [9], [4], KVCommit("a", 1), 30).result().ok
        assert sender._peers[remote.address].transport == want
        got, _, _ = remote.call("blocks", "", [4], 0)
        assert torch.equal(got, src[:, [9]].cpu())
    finally:
        sender.close()
        remote.close()


def test_vram_layer_events_gate_each_layer(gpu_pair):
    """Blocks still being written layer by layer when the send starts: each layer moves only after
    its event (a transport that read them early would carry the values from before the write)."""
    _, src, remote, sender = gpu_pair
    events = []
    for layer in range(L):
        torch.cuda._sleep(20_000_000)  # the layer is computed late (~10 ms per layer)
        src[layer, 4:6] += 1
        event = torch.cuda.Event()
        event.record()
        events.append(event)
    remote.call("reserve", "le", [10, 11], 30)
    p = info("prefill-0")
    ack = sender.send(remote.address, p, "le", [4, 5], [10, 11], KVCommit("le", 1), 30, events).result()
    assert ack.ok
    got, _, _ = remote.call("blocks", "", [10, 11], 0)
    assert torch.equal(got, src[:, [4, 5]].cpu())


def test_vram_blocks_already_written_do_not_wait_for_the_stream(gpu_pair):
    """``written``: the caller read back a result of the kernels that wrote the blocks (a prompt's
    first token), so the send waits for nothing, not for the next step async scheduling has already
    queued on the stream (here a kernel of ~0.5 s); without it the send waits for that kernel."""
    _, src, remote, sender = gpu_pair
    p = info("prefill-0")
    remote.call("reserve", "warm", [14], 30)  # the connection and its set-up, before the timed sends
    assert sender.send(remote.address, p, "warm", [1], [14], KVCommit("warm", 1), 30).result().ok
    torch.cuda.synchronize()
    for rid, written in (("written", True), ("queued", False)):
        remote.call("reserve", rid, [12, 13], 30)
        torch.cuda._sleep(1_000_000_000)  # the next step, queued behind the blocks' writes
        start = time.monotonic()
        ack = sender.send(remote.address, p, rid, [2, 3], [12, 13], KVCommit(rid, 1), 30, written=written)
        assert ack.result().ok
        seconds = time.monotonic() - start
        kernel_done = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        if written:
            assert not kernel_done and seconds < 0.2, seconds
        else:
            assert kernel_done
        got, _, _ = remote.call("blocks", "", [12, 13], 0)
        assert torch.equal(got, src[:, [2, 3]].cpu())
