"""The session lane (``kv_transfer.lane``): a nixl session's messages leave the control connection
for a plain TCP connection once set up; the lane port takes nothing but a lane whose first frame is
the token its set-up handed out; a lane and its control connection close together; a sender that
cannot reach the lane port keeps its messages on the control connection."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
import torch

from pdserve import kv_transfer
from pdserve.kv_transfer import KVTransferError, control_receiver, control_sender
from pdserve.kv_transfer.base import ReservationTable
from pdserve.kv_transfer.lane import FrameReader, LaneClosed, SenderLane, frame
from pdserve.kv_transfer.messages import KVHandshake, KVLane, KVLaneReply
from pdserve.messages import decode, encode
from tests.test_kv_transfer_nixl import SMALL, Pair, cache, info

nixl_only = pytest.mark.skipif("nixl" not in kv_transfer.available_transports(), reason="nixl not installed")


def test_frames_split_anywhere_come_out_whole_and_an_oversized_one_closes_the_lane():
    stream = frame(b"a" * 5) + frame(b"") + frame(b"xyz" * 100)
    for cut in range(len(stream) + 1):
        reader, out = FrameReader(max_bytes=300), []
        for part in (stream[:cut], stream[cut:]):
            reader.feed(part)
            while (body := reader.next()) is not None:
                out.append(body)
        assert out == [b"a" * 5, b"", b"xyz" * 100]
    # Fed a frame at a time (every frame taken before the next comes), then one cut in two.
    reader = FrameReader(max_bytes=300)
    for body in (b"a" * 5, b"bb", b"xyz" * 100):
        reader.feed(frame(body))
        assert reader.next() == body and reader.next() is None
    reader.feed(frame(b"cut")[:3])
    assert reader.next() is None
    reader.feed(frame(b"cut")[3:] + frame(b"d"))
    assert [reader.next(), reader.next(), reader.next()] == [b"cut", b"d", None]
    reader = FrameReader(max_bytes=299)
    reader.feed(frame(b"xyz" * 100))
    with pytest.raises(LaneClosed, match="300 bytes"):
        reader.next()


def _conns(pair: Pair) -> dict:
    return dict(pair.receiver._conns)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _send_ok(pair: Pair, rid: str, src: list[int], dst: list[int]) -> None:
    pair.table.add(rid, dst, time.time() + 30)
    assert pair.send(rid, src, dst).result().ok
    assert torch.equal(pair.dst[:, dst], pair.src[:, src])


def _lane_writers(monkeypatch) -> list[str]:
    """Who writes each message on a sender's lane from now on: "caller" (``SenderLane.post``, the
    caller's thread) or "peer" (``SenderLane.send``, the peer's thread), in order."""
    by: list[str] = []
    post, send = SenderLane.post, SenderLane.send
    monkeypatch.setattr(SenderLane, "post", lambda self, body: (by.append("caller"), post(self, body))[1])
    monkeypatch.setattr(SenderLane, "send", lambda self, *a: (by.append("peer"), send(self, *a))[1])
    return by


@pytest.fixture(params=["unix", "tcp"])
def pair(request):
    """A nixl pair whose lane is the receiver's Unix socket (both on this host), or its TCP port (the
    Unix socket's name not sent, as for a peer on another host)."""
    p = Pair(SMALL, src_blocks=16, dst_blocks=32)
    if request.param == "tcp":
        p.receiver._lane_path = ""
    p.sender.handshake(p.address, info("prefill", SMALL), 10)
    family = p.sender._peers[p.address].lane.sock.family
    assert family == (socket.AF_UNIX if request.param == "unix" else socket.AF_INET)
    yield p
    p.close()


@nixl_only
def test_a_fault_while_taking_a_lane_message_answers_at_once(pair, monkeypatch):
    """As on the control connection: the nixl plane raises on a READ offer that came on the lane;
    its sender hears why at once, and the lane carries the next send."""
    from pdserve.kv_transfer import nixl_receiver

    handle = nixl_receiver.NixlReceiverPlane.handle

    def faulty(self, peer, msg, payload):
        if msg.request_id == "boom":
            raise RuntimeError("a fault here")
        return handle(self, peer, msg, payload)

    monkeypatch.setattr(nixl_receiver.NixlReceiverPlane, "handle", faulty)
    pair.table.add("boom", [5], time.time() + 30)
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="failed on it: RuntimeError: a fault here"):
        pair.send("boom", [1], [5]).result()
    assert time.monotonic() - started < 5
    _send_ok(pair, "after", [2], [6])
    assert pair.sender._peers[pair.address].lane is not None


