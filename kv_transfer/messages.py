"""Every message of the KV channel (prefill node -> decode node), on the control connection.

They travel as the first frame of a ZeroMQ multipart message (``kv_transfer.control``), with the
one serializer of ``pdserve.messages`` (msgpack, tagged structs, unknown fields refused); the
proxy<->node messages stay there. In protocol order:

1. ``KVHandshake`` -> ``KVHandshakeReply``: once per connection (cluster token, ``NodeInfo``).
2. ``KVSetup`` -> ``KVSetupReply``: the sender offers its transports in order of preference, each
   with its plane's own struct (``NixlOffer``, ``NcclOffer``: a tagged union, so a plane reads only
   its own fields); the receiver answers naming the first one it accepts too, with that plane's
   ``*Accept``, or refuses (then no KV moves between the two).
3. Data, per plane: ``KVBlocks`` + payload frames (zmq), ``KVReady`` -> ``KVReadDone`` (nixl),
   ``KVSend`` (nccl; the bytes follow on the pair's communicator).
4. ``KVRenew`` (no reply) while a prompt waits on the prefill node.
5. ``KVCommit`` -> ``KVAck``, right behind the data: the receiver takes the commit after the data
   of its request (zmq and nccl in order on one thread, nixl once its READs ended), so a send costs
   one round trip. zmq and nixl carry it inside their last data message (``commit``): a one-block
   send is then one message each way.

Planes with small messages only (nixl, nccl) move everything after step 2 onto the session's lane,
a plain TCP connection opened with ``KVLane`` -> ``KVLaneReply`` (``kv_transfer.lane``).

A message that waits for an answer says how a refusal is answered (``refused``), so the control
host can refuse any of them without knowing the plane it belongs to.
"""

from __future__ import annotations

from typing import ClassVar

from pdserve.messages import LogprobsMsg, Message, NodeInfo


class KVMessage(Message):
    """Base of the KV channel's messages (never sent itself)."""

    payload_frames: ClassVar[int] = 0
    """Raw frames that follow the message in the same multipart message."""

    def refused(self, why: str) -> KVMessage | None:
        """The answer to this message when the receiver refuses it (None: nobody waits for one)."""
        return None


# -- control: every plane ----------------------------------------------------------------------------


class KVHandshake(KVMessage):
    info: NodeInfo
    cluster_token: str = ""


class KVHandshakeReply(KVMessage):
    ok: bool
    error: str = ""
    info: NodeInfo | None = None


class NixlOffer(KVMessage):
    """What a nixl receiver needs to READ out of the sender's registered memory."""

    agent: str = ""  # the sender's NIXL agent name
    metadata: bytes = b""  # its agent metadata (``get_agent_metadata``)
    # Its registered KV cache: base address, layers, blocks, bytes per (layer, block) slab, device.
    cache: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    block_major: bool = False  # its cache's layout (``kv_transfer.base.KVLayout``)
    mem: str = ""  # DRAM | VRAM
    # Its registered staging region, where fragmented blocks are packed for one READ: address, bytes.
    stage: tuple[int, int] = (0, 0)


class NixlAccept(KVMessage):
    agent: str = ""  # the receiver's NIXL agent name
    metadata: bytes = b""
    gpu: str = ""  # the UUID of the GPU holding the receiver's cache ("" for a DRAM cache)


class NcclOffer(KVMessage):
    device: str = ""  # cpu (gloo) | cuda (nccl): both ends must hold the KV on the same kind


class NcclAccept(KVMessage):
    store: str = ""  # host:port of the receiver's TCPStore for the pair's rendezvous


PlaneOffer = NixlOffer | NcclOffer
PlaneAccept = NixlAccept | NcclAccept


class KVSetup(KVMessage):
    """Sender -> receiver, once per connection: the transports offered and their parameters."""

    session: str  # unique per connection attempt; names the NCCL rendezvous and the NIXL agent state
    transports: list[str]  # preference order, e.g. ["nixl", "nccl", "zmq"]
    offers: list[PlaneOffer] = []  # one per offered plane that needs parameters (zmq needs none)

    def offer(self, kind: type[PlaneOffer]) -> PlaneOffer | None:
        """The offer of one plane (``kind``), if the sender made one."""
        return next((o for o in self.offers if isinstance(o, kind)), None)

    def refused(self, why: str) -> KVSetupReply:
        return KVSetupReply(ok=False, error=why)


class KVSetupReply(KVMessage):
    ok: bool
    transport: str = ""
    error: str = ""
    accept: PlaneAccept | None = None  # the chosen plane's answer (None for zmq)
    final: bool = False
    """A refusal that asking again cannot change (no transport in common): the sender stops trying
    this peer. Any other refusal (the connection lost its handshake, a plane's set-up failed) ends
    only this connection; the next request starts afresh."""
    lane_port: int = 0
    """Where the session's lane is opened (``kv_transfer.lane``), on the control connection's host;
    0: the chosen plane takes none, its messages stay on the control connection."""
    lane_path: str = ""
    """The abstract Unix socket name of the same lanes, for a sender on the receiver's host (in its
    network namespace): found there, it is taken instead of the port ("" where there is none)."""
    lane_token: bytes = b""
    """What the sender presents first on the lane (``KVLane``): binds it to this connection, once."""


class KVLane(KVMessage):
    """The first message on a lane: the token of the set-up it belongs to."""

    token: bytes


class KVLaneReply(KVMessage):
    ok: bool
    error: str = ""


