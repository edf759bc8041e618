"""The zmq KV transport over real loopback sockets: delivery, validation, leases, refusals."""

from __future__ import annotations

import random
import socket
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from pdserve.kv_transfer import (
    KVTransferError,
    ReservationTable,
    ZmqOptions,
    control_receiver,
    create_receiver,
    create_sender,
)
from pdserve.kv_transfer.lane import LaneClosed, SenderLane
from pdserve.kv_transfer.messages import KVAck, KVBlocks, KVCommit
from pdserve.messages import NodeInfo, decode, encode

L, NB, BS, H, D = 3, 12, 4, 2, 8
SLAB = 2 * BS * H * D * 4  # bytes of one (layer, block), float32


def info(node_id: str, **kw) -> NodeInfo:
    base = NodeInfo(node_id, "decode", "m", "float32", BS, L, H, D, "LNB2SHD", "zmq", "", 64, 100)
    return msgspec.structs.replace(base, **kw)


def _ends(lane: bool) -> SimpleNamespace:
    """A sender and a started receiver; the payload on the session's lane (a cache in host memory),
    or in ZeroMQ frames (``lane`` False: a receiver that offers none, as one whose cache is on a
    GPU)."""
    ends = SimpleNamespace(src=torch.randn(L, NB, 2, BS, H, D), dst=torch.zeros(L, NB, 2, BS, H, D))
    ends.table, ends.commits = ReservationTable(L), []
    ends.receiver = create_receiver("zmq")
    ends.receiver.register_kv_cache(ends.dst)
    ends.address = ends.receiver.start(info("decode-0"), ends.table, ends.commits.append)
    ends.receiver.planes["zmq"].lane = lane
    ends.streams = ends.receiver._streams
    ends.sender = create_sender("zmq")
    ends.sender.register_kv_cache(ends.src)
    return ends


@pytest.fixture(params=["lane", "zeromq"])
def pair(request):
    ends = _ends(request.param == "lane")
    sender, receiver = ends.sender, ends.receiver
    yield ends.src, ends.dst, ends.table, ends.commits, sender, ends.address
    sender.close()
    receiver.close()


def test_blocks_land_in_reserved_slots(pair):
    src, dst, table, commits, sender, address = pair
    table.add("r1", [7, 2, 9], time.time() + 10)
    ack = sender.send(
        address, info("prefill-0"), "r1", [0, 5, 11], [7, 2, 9], KVCommit("r1", first_token=42), 5
    ).result()
    assert ack.ok and [c.first_token for c in commits] == [42]
    for s, d in zip([0, 5, 11], [7, 2, 9]):
        assert torch.equal(dst[:, d], src[:, s])
    untouched = [b for b in range(NB) if b not in (7, 2, 9)]
    assert dst[:, untouched].abs().sum() == 0


def test_handshake_refuses_mismatch_by_name(pair):
    _, _, table, _, sender, address = pair
    with pytest.raises(KVTransferError, match=r"block_size: 4 .* vs 16"):
        sender.handshake(address, info("prefill-0", block_size=16), 5)


def test_unreserved_blocks_and_expired_leases_are_refused(pair):
    _, dst, table, commits, sender, address = pair
    table.add("r2", [1], time.time() + 10)
    fut = sender.send(address, info("p"), "r2", [0, 1], [1, 3], KVCommit("r2", 1), 5)  # block 3 not reserved
    with pytest.raises(KVTransferError, match="not all reserved"):
        fut.result()
    table.add("r3", [4], time.time() - 1)  # lease already over
    with pytest.raises(KVTransferError, match="lease expired"):
        sender.send(address, info("p"), "r3", [0], [4], KVCommit("r3", 1), 5).result()
    assert dst.abs().sum() == 0 and commits == []
    assert table.expired() == ["r3"]


