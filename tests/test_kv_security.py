"""Authentication and validation of internal APIs and KV messages, on a real cluster.

A cluster with a cluster token; the test speaks the KV wire protocol itself from a raw zmq socket
to the decode node: a handshake with a wrong token is refused and what that connection sends
afterwards is ignored; after a right handshake, frames with out-of-range block ids, another
request's blocks, an unknown request id, a truncated payload, a layer range past the model, or
garbage bytes are each refused and fail only the request they name. Internal HTTP routes answer
401 without the token. Afterwards every pool is back at its idle free count and the cluster
answers a prompt exactly as it did before the attacks (a write outside a reservation into the
prefix cache would change it).
"""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import torch
import zmq

from pdserve.cluster import LocalCluster
from pdserve.kv_transfer.messages import (
    KVAck,
    KVBlocks,
    KVCommit,
    KVHandshake,
    KVHandshakeReply,
    KVSetup,
    KVSetupReply,
)
from pdserve.messages import (
    AbortRequest,
    LandingDescriptor,
    NodeInfo,
    NodeLoad,
    ReserveRequest,
    StreamRequest,
    decode,
    encode,
)
from pdserve.sampling_params import SamplingParams
from tests import node_link

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "kv-security-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(
        cluster_token=TOKEN,
        redis_url="none",
        min_remote_prefill_tokens=0,
        extra_node_flags="--kv-transport zmq",
    ) as c:
        yield c


def _node(c: LocalCluster, role: str):
    return next(x for x in c.children if x.role.startswith(role))


