"""Every KV backend (zmq, nixl over DRAM, nccl over gloo) through the same tests: delivery,
handshake refusals, lease and reservation rules, transport agreement, and the abort paths
(lease expiry mid-transfer, a peer killed, a peer that stops answering) across processes."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future

import msgspec
import pytest
import torch

from pdserve import kv_transfer
from pdserve.kv_transfer import KVHandshakeRefused, KVRefused, KVTransferError, ReservationTable
from pdserve.kv_transfer.control_sender import _Job
from pdserve.kv_transfer.messages import KVCommit, KVSetupReply
from pdserve.messages import NodeInfo

L, NB, BS, H, D = 3, 16, 4, 2, 8
_NIXL = pytest.mark.skipif("nixl" not in kv_transfer.available_transports(), reason="nixl not installed")
BACKENDS = [
    "zmq",
    pytest.param("nixl", marks=_NIXL),  # READ in place, one descriptor per run of blocks (DRAM)
    pytest.param("nixl-packed", marks=_NIXL),  # packed into staging slots, one READ a slot
    "nccl",
    "nccl-direct",  # nccl moving blocks straight between the caches (not through staging buffers)
    "sim",  # zmq's frames after a modelled link time (none by default)
]
ACROSS_PROCESSES = [b for b in BACKENDS if getattr(b, "values", (b,))[0] != "nixl-packed"]
"""The slower tests across processes take each transport's failure paths once."""


def backend(name: str) -> str:
    return name.split("-")[0]


def kv_cache(fill: bool, block_major: bool = True) -> torch.Tensor:
    """A test cache [L, NB, 2, BS, H, D], block-major in memory as an engine's (``KVLayout``), or
    layer-major."""
    make = torch.randn if fill else torch.zeros
    return make(NB, L, 2, BS, H, D).transpose(0, 1) if block_major else make(L, NB, 2, BS, H, D)


FORCED: tuple = ()
"""Transport options for the senders and receivers this process makes (set per test below, and
handed to a process a test spawns: ``Remote``)."""


@pytest.fixture(autouse=True)
def _forced_ways(request, monkeypatch):
    """Tests of "nccl-direct" send every block straight from cache to cache (over gloo here), and
    of "nixl-packed" pack every send into staging slots (as CUDA caches do with fragmented blocks)."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    forced = []
    if "nccl-direct" in params:
        forced.append(kv_transfer.NcclOptions(direct_on_cpu=True, direct_min_run_bytes=0))
    if "nixl-packed" in params:
        forced.append(kv_transfer.NixlOptions(pack_on_cpu=True, descriptors_per_piece=0))
    monkeypatch.setattr(sys.modules[__name__], "FORCED", tuple(forced))


def _forced(kind: type):
    """This test's forced options of one transport, or its defaults."""
    return next((o for o in FORCED if isinstance(o, kind)), kind())


def info(node_id: str, **kw) -> NodeInfo:
    base = NodeInfo(node_id, "decode", "m", "float32", BS, L, H, D, "LNB2SHD", "zmq", "", 64, 100)
    return msgspec.structs.replace(base, **kw)


def make_sender(name: str, src: torch.Tensor, options: tuple = (), **kw):
    sender = kv_transfer.create_sender(backend(name), options=options or FORCED, **kw)
    sender.register_kv_cache(src)
    return sender


class Receiver:
    """A receiver with its own cache and lease table, as a decode node holds them."""

    def __init__(
        self,
        name: str,
        cluster_token: str = "",
        clock=time.time,
        options: tuple = (),
        block_major: bool = True,
    ) -> None:
        self.dst = kv_cache(fill=False, block_major=block_major)
        self.table = ReservationTable(L, clock=clock)
        self.commits: list[KVCommit] = []
        self.receiver = kv_transfer.create_receiver(
            backend(name), cluster_token=cluster_token, options=options or FORCED
        )
        self.receiver.register_kv_cache(self.dst)
        self.address = self.receiver.start(info("decode-0"), self.table, self.commits.append)

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture(params=BACKENDS)
def pair(request):
    src = kv_cache(fill=True)
    receiver = Receiver(request.param)
    sender = make_sender(request.param, src)
    yield src, receiver, sender
    sender.close()
    receiver.close()


def _send(sender, address, rid, src_ids, dst_ids, first_token=1, commit=True, timeout=5.0):
    c = KVCommit(rid, first_token=first_token) if commit else None
    return sender.send(address, info("prefill-0"), rid, src_ids, dst_ids, c, timeout)