def test_a_fault_while_taking_a_message_answers_at_once(pair, monkeypatch, caplog):
    """The receiver's plane raises on a data message (a fault on the decode node, not the peer's
    doing): the request fails at once, its sender hears why instead of waiting out its timeout
    (the decode node's lease meanwhile), and the next send on the same connection goes through."""
    from pdserve.kv_transfer import zmq_backend

    _, dst, table, commits, sender, address = pair
    handle, land = zmq_backend.ZmqReceiverPlane.handle, zmq_backend.ZmqReceiverPlane.land

    def faulty(self, peer, msg, payload):
        if msg.request_id == "boom":
            raise RuntimeError("a fault in the copy")
        return handle(self, peer, msg, payload)

    def faulty_land(self, peer, msg):
        if msg.request_id == "boom":
            raise RuntimeError("a fault in the copy")
        return land(self, peer, msg)

    monkeypatch.setattr(zmq_backend.ZmqReceiverPlane, "handle", faulty)
    monkeypatch.setattr(zmq_backend.ZmqReceiverPlane, "land", faulty_land)
    table.add("boom", [3], time.time() + 10)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="pdserve.kv_transfer.control_receiver"):
        fut = sender.send(address, info("p"), "boom", [0], [3], KVCommit("boom", 1), 10)
        with pytest.raises(KVTransferError, match="failed on it: RuntimeError: a fault in the copy"):
            fut.result()
    assert time.monotonic() - started < 5  # not the send's 10 s timeout
    assert "handling KVBlocks failed" in caplog.text and "a fault in the copy" in caplog.text
    assert table.commit("boom") and commits == []  # failed: it never commits
    table.add("ok", [4], time.time() + 10)
    assert sender.send(address, info("p"), "ok", [1], [4], KVCommit("ok", 2), 10).result().ok
    assert [c.request_id for c in commits] == ["ok"]


def test_released_reservation_takes_no_writes(pair):
    _, dst, table, commits, sender, address = pair
    table.add("r4", [5], time.time() + 10)
    table.release("r4")
    with pytest.raises(KVTransferError, match="no reservation"):
        sender.send(address, info("p"), "r4", [0], [5], KVCommit("r4", 1), 5).result()
    assert dst.abs().sum() == 0 and commits == []


def test_dead_peer_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = create_sender("zmq")
    sender.register_kv_cache(torch.zeros(L, NB, 2, BS, H, D))
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no reply"):
        sender.send(f"tcp://127.0.0.1:{port}", info("p"), "r", [0], [0], KVCommit("r", 1), 0.5).result()
    assert time.monotonic() - start < 3
    sender.close()


def test_chunked_sends_then_commit(pair):
    src, dst, table, commits, sender, address = pair
    table.add("r5", [3, 4, 6, 8], time.time() + 10)
    p = info("prefill-0")
    assert sender.send(address, p, "r5", [1, 2], [3, 4], None, 5).result() is None
    assert sender.send(address, p, "r5", [7], [6], None, 5).result() is None
    ack = sender.send(address, p, "r5", [9], [8], KVCommit("r5", 3), 5).result()
    assert ack.ok
    for s, d in zip([1, 2, 7, 9], [3, 4, 6, 8]):
        assert torch.equal(dst[:, d], src[:, s])


def test_commit_with_missing_blocks_is_refused(pair):
    _, _, table, commits, sender, address = pair
    table.add("r6", [3, 4], time.time() + 10)
    with pytest.raises(KVTransferError, match="never arrived"):
        sender.send(address, info("p"), "r6", [1], [3], KVCommit("r6", 3), 5).result()
    assert commits == []


def test_renewed_lease_outlives_its_first_deadline(pair):
    _, dst, table, commits, sender, address = pair
    p = info("prefill-0")
    table.add("r7", [5], time.time() + 0.6)
    table.add("r8", [6], time.time() + 0.6)
    for _ in range(6):  # 1.2 s of renewals for r7 only
        sender.renew(address, p, ["r7"])
        time.sleep(0.2)
    assert table.expired() == ["r8"]
    ack = sender.send(address, p, "r7", [0], [5], KVCommit("r7", 1), 5).result()
    assert ack.ok
    with pytest.raises(KVTransferError, match="lease expired"):
        sender.send(address, p, "r8", [0], [6], KVCommit("r8", 1), 5).result()


