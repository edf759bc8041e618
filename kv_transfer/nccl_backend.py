"""The NCCL KV transport: send/recv on a two-rank communicator per prefill-decode pair.

At set-up (``KVSetup`` on the control connection) the decode node answers with the port
of its ``TCPStore``; both ends build a ``torch.distributed`` process group of two ranks over a
``PrefixStore`` named by the connection's session id (prefill rank 0, decode rank 1):
``ProcessGroupNCCL`` when the KV cache is on CUDA, ``ProcessGroupGloo`` when it is on the CPU.
Everything else is one code path, so the CPU tests exercise what runs on GPUs.

The prefill node sends a ``KVSend`` header on the control connection, then the bytes it
announces with the header's sequence number as tag, in one of two ways, chosen per send by the
runs of blocks consecutive in both caches (``block_runs``):

* **direct** (regions of ``direct_min_run_bytes`` or more on average, CUDA): one header for
  every layer, then one ``send`` per region (``run_regions``: a run of blocks, every layer of
  them, in an engine's block-major cache; a (layer, run) in a layer-major one) straight out of
  the prefill node's cache into one ``recv`` straight into the decode node's reserved blocks.
  Nothing is copied. The header names the source blocks and the layout too, so both ends cut the
  same regions (caches laid out unlike break the pair), and the decode node posts all its recvs
  at once. The sends wait on the GPU for the forward's events: block-major, the last layer's;
  layer-major, each layer's own, so the first layers move while the last ones are computed. The decode node
  pins the reservation (``ReservationTable.begin``) before posting the recvs and unpins it when
  they completed or the communicator was aborted (``end``), so a reservation is never released
  while bytes may still land in its blocks.
* **staged** (fragmented blocks, or the CPU): per chunk of layers (at most ``chunk_bytes``) the
  prefill node gathers the chunk into a ``[layers, n, 2, BS, Hkv, D]`` tensor and sends it as
  one op after its header; the decode node receives it into one of two buffers in turn,
  posting chunk k+1's recv before it copies chunk k into the reserved blocks under the
  reservation table's lock (``ReservationTable.write``).

A per-pair thread on the decode node takes headers in order, on its own CUDA stream. The commit
queues behind the data on the same thread and is acked from there, so the prefill node sends it
right after posting its sends, without waiting for them: one round trip per request, during
which the bytes move. Should the ack not come, the prefill node aborts the communicator before
it gives the source blocks back, which ends any send still reading them.

Failure: a header that does not fit the reservation is still received (into the buffer, then
dropped) so the two ends stay in step, and fails the request at its commit. A recv or send
that fails or outlives its deadline aborts the pair's communicator; the sender reconnects
with a new session for its next request. A staged recv lands in the pair's buffers and reaches
the cache only by a copy made after it completed (a broken pair drops them); a direct recv lands
only in blocks pinned for its request until it completed or was aborted. Either way an aborted
or late transfer never writes into blocks that are not (or no longer) reserved for it. A header
whose blocks are not reserved (any more) is still received, into a scratch buffer, so the two
ends stay in step; the request then fails at its commit.

Known limit (CUDA): NCCL creates the communicator at the pair's first send/recv and blocks
until both ranks join; a decode node that dies between set-up and its first recv leaves that
sender thread waiting in NCCL's bootstrap rather than timing out.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import (
    STAGE_CHUNK_BYTES,
    KVLayout,
    KVTransferError,
    ReservationTable,
    Staged,
    block_runs,
    in_place,
    layer_chunks,
    num_regions,
    region_bytes,
    run_regions,
    slab_bytes,
    stage_blocks,
    valid_block_ids,
)
from pdserve.kv_transfer.messages import KVAck, KVCommit, KVSend, KVSetup, KVSetupReply, NcclAccept, NcclOffer
from pdserve.kv_transfer.options import require
from pdserve.kv_transfer.plane import (
    ControlLink,
    Outbox,
    ReceiverPlane,
    SenderPlane,
    SenderSession,
    TransportPlugin,
)
from pdserve.messages import encode
from pdserve.utils import YIELD_S, precise_sleeps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NcclOptions:
    chunk_bytes: int = STAGE_CHUNK_BYTES
    """Largest single send (as staging's chunks): chunk k+1 is sent while the decode node scatters
    chunk k, and chunk 0 while the prefill node still gathers the last layers."""
    direct_min_run_bytes: int = 4 << 20
    """Shortest mean run (bytes per layer of blocks consecutive in both caches) moved directly from
    cache to cache; shorter runs are gathered and scattered, which costs two copies but one op. On
    2xH200 (Llama-3-8B KV, 2 MiB per layer-run at 64 MiB, 8 MiB at 256 MiB) staged beat direct at
    64 MiB (27.0 vs 18.9 GB/s: an op per layer costs more than the copies) and lost at 256 MiB
    (79.2 vs 86.7)."""
    direct_on_cpu: bool = False
    """Direct recvs into the cache must end when their communicator is aborted: NCCL's abort does
    that, gloo's is not relied on, so on the CPU only staged copies move unless this is set (tests
    of the direct path)."""
    recv_timeout_s: float = 30.0
    direct_recv_timeout_s: float = 10.0
    """A direct recv still running after this long aborts the pair: it bounds how long the engine
    thread's ``ReservationTable.release`` waits for a pinned reservation."""
    connect_s: float = 30.0
    """How long the decode node's rendezvous with a new sender may take (gloo's)."""

    def __post_init__(self) -> None:
        require(
            self,
            positive=("chunk_bytes", "recv_timeout_s", "direct_recv_timeout_s", "connect_s"),
            non_negative=("direct_min_run_bytes",),
        )