def test_blocks_land_in_reserved_slots(pair):
    src, r, sender = pair
    r.table.add("r1", [7, 2, 9], time.time() + 10)
    ack = _send(sender, r.address, "r1", [0, 5, 11], [7, 2, 9], first_token=42).result()
    assert ack.ok and [c.first_token for c in r.commits] == [42]
    for s, d in zip([0, 5, 11], [7, 2, 9]):
        assert torch.equal(r.dst[:, d], src[:, s])
    untouched = [b for b in range(NB) if b not in (7, 2, 9)]
    assert r.dst[:, untouched].abs().sum() == 0
    assert sender.bytes_sent == r.receiver.bytes_received == 3 * L * r.dst[0, 0].numel() * 4


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layouts", ["layer-major", "layer-major into block-major"])
def test_caches_laid_out_otherwise_move_too(name, layouts):
    """Caches laid out layer-major (a block is L pieces), and a layer-major sender with a
    block-major receiver (where the transport can move between the two: nixl by descriptor, zmq
    slab by slab, the staged ways by gathered tensor; nccl sends cut in place are refused),
    land runs and scattered blocks where they were reserved."""
    mixed = layouts != "layer-major"
    src = kv_cache(fill=True, block_major=False)
    r = Receiver(name, block_major=mixed)
    sender = make_sender(name, src)
    try:
        sender.handshake(r.address, info("prefill-0"), 10)  # the transport agreed: its own way
        r.table.add("r", [7, 8, 9, 2], time.time() + 10)
        future = _send(sender, r.address, "r", [3, 4, 5, 11], [7, 8, 9, 2])
        if mixed and name in ("nccl-direct",):
            with pytest.raises(KVTransferError):
                future.result()
            return
        assert future.result().ok
        for s, d in zip([3, 4, 5, 11], [7, 8, 9, 2]):
            assert torch.equal(r.dst[:, d], src[:, s])
        assert r.dst[:, [b for b in range(NB) if b not in (7, 8, 9, 2)]].abs().sum() == 0
    finally:
        sender.close()
        r.close()


def test_chunked_sends_then_commit(pair):
    src, r, sender = pair
    r.table.add("r5", [3, 4, 6, 8, 10], time.time() + 10)
    assert _send(sender, r.address, "r5", [1, 2], [3, 4], commit=False).result() is None
    assert _send(sender, r.address, "r5", [7], [6], commit=False).result() is None
    assert _send(sender, r.address, "r5", [9, 12], [8, 10], first_token=3).result().ok
    for s, d in zip([1, 2, 7, 9, 12], [3, 4, 6, 8, 10]):
        assert torch.equal(r.dst[:, d], src[:, s])