def test_a_renewal_does_not_wait_behind_a_send_waiting_for_its_ack(monkeypatch):
    """Lease renewals do not take their turn behind the peer's jobs: one asked for while the peer's
    thread waits for an earlier send's ack (which the sender does not read for a while here) goes
    out then, and the lease it renews outlives its first deadline. (Queued behind sends waiting for
    their acks, a slow prefill node's renewals came seconds late and its leases ran out.)"""
    ends = _ends(True)
    try:
        p = info("prefill-0")
        ends.sender.handshake(ends.address, p, 5)
        hold = threading.Event()
        hold.set()
        recv = SenderLane.recv

        def held(self, timeout):  # the ack stays in the socket while ``hold`` is set
            if hold.is_set():
                time.sleep(min(timeout, 0.01))
                return None
            return recv(self, timeout)

        monkeypatch.setattr(SenderLane, "recv", held)
        ends.table.add("slow", [1], time.time() + 30)
        start = time.time()
        ends.table.add("leased", [2], start + 2.0)
        fut = ends.sender.send(ends.address, p, "slow", [1], [1], KVCommit("slow", 1), 10)
        time.sleep(1.0)
        ends.sender.renew(ends.address, p, ["leased"])  # the peer's thread waits for slow's ack
        time.sleep(max(0.0, start + 2.4 - time.time()))  # past the first deadline, before the renewed one
        assert ends.table.expired() == []
        hold.clear()
        assert fut.result(timeout=10).ok
    finally:
        ends.sender.close()
        ends.receiver.close()


# -- runs sent in place, one frame per (layer, run) -------------------------------------------------

IN_PLACE = ZmqOptions(zero_copy_min_run_bytes=0, max_frame_bytes=2 * 3 * SLAB)  # 2 layers of 3 blocks


@pytest.fixture
def in_place_pair(pair):
    src, dst, table, commits, _, address = pair
    sender = create_sender("zmq", options=[IN_PLACE])
    sender.register_kv_cache(src)
    yield src, dst, table, commits, sender, address
    sender.close()


def test_runs_go_out_of_the_cache_in_place_and_land_in_their_blocks(in_place_pair):
    """Blocks in runs (consecutive in both caches) travel as frames pointing into the sender's
    cache, several layers and runs to a message; each run lands in its reserved blocks."""
    src, dst, table, commits, sender, address = in_place_pair
    src_ids, dst_ids = [0, 1, 2, 5, 9, 10], [7, 8, 9, 2, 3, 4]  # runs of 3, 1 and 2
    sender.handshake(address, info("p"), 5)  # a send before it copies the blocks out at once
    table.add("run", dst_ids, time.time() + 10)
    ack = sender.send(address, info("p"), "run", src_ids, dst_ids, KVCommit("run", 4), 5).result()
    assert ack.ok and [c.request_id for c in commits] == ["run"]
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[:, d], src[:, s])
    untouched = [b for b in range(NB) if b not in dst_ids]
    assert dst[:, untouched].abs().sum() == 0
    session = sender._peers[address].session
    if sender._peers[address].streams:  # raw bytes on the lane, nothing for ZeroMQ to let go of
        assert not session._trackers
    else:
        assert len(session._trackers) == L * 3  # one tracked frame per (layer, run)


def _block_major(make, blocks: int = NB) -> torch.Tensor:
    return make(blocks, L, 2, BS, H, D).transpose(0, 1)  # an engine's cache (``KVLayout``)