class KVCommit(KVMessage):
    """All of a request's KV was sent; carries what the decode node needs to continue."""

    request_id: str
    first_token: int
    first_logprobs: LogprobsMsg | None = None
    generator_state: bytes = b""  # the seeded sampler's state after the first token
    num_cached_tokens: int = 0

    def refused(self, why: str) -> KVAck:
        return KVAck(request_id=self.request_id, ok=False, error=why)


class KVAck(KVMessage):
    request_id: str
    ok: bool
    error: str = ""
    lost: bool = False
    """The receiver holds no handshake for this connection (it lost it): the sender reconnects."""


def _refused_commit(request_id: str, commit: KVCommit | None, why: str) -> KVAck | None:
    """The answer to a refused data message that carries its request's commit: the refused ack
    (what its sender waits for); None without one."""
    if commit is None:
        return None
    return KVAck(request_id=request_id, ok=False, error=why)


class KVRenew(KVMessage):
    """The prefill node still works on these requests: extend their leases by their original length.

    Sent while a prompt waits or runs on the prefill node, so a long queue there does not void
    the decode node's reservation; a dead prefill node stops renewing and the leases run out.
    """

    request_ids: list[str]


# -- data: one plane each ----------------------------------------------------------------------------


class KVBlocks(KVMessage):
    """zmq: header of layers [layer_start, layer_end) of the listed destination blocks.

    Without ``runs``, one payload frame: the raw bytes of a [layer_end - layer_start,
    len(block_ids), 2, BS, Hkv, D] tensor in the agreed dtype (gathered by the sender). With
    ``runs`` (lengths of consecutive groups of ``block_ids``, summing to their number), one payload
    frame per region of ``kv_transfer.base.run_regions``, each its bytes as they lie in the sender's
    cache: out of a block-major one, a message carries every layer and a frame is a run (all its
    layers); out of a layer-major one, a frame is one (layer, run), layer by layer. The sender sends
    runs of blocks contiguous in its cache straight out of it, without a copy.
    ``nbytes`` is the payload's total.
    """

    request_id: str
    block_ids: list[int]
    layer_start: int
    layer_end: int
    nbytes: int
    runs: list[int] = []
    block_major: bool = False
    """With ``runs``: the layout of the cache the frames come out of (``kv_transfer.base.KVLayout``),
    which sets how they are cut (``run_regions``); the receiver's must be the same."""
    commit: KVCommit | None = None
    """The request's commit, taken once this message's blocks landed (the last message of a send)."""

    def refused(self, why: str) -> KVAck | None:
        return _refused_commit(self.request_id, self.commit, why)

    @property
    def payload_frames(self) -> int:  # type: ignore[override]
        if not self.runs:
            return 1
        return len(self.runs) if self.block_major else (self.layer_end - self.layer_start) * len(self.runs)


class KVReady(KVMessage):
    """NIXL: layers [layer_start, layer_end) of ``src_block_ids`` in the sender's registered cache
    may be read now.

    In place (``src_offset`` -1), the receiver READs (layer, ``src_block_ids[i]``) into its (layer,
    ``dst_block_ids[i]``) for each of those layers. Packed (``src_offset`` >= 0), the sender has
    gathered them into its staging region at that offset as ``[layers, len(dst_block_ids), 2, BS,
    Hkv, D]``: the receiver READs that in one piece into its own staging region and scatters it
    into ``dst_block_ids``. Either way it answers ``KVReadDone`` carrying ``xfer_id``, and takes a
    commit of the request only after that; until then the sender keeps the blocks (or the staged
    copy) unchanged. The READ runs at most ``timeout_s`` (the sender's time left, less a margin).

    The last KVReady of a send carries the request's ``commit``: the receiver takes it once no READ
    of the request is left and answers with the ``KVAck`` alone (no ``KVReadDone`` for the READs
    of the request that end after it arrived).
    """

    request_id: str
    xfer_id: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layer_start: int
    layer_end: int
    timeout_s: float  # the READ is abandoned (and the request failed) after this long
    src_offset: int = -1  # packed: byte offset of the gathered blocks in the sender's staging region
    commit: KVCommit | None = None

    def refused(self, why: str) -> KVMessage:
        refused = _refused_commit(self.request_id, self.commit, why)
        return refused or KVReadDone(request_id=self.request_id, xfer_id=self.xfer_id, error=why)


class KVReadDone(KVMessage):
    """NIXL, receiver -> sender on the control connection: the READ of ``xfer_id`` is over (or was
    refused, or failed: ``error``); the sender may reuse the source blocks from now on."""

    request_id: str
    xfer_id: int
    error: str = ""


class KVSend(KVMessage):
    """NCCL: ``nbytes`` of layers [layer_start, layer_end) of ``block_ids`` follow on the pair's
    communicator (tag ``seq``). Staged (``src_block_ids`` empty): one ``send`` of a contiguous
    [layers, blocks, 2, BS, Hkv, D] tensor. Direct: one ``send`` per region of
    ``kv_transfer.base.run_regions`` of the runs of blocks consecutive in both ``src_block_ids`` (the
    sender's cache) and ``block_ids``, cut as the sender's cache is laid out (``block_major``), which
    the receiver's must be too."""

    request_id: str
    seq: int
    block_ids: list[int]
    layer_start: int
    layer_end: int
    nbytes: int
    src_block_ids: list[int] = []
    block_major: bool = False


REQUESTS = KVHandshake | KVSetup | KVBlocks | KVReady | KVSend | KVCommit | KVRenew
"""What a receiver decodes (sender -> receiver)."""
REPLIES = KVHandshakeReply | KVSetupReply | KVAck | KVReadDone
"""What a sender decodes (receiver -> sender)."""