def test_a_handshake_opens_every_connection_to_its_peer():
    """The first handshake with a peer opens the sender's other connections to it at once (each
    its own handshake and set-up), so no request's first send over one pays for them."""
    r = Receiver("zmq")
    sender = make_sender("zmq", kv_cache(fill=True), connections=3)
    try:
        sender.handshake(r.address, info("prefill-0"), 10)
        lanes = sender._more[r.address]
        assert len(lanes) == 2
        deadline = time.monotonic() + 10
        while any(lane.transport != "zmq" for lane in lanes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [lane.transport for lane in lanes] == ["zmq", "zmq"]
        r.table.add("r", [1, 2], time.time() + 10)
        assert _send(sender, r.address, "r", [3, 4], [1, 2]).result().ok
        assert len(sender._more[r.address]) == 2  # no more opened
    finally:
        sender.close()
        r.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_sends_of_different_requests_spread_over_the_connections(name):
    """With ``connections``, each request's parts (a chunk, then the rest with the commit) go over
    one connection, different requests' over several where the plane lets sessions run side by
    side (NCCL and the modelled sim link take one); everything lands where it was reserved, in
    order, including a request whose first part left before the transport was agreed."""
    src = kv_cache(fill=True)
    r = Receiver(name)
    sender = make_sender(name, src, connections=4)
    try:
        r.table.add("early", [0, 1], time.time() + 30)
        first = sender.send(r.address, info("prefill-0"), "early", [0], [0], None, 5.0)  # before set-up
        assert first.result() is None  # the transport is agreed now
        rids = [f"req-{i}" for i in range(7)]
        for i, rid in enumerate(rids):
            r.table.add(rid, [2 + 2 * i, 3 + 2 * i], time.time() + 30)
        parts = [
            sender.send(r.address, info("prefill-0"), rid, [2 + 2 * i], [2 + 2 * i], None, 5.0)
            for i, rid in enumerate(rids)
        ]
        acks = [_send(sender, r.address, rid, [3 + 2 * i], [3 + 2 * i]) for i, rid in enumerate(rids)]
        acks.append(_send(sender, r.address, "early", [1], [1]))
        assert all(p.result() is None for p in parts)
        assert all(a.result().ok for a in acks)
        assert torch.equal(r.dst[:, : 2 + 2 * len(rids)], src[:, : 2 + 2 * len(rids)])
        assert sorted(c.request_id for c in r.commits) == sorted([*rids, "early"])
        used = {id(sender._peer(r.address, rid)) for rid in rids}
        assert len(used) == (1 if backend(name) in ("nccl", "sim") else 4)
        assert not sender._routed  # every request sent in parts committed
    finally:
        sender.close()
        r.close()


@pytest.mark.parametrize(
    "field, value, match",
    [("block_size", 16, r"block_size: 4 .* vs 16"), ("model_id", "other", r"model_id: 'm' .* vs 'other'")],
)
def test_handshake_refuses_mismatch_by_name(pair, field, value, match):
    _, r, sender = pair
    with pytest.raises(KVTransferError, match="refused the handshake: incompatible peers: " + match):
        sender.handshake(r.address, info("prefill-0", **{field: value}), 5)
    # The refusal is remembered: no KV ever moves to that peer.
    r.table.add("r", [1], time.time() + 10)
    with pytest.raises(KVTransferError, match="refused"):
        _send(sender, r.address, "r", [0], [1]).result()
    assert r.dst.abs().sum() == 0 and r.commits == []


@pytest.mark.parametrize("name", BACKENDS)
def test_handshake_refuses_wrong_cluster_token(name):
    r = Receiver(name, cluster_token="secret")
    sender = make_sender(name, kv_cache(fill=True), cluster_token="guess")
    try:
        with pytest.raises(KVTransferError, match="wrong cluster token"):
            sender.handshake(r.address, info("prefill-0"), 5)
    finally:
        sender.close()
        r.close()


def test_unreserved_blocks_and_expired_leases_are_refused(pair):
    _, r, sender = pair
    r.table.add("r2", [1], time.time() + 10)
    with pytest.raises(KVTransferError, match="not all reserved"):
        _send(sender, r.address, "r2", [0, 1], [1, 3]).result()  # block 3 not reserved
    r.table.add("r3", [4], time.time() - 1)  # lease already over
    with pytest.raises(KVTransferError, match="lease expired"):
        _send(sender, r.address, "r3", [0], [4]).result()
    assert r.dst.abs().sum() == 0 and r.commits == []
    assert r.table.expired() == ["r3"]


def test_a_refusal_keeps_the_connection(pair):
    """A request the peer refuses (here: nothing reserved for it) fails alone: the connection and
    its data-plane session stay up (a new NCCL communicator costs a second on GPUs), and the
    next request goes through on them."""
    src, r, sender = pair
    r.table.add("ok-1", [1, 2], time.time() + 10)
    assert _send(sender, r.address, "ok-1", [0, 1], [1, 2]).result().ok
    peer = sender._peers[r.address]
    sock, session = peer.sock, peer.session
    with pytest.raises(KVRefused):
        _send(sender, r.address, "nobody", [2, 3], [3, 4]).result()
    r.table.add("ok-2", [5, 6], time.time() + 10)
    assert _send(sender, r.address, "ok-2", [4, 5], [5, 6]).result().ok
    assert peer.sock is sock and peer.session is session
    assert torch.equal(r.dst[:, [1, 2, 5, 6]], src[:, [0, 1, 4, 5]]) and r.dst[:, [3, 4]].abs().sum() == 0
    assert [c.request_id for c in r.commits] == ["ok-1", "ok-2"]


def test_released_reservation_takes_no_writes(pair):
    _, r, sender = pair
    r.table.add("r4", [5], time.time() + 10)
    r.table.release("r4")
    with pytest.raises(KVTransferError, match="no reservation"):
        _send(sender, r.address, "r4", [0], [5]).result()
    assert r.dst.abs().sum() == 0 and r.commits == []


def test_commit_with_missing_blocks_is_refused(pair):
    _, r, sender = pair
    r.table.add("r6", [3, 4], time.time() + 10)
    with pytest.raises(KVTransferError, match="never arrived"):
        _send(sender, r.address, "r6", [1], [3]).result()
    assert r.commits == []


def test_lease_expiry_mid_transfer_is_never_committed(pair):
    src, r, sender = pair
    r.table.add("r7", [2, 3, 4], time.time() + 0.5)
    assert _send(sender, r.address, "r7", [0], [2], commit=False).result() is None
    time.sleep(0.7)  # the lease runs out between two chunks of the prompt
    assert r.table.expired() == ["r7"]
    with pytest.raises(KVTransferError, match="lease expired"):
        _send(sender, r.address, "r7", [1, 5], [3, 4]).result()
    assert r.commits == [] and r.dst[:, [3, 4]].abs().sum() == 0
    r.table.release("r7")  # what the engine thread does next; then the peer still serves
    r.table.add("r8", [3], time.time() + 10)
    assert _send(sender, r.address, "r8", [6], [3]).result().ok
    assert torch.equal(r.dst[:, 3], src[:, 6])


def test_renewed_lease_outlives_its_first_deadline(pair):
    _, r, sender = pair
    p = info("prefill-0")
    sender.handshake(r.address, p, 5)
    r.table.add("r9", [5], time.time() + 0.6)
    r.table.add("r10", [6], time.time() + 0.6)
    for _ in range(6):  # 1.2 s of renewals for r9 only
        sender.renew(r.address, p, ["r9"])
        time.sleep(0.2)
    assert r.table.expired() == ["r10"]
    assert _send(sender, r.address, "r9", [0], [5]).result().ok
    with pytest.raises(KVTransferError, match="lease expired"):
        _send(sender, r.address, "r10", [0], [6]).result()


def test_dead_address_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in kv_transfer.available_transports():
        sender = make_sender(name, kv_cache(fill=False))
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="no reply"):
            _send(sender, f"tcp://127.0.0.1:{port}", "r", [0], [0], timeout=0.5).result()
        assert time.monotonic() - start < 3
        sender.close()