@pytest.mark.parametrize("lane", [True, False])
def test_block_major_runs_go_out_as_one_frame_of_every_layer_and_land_in_their_blocks(lane):
    """Out of a block-major cache (an engine's), a run is one frame of all its layers, and messages
    are cut by blocks (a run split where a message is full); they land in a block-major cache,
    blocks consecutive there or not, and frames cut from a cache laid out otherwise land too."""
    src, dst = _block_major(torch.randn), _block_major(torch.zeros)
    table = ReservationTable(L)
    commits: list[KVCommit] = []
    receiver = create_receiver("zmq")
    receiver.register_kv_cache(dst)
    address = receiver.start(info("decode-0"), table, commits.append)
    receiver.planes["zmq"].lane = lane
    sender = create_sender("zmq", options=[IN_PLACE])  # messages of at most 2 blocks of 3 layers
    sender.register_kv_cache(src)
    try:
        src_ids, dst_ids = [0, 1, 2, 5, 9, 10], [7, 8, 9, 2, 3, 4]  # runs of 3, 1 and 2
        sender.handshake(address, info("p"), 5)
        table.add("run", dst_ids, time.time() + 10)
        ack = sender.send(address, info("p"), "run", src_ids, dst_ids, KVCommit("run", 4), 5).result()
        assert ack.ok and [c.request_id for c in commits] == ["run"]
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(dst[:, d], src[:, s])
        assert dst[:, [b for b in range(NB) if b not in dst_ids]].abs().sum() == 0
        # Runs of 2+1, then 1, then 2 blocks (the run of 3 split across two messages): 4 frames,
        # tracked on ZeroMQ; raw bytes on the lane.
        assert len(sender._peers[address].session._trackers) == (0 if lane else 4)
    finally:
        sender.close()
    from pdserve.kv_transfer.messages import KVAck, KVBlocks
    from pdserve.messages import decode, encode

    payload = torch.randn(3, L, 2, BS, H, D)  # blocks 3, 4, 5 of a block-major cache: one region
    table.add("part", [0, 6, 11], time.time() + 10)
    sock = _raw(address)
    try:  # a run of a block-major cache is every layer of it: a layer range cannot be cut so
        header = KVBlocks("part", [0, 6, 11], 1, L, 3 * (L - 1) * SLAB, runs=[3], block_major=True)
        sock.send_multipart([encode(header), payload[:, 1:].numpy().tobytes()])
        sock.send(encode(KVCommit("part", first_token=1)))
        assert sock.poll(5000)
        ack = decode(sock.recv(), KVAck)
    finally:
        sock.close(linger=0)
    assert not ack.ok and "must carry every layer" in ack.error
    table.release("part")
    for block_major in (True, False):
        rid = f"raw-{block_major}"
        table.add(rid, [0, 6, 11], time.time() + 10)  # not consecutive here: block by block
        sock = _raw(address)
        try:
            header = KVBlocks(rid, [0, 6, 11], 0, L, 3 * L * SLAB, runs=[3], block_major=block_major)
            if block_major:  # the run, every layer: one frame
                frames = [payload.numpy().tobytes()]
            else:  # the run cut layer by layer, as out of a layer-major cache
                frames = [payload[:, layer].numpy().tobytes() for layer in range(L)]
            sock.send_multipart([encode(header), *frames])
            sock.send(encode(KVCommit(rid, first_token=1)))
            assert sock.poll(5000)
            ack = decode(sock.recv(), KVAck)
        finally:
            sock.close(linger=0)
        assert ack.ok, ack.error
        for i, block in enumerate([0, 6, 11]):
            assert torch.equal(dst[:, block], payload[i])
        dst[:, [0, 6, 11]] = 0
    receiver.close()


def test_a_failed_in_place_send_ends_only_once_zmq_let_go_of_the_cache():
    """A send whose peer never answers fails at its timeout; the socket is closed, then the session
    waits until ZeroMQ let go of every frame pointing into the cache before the send's blocks are
    released (``KVSendFuture.released``: the caller reuses them then)."""
    sender = create_sender("zmq", options=[IN_PLACE])
    sender.register_kv_cache(torch.randn(L, NB, 2, BS, H, D))
    receiver = create_receiver("zmq")
    receiver.register_kv_cache(torch.zeros(L, NB, 2, BS, H, D))
    table = ReservationTable(L)
    address = receiver.start(info("decode-0"), table, lambda c: None)
    receiver.planes["zmq"].lane = False  # frames on ZeroMQ (a lane's bytes are gone once sent)
    sender.handshake(address, info("p"), 5)
    session = sender._peers[address].session
    held: list = []
    close = session.close
    session.close = lambda: (held.extend(session._trackers), close())[1]  # what it held when it closed
    table.add("r", [0, 1], time.time() + 10)
    receiver._stop.set()  # the decode node stops reading its socket: the ack never comes
    receiver._thread.join(timeout=5)
    fut = sender.send(address, info("p"), "r", [0, 1], [0, 1], KVCommit("r", 1), 0.5)
    with pytest.raises(KVTransferError, match="no reply"):
        fut.result(timeout=10)
    let_go: list[bool] = []
    fut.released.add_done_callback(lambda _: let_go.append(all(t.done for t in held)))
    assert fut.released.result(timeout=10) is None
    assert len(held) == L and let_go == [True]  # one run, a frame per layer: all let go by then
    assert sender._peers[address].session is None
    sender.close()
    receiver.close()


