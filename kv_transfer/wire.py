"""Control messages of the GPU transports, beside the zmq backend's (``pdserve.messages``).

They travel on the same ZeroMQ control connection as ``KVHandshake``/``KVCommit``/``KVRenew``
and use the same serializer; only the KV transports read them, so they live here.

After ``KVHandshake`` (model, dtype, block size, layout and token checked), a sender that
can use more than plain zmq frames sends ``KVSetup`` with every transport it offers, in its
order of preference, and what each needs to connect; the receiver answers ``KVSetupReply``
naming the first one it accepts too, or refuses (then no KV moves between the two).
"""

from __future__ import annotations

from pdserve.messages import Message


class KVSetup(Message):
    """Sender -> receiver, once per connection: the transports offered and their parameters."""

    session: str  # unique per connection attempt; names the NCCL rendezvous and the NIXL agent state
    transports: list[str]  # preference order, e.g. ["nixl", "nccl", "zmq"]
    nixl_agent: str = ""  # the sender's NIXL agent name
    nixl_metadata: bytes = b""  # its agent metadata (``get_agent_metadata``)
    # Its registered KV cache: base address, layers, blocks, bytes per (layer, block) slab, device.
    nixl_cache: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    nixl_mem: str = ""  # DRAM | VRAM
    # Its registered staging region, where fragmented blocks are packed for one READ: address, bytes.
    nixl_stage: tuple[int, int] = (0, 0)
    nccl_device: str = ""  # cpu (gloo) | cuda (nccl): both ends must hold the KV on the same kind


class KVSetupReply(Message):
    ok: bool
    transport: str = ""
    error: str = ""
    nixl_agent: str = ""
    nixl_metadata: bytes = b""
    nccl_store: str = ""  # host:port of the receiver's TCPStore for the pair's rendezvous


class KVReady(Message):
    """NIXL: layers [layer_start, layer_end) of ``src_block_ids`` in the sender's registered cache
    may be read now.

    In place (``src_offset`` -1), the receiver READs (layer, ``src_block_ids[i]``) into its (layer,
    ``dst_block_ids[i]``) for each of those layers. Packed (``src_offset`` >= 0), the sender has
    gathered them into its staging region at that offset as ``[layers, len(dst_block_ids), 2, BS,
    Hkv, D]``: the receiver READs that in one piece into its own staging region and scatters it
    into ``dst_block_ids``. Either way it answers ``KVReadDone`` carrying ``xfer_id``; until then
    the sender keeps the blocks (or the staged copy) unchanged.
    """

    request_id: str
    xfer_id: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layer_start: int
    layer_end: int
    timeout_s: float  # the READ is abandoned (and the request failed) after this long
    src_offset: int = -1  # packed: byte offset of the gathered blocks in the sender's staging region


class KVReadDone(Message):
    """NIXL, receiver -> sender on the control connection: the READ of ``xfer_id`` is over (or was
    refused, or failed: ``error``); the sender may reuse the source blocks from now on."""

    request_id: str
    xfer_id: int
    error: str = ""


class KVSend(Message):
    """NCCL: ``nbytes`` of layers [layer_start, layer_end) of ``block_ids`` follow on the pair's
    communicator (tag ``seq``). Staged (``src_block_ids`` empty): one ``send`` of a contiguous
    [layers, blocks, 2, BS, Hkv, D] tensor. Direct: one ``send`` per layer and run of blocks
    consecutive in both ``src_block_ids`` (the sender's cache) and ``block_ids``, layer-major."""

    request_id: str
    seq: int
    block_ids: list[int]
    layer_start: int
    layer_end: int
    nbytes: int
    src_block_ids: list[int] = []