def test_sends_queued_for_a_dead_peer_all_fail_by_their_own_deadline():
    """A send's deadline runs from when it was queued: a dead decode node's queue of sends (and
    the prefill node's blocks they pin) is cleared one timeout after the last one was queued, not
    after one timeout per send in turn."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = make_sender("zmq", kv_cache(fill=False), connections=1)
    try:
        start = time.monotonic()
        sends = [_send(sender, f"tcp://127.0.0.1:{port}", f"r{i}", [0], [0], timeout=1.0) for i in range(4)]
        for fut in sends:
            with pytest.raises(KVTransferError):
                fut.result(timeout=10)
            fut.released.result(timeout=10)
        assert time.monotonic() - start < 2.5  # one after the other: 4 s
        # Each fails at its own deadline: out of time in the queue behind the first, or (where it
        # was queued a little later than the first one gave up) waiting for its own reply.
        assert all(re.search("in the queue|no reply", str(fut.exception())) for fut in sends)
    finally:
        sender.close()


def test_a_lease_renewal_counts_its_timeout_from_its_start_not_its_queueing():
    send = _Job(info("p"), "r", None, [1], None, 2.0, Future(), queued_at=10.0)
    renewal = _Job(info("p"), "", None, [], None, 2.0, Future(), renew=True, queued_at=10.0)
    assert send.deadline(started=50.0) == 12.0  # expired in the queue: fails at once
    assert renewal.deadline(started=50.0) == 52.0  # sent late rather than never


# -- agreement on a transport ----------------------------------------------------------------------


def _agree(sender_names: str, receiver_names: str) -> str:
    src = kv_cache(fill=True)
    r = Receiver(receiver_names)
    sender = make_sender(sender_names, src)
    try:
        sender.handshake(r.address, info("prefill-0"), 5)
        r.table.add("a", [1, 2], time.time() + 10)
        assert _send(sender, r.address, "a", [3, 4], [1, 2]).result().ok
        assert torch.equal(r.dst[:, [1, 2]], src[:, [3, 4]])
        return sender._peers[r.address].transport
    finally:
        sender.close()
        r.close()


def test_both_sides_agree_on_the_best_common_transport():
    assert _agree("nccl,zmq", "zmq") == "zmq"
    assert _agree("zmq", "nccl,zmq") == "zmq"
    assert _agree("nccl,zmq", "nccl,zmq") == "nccl"
    if "nixl" in kv_transfer.available_transports():
        assert _agree("nixl,nccl,zmq", "nccl,zmq") == "nccl"
        assert _agree("nixl,nccl,zmq", "nixl,nccl,zmq") == "nixl"


def test_no_common_transport_is_refused_naming_both_lists():
    with pytest.raises(
        KVTransferError, match="no common KV transport: the sender offers nccl; .* accepts zmq"
    ):
        _agree("nccl", "zmq")


def test_auto_and_preference_lists():
    assert kv_transfer.resolve_transport("auto") == kv_transfer.auto_transports()[0]
    if not torch.cuda.is_available():
        assert kv_transfer.auto_transports() == ("zmq",)
    assert kv_transfer.transport_preferences("nccl, zmq") == ("nccl", "zmq")
    with pytest.raises(ValueError, match="unknown KV transport"):
        kv_transfer.transport_preferences("carrier-pigeon")


# -- the lease table's pins (one-sided transfers) and nixl's descriptors -----------------------------


def test_release_waits_for_pinned_transfers():
    table = ReservationTable(2)
    table.add("r", [1, 2], time.time() + 10)
    assert table.begin("r", [1, 2], 0, 2) == ""
    released = threading.Event()
    t = threading.Thread(target=lambda: (table.release("r"), released.set()))
    t.start()
    assert not released.wait(0.3), "release returned while a transfer into the blocks was in flight"
    table.end("r", [1, 2], 0, 2)
    assert released.wait(5)
    t.join()
    assert table.begin("r", [1], 0, 1).startswith("no reservation")


def test_commit_refuses_kv_still_in_flight():
    table = ReservationTable(1)
    table.add("r", [1], time.time() + 10)
    assert table.begin("r", [1], 0, 1) == ""
    assert "still in flight" in table.commit("r")
    table.end("r", [1], 0, 1, error="NIXL READ failed (peer gone?)")
    assert table.commit("r") == "NIXL READ failed (peer gone?)"


def test_the_last_transfer_ends_with_its_commit_under_one_hold_of_the_lock():
    """``end(..., commit=True)``: the request is committed as its last transfer is unpinned, with
    ``commit``'s checks: refused while another transfer of it is still pinned, or when the one
    that ended failed; taken once every block landed."""
    table = ReservationTable(2)
    table.add("r", [1, 2], time.time() + 10)
    assert table.begin("r", [1], 0, 2) == "" and table.begin("r", [2], 0, 2) == ""
    assert "still in flight" in table.end("r", [1], 0, 2, commit=True)
    assert table.end("r", [2], 0, 2, commit=True) == ""
    assert "already committed" in table.begin("r", [1], 0, 2)
    table.add("f", [3], time.time() + 10)
    assert table.begin("f", [3], 0, 2) == ""
    assert table.end("f", [3], 0, 2, "NIXL READ failed", commit=True) == "NIXL READ failed"
    table.add("m", [4, 5], time.time() + 10)
    assert table.begin("m", [4], 0, 2) == ""
    assert "never arrived" in table.end("m", [4], 0, 2, commit=True)
    assert table.end("m", [4], 0, 2) == ""  # without commit: "" whatever the request's state


@pytest.mark.parametrize("max_bytes", [0, 2 * 64, 3 * 64])
def test_coalesce_runs_contiguous_on_both_sides(max_bytes):
    from pdserve.kv_transfer.base import KVLayout, coalesce

    slab = 64  # bytes per (layer, block) slab; caches of 2 layers, 8 (source) and 6 (destination) blocks

    def lm(layers: int, blocks: int) -> KVLayout:
        return KVLayout(layers, blocks, slab, block_major=False)

    src, dst, lengths = coalesce([3, 4, 5, 7], [0, 1, 2, 3], 0, 2, lm(2, 8), lm(2, 6))
    # Per layer: 3,4,5 -> 0,1,2 is one run; 7 -> 3 is cut because 6 is skipped on the source side.
    assert (src // slab).tolist() == [3, 7, 11, 15] and (dst // slab).tolist() == [0, 3, 6, 9]
    assert (lengths // slab).tolist() == [3, 1, 3, 1]
    # Whole layers in order on both sides: one run across the layer boundary, cut by max_bytes.
    src, dst, lengths = coalesce(range(8), range(8), 0, 2, lm(2, 8), lm(2, 8), max_bytes)
    pieces = max_bytes // slab if max_bytes else 16
    assert lengths.sum() == 16 * slab and lengths.max() == pieces * slab
    assert (src == dst).all() and src.tolist() == list(range(0, 16 * slab, pieces * slab))
    # Descending ids never merge.
    src, dst, lengths = coalesce([5, 4], [1, 0], 0, 1, lm(2, 8), lm(2, 6))
    assert (src // slab).tolist() == [5, 4] and (dst // slab).tolist() == [1, 0] and (lengths == slab).all()
    # A layer range: only layers [1, 3) of 4, offsets from the start of each cache.
    src, dst, lengths = coalesce([2, 3], [0, 1], 1, 3, lm(4, 8), lm(4, 6))
    assert (src // slab).tolist() == [10, 18] and (dst // slab).tolist() == [6, 12]
    assert (lengths // slab).tolist() == [2, 2]


def test_block_major_caches_move_a_run_of_blocks_as_one_region():
    """Block-major (the engine's caches): a run of blocks consecutive in both caches is one region
    of every layer, a layer range one region per block; descriptors no longer grow with the layer
    count (Llama-3-8B: 32 per run layer-major)."""
    from pdserve.kv_transfer.base import KVLayout, coalesce, num_regions, run_regions

    slab = 64

    def bm(blocks: int) -> KVLayout:
        return KVLayout(4, blocks, slab, block_major=True)

    src, dst, lengths = coalesce([3, 4, 5, 7], [0, 1, 2, 3], 0, 4, bm(8), bm(6))
    assert (src // slab).tolist() == [12, 28] and (dst // slab).tolist() == [0, 12]
    assert (lengths // slab).tolist() == [12, 4]
    assert num_regions([3, 4, 5, 7], [0, 1, 2, 3], 0, 4, bm(8)) == 2
    src, dst, lengths = coalesce([3, 4], [0, 1], 1, 3, bm(8), bm(6))  # layers [1, 3): a block each
    assert (src // slab).tolist() == [13, 17] and (dst // slab).tolist() == [1, 5]
    assert (lengths // slab).tolist() == [2, 2]
    src, dst, lengths = coalesce(range(8), range(8), 0, 4, bm(8), bm(8), 5 * slab)  # cut by max_bytes
    assert (lengths // slab).tolist() == [5] * 6 + [2] and (src == dst).all()
    assert run_regions([(3, 3), (7, 1)], 0, 4, bm(8)) == [(12, 12), (28, 4)]
    assert run_regions([(3, 2)], 1, 3, bm(8)) == [(13, 2), (17, 2)]
    assert run_regions([(3, 2)], 1, 3, KVLayout(4, 8, slab, False)) == [(11, 2), (19, 2)]


@pytest.mark.parametrize("layouts", ["layer-major", "block-major", "mixed"])
def test_coalesced_regions_move_exactly_the_blocks_asked(layouts):
    """Copying ``coalesce``'s byte regions from one cache's memory into the other's moves layers
    [l0, l1) of each source block into its destination block and touches nothing else, whatever
    the two layouts (random block lists, runs and layer ranges)."""
    import random

    from pdserve.kv_transfer.base import KVLayout, coalesce, region_bytes

    rng = random.Random(0)
    L, tail = 5, (2, 2, 1, 3)

    def cache(blocks: int, block_major: bool) -> torch.Tensor:
        if block_major:
            return torch.randn(blocks, L, *tail).transpose(0, 1)
        return torch.randn(L, blocks, *tail)

    for trial in range(40):
        src_major = layouts == "block-major" or (layouts == "mixed" and trial % 2 == 0)
        dst_major = layouts == "block-major" or (layouts == "mixed" and trial % 2 == 1)
        src_kv, dst_kv = cache(12, src_major), cache(9, dst_major)
        n = rng.randint(1, 6)
        start = rng.randrange(0, 12 - n + 1)
        src_ids = list(range(start, start + n)) if trial % 3 == 0 else rng.sample(range(12), n)
        dst_ids = rng.sample(range(9), n)
        if trial % 4 == 0:
            dst_ids = sorted(dst_ids)
        l0 = rng.randrange(0, L)
        l1 = L if trial % 2 else rng.randrange(l0 + 1, L + 1)
        expect = dst_kv.clone()
        expect[l0:l1, dst_ids] = src_kv[l0:l1, src_ids]
        offsets = coalesce(src_ids, dst_ids, l0, l1, KVLayout.of(src_kv), KVLayout.of(dst_kv), 3 * 48)
        src_bytes, dst_bytes = region_bytes(src_kv), region_bytes(dst_kv)
        for s, d, length in zip(*offsets):
            dst_bytes[d : d + length] = src_bytes[s : s + length]
        assert torch.equal(dst_kv, expect), (trial, src_ids, dst_ids, l0, l1)


# -- across processes: a receiver killed, a receiver that stops answering, a sender killed -----------


def _serve(name: str, conn) -> None:
    """A receiver in its own process, driven through ``conn``."""
    torch.set_num_threads(1)
    r = Receiver(name)
    conn.send(r.address)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        op, rid, blocks, lease_s = cmd
        if op == "reserve":
            r.table.add(rid, blocks, time.time() + lease_s)
            conn.send("ok")
        elif op == "state":  # (committed ids, expired ids, sum of the reserved blocks)
            conn.send(([c.request_id for c in r.commits], r.table.expired(), float(r.dst[:, blocks].sum())))


def test_receiver_that_lost_a_connections_handshake_makes_its_sender_reconnect(pair):
    """A receiver that no longer holds a connection's handshake (a bug, or state lost to a race)
    answers the commit so (or, where the session had a lane, closes the lane with the connection's
    state); the sender fails that request and reconnects for the next, instead of sending into a
    connection that every later request would find refused. Over nccl the forgotten connection's
    process group closes too, and the sender may see that first: its send into the group fails."""
    src, r, sender = pair
    r.table.add("a", [1], time.time() + 10)
    assert _send(sender, r.address, "a", [0], [1]).result().ok
    for peer in list(r.receiver._conns):
        r.receiver._forget(peer)
    r.table.add("b", [2], time.time() + 10)
    refused = "lost the connection's handshake|lane"
    if "nccl" in r.receiver.name:
        refused += "|nccl send to KV peer .* failed"
    with pytest.raises(KVTransferError, match=refused):
        _send(sender, r.address, "b", [3], [2]).result()
    assert "b" not in [c.request_id for c in r.commits]
    r.table.add("c", [4], time.time() + 10)
    assert _send(sender, r.address, "c", [5], [4]).result().ok
    assert torch.equal(r.dst[:, 4], src[:, 5])


@pytest.mark.parametrize("final", [False, True], ids=["passing", "final"])
def test_a_set_up_refusal_stops_the_sender_only_when_final(final, monkeypatch):
    """Only a refusal that asking again cannot change (no transport in common) is remembered for
    the peer; any other (a plane's set-up failed, the connection lost its handshake) fails that
    request, and the next one sets up afresh."""
    src = kv_cache(fill=True)
    r = Receiver("zmq")
    sender = make_sender("zmq", src)
    setup = r.receiver._setup
    refusals = [KVSetupReply(ok=False, error="set-up failed", final=final)]
    monkeypatch.setattr(r.receiver, "_setup", lambda *a: refusals.pop() if refusals else setup(*a))
    try:
        r.table.add("a", [1], time.time() + 10)
        with pytest.raises(KVTransferError, match="set-up failed") as info:
            _send(sender, r.address, "a", [0], [1]).result()
        assert isinstance(info.value, KVHandshakeRefused) == final
        r.table.add("b", [2], time.time() + 10)
        if final:
            with pytest.raises(KVHandshakeRefused):
                _send(sender, r.address, "b", [3], [2]).result()
        else:
            assert _send(sender, r.address, "b", [3], [2]).result().ok
            assert torch.equal(r.dst[:, 2], src[:, 3])
    finally:
        sender.close()
        r.close()


def _send_from_child(name: str, address: str, conn) -> None:
    """A sender in its own process: ships one chunk of a request, then waits to be killed."""
    torch.set_num_threads(1)
    sender = make_sender(name, torch.ones(L, NB, 2, BS, H, D))
    _send(sender, address, "half", [0], [1], commit=False).result()
    conn.send("sent")
    time.sleep(60)


def _with_forced(forced: tuple, target, *args) -> None:
    """Run ``target`` in a spawned process under the test's forced transport options (it imported
    this module afresh, with none): a receiver there must accept what the test's sender sends."""
    global FORCED
    FORCED = forced
    target(*args)


class Remote:
    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_with_forced, args=(FORCED, target, *args, child), daemon=True)
        self.proc.start()

    def call(self, *cmd, timeout: float = 30):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), "the child process did not answer"
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)