@nixl_only
def test_a_nixl_session_moves_its_messages_onto_the_lane(pair, monkeypatch):
    """After the handshake and set-up, nothing more comes on the control connection: the sends,
    their commits and acks all go over the lane."""
    on_control = []
    receiver_class = control_receiver.ControlReceiver
    handle = receiver_class._handle
    counted = lambda self, *a: (on_control.append(1), handle(self, *a))[1]  # noqa: E731
    monkeypatch.setattr(receiver_class, "_handle", counted)
    peer = pair.sender._peers[pair.address]
    assert peer.lane is not None
    (conn,) = _conns(pair).values()
    assert conn.lane is not None and conn.lane_token == b""
    for i in range(5):
        _send_ok(pair, f"r{i}", [i, 10 + i], [2 * i, 20 + i])
    pair.sender.renew(pair.address, info("prefill", SMALL), ["r0"])
    _send_ok(pair, "last", [15], [31])  # behind the renewal on the same lane
    assert on_control == [] and pair.commits == [*(f"r{i}" for i in range(5)), "last"]


def _lane_port(pair: Pair) -> int:
    return pair.receiver._lane_port


def _raw_lane(pair: Pair) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _lane_port(pair)), timeout=5)
    return sock


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the receiver closed the lane (EOF or reset), skipping what it wrote before."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@nixl_only
def test_the_lane_port_takes_only_a_lane_that_presents_its_token_first(pair, monkeypatch):
    monkeypatch.setattr(control_receiver, "LANE_TOKEN_S", 0.3)
    monkeypatch.setattr(control_receiver, "MAX_PENDING_LANES", 3)
    refused = pair.receiver.num_refused
    # A token nobody was given: refused, then closed.
    wrong = _raw_lane(pair)
    wrong.sendall(frame(encode(KVLane(token=b"\x00" * 16))))
    reader = FrameReader(1 << 20)
    wrong.settimeout(5)
    reader.feed(wrong.recv(4096))
    answer = decode(reader.next(), KVLaneReply)
    assert not answer.ok and "unknown lane token" in answer.error
    assert _closed(wrong)
    # Garbage first, or a length past the limit: closed.
    garbage = _raw_lane(pair)
    garbage.sendall(frame(b"\xc1 not msgpack"))
    assert _closed(garbage)
    huge = _raw_lane(pair)
    huge.sendall(struct.pack("<I", 0xFFFFFFFF) + b"x" * 64)
    assert _closed(huge)
    long_first = _raw_lane(pair)  # before its token a lane may not make the node hold more
    long_first.sendall(struct.pack("<I", 4096) + b"x" * 64)
    assert _closed(long_first)
    # Silent ones: closed after LANE_TOKEN_S, and never more than MAX_PENDING_LANES held.
    silent = [_raw_lane(pair) for _ in range(5)]
    _wait(lambda: sum(ln.peer is None for ln in pair.receiver._lanes.values()) <= 3)
    assert all(_closed(s) for s in silent)
    _wait(lambda: all(ln.peer is not None for ln in pair.receiver._lanes.values()))
    assert pair.receiver.num_refused >= refused + 2
    # The session's own lane never moved, and still carries its sends.
    _send_ok(pair, "after", [1, 2], [3, 4])
    assert pair.commits == ["after"]
    for s in (wrong, garbage, huge, long_first, *silent):
        s.close()


@nixl_only
def test_a_lane_and_its_control_connection_close_together(pair):
    """The sender's lane going away drops its session on the receiver; the next send finds its lane
    gone and fails, the one after sets up afresh (new lane). A handshake arriving on a lane (where
    only the session's messages belong) closes it likewise."""
    peer = pair.sender._peers[pair.address]
    for attack in ("shutdown", "handshake on the lane"):
        if attack == "shutdown":
            peer.lane.sock.shutdown(socket.SHUT_RDWR)
        else:
            peer.lane.sock.sendall(frame(encode(KVHandshake(info=info("prefill", SMALL)))))
        _wait(lambda: _conns(pair) == {})
        pair.table.add(f"lost-{attack}", [5], time.time() + 30)
        with pytest.raises(KVTransferError, match="lane"):
            pair.send(f"lost-{attack}", [5], [5]).result()
        _send_ok(pair, f"again-{attack}", [6], [6])
        (conn,) = _conns(pair).values()
        assert conn.lane is not None and peer.lane is not None
    assert pair.commits == [f"again-{a}" for a in ("shutdown", "handshake on the lane")]


