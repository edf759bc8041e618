"""The zmq KV transport: the blocks travel on the session's own connections, no other library.

``[KVBlocks, payload...]``: layers ``[layer_start, layer_end)`` of the listed destination blocks.
No reply: messages stream back to back, and an error is kept for the commit's ack. A message must
name a layer range inside the model, distinct block ids, a payload whose byte length is exactly
what its header and the agreed shape imply, and blocks all reserved for its request
(``ReservationTable``).

**On the session's lane** (``kv_transfer.lane``; a decode node whose cache is in host memory
offers one): the header, then the payload as raw bytes. The sender writes them straight out of
its cache, region by region (``run_regions`` of the runs of blocks consecutive in both caches,
however short: a region costs a ``send`` call, not a message), and the decode node's control
thread reads them straight into the reserved blocks (``ZmqReceiverPlane.land``: the regions of
this cache, pinned in the table with ``begin`` until the last byte came): one copy on each side,
the kernel's, as a plain socket. Over ZeroMQ frames the receiver's I/O thread read each frame into
its own buffer and the control thread copied it again: on the 2-core box three busy threads on two
cores. Interleaved there (``docs/benchmarks/kv_transfer_zmq_lane_ab_*_cpu.json``), of a raw
loopback socket at 64 / 256 MiB: 0.91-1.04 / 0.87-0.98 over a TCP lane, 1.05-1.27 / 1.22-1.31 over
the Unix socket of a lane between nodes on one host, 0.65-0.68 / 0.81-0.90 in ZeroMQ frames.

A payload that comes in while its reservation is released (the engine thread's ``release`` waits
for the pin) is cut short: the control thread reads at most ``FILL_BYTES`` of a payload a turn and
looks at every turn (at least every ``STREAM_CHECK_MS``) whether its reservation still stands;
the rest is read and dropped, and the commit riding with it is refused. A refused payload is read
and dropped too.

**In ZeroMQ frames on the control connection** (a decode node whose cache is on a GPU, or a sender
that cannot reach the lane). Sender (the peer's thread, in ``deliver``; nothing is copied on the
engine thread). Per layer chunk of at most ``max_frame_bytes``, one message:

* **runs** (a CPU cache whose blocks form runs of ``zero_copy_min_run_bytes`` or more per layer,
  consecutive in both caches, as in a cache that has not turned over): one payload frame per
  region (``run_regions``) pointing straight into the cache (``copy=False``): no copy on this
  side at all. Out of an engine's block-major cache a frame is a run of every layer, and messages
  are cut by blocks; out of a layer-major one, a frame is a (layer, run), messages cut by layers.
  ZeroMQ's I/O thread reads the cache as it writes the socket, so each such frame is tracked, and
  a send that fails is only over (its blocks given back) once ZeroMQ let go of every frame.
* **gathered** (short runs, or a CUDA cache): the chunk's blocks gathered into one of the session's
  ``staging_buffers`` CPU buffers (``index_select``; on CUDA a gather on the device and one copy
  to the host), sent without a further copy and tracked: the gather of chunk k+1 runs while
  ZeroMQ's I/O thread sends chunk k, and a buffer is gathered into again once ZeroMQ let go of it.
  The buffers are kept, so a gather writes memory already mapped: into a fresh 16 MiB tensor the
  page faults tripled its cost here (6.7 vs 2.1 ms, slower than loopback TCP).

Receiver (the control thread): ZeroMQ reads each frame straight into its own buffer; the frame is
copied into the reserved blocks under the reservation table's lock, one ``copy_`` per region of
destination blocks consecutive in the cache (one per block where they are not), while the
I/O thread already reads the next message: one copy on this side, pipelined with the socket.
Runs everywhere; the default on a CPU-only host.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from pdserve.kv_transfer.base import (
    KVLayout,
    KVTransferError,
    ReservationTable,
    Staged,
    block_index,
    block_runs,
    consecutive,
    gather_into,
    in_place,
    layer_chunks,
    region_bytes,
    run_regions,
    side_stream,
    slab_bytes,
    valid_block_ids,
)
from pdserve.kv_transfer.messages import KVBlocks, KVCommit, KVSetup, KVSetupReply
from pdserve.kv_transfer.options import require
from pdserve.kv_transfer.plane import (
    ControlLink,
    Landing,
    Outbox,
    ReceiverPlane,
    SenderPlane,
    SenderSession,
    TransportPlugin,
)
from pdserve.messages import encode

logger = logging.getLogger(__name__)

RELEASE_WAIT_S = 5.0
"""After a failed send, how long the sender waits for ZeroMQ to let go of frames that point into
its cache (it drops them as soon as the socket is closed)."""


@dataclass(frozen=True)
class ZmqOptions:
    max_frame_bytes: int = 16 << 20
    """A message carries layer chunks of at most this many bytes (one layer at least): the unit
    the sender gathers while the previous one is on the wire, and the receiver copies while the
    next one arrives (ZeroMQ hands a message over only once all of it came). Interleaved runs on
    this 2-core machine under load: 16 MiB 0.55-0.69 of raw TCP at 64 MiB, 4 MiB 0.47-0.51 (each
    message costs both sides a wake-up and ~30-50 us of Python); 2 MiB no better."""
    staging_buffers: int = 3
    """CPU buffers a session gathers chunks into, in turn (one being gathered, the others on the
    wire); each as large as the largest chunk it took."""
    zero_copy_min_run_bytes: int = 256 << 10
    """A CPU cache's blocks are sent in place, one frame per (layer, run), when their runs
    (consecutive in both caches) average at least this many bytes per layer; shorter runs are
    gathered (a frame costs a few microseconds a side, a copy ~0.2 ms per MiB)."""

    def __post_init__(self) -> None:
        require(
            self, positive=("max_frame_bytes", "staging_buffers"), non_negative=("zero_copy_min_run_bytes",)
        )


def _frombuffer(buf, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the frame is read-only; we only read it
        return torch.frombuffer(buf, dtype=dtype).view(shape)


class ZmqReceiverPlane(ReceiverPlane):
    """Copies each message's payload into its reserved blocks, on the control thread, under the
    reservation table's lock."""

    name = "zmq"
    messages = (KVBlocks,)

    def __init__(self, options: ZmqOptions = ZmqOptions()) -> None:
        super().__init__()
        self.options = options
        self.max_message_bytes = options.max_frame_bytes

    def start(
        self,
        kv: torch.Tensor,
        table: ReservationTable,
        outbox: Outbox,
        on_commit: Callable[[KVCommit], None],
        host: str,
    ) -> None:
        self.kv, self.table = kv, table
        self.slab_bytes = slab_bytes(kv)
        self.layout = KVLayout.of(kv)
        self.region = region_bytes(kv)
        # Into host memory a payload streams on the session's lane, straight into the blocks.
        self.lane = not kv.is_cuda
        self.memory = memoryview(self.region.numpy()) if self.lane else None

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        return KVSetupReply(ok=True, transport="zmq")

    def _refusal(self, msg: KVBlocks, payload: Sequence) -> tuple[str, list]:
        """Why ``msg`` is refused ("" when it is not), and with ``runs`` the pieces its frames go to
        (``_pieces``), computed once."""
        error, pieces = self._check(msg), []
        if error:
            return error, pieces
        expected = (msg.layer_end - msg.layer_start) * len(msg.block_ids) * self.slab_bytes
        if msg.runs:
            pieces = self._pieces(msg)
            sizes = [sum(count for _, count in frame) * self.slab_bytes for frame in pieces]
        else:
            sizes = [expected]
        if len(payload) != len(sizes):
            return f"{len(payload)} KV frames, expected {len(sizes)}", pieces
        for frame, size in zip(payload, sizes):
            if len(frame.buffer) != size:
                return f"KV frame of {len(frame.buffer)} bytes, expected {size}", pieces
        return "", pieces

    def _check(self, msg: KVBlocks) -> str:
        """The header's own refusals: layers, blocks, runs, layouts and byte count."""
        kv = self.kv
        if not 0 <= msg.layer_start < msg.layer_end <= kv.shape[0]:
            return f"layer range [{msg.layer_start}, {msg.layer_end}) outside [0, {kv.shape[0]})"
        if not valid_block_ids(msg.block_ids, kv.shape[1]):
            return "KV frame names invalid or repeated block ids"
        if msg.runs and (min(msg.runs) <= 0 or sum(msg.runs) != len(msg.block_ids)):
            return f"KV frame's runs {msg.runs[:8]} do not split its {len(msg.block_ids)} blocks"
        if msg.runs and msg.block_major and not self.layout.whole(msg.layer_start, msg.layer_end):
            return "KV frames of runs of a block-major cache must carry every layer"
        expected = (msg.layer_end - msg.layer_start) * len(msg.block_ids) * self.slab_bytes
        if msg.nbytes != expected:
            return f"KV frame header says {msg.nbytes} bytes, expected {expected}"
        return ""

    def _pieces(self, msg: KVBlocks) -> list[list[tuple[int, int]]]:
        """Per payload frame, in the order the sender cut them (``run_regions`` of its runs), the
        (first slab, count) regions of this cache its bytes go to, in order: one where the run's
        blocks are consecutive here too, else one per block (per slab where the two caches are
        laid out unlike each other)."""
        layout, l0, l1 = self.layout, msg.layer_start, msg.layer_end
        index, layers = layout.index, range(l0, l1)
        groups, at = [], 0
        for count in msg.runs:
            groups.append(msg.block_ids[at : at + count])
            at += count
        if msg.block_major:  # a frame is a run, every layer of each block in turn (``_check``)
            if layout.block_major:
                return [_merged([(b * layout.num_layers, layout.num_layers) for b in ids]) for ids in groups]
            return [_merged([(index(layer, b), 1) for b in ids for layer in layers]) for ids in groups]
        return [_merged([(index(layer, b), 1) for b in ids]) for layer in layers for ids in groups]

    def land(self, peer: bytes, msg: KVBlocks) -> _Landing:
        """A message whose payload follows on the lane: its bytes go straight into the blocks (the
        regions of ``_pieces``, or of each (layer, block) of a gathered payload, in order), pinned in
        the table from now until the last one came."""
        error = self._check(msg)
        if error:
            raise ValueError(error)
        if msg.runs:
            units = _merged([unit for frame in self._pieces(msg) for unit in frame])
        else:  # a gathered [layers, blocks, ...] tensor
            index, layers = self.layout.index, range(msg.layer_start, msg.layer_end)
            units = _merged([(index(layer, b), 1) for layer in layers for b in msg.block_ids])
        error = self.table.begin(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end)
        if error:
            return _Landing(self, msg, [], error)
        slab, memory = self.slab_bytes, self.memory
        views = [memory[start * slab : (start + count) * slab] for start, count in units]
        return _Landing(self, msg, views, "")

    def handle(self, peer: bytes, msg: KVBlocks, payload: Sequence) -> str:
        """Copy one message's payload into its reserved blocks; "" or why it was refused."""
        error, pieces = self._refusal(msg, payload)
        if error:
            return error
        kv, l0, l1 = self.kv, msg.layer_start, msg.layer_end
        if msg.runs:
            slab, region = self.slab_bytes, self.region

            def copy() -> None:
                for frame, frame_pieces in zip(payload, pieces):
                    src = _frombuffer(frame.buffer, torch.uint8, (len(frame.buffer),))
                    at = 0
                    for start, count in frame_pieces:
                        region[start * slab : (start + count) * slab].copy_(src[at : at + count * slab])
                        at += count * slab

        else:

            def copy() -> None:
                src = _frombuffer(payload[0].buffer, kv.dtype, (l1 - l0, len(msg.block_ids), *kv.shape[2:]))
                _copy_into(kv[l0:l1], msg.block_ids, src)

        if kv.is_cuda:
            copy = _landed_off_the_engine_stream(kv, copy)
        error = self.table.write(msg.request_id, msg.block_ids, l0, l1, copy)
        if not error:
            self.landed(msg)
        return error

    def landed(self, msg: KVBlocks) -> None:
        """``msg``'s payload landed: counted in ``bytes_received``."""
        self.bytes_received += msg.nbytes

    def drop(self, peer: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _merged(units: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first slab, count) regions, those that continue one another merged."""
    out: list[tuple[int, int]] = []
    for start, count in units:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((start, count))
    return out


class _Landing(Landing):
    """A payload streaming into its reserved blocks on a lane (``ZmqReceiverPlane.land``)."""

    def __init__(self, plane: ZmqReceiverPlane, msg: KVBlocks, views: list[memoryview], error: str) -> None:
        self.plane, self.msg = plane, msg
        self.nbytes, self.views, self.error = msg.nbytes, views, error
        self._pinned = not error

    def live(self) -> bool:
        return self.msg.request_id in self.plane.table

    def end(self, error: str) -> str:
        if self._pinned:
            msg = self.msg
            self._pinned = False
            self.plane.table.end(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, error)
            if not error:
                self.plane.landed(msg)
            self.error = error
        return self.error or error


def _landed_off_the_engine_stream(kv: torch.Tensor, copy: Callable[[], None]) -> Callable[[], None]:
    """``copy`` on a side stream of the cache's device (not behind the decode engine's step on the
    default stream), landed before it returns: the commit follows, and the engine's stream is not
    ordered after the side stream."""

    def run() -> None:
        with torch.cuda.stream(side_stream(kv.device)):
            copy()
            torch.cuda.current_stream().synchronize()

    return run


def _copy_into(layers: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """``layers[:, block_ids] = src``: one contiguous copy where the blocks are consecutive."""
    if consecutive(block_ids):
        layers[:, block_ids[0] : block_ids[0] + len(block_ids)].copy_(src)
    else:
        layers.index_copy_(1, block_index(block_ids, layers.device), src.to(layers.device))


def _run_groups(runs: list[tuple[int, int, int]], block_bytes: int, options: ZmqOptions) -> list[list]:
    """``runs`` (source, destination, count) cut into groups of at most ``max_frame_bytes`` of
    blocks (at least one block each), a run split across groups where it does not fit."""
    per_group = max(1, options.max_frame_bytes // block_bytes)
    groups: list[list] = [[]]
    room = per_group
    for s, d, c in runs:
        while c:
            if not room:
                groups.append([])
                room = per_group
            take = min(c, room)
            groups[-1].append((s, d, take))
            s, d, c, room = s + take, d + take, c - take, room - take
    return groups


class ZmqSenderPlane(SenderPlane):
    name = "zmq"

    def __init__(self, options: ZmqOptions = ZmqOptions()) -> None:
        self.options = options

    def register(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.layout = KVLayout.of(kv)
        self.flat = region_bytes(kv).numpy() if not kv.is_cuda else None  # in-place frames' source

    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> Staged:
        # Nothing moves on the caller's thread: ``deliver`` reads the blocks in place or gathers
        # them chunk by chunk as the chunks go out (on CUDA once their layers are written).
        return in_place(kv, block_ids, layer_events, written)

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> ZmqSession:
        return ZmqSession(self, link)


class ZmqSession(SenderSession):
    def __init__(self, plane: ZmqSenderPlane, link: ControlLink) -> None:
        self.plane = plane
        self.link = link
        self._trackers: list[zmq.MessageTracker] = []  # frames that point into the cache
        # Staging buffers for gathered chunks (flat bytes), each with the tracker of its frame on
        # the wire (None: free), taken in turn.
        self._buffers: list[tuple[torch.Tensor, zmq.MessageTracker | None]] = []
        self._turn = 0

    carries_commit = True  # inside the last KVBlocks (the receiver takes it after those blocks)

    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> None:
        """One message per layer chunk, in place or gathered (see the module's docstring), the last
        one with ``commit``; returns once they are queued on the connection."""
        self._trackers = [t for t in self._trackers if not t.done]
        if staged.tensor is not None:  # copied out before a transport was agreed
            self._send_tensor(request_id, staged.tensor.cpu(), dst_block_ids, deadline, commit)
            return
        kv, options = self.plane.kv, self.plane.options
        src = staged.block_ids
        slab = slab_bytes(kv)
        runs = block_runs(src, dst_block_ids)
        per_layer = len(src) * slab
        chunks = layer_chunks(kv.shape[0], per_layer, options.max_frame_bytes)
        last = chunks[-1]
        streams = self.link.streams  # a lane: raw bytes straight from the cache, however short the runs
        if not kv.is_cuda and (streams or per_layer >= options.zero_copy_min_run_bytes * len(runs)):
            flat, layout = self.plane.flat, self.plane.layout
            if layout.block_major:  # messages of whole blocks, every layer (a run is one frame)
                parts = [(0, kv.shape[0], group) for group in _run_groups(runs, kv.shape[0] * slab, options)]
            else:  # messages of layer chunks (a (layer, run) is one frame)
                parts = [(l0, l1, runs) for l0, l1 in chunks]
            for i, (l0, l1, group) in enumerate(parts):
                frames = []
                for start, count in run_regions([(s, c) for s, _, c in group], l0, l1, layout):
                    region = flat[start * slab : (start + count) * slab]
                    if not streams:  # ZeroMQ's I/O thread reads it later: tracked
                        region = zmq.Frame(region, track=True)
                        self._trackers.append(region.tracker)
                    frames.append(region)
                header = KVBlocks(
                    request_id,
                    [d + k for _, d, c in group for k in range(c)],
                    l0,
                    l1,
                    (l1 - l0) * sum(c for _, _, c in group) * slab,
                    runs=[c for _, _, c in group],
                    block_major=layout.block_major,
                    commit=commit if i == len(parts) - 1 else None,
                )
                self.link.send([encode(header), *frames], deadline)
            return
        # On CUDA the gathers run on a side stream: each waits for its layers on the host first, and
        # must not queue behind the engine's next step.
        device = torch.cuda.device(kv.device) if kv.is_cuda else contextlib.nullcontext()
        stream = torch.cuda.stream(side_stream(kv.device)) if kv.is_cuda else contextlib.nullcontext()
        with device, stream:
            idx = block_index(src, kv.device)
            for l0, l1 in chunks:
                staged.wait(l1)
                shape = (l1 - l0, len(src), *kv.shape[2:])
                turn, part = self._buffer(shape, kv, deadline)
                if kv.is_cuda:  # gathered on the device, then one copy into the host buffer
                    gathered = kv.new_empty(shape)
                    gather_into(kv[l0:l1], idx, gathered)
                    part.copy_(gathered)  # waits for the gather (pageable memory: synchronous)
                else:
                    gather_into(kv[l0:l1], idx, part)
                nbytes = part.numel() * part.element_size()
                header = KVBlocks(
                    request_id, dst_block_ids, l0, l1, nbytes, commit=commit if (l0, l1) == last else None
                )
                frame = memoryview(part.view(torch.uint8).numpy())
                if not streams:  # taken by ZeroMQ's I/O thread later: the buffer waits for it
                    frame = zmq.Frame(frame, track=True)
                    self._buffers[turn] = (self._buffers[turn][0], frame.tracker)
                    self._trackers.append(frame.tracker)
                self.link.send([encode(header), frame], deadline)

    def _buffer(self, shape: tuple, kv: torch.Tensor, deadline: float) -> tuple[int, torch.Tensor]:
        """The next staging buffer in turn (its number, and it as a CPU tensor of ``shape`` in the
        cache's dtype), once ZeroMQ let go of what it held (KVTransferError if not by ``deadline``)."""
        count = self.plane.options.staging_buffers
        if len(self._buffers) < count:
            self._buffers.append((torch.empty(0, dtype=torch.uint8), None))
        turn = self._turn % len(self._buffers)
        self._turn = turn + 1
        buf, tracker = self._buffers[turn]
        if tracker is not None:
            try:
                tracker.wait(max(deadline - time.monotonic(), 0.0))
            except zmq.NotDone:
                raise KVTransferError(f"KV peer {self.link.address} is not taking data") from None
        nbytes = math.prod(shape) * kv.element_size()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        self._buffers[turn] = (buf, None)
        return turn, buf[:nbytes].view(kv.dtype).view(shape)

    def _send_tensor(
        self, request_id: str, tensor: torch.Tensor, dst: list[int], deadline: float, commit: KVCommit | None
    ) -> None:
        bytes_per_layer = tensor[0].numel() * tensor.element_size()
        chunks = layer_chunks(tensor.shape[0], bytes_per_layer, self.plane.options.max_frame_bytes)
        for l0, l1 in chunks:
            part = tensor[l0:l1]
            nbytes = part.numel() * part.element_size()
            last = (l0, l1) == chunks[-1]
            header = KVBlocks(request_id, dst, l0, l1, nbytes, commit=commit if last else None)
            self.link.send([encode(header), memoryview(part.view(torch.uint8).numpy())], deadline)

    def close(self) -> float:
        """After the connection closed: ZeroMQ drops what it had not sent; wait until it let go of
        every frame that points into the cache, so the caller may reuse those blocks from now."""
        until = time.monotonic() + RELEASE_WAIT_S
        for tracker in self._trackers:
            try:
                tracker.wait(max(until - time.monotonic(), 0.0))
            except zmq.NotDone:
                logger.error("zmq still holds KV frames of a closed connection after %.0f s", RELEASE_WAIT_S)
                break
        self._trackers = []
        return time.monotonic()


PLUGIN = TransportPlugin(
    name="zmq",
    options=ZmqOptions,
    available=lambda: True,
    sender_plane=ZmqSenderPlane,
    receiver_plane=ZmqReceiverPlane,
    auto_on_cpu=True,
)
