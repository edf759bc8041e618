"""The NIXL KV transport: the decode node READs the blocks straight out of the prefill node's KV cache.

Its code: ``nixl_common`` (options, nixl's API and agents), ``nixl_receiver`` (the decode side),
``nixl_sender`` (the prefill side); this module ties them into the transport's plug-in.

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
agent. Agents run without NIXL's progress thread unless ``NixlOptions.progress_thread`` (idle, it
costs ~40% of a core here, and it made no send faster on one H100): the
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

from pdserve.kv_transfer.nixl_common import NixlOptions, nixl_available
from pdserve.kv_transfer.nixl_receiver import NixlReceiverPlane
from pdserve.kv_transfer.nixl_sender import NixlSenderPlane
from pdserve.kv_transfer.plane import TransportPlugin

PLUGIN = TransportPlugin(
    name="nixl",
    options=NixlOptions,
    available=nixl_available,
    sender_plane=NixlSenderPlane,
    receiver_plane=NixlReceiverPlane,
)