OP_TIMEOUT = datetime.timedelta(hours=1)
"""The process group's own timeout: far past ours, so that its watchdog (which may end the
process) never fires first; we abort the communicator on our deadlines instead."""
POLL_S = 0.0002
SPIN_S = 0.001


def _wait(work, deadline: float, cuda: bool) -> None:
    """Wait for a send/recv until ``deadline``; raises on failure or timeout. On CUDA it spins for
    SPIN_S, yielding the GIL at every turn (``YIELD_S`` on the threads that call this, which
    ``precise_sleeps``: the engine thread on this node slows by about a fifth meanwhile), then
    polls every POLL_S: sleeping from the start would add up to a sleep's granularity to every
    short transfer."""
    if cuda:
        spin_until = time.monotonic() + SPIN_S
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("timed out")
            time.sleep(YIELD_S if now < spin_until else POLL_S)
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


def direct_allowed(kv: torch.Tensor, options: NcclOptions) -> bool:
    return kv.is_cuda or options.direct_on_cpu


def _region_views(flat: torch.Tensor, regions: list[tuple[int, int]], slab: int) -> list[torch.Tensor]:
    """Byte views of a cache (``flat``: its region as uint8) of ``run_regions``' (slab, count)s."""
    return [flat[start * slab : (start + count) * slab] for start, count in regions]