def _raw(address: str):
    """A DEALER that passed the handshake and set up zmq with the receiver at ``address``."""
    from pdserve.kv_transfer.messages import KVHandshake, KVHandshakeReply, KVSetup, KVSetupReply
    from pdserve.messages import decode, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(encode(KVHandshake(info("raw"))))
    assert sock.poll(5000) and decode(sock.recv(), KVHandshakeReply).ok
    sock.send(encode(KVSetup("raw", ["zmq"])))
    assert sock.poll(5000) and decode(sock.recv(), KVSetupReply).ok
    return sock


@pytest.mark.parametrize(
    "case, match",
    [
        ("runs that do not add up", "do not split"),
        ("an empty run", "do not split"),
        ("a frame too few", "frames where"),
        ("a frame of the wrong size", "bytes, expected"),
    ],
)
def test_run_headers_that_do_not_fit_are_refused(pair, case, match):
    """A KVBlocks message with runs must split its blocks into runs of at least one, carry one frame
    per (layer, run), each of exactly that run's bytes; otherwise nothing of it lands and the
    request's commit is refused with the reason."""
    from pdserve.kv_transfer.messages import KVAck, KVBlocks
    from pdserve.messages import decode, encode

    _, dst, table, commits, _, address = pair
    table.add("bad", [4, 5, 6], time.time() + 10)
    runs = {"runs that do not add up": [2, 2], "an empty run": [0, 3]}.get(case, [2, 1])
    frames = [bytes(c * SLAB) for c in runs] * L
    if case == "a frame too few":
        frames = frames[:-1]
    if case == "a frame of the wrong size":
        frames[1] = bytes(SLAB + 4)
    sock = _raw(address)
    try:
        sock.send_multipart([encode(KVBlocks("bad", [4, 5, 6], 0, L, L * 3 * SLAB, runs=runs)), *frames])
        sock.send(encode(KVCommit("bad", first_token=1)))
        assert sock.poll(5000)
        ack = decode(sock.recv(), KVAck)
    finally:
        sock.close(linger=0)
    assert not ack.ok and match in ack.error, ack.error
    assert dst.abs().sum() == 0 and commits == []


def test_runs_whose_blocks_are_not_consecutive_here_still_land_in_their_blocks(pair):
    """A run is consecutive in the sender's cache; the receiver copies it in one piece where its
    destination blocks are consecutive too, and block by block where they are not."""
    from pdserve.kv_transfer.messages import KVAck, KVBlocks
    from pdserve.messages import decode, encode

    _, dst, table, commits, _, address = pair
    table.add("scattered", [9, 2, 6], time.time() + 10)
    payload = torch.randn(L, 3, 2, BS, H, D)
    frames = [payload[layer, a:b].numpy().tobytes() for layer in range(L) for a, b in ((0, 2), (2, 3))]
    sock = _raw(address)
    try:
        sock.send_multipart(
            [encode(KVBlocks("scattered", [9, 2, 6], 0, L, L * 3 * SLAB, runs=[2, 1])), *frames]
        )
        sock.send(encode(KVCommit("scattered", first_token=1)))
        assert sock.poll(5000)
        assert decode(sock.recv(), KVAck).ok
    finally:
        sock.close(linger=0)
    for i, block in enumerate([9, 2, 6]):
        assert torch.equal(dst[:, block], payload[:, i])


