"""Transport-agnostic KV block movement between a prefill node and a decode node.

The API has two halves.

**Scheduler side** (decode node, in its engine thread):

* ``Scheduler.reserve_remote`` allocates blocks for a prompt and the node records them
  in a ``ReservationTable`` under a **lease** (a deadline). The landing descriptor
  (request id, block ids, transport address) goes back to the proxy, which hands it
  to the prefill node.
* When the transport reports the request **committed** (every block written, first
  token received), ``Scheduler.remote_kv_landed`` moves it into the running queue.
* **Abort** (client gone, proxy gives up) or **lease expiry**: the engine thread
  releases the reservation *first* (after which the receiver rejects every late
  frame for it) and only then frees the blocks. Blocks are therefore never written
  after they were freed, and a request never runs on partial KV.
* Who frees: the decode node frees what it reserved (on finish, abort or expiry);
  the prefill node frees its own blocks once the transport has copied them out
  (``Scheduler.release_held``), or keeps them as prefix cache.

**Worker side** (the backends; they move bytes and never touch scheduler state):

* ``KVReceiver`` (decode): ``register_kv_cache`` once, then serves handshakes and
  writes incoming blocks into reserved block ids after validating them against the
  reservation table (sizes, ids, layer ranges), and reports commits.
* ``KVSender`` (prefill): ``register_kv_cache`` once; ``handshake`` with a peer at
  first contact (mismatched model, dtype, block size, layout or shapes are refused
  then, with an error naming the field); ``send`` copies a request's blocks to the
  peer's reserved blocks and returns a future that resolves when the peer acked the
  commit, or fails with a clear error on timeout or a dead peer.

Backends: ``zmq`` (CPU-staged frames over TCP; everywhere). ``nccl`` and ``nixl``
come with the GPU transfer work.
"""

from kv_transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferError,
    ReservationTable,
    check_compatible,
)

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReservationTable",
    "check_compatible",
    "create_receiver",
    "create_sender",
    "available_transports",
]


def available_transports() -> list[str]:
    return ["zmq"]


def resolve_transport(name: str) -> str:
    """`auto` picks the best available backend; anything else must be available."""
    available = available_transports()
    if name == "auto":
        return available[0]
    if name not in available:
        raise ValueError(f"KV transport {name!r} is not available here (available: {', '.join(available)})")
    return name


def create_receiver(name: str, **kwargs) -> KVReceiver:
    from kv_transfer.zmq_backend import ZmqReceiver

    resolve_transport(name)
    return ZmqReceiver(**kwargs)


def create_sender(name: str, **kwargs) -> KVSender:
    from kv_transfer.zmq_backend import ZmqSender

    resolve_transport(name)
    return ZmqSender(**kwargs)