def _p2p(group, tensors: list[torch.Tensor], peer: int, tag: int, recv: bool) -> list:
    """Post a send (or recv) of each tensor, in order (NCCL runs them one after another on the
    pair's stream; runs are long, so one op each costs little)."""
    op = group.recv if recv else group.send
    return [op([t], peer, tag) for t in tensors]


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
    """Recvs in flight for one header: staged (one recv into ``buf``) or direct (one per run,
    into the cache: ``pinned`` when they land in the request's reserved blocks, else scratch)."""

    msg: KVSend
    works: list
    buf: torch.Tensor | None
    deadline: float
    direct: bool = False
    pinned: bool = False


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
        self._scratch: torch.Tensor | None = None
        self._turn = 0
        self.thread = threading.Thread(target=self._run, name="kv-nccl-pair", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        precise_sleeps()  # its waits for NCCL ops spin in YIELD_S turns (``_wait``)
        plane = self.plane
        try:
            store = dist.PrefixStore(f"pdserve-kv/{self.session}/", plane.store)
            self.group = _process_group(store, 1, plane.kv.device, plane.gloo_host, plane.options.connect_s)
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
                self._drop(pending, self.broken)
                pending = None

    def _break(self, why: str) -> None:
        self.broken = why
        self._bufs = [None, None]
        self._scratch = None
        logger.warning("KV pair %s: %s", self.session[:8], why)
        _abort(self.group)
        self.group = None

    def _post(self, msg: KVSend) -> _Posted | None:
        plane, table = self.plane, self.plane.table
        if self.broken:
            table.fail(msg.request_id, self.broken)
            return None
        if msg.src_block_ids:
            return self._post_direct(msg)
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
        return _Posted(msg, [work], buf, time.monotonic() + plane.options.recv_timeout_s)

    def _post_direct(self, msg: KVSend) -> _Posted | None:
        """Post one recv per (layer, run) into the reserved blocks, pinned; into scratch if the
        blocks are not reserved for the request (any more). A header whose runs cannot be cut as
        the sender cut them breaks the pair: the two ends could not stay in step."""
        plane, table, kv = self.plane, self.plane.table, self.plane.kv
        n = len(msg.block_ids)
        layers_ok = 0 <= msg.layer_start < msg.layer_end <= kv.shape[0]
        if not (
            direct_allowed(kv, plane.options)
            and layers_ok
            and len(msg.src_block_ids) == n
            and valid_block_ids(msg.block_ids, kv.shape[1])
            and valid_block_ids(msg.src_block_ids, 1 << 31)
            and msg.nbytes == (msg.layer_end - msg.layer_start) * n * plane.region_bytes
        ):
            self._break(f"direct KVSend of {msg.nbytes} bytes does not match its blocks and layers")
            table.fail(msg.request_id, self.broken)
            return None
        if msg.block_major != plane.layout.block_major:
            self._break("direct KVSend cut from a cache laid out unlike this node's")
            table.fail(msg.request_id, self.broken)
            return None
        runs = [(d, c) for _, d, c in block_runs(msg.src_block_ids, msg.block_ids)]
        regions = run_regions(runs, msg.layer_start, msg.layer_end, plane.layout)
        pinned = not table.begin(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end)
        if pinned:
            views = _region_views(plane.flat, regions, plane.region_bytes)
        else:  # received to stay in step with the sender, then dropped
            longest = max(count for _, count in regions) * plane.region_bytes
            if self._scratch is None or self._scratch.numel() < longest:
                self._scratch = torch.empty(longest, dtype=torch.uint8, device=kv.device)
            views = [self._scratch[: count * plane.region_bytes] for _, count in regions]
        try:
            works = _p2p(self.group, views, 0, msg.seq, recv=True)
        except Exception as e:
            self._break(f"nccl recv failed: {e}")
            if pinned:
                table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, self.broken)
            table.fail(msg.request_id, self.broken)
            return None
        deadline = time.monotonic() + plane.options.direct_recv_timeout_s
        return _Posted(msg, works, None, deadline, direct=True, pinned=pinned)

    def _drop(self, posted: _Posted | None, error: str) -> None:
        """Fail a posted header's request (its recvs were aborted with the pair) and unpin it."""
        if posted is None:
            return
        msg = posted.msg
        if posted.pinned:
            self.plane.table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, error)
        self.plane.table.fail(msg.request_id, error)

    def _land(self, posted: _Posted | None) -> None:
        """Wait for a posted header's recvs; a staged one is then copied into the reserved blocks
        if they still are, a direct one unpinned (it landed in place)."""
        if posted is None:
            return
        plane, kv, table, msg = self.plane, self.plane.kv, self.plane.table, posted.msg
        if self.broken:
            self._drop(posted, self.broken)
            return
        try:
            for work in posted.works:
                _wait(work, posted.deadline, kv.is_cuda)
        except Exception as e:
            self._break(f"nccl recv failed: {e}")  # aborts the recvs: nothing lands after this
            self._drop(posted, self.broken)
            return
        if posted.direct:
            if posted.pinned:
                table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end)
                plane.bytes_received += msg.nbytes
            else:
                table.fail(msg.request_id, f"direct KV chunk for {msg.request_id!r} arrived unreserved")
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
    messages = (KVSend,)
    handles_commit = True  # a commit must wait for the chunks queued on its pair's thread
    lane = True  # its messages are small: after set-up they take the session's lane

    def __init__(self, options: NcclOptions = NcclOptions()) -> None:
        super().__init__()
        self.options = options
        self._pairs: dict[bytes, _Pair] = {}
        self._lock = threading.Lock()

    def start(
        self,
        kv: torch.Tensor,
        table: ReservationTable,
        outbox: Outbox,
        on_commit: Callable[[KVCommit], None],
        host: str,
    ) -> None:
        self.kv, self.table, self.outbox, self.on_commit = kv, table, outbox, on_commit
        self.region_bytes = slab_bytes(kv)
        self.cache_bytes = kv.numel() * kv.element_size()
        self.layout = KVLayout.of(kv)
        self.flat = region_bytes(kv)
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
        offer = msg.offer(NcclOffer) or NcclOffer()
        if offer.device != device:
            error = f"nccl needs both KV caches on one kind of device: the sender's is on {offer.device}"
            return KVSetupReply(ok=False, error=f"{error}, this node's on {device}")
        pair = _Pair(self, peer, msg.session)
        with self._lock:
            self._pairs[peer] = pair
        return KVSetupReply(ok=True, transport="nccl", accept=NcclAccept(store=str(self.store.port)))

    def handle(self, peer: bytes, msg: KVSend | KVCommit, payload: Sequence) -> str:
        with self._lock:
            pair = self._pairs.get(peer)
        if pair is None:
            if isinstance(msg, KVCommit):
                self.outbox.put(peer, KVAck(request_id=msg.request_id, ok=False, error="no nccl session"))
            else:
                self.table.fail(msg.request_id, "KVSend on a connection without an nccl session")
            return ""
        pair.jobs.put(msg)
        return ""

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
    concurrent_sessions = False  # two communicators' kernels on one stream pair up in order

    def __init__(self, options: NcclOptions = NcclOptions()) -> None:
        self.options = options
        self.kv: torch.Tensor | None = None

    def register(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.layout = KVLayout.of(kv)
        self.flat = region_bytes(kv)
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    def offer(self) -> NcclOffer:
        return NcclOffer(device="cuda" if self.kv.is_cuda else "cpu")

    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> Staged:
        """In place when the blocks form long runs in both caches (each layer chunk's sends then
        wait on the GPU for that chunk's layer event), else gathered on the cache's device once
        everything queued so far is done."""
        regions = num_regions(block_ids, dst_block_ids, 0, kv.shape[0], self.layout)
        nbytes = kv.shape[0] * len(block_ids) * slab_bytes(kv)
        if direct_allowed(kv, self.options) and nbytes >= self.options.direct_min_run_bytes * regions:
            return in_place(kv, block_ids, layer_events, written)  # unchanged until the send is over
        return stage_blocks(kv, block_ids, written)

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> NcclSession:
        peer = link
        accept = reply.accept if isinstance(reply.accept, NcclAccept) else NcclAccept()
        host = urlsplit(peer.address).hostname or "127.0.0.1"
        left = max(deadline - time.monotonic(), 0.1)
        try:
            store = dist.TCPStore(
                host, int(accept.store), is_master=False, timeout=datetime.timedelta(seconds=left)
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

    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> Callable[[float], None]:
        """Post every send and return: the decode node's pair thread takes the commit after the
        recvs, so the commit may go out now; the returned function waits for the sends."""
        cuda = self.plane.kv.is_cuda
        with self._on_stream():
            works = self._post(request_id, staged, dst_block_ids, deadline)

        def finish(until: float) -> None:
            with self._on_stream():
                for work in works:
                    _wait(work, until, cuda)

        return finish

    @contextlib.contextmanager
    def _on_stream(self):
        """On the pair's CUDA stream (where there is one), with any failure as a KVTransferError
        that names the peer."""
        plane = self.plane
        try:
            if plane.kv.is_cuda:
                with torch.cuda.device(plane.kv.device), torch.cuda.stream(plane.stream):
                    yield
            else:
                yield
        except KVTransferError:
            raise
        except TimeoutError as e:
            raise KVTransferError(f"no reply from KV peer {self.peer.address} in time (nccl send)") from e
        except Exception as e:
            raise KVTransferError(f"nccl send to KV peer {self.peer.address} failed: {e}") from e

    def _post(self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float) -> list:
        """Post every chunk's send (each after its layers are ready); NCCL queues them in order."""
        if staged.tensor is None:
            return self._post_direct(request_id, staged, dst_block_ids, deadline)
        device = self.plane.kv.device
        tensor = staged.tensor.to(device, non_blocking=True)  # staged on the CPU before set-up: copied once
        bytes_per_layer = tensor[0].numel() * tensor.element_size()
        works = []
        for l0, l1 in layer_chunks(tensor.shape[0], bytes_per_layer, self.plane.options.chunk_bytes):
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

    def _post_direct(
        self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float
    ) -> list:
        """One header for every layer (the receiver posts all its recvs at once, so the link never
        waits for a header's trip), then one send per region (``run_regions``) straight out of the
        cache: block-major, a run of every layer each, queued behind the last layer's event on the
        GPU; layer-major, a (layer, run) each, queued behind its layer's event."""
        plane = self.plane
        kv, slab, layout = plane.kv, slab_bytes(plane.kv), plane.layout
        src = list(staged.block_ids)
        runs = [(s, c) for s, _, c in block_runs(src, dst_block_ids)]
        num_layers = kv.shape[0]
        seq = next(self._seq)
        nbytes = num_layers * len(src) * slab
        header = KVSend(
            request_id,
            seq,
            list(dst_block_ids),
            0,
            num_layers,
            nbytes,
            src_block_ids=src,
            block_major=layout.block_major,
        )
        self.peer.send([encode(header)], deadline)
        works = []
        waited = None
        chunks = [(0, num_layers)] if layout.block_major else [(i, i + 1) for i in range(num_layers)]
        for l0, l1 in chunks:
            event = staged.event(l1)
            if event is not None and event is not waited:
                torch.cuda.current_stream().wait_event(event)
                waited = event
            views = _region_views(plane.flat, run_regions(runs, l0, l1, layout), slab)
            works += _p2p(self.group, views, 1, seq, recv=False)
        return works

    def close(self) -> float:
        """Abort the communicator: nothing of it moves once that returned."""
        _abort(self.group)
        self.group = None
        return time.monotonic()


def nccl_available() -> bool:
    """NCCL where CUDA is, gloo (one code path) where it is not."""
    if not dist.is_available():
        return False
    return dist.is_nccl_available() if torch.cuda.is_available() else dist.is_gloo_available()


PLUGIN = TransportPlugin(
    name="nccl",
    options=NcclOptions,
    available=nccl_available,
    sender_plane=NcclSenderPlane,
    receiver_plane=NcclReceiverPlane,
)