def test_gathered_chunks_take_the_staging_buffers_in_turn():
    """Scattered blocks are gathered chunk by chunk into the session's staging buffers, taken in
    turn and kept across sends (memory already mapped), each gathered into again only once ZeroMQ
    let go of the chunk it carried: three one-layer chunks a send through two buffers land intact."""
    src = torch.randn(L, NB, 2, BS, H, D)
    dst = torch.zeros(L, NB, 2, BS, H, D)
    table = ReservationTable(L)
    options = (ZmqOptions(max_frame_bytes=4 * SLAB, staging_buffers=2, zero_copy_min_run_bytes=1 << 30),)
    receiver = create_receiver("zmq", options=options)
    receiver.register_kv_cache(dst)
    address = receiver.start(info("decode-0"), table, lambda commit: None)
    receiver.planes["zmq"].lane = False  # on a lane blocks go out of the cache in place, never gathered
    sender = create_sender("zmq", options=options)
    sender.register_kv_cache(src)
    try:
        sender.handshake(address, info("prefill-0"), 5)  # agreed: sends gather (not copied before)
        pointers = None
        for k, (src_ids, dst_ids) in enumerate([([9, 2, 5, 0], [1, 3, 5, 7]), ([4, 11, 1, 6], [0, 2, 4, 6])]):
            table.add(f"g{k}", dst_ids, time.time() + 10)
            ack = sender.send(address, info("prefill-0"), f"g{k}", src_ids, dst_ids, KVCommit(f"g{k}", 1), 5)
            assert ack.result().ok
            assert torch.equal(dst[:, dst_ids], src[:, src_ids])
            session = sender._peers[address].session
            assert len(session._buffers) == 2
            now = [buf.data_ptr() for buf, _ in session._buffers]
            assert pointers is None or now == pointers  # the same buffers, not fresh ones
            pointers = now
    finally:
        sender.close()
        receiver.close()


def test_a_staging_buffer_still_on_the_wire_is_never_gathered_into():
    """A buffer ZeroMQ has not let go of (the peer stopped taking data) is waited for until the
    send's deadline, then the send fails; its bytes stay as they went out."""
    from types import SimpleNamespace

    from pdserve.kv_transfer.zmq_backend import ZmqSession

    class Stuck:
        def wait(self, timeout):
            time.sleep(timeout)
            raise zmq.NotDone

    plane = SimpleNamespace(options=ZmqOptions(staging_buffers=1))
    session = ZmqSession(plane, SimpleNamespace(address="tcp://peer"))
    kv = torch.zeros(L, NB, 2, BS, H, D)
    turn, part = session._buffer((1, 2, 2, BS, H, D), kv, time.monotonic() + 1)
    part.fill_(7.0)
    session._buffers[turn] = (session._buffers[turn][0], Stuck())
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="not taking data"):
        session._buffer((1, 2, 2, BS, H, D), kv, time.monotonic() + 0.2)
    assert 0.15 < time.monotonic() - start < 2
    assert bool((session._buffers[0][0].view(torch.float32) == 7.0).all())


def test_kv_transfer_benchmark_dry_run(kv_benchmark):
    """The kv_transfer benchmark end to end on the CPU (zmq against raw TCP, small sizes): every
    size has its figures and ratio, the one-block sends their fixed cost, and the breakdown times
    a send to its outcome on the sender's peer thread, which comes before the caller's wake-up."""
    result = kv_benchmark("--transports", "zmq", "--anchors", "tcp")
    assert [r["mib"] for r in result["results"]] == [4, 16]
    for row in result["results"]:
        assert row["pdserve_zmq_gb_s"] > 0 and row["raw_tcp_gb_s"] > 0
        assert row["ratio_zmq_to_raw_tcp"] == pytest.approx(row["pdserve_zmq_gb_s"] / row["raw_tcp_gb_s"])
        assert row["ratio_zmq_to_raw_tcp_paired_median"] > 0
    assert 0 < result["one_block_send_us"]["zmq"]["p50"] <= result["one_block_send_us"]["zmq"]["p90"]
    steps = result["one_block_breakdown_us"]["zmq"]
    outcome = steps["send to its outcome on the sender's peer thread (what is timed)"]["p50"]
    assert 0 < steps["send to the commit on the receiver (what TTFT waits for)"]["p50"] < outcome
    assert outcome <= steps["the whole send, to the caller's wake-up"]["p50"]


def test_the_paired_ratio_pairs_runs_of_the_same_round_and_leaves_out_the_warm_up():
    from pdserve.benchmarks.kv_transfer import _paired_median

    ours = [9.0, 2.0, 4.0, 8.0]  # a warm-up, then rounds in which the host ran fast, slow, slower
    anchor = [1.0, 1.0, 2.0, 4.0]
    assert _paired_median(ours, anchor) == 0.5  # every round's pair: 0.5; best to best would be 1/2 too
    assert _paired_median([9.0, 1.0, 4.0, 4.0], [1.0, 1.0, 1.0, 4.0]) == 1.0  # pairs 1, 0.25, 1


