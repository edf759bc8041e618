"""The NIXL KV transport: the decode node READs the blocks straight out of the prefill node's KV cache.

Both nodes register their whole KV cache with NIXL's UCX backend once (VRAM on a GPU, DRAM on the
CPU) and exchange its base address, shape and layout at set-up (``KVSetup``/``KVSetupReply``). A
cache ``[L, NB, 2, BS, Hkv, D]`` is one region of contiguous (layer, block) slabs
``[2, BS, Hkv, D]`` (``KVLayout``); an engine's is block-major, so a block's every layer is one
piece and a run of blocks consecutive in both caches one descriptor (``coalesce``), however many
layers the model has: a send is one READ of as many descriptors as its runs. Nothing is copied on
either side. (Layer-major caches, a block in ``L`` pieces, move too: a descriptor per layer and
run.) Per descriptor, UCX's CUDA IPC READ costs ~7 us on an H200 (``raw_nixl_read_layers`` in
the kv_transfer benchmark: 32 descriptors against one), which a one-block send of Llama-3-8B paid
32 times while the cache was layer-major.

**Packed sends.** Once a cache has turned over, a request's blocks are scattered and a READ in
place needs a descriptor per block (per (layer, block) in a layer-major cache: 64 KiB each for
Llama-3-8B, 7-10 GB/s on one H100). When in place would take more than ``descriptors_per_piece``
descriptors per staging slot, the prefill
node gathers the blocks piece by piece into slots of its registered staging pool
(``kv_transfer.staging``), the decode node READs each slot in one descriptor into a slot of its
own and scatters it into the reserved blocks, still pinned: 5-9x faster there. Both pools are
registered with NIXL next to the caches, and the staging region's address travels in KVSetup.

**Layer chunks while the forward runs, out of a layer-major cache on another GPU.** With
per-layer events (a prefill step's), a send out of a layer-major cache is offered in layer chunks,
each READ as soon as its layers are written, so the bytes move while the forward goes on. Out of
a block-major cache, a layer chunk of a block is its own piece (a descriptor per block and chunk
rather than per run), so a send waits for its step's forward and is one READ (as vLLM's NIXL
connector, whose cross-layer layout made the same trade: vllm-project/vllm#30207); a long prompt
prefilled in several steps still moves step by step. Nor when both caches are on one GPU (their UUIDs match at
set-up, ``NixlAccept.gpu``): a READ is then a copy the decode process queues on the GPU the
forward runs on, and the GPU time-slices between the two processes' contexts. READs during the
forward slowed it: P/D on one H200 with 8,000-token prompts, the prefill node's first token came
8 ms later than a co-located node's (32 one-layer READs), 1 ms at 2,048 tokens (8 READs). There
the send waits for its whole forward and is one READ.

**READ by the decode node, not WRITE by the prefill node.** The decode node owns the
destination blocks and their lease. It starts each READ only after pinning the reservation
(``ReservationTable.begin``), and ``release`` waits for the READs it started (each bounded by
a deadline, then cancelled), so no byte lands in blocks after they were freed. With WRITE the
decode node could not stop a prefill node whose lease ran out mid-transfer short of
deregistering its whole cache: late bytes would land in blocks already given to another
request.

**The source blocks stay put until the READ is over.** ``send``'s future resolves only after the
decode node acked the commit, which it does only once every READ of the request ended (or, for a
send without a commit, once it reported each READ over), and the prefill node keeps the blocks
until then. Each READ is given the send's time left less a margin (``READ_MARGIN_S``); one still
running then is cancelled, and one found done only after it fails its request, so a READ that
could have read blocks given back never counts. If the sender gives up first (its deadline, a
dead peer), the send fails at once, but its blocks (``KVSendFuture.released``) and staging slots
are given back only once each READ it offered and did not hear the end of is past the time the
decode node was given for it, plus the margin (``NixlSession.close``).

Per send (control messages in ``kv_transfer/messages.py`` on the session's lane):

1. prefill: wait for the kernels that wrote the blocks (CUDA: an event recorded by ``send``);
2. prefill -> decode ``KVReady`` (request id, transfer id, source and destination block ids,
   the READ's time to run), one per layer chunk as its layers are written, the last one carrying
   the ``KVCommit``, without waiting for anything (a one-chunk send is one message);
3. decode, on the receiver's control thread as each message arrives: validate, pin, start one
   READ of those layers and blocks; the control loop then polls it until done, failed or past its
   deadline (then cancelled), unpins it and sends ``KVReadDone`` (which frees a packed READ's
   staging slot on the prefill node) unless the request's commit already waits there; the commit
   waits until no READ of its request is left;
4. decode -> prefill ``KVAck`` once the lease table found every block of the reservation landed:
   one round trip a send, during which the bytes move; the ack also tells the prefill node that
   its blocks are not read any more.

Everything between the two nodes but the bytes themselves travels on the session's lane (a plain
TCP connection beside the control connection, ``kv_transfer.lane``): the decode node's control
thread reads it itself, the prefill node's peer thread wakes on the reply rather than polling for a
NIXL notification, and no ZeroMQ I/O thread stands between them. Agent metadata is exchanged
inside ``KVSetup``/``KVSetupReply`` on the authenticated control connection, whose handshake is
resent until the listener answers, rather than through NIXL's own listener (``NixlOffer``/
``NixlAccept``). Options
(``NixlOptions``): ``ucx_net_devices`` travels as NIXL's ``ucx_devices`` parameter; ``ucx_tls``
and the CUDA IPC READ switch reach UCX only through the environment (NIXL's UCX backend passes no
UCX variables on), which ``pdserve.envs.set_up_ucx`` writes once per process, before its first
agent. Agents run without NIXL's progress thread (idle, it costs ~40% of a core here): the
decode node progresses UCX while its READs run (the control loop polls them), the prefill node
every millisecond while it waits for a READ's end or an ack (transports that need the target's
help, such as TCP, and a first connection's wire-up).

**Descriptor lists prepared once.** The decode node prepares every unit of its own cache, and of
each sender's cache at set-up, as one NIXL descriptor list (``prep_xfer_dlist``, one strided row
each, ``_unit_array``: block-major, descriptor ``block`` is that block's every layer; layer-major,
descriptor ``layer * NB + block`` is that slab), and a READ of blocks of which no two are
consecutive in both caches (one block, or a cache that has turned over; block-major, of every
layer), and block-major any READ of at most ``prepared_max_blocks`` blocks, is made from those
lists by index (``make_prepped_xfer``): no list is built for it, which on CUDA IPC costs more than
a few dozen prepared descriptors. Longer runs of blocks consecutive in both caches get one
descriptor per run (per (layer, run) layer-major), built per READ (``coalesce``,
``initialize_xfer``): a prepared list fixes each descriptor's length.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from pdserve import envs
from pdserve.kv_transfer.base import (
    KVLayout,
    KVRefused,
    KVTransferError,
    ReservationTable,
    Staged,
    block_index,
    call_at,
    coalesce,
    gather_into,
    in_place,
    layer_chunks,
    num_regions,
    region_bytes,
    scatter_from,
    slab_bytes,
    valid_block_ids,
)
from pdserve.kv_transfer.messages import (
    KVAck,
    KVCommit,
    KVMessage,
    KVReadDone,
    KVReady,
    KVSetup,
    KVSetupReply,
    NixlAccept,
    NixlOffer,
)
from pdserve.kv_transfer.plane import (
    ControlLink,
    Outbox,
    ReceiverPlane,
    SenderPlane,
    SenderSession,
    TransportPlugin,
)
from pdserve.kv_transfer.staging import StagePool, StagingOptions, stage_pieces
from pdserve.messages import encode

logger = logging.getLogger(__name__)

POLL_S = 0.0001


@dataclass(frozen=True)
class NixlOptions:
    max_desc_bytes: int = 0
    """Longest descriptor of a READ (a multiple of the slab size; 0: runs are never cut). Cutting
    long runs lets UCX move pieces of one READ on several lanes where the transport has them."""
    max_read_s: float = 10.0
    """A READ still running after this long is cancelled (it takes milliseconds on any sane link);
    it bounds how long the engine thread's ``ReservationTable.release`` can wait."""
    prepared_max_blocks: int = 64
    """A READ of at most this many blocks (block-major, every layer) takes a descriptor per block
    by index from the lists prepared once even where its blocks are consecutive; longer ones one
    descriptor per run, built for the READ. The READ alone (``pdserve.benchmarks.nixl_read_setup``,
    one H200, two processes, medians): built 28.8 / 31.9 / 58.5 / 153.5 / 535.1 us against
    prepared 19.6 / 23.3 / 51.6 / 150.2 / 550.9 at 1 / 8 / 32 / 128 / 512 blocks of 2 MiB: a built
    list costs ~8 us more up to a few dozen blocks, the same at 128, and per-block descriptors
    cost more than one long one past that. (An earlier figure of ~0.4 ms more for a built list,
    taken inside whole sends, did not hold once measured alone.)"""
    descriptors_per_piece: int = 100
    """A send is packed into staging slots (gather, one READ a slot, scatter) when READ in place it
    would take more than this many descriptors for each piece it takes packed. Between two processes
    on one H100 (``docs/benchmarks/kv_transfer_same_gpu_h100.json``) a descriptor cost ~8 us of a
    READ, a packed piece ~0.8 ms of both nodes' time: in-place READs of blocks in order ran at 67
    GB/s (64 MiB) to 581 (1 GiB), packed ones at 28-55; shuffled blocks, one descriptor per 64 KiB
    slab, at 8-12 in place and 28-55 packed."""
    pack_on_cpu: bool = False
    """DRAM caches are read in place (packing costs two more copies on the CPU, and a descriptor
    little); tests set this to run the packed path on the CPU."""
    settle_spin_s: float = 75e-6
    """On a GPU, after a send's last READ started, the control thread polls it in a tight loop for
    up to this long before it goes back to its turns (each a ``YIELD_S`` sleep and the loop's own
    work, ~12-17 us later than a tight poll sees the end: ``nixl_read_setup_polls_h200.json``):
    a READ of up to ~64 MiB on one GPU ends within it, and the commit and ack go out at once. The
    GIL is held meanwhile, once per send, for no longer than this; 0 turns it off."""
    layer_chunk_bytes: int = 32 << 20
    """With per-layer events, a send is offered in READs of layer chunks of about this size, each as
    soon as its layers are written."""
    staging: StagingOptions = field(default_factory=StagingOptions)
    """The staging slots packed sends go through, on both sides."""
    ucx_net_devices: str = ""
    """UCX's network devices (NIXL's ``ucx_devices``; e.g. ``mlx5_0:1``); "" lets UCX choose."""
    ucx_tls: str = ""
    """UCX_TLS for the process's agents ("" leaves the operator's or UCX's choice)."""


