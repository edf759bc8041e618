"""The NCCL KV transport: send/recv on a two-rank communicator per prefill-decode pair.

At set-up (``KVSetup`` on the zmq control connection) the decode node answers with the port
of its ``TCPStore``; both ends build a ``torch.distributed`` process group of two ranks over a
``PrefixStore`` named by the connection's session id (prefill rank 0, decode rank 1):
``ProcessGroupNCCL`` when the KV cache is on CUDA, ``ProcessGroupGloo`` when it is on the CPU.
Everything else is one code path, so the CPU tests exercise what runs on GPUs.

Per chunk of layers (at most ``CHUNK_BYTES``): the prefill node sends a ``KVSend`` header on
the control connection, then ``send``s the staged ``[layers, n, 2, BS, Hkv, D]`` tensor (bytes)
with the header's sequence number as tag. A per-pair thread on the decode node takes headers
in order and ``recv``s them into two buffers in turn, posting chunk k+1's recv before it copies
chunk k into the reserved blocks under the reservation table's lock (``ReservationTable.write``),
on its own CUDA stream. On the prefill side chunk k is sent as soon as its layers are gathered.
The commit queues behind the chunks on the same thread and is acked from there.

Failure: a header that does not fit the reservation is still received (into the buffer, then
dropped) so the two ends stay in step, and fails the request at its commit. A recv or send
that fails or outlives its deadline aborts the pair's communicator; the sender reconnects
with a new session for its next request. Because a recv lands in the pair's buffers and
reaches the cache only by a copy made after it completed (a broken pair drops them), an
aborted or late transfer never writes into the cache, and released reservations take no copies.

Known limit (CUDA): NCCL creates the communicator at the pair's first send/recv and blocks
until both ranks join; a decode node that dies between set-up and its first recv leaves that
sender thread waiting in NCCL's bootstrap rather than timing out.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from kv_transfer.base import (
    STAGE_CHUNK_BYTES,
    KVTransferError,
    ReceiverPlane,
    ReservationTable,
    SenderPlane,
    SenderSession,
    Staged,
    layer_chunks,
    stage_blocks,
)
from kv_transfer.wire import KVSend, KVSetup, KVSetupReply
from kv_transfer.zmq_backend import valid_block_ids
from pdserve.messages import KVAck, KVCommit, encode

logger = logging.getLogger(__name__)

CHUNK_BYTES = STAGE_CHUNK_BYTES
"""Largest single send (as staging's chunks): chunk k+1 is sent while the decode node scatters
chunk k, and chunk 0 while the prefill node still gathers the last layers."""
RECV_TIMEOUT_S = 30.0
OP_TIMEOUT = datetime.timedelta(hours=1)
"""The process group's own timeout: far past ours, so that its watchdog (which may end the
process) never fires first; we abort the communicator on our deadlines instead."""
POLL_S = 0.0002


def _wait(work, deadline: float, cuda: bool) -> None:
    """Wait for a send/recv until ``deadline``; raises on failure or timeout."""
    if cuda:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("timed out")
            time.sleep(POLL_S)
        work.wait()  # the current stream waits for NCCL's; raises if the op failed
        return
    left = deadline - time.monotonic()
    if left <= 0 and not work.is_completed():
        raise TimeoutError("timed out")
    try:
        work.wait(datetime.timedelta(seconds=max(left, 0.001)))
    except RuntimeError as e:
        if time.monotonic() >= deadline - 0.01 and "Timed out" in str(e):
            raise TimeoutError("timed out") from e
        raise


def _local_address_toward(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _process_group(store, rank: int, device: torch.device, hostname: str, connect_s: float):
    """A two-rank group on ``store``: NCCL for CUDA tensors, gloo (bound to ``hostname``) for CPU ones."""
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = OP_TIMEOUT
        options.is_high_priority_stream = True
        return ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = datetime.timedelta(seconds=max(connect_s, 1.0))  # bounds the rendezvous
    group = dist.ProcessGroupGloo(store, rank, 2, options)
    group.set_timeout(OP_TIMEOUT)
    return group


def _abort(group) -> None:
    if group is not None:
        try:
            group.abort()
        except Exception as e:
            logger.warning("aborting a KV communicator failed: %s", e)


# -- decode side ---------------------------------------------------------------------------------


@dataclass
class _Posted:
    """A recv in flight: its header, work, buffer and deadline."""

    msg: KVSend
    work: object
    buf: torch.Tensor
    deadline: float


class _Pair:
    """One sender's communicator on the decode node, with the thread that receives on it.

    Two receive buffers take turns: the recv of chunk k+1 is posted before chunk k is copied
    into the cache, so the copy overlaps the transfer. A failed recv breaks the pair (its
    communicator is aborted and its buffers dropped) and fails every request it touched.
    """

    def __init__(self, plane: NcclReceiverPlane, peer: bytes, session: str) -> None:
        self.plane = plane
        self.peer = peer
        self.session = session
        self.jobs: queue.Queue = queue.Queue()
        self.group = None
        self.broken = ""
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.thread = threading.Thread(target=self._run, name="kv-nccl-pair", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        plane = self.plane
        try:
            store = dist.PrefixStore(f"pdserve-kv/{self.session}/", plane.store)
            self.group = _process_group(store, 1, plane.kv.device, plane.gloo_host, plane.connect_s)
        except Exception as e:
            self.broken = f"nccl rendezvous with the sender failed: {e}"
            logger.warning("%s", self.broken)
        if plane.kv.is_cuda:
            stream = torch.cuda.Stream(plane.kv.device)
            with torch.cuda.device(plane.kv.device), torch.cuda.stream(stream):
                self._serve()
        else:
            self._serve()
        _abort(self.group)

    def _serve(self) -> None:
        pending: _Posted | None = None  # received (or receiving) and not yet in the cache
        while True:
            try:
                try:
                    msg = self.jobs.get_nowait() if pending is not None else self.jobs.get()
                except queue.Empty:  # nothing queued behind it: land the last chunk now
                    posted, pending = pending, None
                    self._land(posted)
                    continue
                if msg is None:
                    posted, pending = pending, None
                    self._land(posted)
                    return
                if isinstance(msg, KVSend):
                    posted = self._post(msg)
                    landing, pending = pending, posted
                    self._land(landing)
                else:
                    landing, pending = pending, None
                    self._land(landing)
                    self._commit(msg)
            except Exception as e:  # nothing a peer sends may stop this thread: break the pair
                logger.exception("KV pair %s: unexpected error", self.session[:8])
                self._break(f"KV pair failed: {e}")
                if pending is not None:
                    self.plane.table.fail(pending.msg.request_id, self.broken)
                    pending = None

    def _break(self, why: str) -> None:
        self.broken = why
        self._bufs = [None, None]
        logger.warning("KV pair %s: %s", self.session[:8], why)
        _abort(self.group)
        self.group = None

    def _post(self, msg: KVSend) -> _Posted | None:
        plane, table = self.plane, self.plane.table
        if self.broken:
            table.fail(msg.request_id, self.broken)
            return None
        if not 0 < msg.nbytes <= plane.cache_bytes:
            self._break(f"KVSend of {msg.nbytes} bytes cannot be received")
            table.fail(msg.request_id, self.broken)
            return None
        buf = self._bufs[self._turn]
        if buf is None or buf.numel() < msg.nbytes:
            buf = self._bufs[self._turn] = torch.empty(msg.nbytes, dtype=torch.uint8, device=plane.kv.device)
        self._turn ^= 1
        buf = buf[: msg.nbytes]
        try:
            work = self.group.recv([buf], 0, msg.seq)
        except Exception as e:
            self._break(f"nccl recv failed: {e}")
            table.fail(msg.request_id, self.broken)
            return None
        return _Posted(msg, work, buf, time.monotonic() + RECV_TIMEOUT_S)

    def _land(self, posted: _Posted | None) -> None:
        """Wait for a posted recv, then copy it into the reserved blocks if they still are."""
        if posted is None:
            return
        plane, kv, table, msg = self.plane, self.plane.kv, self.plane.table, posted.msg
        if self.broken:
            table.fail(msg.request_id, self.broken)
            return
        try:
            _wait(posted.work, posted.deadline, kv.is_cuda)
        except Exception as e:
            self._break(f"nccl recv failed: {e}")
            table.fail(msg.request_id, self.broken)
            return
        num_layers, n = msg.layer_end - msg.layer_start, len(msg.block_ids)
        fits = 0 <= msg.layer_start < msg.layer_end <= kv.shape[0] and valid_block_ids(
            msg.block_ids, kv.shape[1]
        )
        if not fits or msg.nbytes != num_layers * n * plane.region_bytes:
            # Received to stay in step with the sender, then dropped.
            table.fail(msg.request_id, f"KVSend of {msg.nbytes} bytes does not match its blocks and layers")
            return
        src = posted.buf.view(kv.dtype).view(num_layers, n, *kv.shape[2:])

        def copy() -> None:
            ids = torch.tensor(msg.block_ids, dtype=torch.long, device=kv.device)
            kv[msg.layer_start : msg.layer_end].index_copy_(1, ids, src)
            if kv.is_cuda:
                torch.cuda.current_stream().synchronize()  # landed before the commit can run on it

        error = table.write(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, copy)
        if error:
            logger.warning("KV chunk for %s refused: %s", msg.request_id, error)
        else:
            plane.bytes_received += msg.nbytes

    def _commit(self, msg: KVCommit) -> None:
        error = self.plane.table.commit(msg.request_id)
        if not error:
            self.plane.on_commit(msg)
        self.plane.outbox.put(self.peer, KVAck(request_id=msg.request_id, ok=not error, error=error))

    def close(self) -> None:
        self.jobs.put(None)


class NcclReceiverPlane(ReceiverPlane):
    name = "nccl"
    handles_commit = True  # a commit must wait for the chunks queued on its pair's thread

    def __init__(self, connect_s: float = 30.0) -> None:
        super().__init__()
        self.connect_s = connect_s
        self._pairs: dict[bytes, _Pair] = {}
        self._lock = threading.Lock()

    def start(self, kv: torch.Tensor, table: ReservationTable, outbox, on_commit, host: str) -> None:
        self.kv, self.table, self.outbox, self.on_commit = kv, table, outbox, on_commit
        self.region_bytes = kv[0, 0].numel() * kv.element_size()
        self.cache_bytes = kv.numel() * kv.element_size()
        self.gloo_host = host if host not in ("0.0.0.0", "") else socket.gethostbyname(socket.gethostname())
        # One store for every pair on this node; each pair works under its own prefix. It listens
        # on a socket bound here to the KV interface only (TCPStore alone binds every interface).
        host = host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family, backlog=128)
        port = listener.getsockname()[1]
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=listener.detach(),  # the store owns the socket from here
        )

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        device = "cuda" if self.kv.is_cuda else "cpu"
        if msg.nccl_device != device:
            error = f"nccl needs both KV caches on one kind of device: the sender's is on {msg.nccl_device}"
            return KVSetupReply(ok=False, error=f"{error}, this node's on {device}")
        pair = _Pair(self, peer, msg.session)
        with self._lock:
            self._pairs[peer] = pair
        return KVSetupReply(ok=True, transport="nccl", nccl_store=str(self.store.port))

    def handle(self, peer: bytes, msg) -> None:
        with self._lock:
            pair = self._pairs.get(peer)
        if pair is None:
            if isinstance(msg, KVCommit):
                self.outbox.put(peer, KVAck(request_id=msg.request_id, ok=False, error="no nccl session"))
            else:
                self.table.fail(msg.request_id, "KVSend on a connection without an nccl session")
            return
        pair.jobs.put(msg)

    def drop(self, peer: bytes) -> None:
        with self._lock:
            pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()
        for pair in pairs:
            pair.thread.join(timeout=5)


# -- prefill side --------------------------------------------------------------------------------


class NcclSenderPlane(SenderPlane):
    name = "nccl"

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None

    def register(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    def setup_fields(self) -> dict:
        return {"nccl_device": "cuda" if self.kv.is_cuda else "cpu"}

    def stage(self, kv: torch.Tensor, block_ids: Sequence[int]) -> Staged:
        return stage_blocks(kv, block_ids)  # on the cache's device; the caller may free the blocks

    def connect(self, peer, setup: KVSetup, reply: KVSetupReply, deadline: float) -> NcclSession:
        host = urlsplit(peer.address).hostname or "127.0.0.1"
        left = max(deadline - time.monotonic(), 0.1)
        try:
            store = dist.TCPStore(
                host, int(reply.nccl_store), is_master=False, timeout=datetime.timedelta(seconds=left)
            )
            prefixed = dist.PrefixStore(f"pdserve-kv/{setup.session}/", store)
            group = _process_group(prefixed, 0, self.kv.device, _local_address_toward(host), left)
        except Exception as e:
            raise KVTransferError(f"nccl rendezvous with KV peer {peer.address} failed: {e}") from e
        return NcclSession(self, peer, group)


class NcclSession(SenderSession):
    def __init__(self, plane: NcclSenderPlane, peer, group) -> None:
        self.plane = plane
        self.peer = peer
        self.group = group
        self._seq = itertools.count(1)

    def deliver(self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float) -> None:
        plane = self.plane
        cuda = plane.kv.is_cuda
        try:
            if cuda:
                with torch.cuda.device(plane.kv.device), torch.cuda.stream(plane.stream):
                    works = self._post(request_id, staged, dst_block_ids, deadline)
                    for work in works:
                        _wait(work, deadline, cuda)
            else:
                works = self._post(request_id, staged, dst_block_ids, deadline)
                for work in works:
                    _wait(work, deadline, cuda)
        except KVTransferError:
            raise
        except Exception as e:
            if isinstance(e, TimeoutError):
                raise KVTransferError(f"no reply from KV peer {self.peer.address} in time (nccl send)") from e
            raise KVTransferError(f"nccl send to KV peer {self.peer.address} failed: {e}") from e

    def _post(self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float) -> list:
        """Post every chunk's send (each after its layers are staged); NCCL queues them in order."""
        device = self.plane.kv.device
        tensor = staged.tensor.to(device, non_blocking=True)  # staged on the CPU before set-up: copied once
        bytes_per_layer = tensor[0].numel() * tensor.element_size()
        works = []
        for l0, l1 in layer_chunks(tensor.shape[0], bytes_per_layer, CHUNK_BYTES):
            event = staged.event(l1)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            part = tensor[l0:l1].reshape(-1).view(torch.uint8)
            seq = next(self._seq)
            self.peer.send(
                [encode(KVSend(request_id, seq, list(dst_block_ids), l0, l1, part.numel()))], deadline
            )
            works.append(self.group.send([part], 1, seq))
        return works

    def close(self) -> None:
        _abort(self.group)
        self.group = None
