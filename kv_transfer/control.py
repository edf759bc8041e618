"""The control host: the connection every KV transport speaks, over ZeroMQ, whatever plane moves
the blocks. Its two ends: ``control_sender`` (``ControlSender``, prefill side) and
``control_receiver`` (``ControlReceiver``, decode side); this module holds the protocol they
share.

Wire protocol (DEALER on the prefill node -> ROUTER on the decode node, multipart messages whose
first frame is a msgpack message of ``kv_transfer.messages``). A sender opens ``connections``
DEALERs to each peer (one thread each, jobs in order): a request's sends all go over the one its
id hashes to, so its chunks and commit stay in order while sends of different requests overlap
rather than each waiting for the previous one's ack. Planes whose sessions must not run side by
side (``SenderPlane.concurrent_sessions``: NCCL, whose kernels of two communicators on the same
stream pair up in order) get one.

1. ``[KVHandshake]`` -> ``[KVHandshakeReply]``: first, once per connection (cluster token,
   model, dtype, block size, layout, shapes). The receiver ignores anything else from a
   connection that has not passed it. Resent every second until answered, so a sender may
   start before the receiver listens.
2. ``[KVSetup]`` -> ``[KVSetupReply]``: the sender offers its transports in order of
   preference; the receiver picks the first one it accepts too, or refuses. The chosen plane
   (``kv_transfer.plane``) answers with its own struct and moves the blocks: zmq in frames on
   this connection (``zmq_backend``), nixl and nccl (``nixl_backend``, ``nccl_backend``) on
   their own data plane, using this connection for control only.
3. Data messages of the chosen plane, handed to it (``ReceiverPlane.handle``). A plane with small
   messages only (``ReceiverPlane.lane``: nixl, nccl) gets a lane with its set-up reply: a plain
   TCP connection the receiver's control thread reads itself, which carries every later message of
   the session both ways, without ZeroMQ's I/O threads (``kv_transfer.lane``).
4. ``[KVRenew]``: extend leases, no reply.
5. ``[KVCommit]`` -> ``[KVAck]``: the ack says whether every layer of every block landed
   inside a live reservation. The sender sends the commit right behind the data, without waiting
   for an answer to it, or inside the send's last data message (``commit`` of ``KVBlocks`` and
   ``KVReady``: ``SenderSession.carries_commit``); the receiver takes it only after the data of
   its request (on this thread for zmq, behind the plane's own work for nixl and nccl:
   ``ReceiverPlane.handles_commit``), so a send costs one round trip (a one-block send one message
   each way), and the ack also tells the sender its blocks are no longer read. A data message
   whose commit names another request is refused (with a refused ack).

Validation on the receiver (a hostile or broken peer can neither crash the node nor write
outside a reservation): the cluster token is compared in constant time; what a connection
passed (handshake, set-up) is state of that TCP connection, dropped when it closes, so a
routing id reused by another connection inherits nothing; after the handshake every message
must decode as a known type with the right number of frames and belong to the plane its
connection set up, which validates it further (layer ranges inside the model, distinct block
ids, byte lengths exactly what the header and the agreed shape imply, blocks all reserved for
its request: ``ReservationTable``). A refused message logs a warning (rate-limited) and fails
only the request it names; nothing a peer sends raises out of the receiver thread.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 << 20
"""The largest message (with its payload frames) a receiver takes, more where a plane's are larger
(``ReceiverPlane.max_message_bytes``), plus 1 MiB of headers."""
HANDSHAKE_RESEND_S = 1.0
"""A sender resends its handshake this often until it is answered (the receiver may start later)."""