@pytest.mark.parametrize("name", BACKENDS)
def test_receiver_killed_fails_the_transfer_in_time(name):
    """A send to a receiver killed after an earlier send (given a long timeout) went through fails at
    its own timeout; its source blocks are released (``KVSendFuture.released``) only once nothing
    can read them any more: for nixl, once the decode node's time for the READ it was offered is
    past (plus the margin for the trip), however long that earlier send's READ was given."""
    remote = Remote(_serve, name)
    assert remote.conn.poll(60)
    address = remote.conn.recv()
    src = kv_cache(fill=True)
    sender = make_sender(name, src)
    try:
        remote.call("reserve", "ok", [1, 2], 60)
        assert _send(sender, address, "ok", [0, 1], [1, 2], timeout=30.0).result().ok
        remote.call("reserve", "lost", [3, 4], 10)
        remote.kill()
        start = time.monotonic()
        fut = _send(sender, address, "lost", [2, 3], [3, 4], timeout=1.0)
        released_at: list[float] = []
        fut.released.add_done_callback(lambda _: released_at.append(time.monotonic() - start))
        with pytest.raises(KVTransferError):
            fut.result()
        failed_after = time.monotonic() - start
        assert failed_after < 1.0 + 0.5
        assert fut.released.result(timeout=10) is None
        if backend(name) == "nixl":  # the READ offered would have ended 0.9 s in, failed if late
            from pdserve.kv_transfer.nixl_sender import READ_MARGIN_S

            assert released_at[0] >= 0.9 + READ_MARGIN_S - 0.05 > failed_after
        else:  # nothing moves once the connection is closed
            assert released_at[0] < failed_after + 0.5
    finally:
        sender.close()
        remote.kill()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: the signal is delivered
    asynchronously, and a thread still running could take the message sent next."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.parametrize("name", ACROSS_PROCESSES)
