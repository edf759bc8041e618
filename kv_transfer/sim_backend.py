"""The sim KV transport: simulated nodes' tiny KV payloads, delivered after the real bytes' time.

A simulated engine (``pdserve.engine.sim``) keeps a KV cache with real block ids and layers but a
payload of one element per layer, K/V and block. This plane moves that payload exactly as the zmq
plane does (on the session's lane, or in frames on the control connection, validated against the
reservation table, so leases, refusals, commits and aborts run for real) and, before the payload
leaves, holds the peer's queue for the time the simulated model's real blocks would take on the
calibrated link:
``latency_s + blocks x bytes_per_block / gbps``. Each prefill-decode pair is one link: a pair's
sends queue behind each other (one thread per peer runs them in order), other pairs' do not. Both
ends count the real bytes in ``bytes_sent``/``bytes_received`` (the nodes' KV transfer metrics).

Only simulated nodes use it: ``auto`` never offers it, and a node whose engine is simulated asks
for it alone (``pdserve.node.framework``), passing ``SimOptions`` from its calibration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import Staged
from pdserve.kv_transfer.messages import KVBlocks, KVCommit, KVSetup, KVSetupReply
from pdserve.kv_transfer.options import require
from pdserve.kv_transfer.plane import ControlLink, TransportPlugin
from pdserve.kv_transfer.zmq_backend import ZmqReceiverPlane, ZmqSenderPlane, ZmqSession


@dataclass(frozen=True)
class SimOptions:
    latency_s: float = 0.0
    """Fixed cost of one delivery on the modelled link."""
    gbps: float = 0.0
    """The modelled link's bandwidth in GB/s; 0: no modelled time (the payload's own alone)."""
    bytes_per_block: int = 0
    """Bytes of one KV block of the simulated model (all layers), what the link would move."""

    def __post_init__(self) -> None:
        require(self, non_negative=("latency_s", "gbps", "bytes_per_block"))

    def seconds(self, num_blocks: int) -> float:
        if self.gbps <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.bytes_per_block / (self.gbps * 1e9)


class SimReceiverPlane(ZmqReceiverPlane):
    """zmq's receiver; ``bytes_received`` counts the simulated model's bytes (as a real node's
    metrics would), not the payload's."""

    name = "sim"

    def __init__(self, options: SimOptions = SimOptions()) -> None:
        super().__init__()
        self.sim = options

    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        return KVSetupReply(ok=True, transport="sim")

    def landed(self, msg: KVBlocks) -> None:
        if not self.sim.bytes_per_block:
            super().landed(msg)
            return
        layers = (msg.layer_end - msg.layer_start) / self.kv.shape[0]
        self.bytes_received += round(len(msg.block_ids) * layers * self.sim.bytes_per_block)


class SimSenderPlane(ZmqSenderPlane):
    name = "sim"
    concurrent_sessions = False  # one modelled link per pair: its sends queue behind each other

    def __init__(self, options: SimOptions = SimOptions()) -> None:
        super().__init__()
        self.sim = options

    def block_bytes(self, kv: torch.Tensor) -> int:
        return self.sim.bytes_per_block or super().block_bytes(kv)

    def connect(self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float) -> SimSession:
        return SimSession(self, link)


class SimSession(ZmqSession):
    plane: SimSenderPlane

    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> None:
        """Wait the modelled transfer time (bounded by the deadline), then send the frames."""
        delay = min(self.plane.sim.seconds(len(dst_block_ids)), deadline - time.monotonic())
        if delay > 0:
            time.sleep(delay)
        super().deliver(request_id, staged, dst_block_ids, deadline, commit)


def _available() -> bool:
    return True


PLUGIN = TransportPlugin(
    name="sim",
    options=SimOptions,
    available=_available,
    sender_plane=SimSenderPlane,
    receiver_plane=SimReceiverPlane,
    in_auto=False,
)