@nixl_only
def test_a_sender_that_cannot_reach_the_lane_port_keeps_the_session_on_the_control_connection(caplog):
    pair = Pair(SMALL, src_blocks=16, dst_blocks=32)
    try:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        pair.receiver._lane_port = closed.getsockname()[1]  # nobody listens there
        pair.receiver._lane_path = "pdserve-kv-lane-on-another-host"  # nor is this socket here
        closed.close()
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.control_sender"):
            pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        assert "stays on its control connection" in caplog.text
        assert pair.sender._peers[pair.address].lane is None
        _send_ok(pair, "control", [1, 2, 3], [7, 8, 9])
        (conn,) = _conns(pair).values()
        assert conn.lane is None and pair.commits == ["control"]
    finally:
        pair.close()


@nixl_only
@pytest.mark.parametrize("packed", [False, True], ids=["in place", "packed"])
def test_a_last_send_of_written_blocks_goes_out_on_the_callers_thread(packed, monkeypatch):
    """The commit's send, one READ of blocks already written, is put on the lane by the thread
    that calls ``send`` (``SenderLane.post``, which never waits) while the peer's thread is idle;
    chunks without the commit, and packed sends (gathers, staging slots), go through the peer's
    thread. Either way the blocks land and the commit is acked."""
    options = (kv_transfer.NixlOptions(pack_on_cpu=True, descriptors_per_piece=0),) if packed else ()
    pair = Pair(SMALL, src_blocks=16, dst_blocks=32, options=options)
    try:
        pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        by = _lane_writers(monkeypatch)
        me = threading.get_ident()
        posted_on = []
        peer_post = control_sender._Peer.post

        def recording_post(self, *args):
            posted_on.append(threading.get_ident())
            return peer_post(self, *args)

        monkeypatch.setattr(control_sender._Peer, "post", recording_post)
        _send_ok(pair, "now", [1, 2], [3, 4])
        pair.table.add("parts", [5, 6, 7], time.time() + 30)
        assert pair.send("parts", [8], [5], commit=False).result() is None
        assert pair.send("parts", [9, 10], [6, 7]).result().ok
        assert torch.equal(pair.dst[:, [5, 6, 7]], pair.src[:, [8, 9, 10]])
        if packed:
            assert "caller" not in by and pair.commits == ["now", "parts"]
        else:
            assert by == ["caller", "peer", "caller"] and set(posted_on) == {me}
            assert pair.commits == ["now", "parts"]
    finally:
        pair.close()


@nixl_only
def test_a_send_that_packs_only_as_one_piece_goes_out_at_once_in_place(monkeypatch):
    """Packing is weighed as one piece first, but a send packs only if it would in the pieces its
    slots cut it into (more pieces allow more descriptors). One descriptor a piece, slots of four
    slabs: two runs of a block each would pack as one piece, but their three layers go in two
    pieces (two layers, then one), which allow two descriptors: in place, and the caller's thread
    puts it on the lane (it went through the peer's thread, planning twice there, before). Four
    runs in three pieces (a layer each) pack, through the peer's thread."""
    slab = 2 * SMALL[2] * SMALL[1] * SMALL[3] * 4  # [2, BS, H, D] float32
    staging = kv_transfer.StagingOptions(num_slots=2, slot_bytes=4 * slab)
    options = (kv_transfer.NixlOptions(pack_on_cpu=True, descriptors_per_piece=1, staging=staging),)
    pair = Pair(SMALL, src_blocks=16, dst_blocks=32, options=options)
    try:
        pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        by = _lane_writers(monkeypatch)
        _send_ok(pair, "two-runs", [1, 5], [3, 9])
        assert by == ["caller"] and torch.equal(pair.dst[:, [3, 9]], pair.src[:, [1, 5]])
        _send_ok(pair, "four-runs", [1, 5, 9, 13], [20, 24, 28, 31])
        assert by[1:] and "caller" not in by[1:]
    finally:
        pair.close()