def test_receiver_that_stops_answering_times_out_and_recovers(name):
    remote = Remote(_serve, name)
    assert remote.conn.poll(60)
    address = remote.conn.recv()
    src = kv_cache(fill=True)
    sender = make_sender(name, src)
    try:
        sender.handshake(address, info("prefill-0"), 10)
        remote.call("reserve", "stuck", [1, 2], 30)
        _stop(remote.proc.pid)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="no reply|not accepting"):
            _send(sender, address, "stuck", [0, 1], [1, 2], timeout=1.0).result()
        assert time.monotonic() - start < 5
        os.kill(remote.proc.pid, signal.SIGCONT)
        # The sender starts afresh: a later request goes through on a new connection.
        remote.call("reserve", "after", [5, 6], 30)
        assert _send(sender, address, "after", [3, 4], [5, 6], timeout=10).result().ok
        committed, _, total = remote.call("state", "", [5, 6], 0)
        assert "after" in committed and total == pytest.approx(float(src[:, [3, 4]].sum()), rel=1e-5)
    finally:
        sender.close()
        if remote.proc.is_alive():
            os.kill(remote.proc.pid, signal.SIGCONT)
        remote.kill()


@pytest.mark.parametrize("name", ACROSS_PROCESSES)
def test_sender_killed_mid_prompt_leaves_an_uncommitted_lease(name):
    now = [1000.0]
    r = Receiver(name, clock=lambda: now[0])  # the lease runs on a clock the test moves
    sender = None
    try:
        r.table.add("half", [1, 2], now[0] + 10)
        child = Remote(_send_from_child, name, r.address)
        assert child.conn.poll(60) and child.conn.recv() == "sent"
        # The first chunk lands (a chunk without commit resolves once it is sent, not landed).
        deadline = time.monotonic() + 10
        while r.dst[:, 1].sum() != r.dst[0, 0].numel() * L and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.dst[:, 1].sum() == r.dst[0, 0].numel() * L
        child.kill()
        now[0] += 11
        assert r.table.expired() == ["half"] and r.commits == []
        r.table.release("half")
        # The receiver still serves a new sender.
        src = kv_cache(fill=True)
        sender = make_sender(name, src)
        r.table.add("next", [1, 2], now[0] + 10)
        assert _send(sender, r.address, "next", [4, 5], [1, 2], timeout=10).result().ok
        assert torch.equal(r.dst[:, [1, 2]], src[:, [4, 5]])
    finally:
        if sender is not None:
            sender.close()
        r.close()


