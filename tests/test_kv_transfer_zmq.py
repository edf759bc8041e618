"""The zmq KV transport over real loopback sockets: delivery, validation, leases, refusals."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import torch

from pdserve.kv_transfer import KVTransferError, ReservationTable, create_receiver, create_sender
from pdserve.kv_transfer.messages import KVCommit
from pdserve.messages import NodeInfo

L, NB, BS, H, D = 3, 12, 4, 2, 8


def info(node_id: str, **kw) -> NodeInfo:
    base = NodeInfo(node_id, "decode", "m", "float32", BS, L, H, D, "LNB2SHD", "zmq", "", 64, 100)
    return msgspec.structs.replace(base, **kw)


@pytest.fixture
def pair():
    src = torch.randn(L, NB, 2, BS, H, D)
    dst = torch.zeros(L, NB, 2, BS, H, D)
    table = ReservationTable(L)
    commits: list[KVCommit] = []
    receiver = create_receiver("zmq")
    receiver.register_kv_cache(dst)
    address = receiver.start(info("decode-0"), table, commits.append)
    sender = create_sender("zmq")
    sender.register_kv_cache(src)
    yield src, dst, table, commits, sender, address
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
