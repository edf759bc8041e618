"""The ZeroMQ KV transport: CPU-staged blocks over TCP, received in place.

Wire protocol (DEALER on the prefill node -> ROUTER on the decode node, one DEALER per
peer, multipart messages whose first frame is a msgpack ``Message``):

* ``[KVHandshake]`` -> ``[KVHandshakeReply]``: once per connection, before any KV.
* ``[KVBlocks, payload]``: layers ``[layer_start, layer_end)`` of the listed destination
  blocks, payload = raw bytes of ``[layers, blocks, 2, BS, Hkv, D]``. No reply: frames
  stream back to back, and an error is kept for the commit's ack.
* ``[KVCommit]`` -> ``[KVAck]``: the ack says whether every layer of every block
  landed inside a live reservation.

The sender copies the request's blocks out of its cache into one staging tensor
(the only copy on that side), so the caller may free them at once; frames point into
that tensor (``copy=False``). The receiver reads each frame without copying it and
copies it straight into the reserved blocks: one copy per side.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import zmq

from kv_transfer.base import KVReceiver, KVSender, KVTransferError, ReservationTable, check_compatible
from pdserve.messages import (
    KVAck,
    KVBlocks,
    KVCommit,
    KVHandshake,
    KVHandshakeReply,
    KVRenew,
    NodeInfo,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20
"""Payload frames are cut at layer boundaries to stay under this size (memory per frame)."""


def _frame_layers(num_layers: int, bytes_per_layer: int) -> list[tuple[int, int]]:
    step = max(1, MAX_FRAME_BYTES // max(bytes_per_layer, 1))
    return [(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


class ZmqReceiver(KVReceiver):
    name = "zmq"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, cluster_token: str = "") -> None:
        self.host = host
        self.port = port
        self.cluster_token = cluster_token
        self.kv: torch.Tensor | None = None
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_received = 0

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        assert kv_cache.dim() == 6 and kv_cache.is_contiguous(), "kv_cache must be [L, NB, 2, BS, Hkv, D]"
        self.kv = kv_cache

    def start(self, info: NodeInfo, table: ReservationTable, on_commit: Callable[[KVCommit], None]) -> str:
        assert self.kv is not None, "register_kv_cache first"
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
            port = self.port
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        address = f"tcp://{self.host}:{port}"
        self._thread = threading.Thread(
            target=self._serve, args=(sock, info, table, on_commit), name="kv-receiver", daemon=True
        )
        self._thread.start()
        return address

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- receiver thread -----------------------------------------------------------------------

    def _serve(self, sock, info: NodeInfo, table: ReservationTable, on_commit) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    reply = self._handle(frames[1:], info, table, on_commit)
                except Exception as e:  # a bad frame must never take the node down
                    logger.warning("dropping malformed KV message: %s", e)
                    reply = None
                if reply is not None:
                    sock.send_multipart([frames[0], encode(reply)])
        finally:
            sock.close(linger=0)

    def _handle(self, frames, info: NodeInfo, table: ReservationTable, on_commit):
        msg = decode(frames[0].buffer, KVHandshake | KVBlocks | KVCommit | KVRenew)
        if isinstance(msg, KVHandshake):
            if self.cluster_token and msg.cluster_token != self.cluster_token:
                return KVHandshakeReply(ok=False, error="wrong cluster token")
            mismatches = check_compatible(info, msg.info)
            if mismatches:
                error = "incompatible peers: " + "; ".join(mismatches)
                logger.error("refusing KV peer %s: %s", msg.info.node_id, error)
                return KVHandshakeReply(ok=False, error=error, info=info)
            return KVHandshakeReply(ok=True, info=info)
        if isinstance(msg, KVRenew):
            table.renew(msg.request_ids)
            return None
        if isinstance(msg, KVBlocks):
            self._write(msg, frames[1] if len(frames) > 1 else None, table)
            return None
        error = table.commit(msg.request_id)
        if not error:
            on_commit(msg)
        return KVAck(request_id=msg.request_id, ok=not error, error=error)

    def _write(self, msg: KVBlocks, payload, table: ReservationTable) -> None:
        kv = self.kv
        num_layers = msg.layer_end - msg.layer_start
        shape = (num_layers, len(msg.block_ids), *kv.shape[2:])
        expected = num_layers * len(msg.block_ids) * kv[0, 0].numel() * kv.element_size()
        if payload is None or len(payload.buffer) != expected or msg.nbytes != expected or num_layers <= 0:
            got = len(payload.buffer) if payload is not None else 0
            table.fail(msg.request_id, f"KV frame of {got} bytes, expected {expected}")
            return
        if (
            len(set(msg.block_ids)) != len(msg.block_ids)
            or min(msg.block_ids) < 0
            or max(msg.block_ids) >= kv.shape[1]
        ):
            table.fail(msg.request_id, "KV frame names invalid or repeated block ids")
            return

        def copy() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the frame is read-only; we only read it
                src = torch.frombuffer(payload.buffer, dtype=kv.dtype).view(shape)
            ids = torch.tensor(msg.block_ids, dtype=torch.long)
            kv[msg.layer_start : msg.layer_end].index_copy_(1, ids, src)

        error = table.write(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, copy)
        if error:
            logger.warning("KV frame for %s refused: %s", msg.request_id, error)
        else:
            self.bytes_received += expected


@dataclass
class _Job:
    info: NodeInfo
    request_id: str  # or, for a lease renewal, "" with ``renew`` set
    staged: torch.Tensor | None  # [L, n, 2, BS, Hkv, D] on the CPU, or None for a bare handshake
    dst_block_ids: list[int]
    commit: KVCommit | None  # None: more blocks follow later
    timeout: float
    future: Future
    renew: KVRenew | None = None


class _Peer:
    """One decode node: a DEALER socket owned by one thread that runs jobs in order."""

    def __init__(self, ctx: zmq.Context, address: str, cluster_token: str) -> None:
        self.ctx = ctx
        self.address = address
        self.cluster_token = cluster_token
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.sock = None
        self.peer_info: NodeInfo | None = None
        self.refused = ""  # permanent handshake refusal
        self.thread = threading.Thread(target=self._run, name=f"kv-sender {address}", daemon=True)
        self.thread.start()

    def _connect(self) -> None:
        self._close_socket()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(self.address)
        self.sock = sock
        self.peer_info = None

    def _close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self._close_socket()
                return
            try:
                job.future.set_result(self._do(job))
            except Exception as e:
                # A timeout or broken peer leaves the socket with unknown state: start afresh.
                self._close_socket()
                job.future.set_exception(e if isinstance(e, KVTransferError) else KVTransferError(str(e)))

    def _recv(self, deadline: float, kind):
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise KVTransferError(f"no reply from KV peer {self.address} in time")
            msg = decode(self.sock.recv(), kind)
            if not isinstance(msg, KVAck) or msg.request_id == self._waiting_for:
                return msg

    def _send(self, frames: list, deadline: float) -> None:
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise KVTransferError(f"KV peer {self.address} is not accepting data") from None
                time.sleep(0.001)

    def _do(self, job: _Job):
        if self.refused:
            raise KVTransferError(self.refused)
        deadline = time.monotonic() + job.timeout
        self._waiting_for = ""
        if self.sock is None:
            self._connect()
        if self.peer_info is None:
            self._send([encode(KVHandshake(info=job.info, cluster_token=self.cluster_token))], deadline)
            reply = self._recv(deadline, KVHandshakeReply)
            if not reply.ok:
                self.refused = f"KV peer {self.address} refused the handshake: {reply.error}"
                raise KVTransferError(self.refused)
            self.peer_info = reply.info
        if job.renew is not None:
            self._send([encode(job.renew)], deadline)
            return None
        staged = job.staged
        if staged is None:
            return self.peer_info
        rid = job.request_id
        if staged.shape[1]:
            bytes_per_layer = staged[0].numel() * staged.element_size()
            for start, end in _frame_layers(staged.shape[0], bytes_per_layer):
                part = staged[start:end]
                header = KVBlocks(rid, job.dst_block_ids, start, end, part.numel() * part.element_size())
                self._send([encode(header), memoryview(part.view(torch.uint8).numpy())], deadline)
        if job.commit is None:
            return None
        self._waiting_for = rid
        self._send([encode(job.commit)], deadline)
        ack = self._recv(deadline, KVAck)
        if not ack.ok:
            raise KVTransferError(f"KV peer {self.address} refused request {rid}: {ack.error}")
        return ack


class ZmqSender(KVSender):
    name = "zmq"

    def __init__(self, cluster_token: str = "") -> None:
        self.cluster_token = cluster_token
        self.kv: torch.Tensor | None = None
        self._ctx = zmq.Context.instance()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        assert kv_cache.dim() == 6 and kv_cache.is_contiguous(), "kv_cache must be [L, NB, 2, BS, Hkv, D]"
        self.kv = kv_cache

    def _peer(self, address: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = _Peer(self._ctx, address, self.cluster_token)
            return peer

    def renew(self, address: str, info: NodeInfo, request_ids: Sequence[str]) -> None:
        job = _Job(info, "", None, [], None, 5.0, Future(), renew=KVRenew(list(request_ids)))
        self._peer(address).jobs.put(job)

    def handshake(self, address: str, info: NodeInfo, timeout: float) -> NodeInfo:
        fut: Future = Future()
        self._peer(address).jobs.put(_Job(info, "", None, [], None, timeout, fut))
        return fut.result()

    def send(
        self,
        address: str,
        info: NodeInfo,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        commit: KVCommit | None,
        timeout: float,
    ) -> Future[KVAck | None]:
        assert self.kv is not None, "register_kv_cache first"
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        idx = torch.tensor(list(src_block_ids), dtype=torch.long, device=self.kv.device)
        staged = self.kv.index_select(1, idx).cpu()  # [L, n, 2, BS, Hkv, D]: the only copy
        self.bytes_sent += staged.numel() * staged.element_size()
        fut: Future = Future()
        self._peer(address).jobs.put(
            _Job(info, request_id, staged, list(dst_block_ids), commit, timeout, fut)
        )
        return fut

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.jobs.put(None)
        for peer in peers:
            peer.thread.join(timeout=5)