NIXL_BUILDS = ("nixl_cu13", "nixl_cu12")
"""nixl's per-CUDA builds (PyPI ``nixl-cu13``, ``nixl-cu12``), tried in this order without the meta
package ``nixl``, which picks the build matching torch's CUDA but installs both (the tests install
one, see pyproject.toml)."""


def nixl_api() -> ModuleType:
    """nixl's Python API (``nixl_agent``, ``nixl_agent_config``, ...): the meta package's when it is
    installed, else that of the one build that is. Raises ImportError without either."""
    try:
        import nixl._api as api
    except ModuleNotFoundError as e:
        if e.name != "nixl":
            raise
        for build in NIXL_BUILDS:
            try:
                return importlib.import_module(f"{build}._api")
            except ModuleNotFoundError as missing:
                if missing.name != build:
                    raise
        raise ImportError(f"nixl is not installed (neither `nixl` nor one of {NIXL_BUILDS})") from e
    return api


def nixl_available() -> bool:
    try:
        nixl_api()
    except Exception:  # ImportError, or a wheel that cannot load its libraries here
        return False
    return True


def _agent(role: str, options: NixlOptions):
    import uuid

    api = nixl_api()
    # UCX reads its environment when the backend starts, just below: CUDA IPC READs on unless the
    # operator chose otherwise (``envs.UCX_CUDA_IPC_GET_ZCOPY_DEFAULT`` says why), ``ucx_tls``.
    envs.set_up_ucx(options.ucx_tls)
    config = api.nixl_agent_config(
        enable_prog_thread=False, backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = api.nixl_agent(f"pdserve-{role}-{uuid.uuid4().hex[:12]}", config)
    devices = options.ucx_net_devices
    agent.create_backend("UCX", {"ucx_devices": devices} if devices else {})
    return agent


def _on_device(t: torch.Tensor):
    """Make the tensor's CUDA context current on this thread (UCX asks the driver about pointers)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def _device_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


def gpu_uuid(t: torch.Tensor) -> str:
    """The UUID of the GPU holding ``t`` (the same GPU whatever a process's device numbering); ""
    for a CPU tensor or where torch does not say."""
    if not t.is_cuda:
        return ""
    return str(getattr(torch.cuda.get_device_properties(t.device), "uuid", "") or "")


def _unit_array(address: int, layout: KVLayout, device: int) -> np.ndarray:
    """A cache's units as one strided NIXL descriptor row (address, length, device, stride, count):
    block-major, its blocks (descriptor ``block`` is every layer of it); layer-major, its (layer,
    block) slabs (descriptor ``layer * NB + block``)."""
    count = layout.num_blocks if layout.block_major else layout.num_blocks * layout.num_layers
    unit = layout.slab * (layout.num_layers if layout.block_major else 1)
    return np.array([[address, unit, device, unit, count]], dtype=np.uint64)


def _prepared(agent, owner: str, slabs: np.ndarray, mem: str):
    """``slabs`` prepared as a NIXL descriptor list of ``owner`` (this agent: NIXL_INIT_AGENT), or
    None where NIXL cannot (READs of those slabs then build their lists each time)."""
    try:
        return agent.prep_xfer_dlist(owner, slabs, mem)
    except Exception as e:
        logger.warning("NIXL could not prepare a descriptor list of %s slabs (%s): built per READ", mem, e)
        return None


def _scattered(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> bool:
    """No block followed by its successor in both caches (so no two slabs of a layer coalesce)."""
    return all(
        s + 1 != s2 or d + 1 != d2
        for s, s2, d, d2 in zip(src_block_ids, src_block_ids[1:], dst_block_ids, dst_block_ids[1:])
    )


def _slab_indices(block_ids: Sequence[int], layer_start: int, layer_end: int, num_blocks: int):
    """Indices into a prepared slab list (``_slab_array``) of layers [layer_start, layer_end) of
    ``block_ids``, layer-major: a list for a few, else an int32 array."""
    if (layer_end - layer_start) * len(block_ids) <= 64:
        return [layer * num_blocks + b for layer in range(layer_start, layer_end) for b in block_ids]
    layers = np.arange(layer_start, layer_end, dtype=np.int64)[:, None] * num_blocks
    return (layers + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """[n, 3] NIXL descriptors (address, length, device)."""
    descs = np.empty((len(offsets), 3), dtype=np.uint64)
    descs[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    descs[:, 1] = lengths
    descs[:, 2] = device
    return descs


# -- decode side ---------------------------------------------------------------------------------


@dataclass
class _Remote:
    """A sender's registered cache and staging region."""

    agent: str  # its NIXL agent name
    address: int
    num_blocks: int
    device: int
    mem: str  # DRAM | VRAM
    layout: KVLayout | None = None
    stage_address: int = 0
    stage_bytes: int = 0  # 0: it packs nothing
    units: object = None  # its cache as a prepared descriptor list of units (``_unit_array``)


@dataclass
class _Read:
    handle: object
    peer: bytes  # the sender's control connection, where the KVReadDone goes
    msg: KVReady
    deadline: float
    nbytes: int
    cancel_logged: bool = False
    slot: int = -1  # packed: the staging slot it lands in, then scattered from
    scatter: object = None  # packed: the CUDA event after the scatter (True once done on the CPU)


class NixlReceiverPlane(ReceiverPlane):
    """Runs on the receiver's control thread (with the cache's device current): a KVReady starts
    its READ at once (``handle``), and every turn of the control loop checks the READs in flight
    (``poll``), so a READ's end is answered without a thread hand-off. While READs run, the
    control loop spins, each turn yielding the GIL for ``pdserve.utils.YIELD_S`` (a sleep made
    exact by ``precise_sleeps``: at Linux's default timer slack a turn took ~60 us longer than
    the READ needed); that is also what progresses UCX (no progress thread). A send's last READ
    is first polled in a tight loop for up to ``NixlOptions.settle_spin_s`` (``_settle``).

    A packed READ lands in a slot of this node's staging pool and is scattered from there into the
    reserved blocks (on its own CUDA stream); the reservation stays pinned until the scatter is
    done. A packed KVReady that finds no free slot waits for one, unpinned, until its timeout."""

    name = "nixl"
    messages = (KVReady,)
    handles_commit = True  # a commit waits here for the READs of its request still running
    lane = True  # its messages are small: after set-up they take the session's lane

    def __init__(self, options: NixlOptions = NixlOptions()) -> None:
        super().__init__()
        self.options = options
        self._remotes: dict[str, _Remote] = {}  # sender agent -> its cache (kept across reconnects)
        self._sessions: dict[bytes, _Remote] = {}
        self._inflight: list[_Read] = []
        self._waiting: collections.deque[tuple[bytes, KVReady, float]] = collections.deque()
        self._commits: list[tuple[bytes, KVCommit]] = []  # commits waiting for their READs to end
        self.stream: torch.cuda.Stream | None = None  # the scatters' (``start``, on a GPU)

    def start(
        self,
        kv: torch.Tensor,
        table: ReservationTable,
        outbox: Outbox,
        on_commit: Callable[[KVCommit], None],
        host: str,
    ) -> None:
        self.kv, self.table, self.outbox, self.on_commit = kv, table, outbox, on_commit
        self.num_layers, self.num_blocks = kv.shape[0], kv.shape[1]
        self.slab_bytes = slab_bytes(kv)
        self.layout = KVLayout.of(kv)
        self.gpu = gpu_uuid(kv)
        self.pool = StagePool(kv, self.options.staging)
        with _on_device(kv):
            self.agent = _agent("decode", self.options)
            self._registered = self.agent.register_memory(region_bytes(kv))  # the whole cache, once
            self._registered_pool = self.agent.register_memory(self.pool.buf)
            self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
            # Every unit (block or slab) of the cache as one prepared list, once (see the docstring).
            units = _unit_array(kv.data_ptr(), self.layout, _device_id(kv))
            self._units = _prepared(self.agent, "NIXL_INIT_AGENT", units, _mem_type(kv))

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        offer = msg.offer(NixlOffer) or NixlOffer()
        address, num_layers, num_blocks, slab, device = offer.cache
        stage_address, stage_bytes = offer.stage
        if not offer.metadata or not offer.agent or not address or num_blocks <= 0:
            return KVSetupReply(ok=False, error="the sender offered nixl without agent metadata and cache")
        if not 0 < address < 1 << 64 or not 0 <= device < 1 << 16 or offer.mem not in ("DRAM", "VRAM"):
            error = f"the sender's nixl cache is not valid memory: {offer.mem} at {address:#x} on {device}"
            return KVSetupReply(ok=False, error=error)
        if stage_bytes and not (0 < stage_address < stage_address + stage_bytes < 1 << 64):
            error = (
                f"the sender's nixl staging region is not valid memory: {stage_bytes} B at {stage_address:#x}"
            )
            return KVSetupReply(ok=False, error=error)
        if (num_layers, slab) != (self.num_layers, self.slab_bytes):
            error = (
                f"nixl KV layout mismatch: the sender's cache has {num_layers} layers of {slab}-byte "
                f"block slabs, this node's {self.num_layers} of {self.slab_bytes}"
            )
            return KVSetupReply(ok=False, error=error)
        remote = self._remotes.get(offer.agent)
        if remote is None:
            name = self.agent.add_remote_agent(offer.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            layout = KVLayout(num_layers, num_blocks, slab, offer.block_major)
            remote = _Remote(name, address, num_blocks, device, offer.mem, layout, stage_address, stage_bytes)
            self.agent.make_connection(name)  # now, rather than at the first READ
            remote.units = _prepared(self.agent, name, _unit_array(address, layout, device), offer.mem)
            self._remotes[offer.agent] = remote
        self._sessions[peer] = remote
        accept = NixlAccept(agent=self.agent.name, metadata=self.agent.get_agent_metadata(), gpu=self.gpu)
        return KVSetupReply(ok=True, transport="nixl", accept=accept)

    def handle(self, peer: bytes, msg: KVReady | KVCommit, payload: Sequence) -> str:
        if isinstance(msg, KVCommit):
            self._commits.append((peer, msg))
            self._settle_commits()
            return ""
        if msg.commit is not None:
            # The send's last READ, with its commit: the commit waits here first, so that the end of
            # this READ (or its refusal) is told by the ack alone.
            self._commits.append((peer, msg.commit))
        try:
            if msg.src_offset >= 0 and self._waiting:
                self._queue(peer, msg)  # behind the packed READs already waiting for a slot
            else:
                self._start(peer, self._sessions.get(peer), msg)
        except Exception:  # nothing a peer sends may stop the control thread
            logger.exception("KVReady for %r could not be handled", getattr(msg, "request_id", "?"))
            self.table.fail(msg.request_id, "the KVReady could not be handled")
        if msg.commit is not None:
            self._settle()
        return ""

    def _settle(self) -> None:
        """A send's last READ was just started: ack it now if it ends soon. A small one on the CPU
        ended inside ``transfer``; on a GPU, the only READ in flight is polled in a tight loop for
        up to ``settle_spin_s`` first."""
        spin = self.options.settle_spin_s
        if spin > 0 and self.stream is not None and len(self._inflight) == 1 and not self._waiting:
            read = self._inflight[0]
            if read.slot < 0:  # in place (a packed READ's scatter follows it: not worth a spin)
                check, until = self.agent.check_xfer_state, time.perf_counter() + spin
                try:
                    while check(read.handle) == "PROC" and time.perf_counter() < until:
                        pass
                except Exception:  # ``poll`` deals with a READ whose state cannot be read
                    pass
        self.poll()

    def poll(self) -> bool:
        if self._inflight:
            self._inflight = [read for read in self._inflight if not self._poll_safely(read)]
        while self._waiting:  # packed READs waiting for a slot: start what now fits, in order
            peer, msg, deadline = self._waiting[0]
            if time.monotonic() > deadline:
                self._waiting.popleft()
                self.table.fail(msg.request_id, "no staging slot came free in time")
                self._reply(peer, msg, "no staging slot came free in time")
            elif self._start(peer, self._sessions.get(peer), msg, queued=True):
                self._waiting.popleft()
            else:
                break
        if self._commits:
            self._settle_commits()
        return bool(self._inflight or self._waiting)

    def _settle_commits(self) -> None:
        """Commit (and ack) every waiting commit whose request has no READ left running or waiting
        for a slot: the sender sends its commit right behind its KVReadys, without waiting for
        them, and the ack tells it both that the KV landed and that its blocks are no longer read."""
        busy = {(r.peer, r.msg.request_id) for r in self._inflight} if self._inflight else ()
        if self._waiting:
            busy = {*busy, *((peer, msg.request_id) for peer, msg, _ in self._waiting)}
        waiting = []
        for peer, commit in self._commits:
            if (peer, commit.request_id) in busy:
                waiting.append((peer, commit))
                continue
            error = self.table.commit(commit.request_id)
            if not error:
                self.on_commit(commit)
            if self.outbox is not None:
                self.outbox.put(peer, KVAck(request_id=commit.request_id, ok=not error, error=error))
        self._commits = waiting

    def drop(self, peer: bytes) -> None:
        """Its READs in flight run on to their end or deadline; its commits still waiting for them
        are never taken (the sender gave up on them, and may give their blocks back any time)."""
        self._sessions.pop(peer, None)
        for _, commit in [c for c in self._commits if c[0] == peer]:
            self.table.fail(commit.request_id, "the sender's connection closed before its KV landed")
        self._commits = [c for c in self._commits if c[0] != peer]

    def close(self) -> None:
        """After the control thread stopped: cancel what is left, and unpin it."""
        self.outbox = None  # the control connection is gone: nobody to answer
        self._waiting.clear()
        self._commits = []
        for read in self._inflight:
            read.deadline = 0.0
        give_up = time.monotonic() + self.options.max_read_s
        with _on_device(self.kv):
            while self.poll() and time.monotonic() < give_up:
                time.sleep(POLL_S)

    # -- on the control thread ---------------------------------------------------------------------

    def _read_deadline(self, msg: KVReady) -> float:
        """When a READ (or its wait for a staging slot) is given up: the sender's timeout, bounded."""
        return time.monotonic() + min(max(msg.timeout_s, 0.0), self.options.max_read_s)

    def _queue(self, peer: bytes, msg: KVReady) -> None:
        self._waiting.append((peer, msg, self._read_deadline(msg)))

    def _packed_bytes(self, msg: KVReady) -> int:
        return (msg.layer_end - msg.layer_start) * len(msg.dst_block_ids) * self.slab_bytes

    def _poll_safely(self, read: _Read) -> bool:
        """``_poll``, and nothing may stop the control thread. A READ whose state cannot be read stays
        pinned until its deadline and then ends as failed once its cancel went through, never
        before: bytes may still be landing in the reserved blocks."""
        try:
            return self._poll(read)
        except Exception as e:
            if not read.cancel_logged:
                logger.warning("polling the NIXL READ for %s failed: %s", read.msg.request_id, e)
                read.cancel_logged = True
            if time.monotonic() < read.deadline:
                return False
            if read.scatter is None:
                try:
                    read.handle.release()
                except Exception:
                    return False
            elif read.scatter is not True and self.stream is not None:
                self.stream.synchronize()  # a scatter is still writing: wait it out
            self._end(read.peer, read.msg, read.slot, f"NIXL READ failed: {e}")
            return True

    def _refusal(self, remote: _Remote | None, msg: KVReady) -> str:
        """Why this READ must not start ("" when it may): it may only ever land in blocks reserved
        for ``msg.request_id``, from blocks inside the sender's registered cache (or staging region)."""
        if remote is None:
            return "KVReady on a connection without a nixl session"
        if not math.isfinite(msg.timeout_s):
            return f"KVReady with a timeout of {msg.timeout_s}"
        if not valid_block_ids(msg.dst_block_ids, self.num_blocks):
            return "KVReady names invalid or repeated block ids"
        if not 0 <= msg.layer_start < msg.layer_end <= self.num_layers:
            return f"KVReady names layers [{msg.layer_start}, {msg.layer_end}) of {self.num_layers}"
        if msg.src_offset >= 0:
            nbytes = self._packed_bytes(msg)
            if nbytes > self.pool.slot_bytes:
                return (
                    f"a packed KVReady of {nbytes} bytes exceeds this node's {self.pool.slot_bytes}-byte slot"
                )
            if msg.src_offset + nbytes > remote.stage_bytes:
                return f"a packed KVReady reaches past the sender's {remote.stage_bytes}-byte staging region"
        else:
            if len(msg.src_block_ids) != len(msg.dst_block_ids):
                return f"KVReady names {len(msg.src_block_ids)} source blocks for {len(msg.dst_block_ids)}"
            if not valid_block_ids(msg.src_block_ids, remote.num_blocks):
                return f"KVReady names source blocks outside the sender's cache of {remote.num_blocks}"
        return ""

    def _start(self, peer: bytes, remote: _Remote | None, msg: KVReady, queued: bool = False) -> bool:
        """Start the READ, or refuse it; False only when a packed one must wait for a slot."""
        error = self._refusal(remote, msg)
        slot = -1
        if not error and msg.src_offset >= 0:
            slot = self.pool.try_acquire()
            if slot is None:
                if not queued:
                    self._queue(peer, msg)
                return False
        if not error:
            error = self.table.begin(msg.request_id, msg.dst_block_ids, msg.layer_start, msg.layer_end)
        if error:
            if slot >= 0:
                self.pool.release(slot)
            logger.warning("refusing a NIXL READ for %r: %s", msg.request_id[:64], error)
            self.table.fail(msg.request_id, error)
            self._reply(peer, msg, error)
            return True
        try:  # pinned from here: every way out ends the pin
            kv, handle = self.kv, None
            if slot >= 0:
                nbytes = self._packed_bytes(msg)
                at = self.pool.buf.data_ptr() + self.pool.offset(slot)
                local = np.array([[at, nbytes, _device_id(kv)]], dtype=np.uint64)
                at = remote.stage_address + msg.src_offset
                source = np.array([[at, nbytes, remote.device]], dtype=np.uint64)
            elif (indices := self._unit_indices(remote, msg)) is not None:
                # One descriptor per unit, taken by index from the lists prepared once (no list built
                # for the READ): scattered blocks, or few (``_unit_indices``).
                nbytes = self._packed_bytes(msg)
                local, source = indices
                handle = self.agent.make_prepped_xfer("READ", self._units, local, remote.units, source)
            else:
                src, dst, lengths = coalesce(
                    msg.src_block_ids,
                    msg.dst_block_ids,
                    msg.layer_start,
                    msg.layer_end,
                    remote.layout,
                    self.layout,
                    self.options.max_desc_bytes,
                )
                nbytes = int(lengths.sum())
                local = _descs(kv.data_ptr(), dst, lengths, _device_id(kv))
                source = _descs(remote.address, src, lengths, remote.device)
            if handle is None:
                local = self.agent.get_xfer_descs(local, _mem_type(kv))
                source = self.agent.get_xfer_descs(source, remote.mem)
                handle = self.agent.initialize_xfer("READ", local, source, remote.agent)
            if self.agent.transfer(handle) == "ERR":
                handle.release()
                raise RuntimeError("the transfer was refused")
        except Exception as e:
            self._end(peer, msg, slot, f"NIXL READ could not start: {e}")
            return True
        self._inflight.append(_Read(handle, peer, msg, self._read_deadline(msg), nbytes, slot=slot))
        return True

    def _unit_indices(self, remote: _Remote, msg: KVReady):
        """(local, remote) indices into the prepared unit lists of a READ that is one descriptor per
        unit (whole blocks block-major, slabs layer-major): both caches laid out alike, block-major
        every layer, and its blocks scattered (no two consecutive in both caches: one descriptor per
        unit either way) or, block-major, at most ``prepared_max_blocks`` of them; None otherwise
        (``coalesce`` then builds its list)."""
        layout, l0, l1 = self.layout, msg.layer_start, msg.layer_end
        if (
            self._units is None
            or remote.units is None
            or remote.layout.block_major != layout.block_major
            or (layout.block_major and not layout.whole(l0, l1))
        ):
            return None
        few = layout.block_major and len(msg.dst_block_ids) <= self.options.prepared_max_blocks
        if not few and not _scattered(msg.src_block_ids, msg.dst_block_ids):
            return None
        if layout.block_major:
            return list(msg.dst_block_ids), list(msg.src_block_ids)
        local = _slab_indices(msg.dst_block_ids, l0, l1, self.num_blocks)
        return local, _slab_indices(msg.src_block_ids, l0, l1, remote.num_blocks)

    def _poll(self, read: _Read) -> bool:
        """Check one READ (and a packed one's scatter); True once it is over (and unpinned)."""
        if read.scatter is not None:  # packed, landed in its slot: the scatter runs
            if read.scatter is not True and not read.scatter.query():
                if time.monotonic() < read.deadline:
                    return False
                self.stream.synchronize()  # a scatter does not hang: let it finish, then unpin
            self.bytes_received += read.nbytes
            self._end(read.peer, read.msg, read.slot, "")
            return True
        state = self.agent.check_xfer_state(read.handle)
        if state == "PROC" and time.monotonic() < read.deadline:
            return False
        try:
            read.handle.release()  # cancels a READ still in progress, or raises if it cannot
        except Exception as e:
            if state == "PROC":
                if not read.cancel_logged:
                    logger.warning("cannot cancel a NIXL READ for %s yet: %s", read.msg.request_id, e)
                    read.cancel_logged = True
                return False
        error = {"DONE": "", "PROC": "NIXL READ timed out"}.get(state, "NIXL READ failed (peer gone?)")
        if not error and time.monotonic() > read.deadline:
            # The sender may have stopped waiting (its deadline follows this one closely) and
            # given the source blocks back: what landed now may be stale, so it never commits.
            error = "NIXL READ ended past its deadline"
        if not error and read.slot >= 0:
            read.scatter = self._scatter(read)
            return self._poll(read)
        if not error:
            self.bytes_received += read.nbytes
        self._end(read.peer, read.msg, read.slot, error)
        return True

    def _scatter(self, read: _Read):
        """Copy a packed READ's slot into its reserved blocks (still pinned); the CUDA event after
        the copy, or True once done on the CPU."""
        msg, kv = read.msg, self.kv
        buf = self.pool.view(read.slot, kv, msg.layer_end - msg.layer_start, len(msg.dst_block_ids))
        layers = kv[msg.layer_start : msg.layer_end]
        if self.stream is None:
            scatter_from(buf, layers, block_index(msg.dst_block_ids, kv.device))
            return True
        with torch.cuda.stream(self.stream):
            # The ids' copy to the device on this stream too: on the default one it would wait for
            # the decode engine's step.
            scatter_from(buf, layers, block_index(msg.dst_block_ids, kv.device))
            event = torch.cuda.Event()
            event.record()
        return event

    def _end(self, peer: bytes, msg: KVReady, slot: int, error: str) -> None:
        """The READ (and scatter) is over: unpin, free its slot, tell the sender (``_reply``)."""
        self.table.end(msg.request_id, msg.dst_block_ids, msg.layer_start, msg.layer_end, error)
        if slot >= 0:
            self.pool.release(slot)
        self._reply(peer, msg, error)

    def _reply(self, peer: bytes, msg: KVReady, error: str) -> None:
        """Tell the sender the READ is over: it may reuse the source blocks from now on; unless the
        request's commit already waits here: its ack then tells the sender that every READ of the
        request is over (it has offered them all), and an error reaches it through the ack."""
        if any(p == peer and c.request_id == msg.request_id for p, c in self._commits):
            return
        if self.outbox is not None:
            self.outbox.put(peer, KVReadDone(msg.request_id, msg.xfer_id, error))


# -- prefill side --------------------------------------------------------------------------------


class NixlSenderPlane(SenderPlane):
    name = "nixl"

    def __init__(self, options: NixlOptions = NixlOptions()) -> None:
        self.options = options
        self._xfer_ids = itertools.count(1)
        self._lock = threading.Lock()  # peer threads connect concurrently
        self._remotes: set[str] = set()

    def register(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.slab_bytes = slab_bytes(kv)
        self.layout = KVLayout.of(kv)
        self.gpu = gpu_uuid(kv)
        self.pool = StagePool(kv, self.options.staging)
        with _on_device(kv):
            self.agent = _agent("prefill", self.options)
            self._registered = self.agent.register_memory(region_bytes(kv))  # the whole cache, once
            self._registered_pool = self.agent.register_memory(self.pool.buf)
            self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    def offer(self) -> NixlOffer:
        kv = self.kv
        return NixlOffer(
            agent=self.agent.name,
            metadata=self.agent.get_agent_metadata(),
            cache=(kv.data_ptr(), kv.shape[0], kv.shape[1], slab_bytes(kv), _device_id(kv)),
            block_major=self.layout.block_major,
            mem=_mem_type(kv),
            stage=(self.pool.buf.data_ptr(), self.pool.buf.numel()),
        )

    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> Staged:
        # The blocks stay in the registered cache: read in place, or packed into staging slots by
        # ``deliver`` as their layers are written.
        return in_place(kv, block_ids, layer_events, written)

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> NixlSession:
        accept = reply.accept if isinstance(reply.accept, NixlAccept) else NixlAccept()
        with self._lock:
            if accept.agent not in self._remotes:
                self.agent.add_remote_agent(accept.metadata)
                self._remotes.add(accept.agent)
        return NixlSession(self, link, same_gpu=bool(self.gpu) and accept.gpu == self.gpu)

    def progress(self) -> None:
        """Progress UCX here, for transports whose READs need the target's help (TCP; not CUDA IPC,
        RDMA or CMA), and for a first connection's wire-up."""
        self.agent.get_new_notifs()


def packs(
    kv: torch.Tensor,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    pieces: int,
    options: NixlOptions = NixlOptions(),
    layout: KVLayout | None = None,
) -> bool:
    """Whether a send is packed into ``pieces`` staging slots rather than read in place: on CUDA,
    when in place it would take more than ``descriptors_per_piece`` descriptors (``num_regions``:
    one per run of blocks consecutive in both caches, per layer and run layer-major) for each
    piece. Never on the CPU (unless ``pack_on_cpu``), where a descriptor costs little beside
    copying the bytes twice more. ``layout``: the cache's (``KVLayout.of``), when known already."""
    if not (kv.is_cuda or options.pack_on_cpu):
        return False
    layout = layout or KVLayout.of(kv)
    descriptors = num_regions(src_block_ids, dst_block_ids, 0, kv.shape[0], layout)
    return descriptors > options.descriptors_per_piece * pieces


READ_MARGIN_S = 0.5
"""A KVReady gives the decode node the send's time left less this (at most a tenth of it) for its
READ: a READ still running then fails before the sender stops waiting for the ack, so a commit
that waited behind it is refused before the sender may give the source blocks back."""


def _read_timeout(left: float) -> float:
    return max(left - min(READ_MARGIN_S, left / 10), 0.0)


@dataclass(frozen=True)
class _Offered:
    """A READ offered to the decode node and not yet reported over."""

    slot: int  # the staging slot it reads (-1: in place)
    read_until: float  # time.monotonic() here when the decode node's time for it ends


class NixlSession(SenderSession):
    """Offers READs on the session's lane (the control connection where it has none). The READs
    offered and not yet reported over (``KVReadDone``) are the session's ``pending``, whatever send
    offered them: reports the control host receives while it waits for an ack come here too
    (``received``)."""

    def __init__(self, plane: NixlSenderPlane, link: ControlLink, same_gpu: bool = False) -> None:
        self.plane = plane
        self.peer = link
        self.same_gpu = same_gpu  # the peer's cache is on this cache's GPU: no READ during a forward
        self.progress = plane.progress
        self._pending: dict[int, _Offered] = {}  # xfer id -> the READ
        self._error = ""  # the first refusal among the pending READs' reports
        self._planned: tuple[Staged, list, list] | None = None  # ``quick``'s plan of the send it saw

    carries_commit = True  # inside the send's last KVReady

    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> Callable[[float], None]:
        """Offer the blocks for READs, a chunk of layers as soon as the kernels that wrote it are
        done (all layers at once without per-layer events, or when the peer's cache is on this GPU:
        ``same_gpu``), in place or packed into staging slots
        (``packs``), the last KVReady with ``commit``, and return: the decode node commits behind its
        own READs. The returned function waits until the peer reported every READ over
        (``KVReadDone``; raises KVRefused if one was refused); after the ack it returns at once."""
        src, dst, num_layers = staged.block_ids, list(dst_block_ids), self.plane.kv.shape[0]
        self._error = ""
        pieces, chunks = self._plan(staged, dst)
        if pieces:
            self._deliver_packed(request_id, staged, dst, pieces, deadline, commit)
            return self._finish
        for l0, l1 in chunks:
            staged.wait(l1)
            self._offer(
                request_id, -1, src, dst, l0, l1, deadline, commit=commit if l1 == num_layers else None
            )
        return self._finish

    def _plan(self, staged: Staged, dst: list[int]) -> tuple[list, list[tuple[int, int]]]:
        """How ``deliver`` sends: the pieces of a packed send (``packs``), else no pieces and the
        layer chunks READ in place (per-layer events: chunks follow the layers as they finish; not
        on one GPU, nor out of a block-major cache: the docstring)."""
        planned = self._planned
        if planned is not None and planned[0] is staged:  # ``quick`` planned this send already
            self._planned = None
            return planned[1], planned[2]
        plane, kv = self.plane, self.plane.kv
        num_layers, slab = kv.shape[0], plane.slab_bytes
        layer_wise = len(staged.ready) > 1 and not self.same_gpu and not plane.layout.block_major
        if kv.is_cuda or plane.options.pack_on_cpu:  # packing is considered (``packs``)
            chunk_bytes = plane.options.layer_chunk_bytes if layer_wise else 0
            pieces = stage_pieces(num_layers, len(dst), slab, plane.pool.slot_bytes, chunk_bytes)
            if packs(kv, staged.block_ids, dst, len(pieces), plane.options, plane.layout):
                return pieces, []
        if layer_wise:
            return [], layer_chunks(num_layers, len(dst) * slab, plane.options.layer_chunk_bytes)
        return [], [(0, num_layers)]

    def quick(self, staged: Staged, dst_block_ids: list[int]) -> bool:
        """Read in place in one READ whose blocks are written already: one message, no wait."""
        if self._pending or not staged.done():
            return False
        pieces, chunks = self._plan(staged, list(dst_block_ids))
        self._planned = (staged, pieces, chunks)  # ``deliver`` takes it rather than planning again
        return not pieces and len(chunks) == 1

    def _offer(
        self,
        request_id: str,
        slot: int,
        src: list[int],
        dst: list[int],
        layer_start: int,
        layer_end: int,
        deadline: float,
        src_offset: int = -1,
        commit: KVCommit | None = None,
    ) -> None:
        """Send one KVReady, with the READ's time to run (``_read_timeout``); pending until reported
        (or, with the commit, until the ack)."""
        now = time.monotonic()
        timeout = _read_timeout(max(deadline - now, 0.0))
        xfer_id = next(self.plane._xfer_ids)
        msg = KVReady(request_id, xfer_id, src, dst, layer_start, layer_end, timeout, src_offset, commit)
        self._pending[xfer_id] = _Offered(slot, now + timeout)
        self.peer.send([encode(msg)], deadline)

    def _finish(self, until: float) -> None:
        self._drain(until, "")

    def received(self, msg: KVMessage) -> None:
        if isinstance(msg, KVReadDone):
            self._done(msg)

    def acked(self) -> None:
        """The decode node answered the commit only once no READ of the request was left, and
        reports no READ that ends after the commit arrived: every pending one is over."""
        for read in self._pending.values():
            if read.slot >= 0:
                self.plane.pool.release(read.slot)
        self._pending.clear()

    def _done(self, done: KVReadDone) -> bool:
        """A READ is over: free its slot; False for a report of none pending (a transfer given up)."""
        if done.xfer_id not in self._pending:
            return False
        slot = self._pending.pop(done.xfer_id).slot
        if slot >= 0:
            self.plane.pool.release(slot)
        self._error = self._error or done.error
        return True

    def _deliver_packed(
        self,
        request_id: str,
        staged: Staged,
        dst: list[int],
        pieces: list,
        deadline: float,
        commit: KVCommit | None,
    ) -> None:
        """Per piece (``stage_pieces``): take a free slot (taking the peer's reports of earlier
        pieces while none is free), gather the piece into it once its layers are written, offer it
        for one READ, the last with ``commit``. A slot is free again once the peer reported its READ
        over. Where a refusal stops the pieces early, the commit goes alone (the peer refuses it)."""
        plane, kv = self.plane, self.plane.kv
        with _on_device(kv), _stream(plane.stream):
            idx = block_index(staged.block_ids, kv.device)
            for i, (l0, l1, b0, b1) in enumerate(pieces):
                slot = self._take_slot(deadline)
                if slot is None:  # a piece was refused: offer no more
                    break
                try:
                    staged.wait(l1)
                    gather_into(kv[l0:l1], idx[b0:b1], plane.pool.view(slot, kv, l1 - l0, b1 - b0))
                    if plane.stream is not None:
                        plane.stream.synchronize()  # gathered before the peer reads the slot
                except BaseException:
                    plane.pool.release(slot)
                    raise
                last = commit if i == len(pieces) - 1 else None
                self._offer(request_id, slot, [], dst[b0:b1], l0, l1, deadline, plane.pool.offset(slot), last)
                if last is not None:
                    return
        if commit is not None:
            self.peer.send([encode(commit)], deadline)

    def _take_slot(self, deadline: float) -> int | None:
        """A free staging slot: while none is, wait for this session's READs to end (None once one
        was refused), or, when it has none in flight, for other sends to give one back."""
        pool = self.plane.pool
        while True:
            if self._error:
                return None
            slot = pool.try_acquire()
            if slot is not None:
                return slot
            if self._pending:
                self._wait_one(deadline)
                continue
            slot = pool.acquire(min(deadline - time.monotonic(), 0.01))
            if slot is not None:
                return slot
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"no nixl staging slot came free in time for KV peer {self.peer.address}"
                )

    def _wait_one(self, deadline: float) -> None:
        """Wait until one of the pending READs is reported over."""
        while not self._done(self.peer.recv(deadline, KVReadDone, idle=self.plane.progress)):
            pass  # late reports of transfers given up

    def _drain(self, deadline: float, error: str) -> None:
        """Wait for every READ offered to be over, even after one was refused: the send ends (and
        the caller may reuse the blocks, this plane the slots) only once none can read them any
        more. Raises KVRefused with the first refusal."""
        while self._pending:
            self._wait_one(deadline)
        error = error or self._error
        self._error = ""
        if error:
            raise KVRefused(f"KV peer {self.peer.address} refused a NIXL READ: {error}")

    def close(self) -> float:
        """The connection is gone with READs not reported over: each ends on the decode node by the
        time it was given (failed, if it is still running then; never later than ``max_read_s``),
        so their blocks and slots are free only after that, plus ``READ_MARGIN_S`` for the trip of
        the KVReady. Returns at once with that time (now when nothing is pending), and gives the
        slots back then, on a timer. A decode node that is gone or stuck says nothing more, so the
        wait is never cut short."""
        now = time.monotonic()
        if not self._pending:
            return now
        read_until = max(read.read_until for read in self._pending.values())
        free_at = min(read_until, now + self.plane.options.max_read_s) + READ_MARGIN_S
        slots = [read.slot for read in self._pending.values() if read.slot >= 0]
        self._pending.clear()
        pool = self.plane.pool

        def give_back() -> None:
            for slot in slots:
                pool.release(slot)

        call_at(free_at, give_back)
        return free_at


def _stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


PLUGIN = TransportPlugin(
    name="nixl",
    options=NixlOptions,
    available=nixl_available,
    sender_plane=NixlSenderPlane,
    receiver_plane=NixlReceiverPlane,
)