@nixl_only
def test_a_last_part_never_overtakes_a_job_the_peer_thread_took_and_has_not_done(pair, monkeypatch):
    """The peer's thread has taken a chunk of the request off its queue but not yet started it: the
    request's last part, sent meanwhile, goes behind it through that thread, not out at once on the
    caller's thread (which would put the commit on the lane ahead of the chunk's READ)."""
    peer = pair.sender._peers[pair.address]
    took, go = threading.Event(), threading.Event()
    get = peer.jobs.get

    def slow_get(*args, **kwargs):
        job = get(*args, **kwargs)
        if job is not None and job.request_id == "order" and job.commit is None:
            took.set()
            go.wait(10)  # taken, its turn not yet begun
        return job

    peer.jobs.get = slow_get
    pair.sender.renew(pair.address, info("prefill", SMALL), ["nobody"])  # the thread now waits in slow_get
    by = []
    post = SenderLane.post
    monkeypatch.setattr(SenderLane, "post", lambda self, body: (by.append("caller"), post(self, body))[1])
    pair.table.add("order", [5, 6, 7], time.time() + 30)
    chunk = pair.send("order", [8], [5], commit=False)
    assert took.wait(10)
    last = pair.send("order", [9, 10], [6, 7])
    go.set()
    assert chunk.result() is None and last.result().ok
    assert by == [] and pair.commits == ["order"]
    assert torch.equal(pair.dst[:, [5, 6, 7]], pair.src[:, [8, 9, 10]])


@nixl_only
def test_a_reply_that_cannot_be_written_closes_the_lane_at_the_next_turn(pair, monkeypatch):
    """The ack's write fails (the lane broke under it) inside the plane's own call: the lane and its
    connection close at the control thread's next turn, not inside the plane; that send fails, and
    the next one sets up afresh."""
    from pdserve.kv_transfer.lane import ReceiverLane
    from pdserve.kv_transfer.messages import KVAck

    write = ReceiverLane.write
    broke = []

    def breaking_write(self, body):
        if not broke and isinstance(decode(body, KVAck | KVLaneReply), KVAck):
            broke.append(1)
            raise LaneClosed("broken under the ack")
        write(self, body)

    monkeypatch.setattr(ReceiverLane, "write", breaking_write)
    pair.table.add("lost-ack", [5], time.time() + 30)
    with pytest.raises(KVTransferError, match="lane"):
        pair.send("lost-ack", [5], [5], timeout=10).result()
    assert broke
    _wait(lambda: _conns(pair) == {} or all(c.lane is not None for c in _conns(pair).values()))
    _send_ok(pair, "after", [6], [6])
    assert "after" in pair.commits


@nixl_only
def test_a_lane_socket_name_not_found_here_falls_back_to_the_port():
    """A receiver on another host (or in another network namespace) names a Unix socket this host
    does not have: the sender opens the lane on the TCP port instead."""
    pair = Pair(SMALL, src_blocks=16, dst_blocks=32)
    try:
        pair.receiver._lane_path = "pdserve-kv-lane-on-another-host"
        pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        assert pair.sender._peers[pair.address].lane.sock.family == socket.AF_INET
        _send_ok(pair, "port", [1, 2], [3, 4])
        assert pair.commits == ["port"]
    finally:
        pair.close()


@nixl_only
def test_a_fixed_lane_port_is_where_a_session_from_another_host_opens_its_lane():
    """``--kv-lane-port``: the set-up reply names it, and a sender that does not share the
    receiver's host (no Unix socket name) opens its lane there."""
    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    p = Pair(SMALL, src_blocks=16, dst_blocks=32)
    try:
        fixed = kv_transfer.create_receiver("nixl", lane_port=port)
        fixed.register_kv_cache(p.dst)
        p.receiver.close()
        p.receiver, p.address = fixed, fixed.start(info("decode", SMALL), p.table, p._commit)
        fixed._lane_path = ""
        p.sender.handshake(p.address, info("prefill", SMALL), 10)
        assert p.sender._peers[p.address].lane.sock.getpeername()[1] == port
        _send_ok(p, "fixed-port", [3, 4], [7, 8])
    finally:
        p.close()