@pytest.mark.parametrize("name", [b for b in BACKENDS if b != "zmq"])
def test_many_chunks_in_flight_stay_in_step(name):
    """One layer per chunk: nccl posts chunk k+1's recv before landing chunk k, nixl cuts its READ
    into descriptors of a few slabs; a refused chunk in the middle fails only its request."""
    src = kv_cache(fill=True)
    region = src[0, 0].numel() * 4
    options = (
        dataclasses.replace(_forced(kv_transfer.NcclOptions), chunk_bytes=10 * region),
        dataclasses.replace(_forced(kv_transfer.NixlOptions), max_desc_bytes=3 * region),
    )
    r = Receiver(name, options=options)
    sender = make_sender(name, src, options=options)
    try:
        ids = list(range(10))
        r.table.add("a", [15 - i for i in ids], time.time() + 10)
        r.table.add("c", [0, 1], time.time() + 10)
        fa = _send(sender, r.address, "a", ids, [15 - i for i in ids])
        fb = _send(sender, r.address, "b", [0, 1], [2, 3])  # nothing reserved for b
        fc = _send(sender, r.address, "c", [12, 13], [0, 1])
        assert fa.result().ok and fc.result().ok
        with pytest.raises(KVTransferError, match="no reservation"):
            fb.result()
        assert torch.equal(r.dst[:, [15 - i for i in ids]], src[:, ids])
        assert torch.equal(r.dst[:, [0, 1]], src[:, [12, 13]]) and r.dst[:, [2, 3]].abs().sum() == 0
    finally:
        sender.close()
        r.close()


