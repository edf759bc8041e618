"""The zmq KV transport: the blocks travel as frames on the control connection itself.

``[KVBlocks, payload]``: layers ``[layer_start, layer_end)`` of the listed destination blocks,
payload = raw bytes of ``[layers, blocks, 2, BS, Hkv, D]``. No reply: frames stream back to back,
and an error is kept for the commit's ack. A payload frame must name a layer range inside the
model, distinct block ids, a byte length exactly what its header and the agreed shape imply, and
blocks all reserved for its request (``ReservationTable``).

The sender copies the request's blocks out of its cache into one CPU staging tensor when
``send`` is called (the only copy on that side); frames point into that tensor (``copy=False``).
The receiver reads each frame without copying it and copies it straight into the reserved
blocks: one copy per side. Runs everywhere; the default on a CPU-only host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import (
    ReservationTable,
    Staged,
    copy_to_cpu,
    layer_chunks,
    slab_bytes,
    valid_block_ids,
)
from pdserve.kv_transfer.messages import KVBlocks, KVCommit, KVSetup, KVSetupReply
from pdserve.kv_transfer.plane import (
    ControlLink,
    Outbox,
    ReceiverPlane,
    SenderPlane,
    SenderSession,
    TransportPlugin,
)
from pdserve.messages import encode


@dataclass(frozen=True)
class ZmqOptions:
    max_frame_bytes: int = 16 << 20
    """Payload frames are cut at layer boundaries to stay under this size (memory per frame)."""


class ZmqReceiverPlane(ReceiverPlane):
    """Copies each payload frame into its reserved blocks, on the control thread, under the
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

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        return KVSetupReply(ok=True, transport="zmq")

    def handle(self, peer: bytes, msg: KVBlocks, payload: Sequence) -> str:
        """Copy one payload frame into its reserved blocks; "" or why it was refused."""
        kv = self.kv
        num_layers = msg.layer_end - msg.layer_start
        if not 0 <= msg.layer_start < msg.layer_end <= kv.shape[0]:
            return f"layer range [{msg.layer_start}, {msg.layer_end}) outside [0, {kv.shape[0]})"
        if not valid_block_ids(msg.block_ids, kv.shape[1]):
            return "KV frame names invalid or repeated block ids"
        expected = num_layers * len(msg.block_ids) * slab_bytes(kv)
        frame = payload[0]
        got = len(frame.buffer)
        if got != expected or msg.nbytes != expected:
            return f"KV frame of {got} bytes (header: {msg.nbytes}), expected {expected}"
        shape = (num_layers, len(msg.block_ids), *kv.shape[2:])

        def copy() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the frame is read-only; we only read it
                src = torch.frombuffer(frame.buffer, dtype=kv.dtype).view(shape)
            ids = torch.tensor(msg.block_ids, dtype=torch.long, device=kv.device)
            kv[msg.layer_start : msg.layer_end].index_copy_(1, ids, src.to(kv.device))

        error = self.table.write(msg.request_id, msg.block_ids, msg.layer_start, msg.layer_end, copy)
        if not error:
            self.bytes_received += expected
        return error

    def drop(self, peer: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqSenderPlane(SenderPlane):
    name = "zmq"

    def __init__(self, options: ZmqOptions = ZmqOptions()) -> None:
        self.options = options

    def register(self, kv: torch.Tensor) -> None:
        pass

    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
    ) -> Staged:
        return copy_to_cpu(kv, block_ids)  # [L, n, 2, BS, Hkv, D] on the CPU, the only copy

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> ZmqSession:
        return ZmqSession(self, link)


class ZmqSession(SenderSession):
    def __init__(self, plane: ZmqSenderPlane, link: ControlLink) -> None:
        self.plane = plane
        self.link = link

    def deliver(self, request_id: str, staged: Staged, dst_block_ids: list[int], deadline: float) -> None:
        """Frames of at most ``max_frame_bytes``, cut at layer boundaries, pointing into the staged
        tensor; returns once they are queued on the connection (the commit follows them)."""
        staged.wait()
        tensor = staged.tensor.cpu()
        bytes_per_layer = tensor[0].numel() * tensor.element_size()
        for start, end in layer_chunks(tensor.shape[0], bytes_per_layer, self.plane.options.max_frame_bytes):
            part = tensor[start:end]
            header = KVBlocks(request_id, dst_block_ids, start, end, part.numel() * part.element_size())
            self.link.send([encode(header), memoryview(part.view(torch.uint8).numpy())], deadline)

    def close(self) -> None:
        pass


PLUGIN = TransportPlugin(
    name="zmq",
    options=ZmqOptions,
    available=lambda: True,
    sender_plane=ZmqSenderPlane,
    receiver_plane=ZmqReceiverPlane,
    auto_on_cpu=True,
)