def _get(url: str, kind):
    r = httpx.get(url, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return decode(r.content, kind)


def _post(url: str, msg, headers=AUTH) -> httpx.Response:
    return httpx.post(url, content=encode(msg), headers={**MSGPACK, **headers}, timeout=30)


def _wait_idle(c: LocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = {
            x.role: _get(f"{x.url}/internal/load", NodeLoad)
            for x in (_node(c, "prefill"), _node(c, "decode"))
        }
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


def _ask(c: LocalCluster) -> str:
    proxy = _node(c, "proxy").url
    body = {"model": MODEL, "prompt": "The harbor at dawn was", "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{proxy}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _alive(c: LocalCluster) -> None:
    assert all(x.proc.poll() is None for x in c.children), "a node died"


class RawPeer:
    """A KV sender written from the wire protocol, on one zmq connection to the decode node."""

    def __init__(self, info: NodeInfo) -> None:
        self.info = info
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(info.kv_address)
        itemsize = getattr(torch, info.dtype).itemsize
        self.slab = 2 * info.block_size * info.num_kv_heads * info.head_dim * itemsize

    def recv(self, kind):
        assert self.sock.poll(10_000), "the decode node stopped answering on its KV socket"
        return decode(self.sock.recv(), kind)

    def handshake(self, token: str) -> KVHandshakeReply:
        me = msgspec.structs.replace(self.info, node_id="raw-peer", role="prefill", kv_address="")
        self.sock.send(encode(KVHandshake(me, token)))
        return self.recv(KVHandshakeReply)

    def setup(self) -> KVSetupReply:
        self.sock.send(encode(KVSetup("raw", ["zmq"])))
        return self.recv(KVSetupReply)

    def blocks(self, rid: str, block_ids: list[int], layers=None, payload: bytes | None = None) -> None:
        start, end = layers or (0, self.info.num_layers)
        nbytes = max(end - start, 0) * len(block_ids) * self.slab
        payload = bytes(nbytes) if payload is None else payload
        self.sock.send_multipart([encode(KVBlocks(rid, block_ids, start, end, nbytes)), payload])

    def commit(self, rid: str) -> KVAck:
        self.sock.send(encode(KVCommit(rid, first_token=1)))
        while True:
            ack = self.recv(KVAck)
            if ack.request_id == rid:
                return ack

    def close(self) -> None:
        self.sock.close(linger=0)


def _reserve(decode_url: str, rid: str, seed: int) -> list[int]:
    prompt = [1000 + seed * 97 + i for i in range(40)]  # 3 blocks of 16, no cached prefix
    r = node_link.call(decode_url, ReserveRequest(rid, prompt, SamplingParams(max_tokens=2), 60.0), TOKEN)
    assert r.status == 200, r
    landing = r.body
    assert isinstance(landing, LandingDescriptor) and landing.block_ids
    return landing.block_ids


def test_internal_routes_need_the_cluster_token(cluster):
    reference = _ask(cluster)
    routes = [
        ("GET", "decode", "/internal/info"),
        ("GET", "decode", "/internal/load"),
        ("POST", "decode", "/internal/abort"),
        ("GET", "prefill", "/internal/load"),
    ]
    for method, role, path in routes:
        url = _node(cluster, role).url + path
        for given in (
            None,
            b"Bearer wrong",
            TOKEN.encode(),
            "Bearer ä".encode(),
            f"Bearer {TOKEN}x".encode(),
        ):
            headers = {"authorization": given} if given else {}
            r = httpx.request(method, url, content=b"\x80", headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.status_code, r.text)
            assert "cluster token" in r.json()["error"]["message"]
    for role in ("decode", "prefill"):
        assert httpx.get(f"{_node(cluster, role).url}/health", timeout=10).status_code == 200
    # The request channel: a Hello with anything but the token is refused, and a call from a
    # peer that was not welcomed is refused without being run.
    prompt = list(range(500, 540))
    calls = [
        ("decode", ReserveRequest("tok-r", prompt, SamplingParams(max_tokens=2), 60.0)),
        ("decode", StreamRequest("tok-r")),
        ("decode", AbortRequest("tok-r")),
    ]
    for role, body in calls:
        url = _node(cluster, role).url
        for given in ("", "wrong", f"{TOKEN}x", "ä"):
            with node_link.NodeLink(url, TOKEN, hello=False) as link:
                if given:
                    with pytest.raises(node_link.LinkRefused) as refused:
                        link.hello(given)
                    assert refused.value.reply.status == 401 and "cluster token" in refused.value.reply.error
                reply = link.call(body, 10)  # 428: not run, say Hello (with the right token) first
                assert reply.status == 428 and "cluster token" in reply.error, (role, given, reply)
    load = _get(f"{_node(cluster, 'decode').url}/internal/load", NodeLoad)
    assert load.waiting_for_kv == 0  # nothing was reserved
    _alive(cluster)
    assert _ask(cluster) == reference
    _wait_idle(cluster)


def test_hostile_kv_messages_are_refused_and_the_node_keeps_serving(cluster):
    reference = _ask(cluster)
    _wait_idle(cluster)
    decode_url = _node(cluster, "decode").url
    info = _get(f"{decode_url}/internal/info", NodeInfo)
    load = _get(f"{decode_url}/internal/load", NodeLoad)
    rids = [f"sec-{name}" for name in "abcdefgh"]
    reserved = {rid: _reserve(decode_url, rid, i) for i, rid in enumerate(rids)}
    a, b, c, d, e, f, g, h = rids
    try:
        # (a) wrong token: refused, and nothing that connection sends afterwards is acted on.
        intruder = RawPeer(info)
        reply = intruder.handshake("not-the-token")
        assert not reply.ok and "token" in reply.error
        assert not intruder.setup().ok
        intruder.blocks(a, reserved[a])
        ack = intruder.commit(a)
        assert not ack.ok and "handshake" in ack.error
        intruder.close()

        peer = RawPeer(info)
        assert peer.handshake(TOKEN).ok and peer.setup().ok
        ack = peer.commit(a)  # the intruder's frames for a never landed
        assert not ack.ok and "never arrived" in ack.error, ack

        # (b) authenticated but hostile frames: each refused, failing the request it names.
        peer.blocks(b, [load.total_blocks + 5])  # outside the pool
        peer.blocks(c, reserved[h][:1])  # blocks of another request
        peer.blocks(d, reserved[d], payload=bytes(peer.slab))  # truncated payload
        peer.blocks(e, reserved[e], layers=(0, info.num_layers + 1))  # past the model's layers
        peer.blocks("sec-unknown", reserved[f])  # a request id with no reservation here
        peer.sock.send_multipart([b"\x93garbage", b"\xff" * 100, b""])
        peer.sock.send(b"\xc1")
        expected = {
            b: "invalid or repeated block ids",
            c: "not all reserved",
            d: "bytes",
            e: "layer range",
        }
        for rid, why in expected.items():
            ack = peer.commit(rid)
            assert not ack.ok and why in ack.error, (rid, ack)
        ack = peer.commit("sec-unknown")
        assert not ack.ok and "no reservation" in ack.error

        # The refusals failed nothing else: f (whose blocks the unknown id named) and h (whose
        # blocks c named) were never written; a full, valid transfer into g commits.
        assert "never arrived" in peer.commit(f).error
        assert "never arrived" in peer.commit(h).error
        peer.blocks(g, reserved[g])
        assert peer.commit(g).ok
        peer.close()
    finally:
        for rid in rids:
            assert _post(f"{decode_url}/internal/abort", AbortRequest(rid)).status_code == 200
    _wait_idle(cluster)
    _alive(cluster)
    assert _ask(cluster) == reference  # the prefix cache and the KV path are intact
    _wait_idle(cluster)