def test_the_paired_ratios_interval_holds_the_median_and_narrows_with_more_rounds():
    from pdserve.benchmarks.kv_transfer import _paired_median, _paired_median_interval

    draw = random.Random(7)
    widths = []
    for rounds in (30, 300):
        anchor = [1.0 + draw.random() for _ in range(rounds + 1)]
        ours = [a / (0.9 + 0.2 * draw.random()) for a in anchor]  # ratios spread over [0.9, 1.1]
        low, high = _paired_median_interval(ours, anchor)
        assert 0.9 <= low <= _paired_median(ours, anchor) <= high <= 1.1
        assert _paired_median_interval(ours, anchor) == (low, high)  # seeded: the same run, the same figures
        widths.append(high - low)
    assert widths[1] < widths[0] / 2


# -- payloads on the lane (``kv_transfer.lane``: raw bytes after their header) ------------------------


@pytest.fixture
def on_lane():
    """A sender and a receiver set up, and the sender's lane for the test to write on (its own
    thread is idle between jobs)."""
    ends = _ends(True)
    ends.sender.handshake(ends.address, info("p"), 5)
    ends.lane = ends.sender._peers[ends.address].lane
    assert ends.lane is not None
    yield ends
    ends.sender.close()
    ends.receiver.close()


def _wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _timed_release(table: ReservationTable, rid: str) -> float:
    """Seconds ``table.release(rid)`` took, on a thread of its own (as the engine's), at most 10."""
    took: list[float] = []

    def release() -> None:
        start = time.monotonic()
        table.release(rid)
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=release)
    thread.start()
    thread.join(10)
    assert took, "release still waiting"
    return took[0]


def test_a_reservation_released_while_its_payload_comes_in_waits_for_no_more_of_it(on_lane):
    """Half a payload in, the engine releases the reservation (its lease ran out): ``release``
    returns at once rather than when the rest came, no byte of the rest lands, the commit riding
    with it is refused, and the lane goes on."""
    t = on_lane
    src, dst, table, commits, sender, address, lane = (
        t.src,
        t.dst,
        t.table,
        t.commits,
        t.sender,
        t.address,
        t.lane,
    )
    receiver_streams = t.streams
    payload = torch.randn(L, 2, 2, BS, H, D)  # a gathered tensor: layers of blocks 2 and 3
    raw = payload.numpy().tobytes()
    table.add("slow", [2, 3], time.time() + 10)
    header = KVBlocks("slow", [2, 3], 0, L, len(raw), commit=KVCommit("slow", 1))
    lane.send(encode(header), time.monotonic() + 5)
    half = len(raw) // 2
    lane.sock.sendall(raw[:half])
    _wait(lambda: bool(receiver_streams))
    assert _timed_release(table, "slow") < 1.0  # not waiting for the other half
    lane.sock.sendall(raw[half:])
    ack = decode(lane.recv(5), KVAck)
    assert not ack.ok and "released while its KV came in" in ack.error
    assert dst[L - 1, 2:4].abs().sum() == 0  # the last layer, in the second half, never landed
    assert commits == [] and not receiver_streams
    table.add("next", [5], time.time() + 10)
    assert sender.send(address, info("p"), "next", [1], [5], KVCommit("next", 2), 5).result().ok
    assert torch.equal(dst[:, 5], src[:, 1])


def test_a_lane_closed_inside_a_payload_unpins_it_and_fails_the_request(on_lane):
    """The sender's lane breaks half a payload in: the blocks are unpinned at once (``release``
    does not wait) and the request never commits."""
    t = on_lane
    table, commits, lane, receiver_streams = t.table, t.commits, t.lane, t.streams
    table.add("cut", [4], time.time() + 10)
    header = KVBlocks("cut", [4], 0, L, L * SLAB, commit=KVCommit("cut", 1))
    lane.send(encode(header), time.monotonic() + 5)
    lane.sock.sendall(b"\1" * SLAB)
    _wait(lambda: bool(receiver_streams))
    lane.sock.close()
    _wait(lambda: not receiver_streams)
    assert "lane closed inside a payload" in table.commit("cut")
    assert _timed_release(table, "cut") < 1.0 and commits == []