def test_a_lane_port_in_use_fails_the_receivers_start_naming_it():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with socket.socket() as probe:  # a port free a moment ago, for the control connection
            probe.bind(("127.0.0.1", 0))
            kv_port = probe.getsockname()[1]
        receiver = kv_transfer.create_receiver("zmq", port=kv_port, lane_port=port)
        receiver.register_kv_cache(cache(SMALL, 4, fill=False))
        with pytest.raises(KVTransferError, match=f"cannot take KV lanes on 127.0.0.1:{port}"):
            receiver.start(info("decode", SMALL), ReservationTable(SMALL[0]), lambda commit: None)
        # The control port it had bound was let go: a receiver can take it now.
        again = kv_transfer.create_receiver("zmq", port=kv_port)
        again.register_kv_cache(cache(SMALL, 4, fill=False))
        assert again.start(info("decode", SMALL), ReservationTable(SMALL[0]), lambda commit: None)
        again.close()


def test_a_sink_fills_its_views_in_order_and_drops_what_comes_after_drop():
    """A payload split anywhere fills its views in order (bytes read with the header first); once
    dropped, the rest is read into scratch and ``done`` hears why; a lane closed first fails it."""
    from pdserve.kv_transfer.lane import Sink

    payload = bytes(range(256)) * 3
    for cut in (0, 1, 100, 767):
        views = [memoryview(bytearray(n)) for n in (10, 500, 258)]
        ended: list[str] = []
        sink = Sink(len(payload), views, ended.append)
        reader = FrameReader(1 << 20)
        reader.feed(frame(b"header") + payload[:cut])
        assert reader.next() == b"header"
        at = reader.take(sink.target())
        while not sink.advance(at) and (n := reader.take(sink.target())):
            at = n
        rest = memoryview(payload)[cut:]
        while sink.left:
            target = sink.target()
            n = min(len(target), len(rest), 37)
            target[:n] = rest[:n]
            rest = rest[n:]
            sink.advance(n)
        assert b"".join(bytes(v) for v in views) == payload and ended == [""]
    views = [memoryview(bytearray(100))]
    ended = []
    sink = Sink(100, views, ended.append)
    sink.target()[:40] = b"x" * 40
    sink.advance(40)
    sink.drop("released")
    sink.target()[: sink.left] = b"y" * sink.left
    assert sink.advance(60) and ended == ["released"] and bytes(views[0]) == b"x" * 40 + bytes(60)
    ended = []
    sink = Sink(10, [memoryview(bytearray(10))], ended.append)
    sink.fail("closed")
    sink.fail("again")
    assert ended == ["closed"]
    with pytest.raises(ValueError):
        Sink(10, [memoryview(bytearray(9))], ended.append)


def test_a_payload_is_read_a_bounded_amount_per_turn(monkeypatch):
    """The control thread reads at most FILL_BYTES of a payload off one lane per turn, then turns
    (other lanes, other peers, and whether the payload's reservation still stands); the rest waits
    in the socket, whose poll wakes it again, and frames after the payload come out whole."""
    from pdserve.kv_transfer import lane as lane_mod
    from pdserve.kv_transfer.lane import ReceiverLane, Sink

    monkeypatch.setattr(lane_mod, "FILL_BYTES", 32 << 10)
    a, b = socket.socketpair()
    lane = ReceiverLane(a, 1 << 20)
    lane.bind(b"peer")
    payload = bytes(range(256)) * 4096  # 1 MiB: more than one read takes with its header
    writer = threading.Thread(target=b.sendall, args=(frame(b"head") + payload + frame(b"next"),))
    writer.start()
    views = [memoryview(bytearray(16 << 10)) for _ in range(64)]
    ended: list[str] = []
    turns, frames = 0, []
    while not frames or frames[-1] != b"next":
        turns += 1
        for body in lane.read():
            frames.append(body)
            if body == b"head":
                lane.expect(Sink(len(payload), views, ended.append))
        assert turns < 10000
        time.sleep(0.0005)
    writer.join()
    assert frames == [b"head", b"next"] and ended == [""]
    assert b"".join(bytes(v) for v in views) == payload
    assert turns >= 16  # the 768 KiB after the first read: at most 48 KiB a turn
    a.close()
    b.close()