def test_nccl_moves_long_runs_in_place_and_gathers_fragments():
    """The sender's choice per send: blocks consecutive in both caches move straight out of the
    cache (no copy); fragmented ones are gathered first (one op instead of one per block)."""
    from pdserve.kv_transfer import nccl_backend as nb
    from pdserve.kv_transfer.base import block_runs

    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([4, 5, 6], [0, 2, 3]) == [(4, 0, 1), (5, 2, 2)]
    kv = kv_cache(fill=True)
    slab = kv[0, 0].numel() * 4
    plane = nb.NcclSenderPlane()
    plane.register(kv)
    assert plane.stage(kv, [1, 2, 3, 4], [5, 6, 7, 8]).tensor is not None  # CPU: always staged
    # Block-major: a run is one region of its blocks' every layer (3 slabs a block here).
    plane = nb.NcclSenderPlane(nb.NcclOptions(direct_on_cpu=True, direct_min_run_bytes=4 * slab))
    plane.register(kv)
    assert plane.stage(kv, [1, 2, 3, 4], [5, 6, 7, 8]).tensor is None  # one region of 12 slabs
    assert plane.stage(kv, [1, 2, 3, 4], [5, 7, 9, 11]).tensor is not None  # four of 3
    staged = plane.stage(kv, [1, 3], [0, 1])
    assert torch.equal(staged.tensor, kv[:, [1, 3]])