@pytest.mark.parametrize(
    "why",
    ["nbytes", "negative", "blocks", "commit of another request"],
    ids=["length", "negative length", "blocks", "commit"],
)
def test_a_header_that_cannot_say_where_its_payload_goes_closes_the_lane(on_lane, why):
    """The bytes after such a header could not be told from the next message: the lane closes (the
    sender starts afresh) and the request fails."""
    t = on_lane
    src, dst, table, sender, address, lane = t.src, t.dst, t.table, t.sender, t.address, t.lane
    table.add("bad", [6], time.time() + 10)
    header = {
        "nbytes": KVBlocks("bad", [6], 0, L, L * SLAB + 1),
        "negative": KVBlocks("bad", [6], 0, L, -1),
        "blocks": KVBlocks("bad", [6, 6], 0, L, 2 * L * SLAB),
        "commit of another request": KVBlocks("bad", [6], 0, L, L * SLAB, commit=KVCommit("other", 1)),
    }[why]
    lane.send(encode(header), time.monotonic() + 5)
    with pytest.raises(LaneClosed):
        while lane.recv(5) is not None:
            pass
    assert table.commit("bad")  # failed
    table.add("after", [7], time.time() + 10)
    with pytest.raises(KVTransferError):  # the sender learns of it at its next send...
        sender.send(address, info("p"), "after", [2], [7], KVCommit("after", 1), 5).result()
    table.add("again", [8], time.time() + 10)  # ... and starts afresh
    assert sender.send(address, info("p"), "again", [2], [8], KVCommit("again", 1), 5).result().ok
    assert torch.equal(dst[:, 8], src[:, 2])


def test_a_payload_the_decode_node_stops_taking_fails_the_send_at_its_deadline(monkeypatch):
    """The decode node stops reading its lanes mid-payload (stuck): the send fails at its timeout,
    not later, and its blocks are given back at once (a lane's bytes are the kernel's once sent:
    nothing points into the cache any more); the next send starts afresh."""
    big = (L, 6, 2, 256, 8, 128)  # 2 MiB slabs: a 36 MiB payload, more than the sockets buffer
    src, dst = torch.randn(big), torch.zeros(big)
    table = ReservationTable(L)
    receiver = create_receiver("zmq")
    receiver.register_kv_cache(dst)
    shape = {"block_size": 256, "num_kv_heads": 8, "head_dim": 128}
    address = receiver.start(info("decode-0", **shape), table, lambda c: None)
    sender = create_sender("zmq")
    sender.register_kv_cache(src)
    try:
        sender.handshake(address, info("p", **shape), 5)
        assert sender._peers[address].lane is not None
        stuck = threading.Event()
        serve_lanes = control_receiver.ControlReceiver._serve_lanes
        monkeypatch.setattr(
            control_receiver.ControlReceiver,
            "_serve_lanes",
            lambda self, *a: None if stuck.is_set() else serve_lanes(self, *a),
        )
        stuck.set()
        table.add("r", list(range(6)), time.time() + 30)
        started = time.monotonic()
        fut = sender.send(
            address, info("p", **shape), "r", list(range(6)), list(range(6)), KVCommit("r", 1), 1.0
        )
        with pytest.raises(KVTransferError, match="did not take a payload in time"):
            fut.result(timeout=10)
        assert time.monotonic() - started < 3
        assert fut.released.result(timeout=1) is None
        stuck.clear()
        table.release("r")
        table.add("r2", [0], time.time() + 30)
        ok = None
        for _ in range(2):  # the first send after may still meet the lane the receiver closes now
            try:
                ok = sender.send(address, info("p", **shape), "r2", [1], [0], KVCommit("r2", 1), 5).result()
                break
            except KVTransferError:
                table.add("r2", [0], time.time() + 30)
        assert ok is not None and ok.ok and torch.equal(dst[:, 0], src[:, 1])
    finally:
        sender.close()
        receiver.close()
