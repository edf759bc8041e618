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
  the prefill node frees its own blocks (``Scheduler.release_held``) only once the send's
  future has resolved, either way, since a transport may read them in place until then, or
  keeps them as prefix cache. A request whose send failed is never committed, so the blocks
  may be reused at once even if the peer still reads them.

**Worker side** (the backends; they move bytes and never touch scheduler state):

* ``KVReceiver`` (decode): ``register_kv_cache`` once, then serves handshakes and
  writes incoming blocks into reserved block ids after validating them against the
  reservation table (sizes, ids, layer ranges), and reports commits.
* ``KVSender`` (prefill): ``register_kv_cache`` once; ``handshake`` with a peer at
  first contact (mismatched model, dtype, block size, layout or shapes are refused
  then, with an error naming the field); ``send`` moves a request's blocks into the
  peer's reserved blocks and returns a future that resolves when the peer acked the
  commit, or fails with a clear error on timeout or a dead peer. The caller keeps the source
  blocks unchanged until then.

Backends (``kv_transfer/<name>_backend.py``): every one speaks the same control protocol on a
ZeroMQ connection (handshake, transport set-up, renewals, commits: ``zmq_backend``) and moves
the blocks on its own data plane:

* ``zmq``: CPU-staged frames on that connection; runs everywhere.
* ``nixl``: the decode node READs the blocks in place, by descriptor, out of the prefill node's
  registered KV cache into its own (UCX; VRAM on GPUs, DRAM on the CPU): no copy on either side.
* ``nccl``: send/recv on a communicator per prefill-decode pair (torch.distributed's NCCL
  backend for CUDA caches, gloo for CPU caches: one code path), on its own CUDA stream.

A node is configured with ``auto``, one name, or a comma-separated order of preference. A
sender offers its list at set-up and the receiver takes the first one it accepts too, so two
``auto`` nodes agree on the best transport both have; with nothing in common the set-up is
refused, naming both lists. ``auto`` is nixl > nccl > zmq among what is available on a host
with CUDA, and zmq alone on a CPU-only host, where zmq is the default (pick ``nixl`` or ``nccl``
explicitly to move DRAM with them).
"""

import functools

from pdserve.kv_transfer.base import (
    KVReceiver,
    KVRefused,
    KVSender,
    KVTransferError,
    ReservationTable,
    check_compatible,
)

__all__ = [
    "KVReceiver",
    "KVRefused",
    "KVSender",
    "KVTransferError",
    "ReservationTable",
    "TRANSPORTS",
    "auto_transports",
    "available_transports",
    "check_compatible",
    "create_receiver",
    "create_sender",
    "resolve_transport",
    "transport_preferences",
]

TRANSPORTS = ("nixl", "nccl", "zmq")
"""Every backend, best first."""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _nccl_available() -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    return dist.is_nccl_available() if _cuda() else dist.is_gloo_available()


@functools.cache
def available_transports() -> tuple[str, ...]:
    """Backends that can run here, best first (nccl runs on gloo without CUDA)."""
    from pdserve.kv_transfer.nixl_backend import nixl_available

    found = {"nixl": nixl_available(), "nccl": _nccl_available(), "zmq": True}
    return tuple(name for name in TRANSPORTS if found[name])


def auto_transports() -> tuple[str, ...]:
    """What ``auto`` offers and accepts: all available transports, best first, on a CUDA host; zmq
    on a CPU-only one."""
    return available_transports() if _cuda() else ("zmq",)


def transport_preferences(name: str) -> tuple[str, ...]:
    """``auto``, one transport, or a comma-separated order of preference -> available names."""
    if name == "auto":
        return auto_transports()
    names = tuple(dict.fromkeys(part.strip() for part in name.split(",") if part.strip()))
    unknown = [n for n in names if n not in TRANSPORTS]
    if not names or unknown:
        raise ValueError(f"unknown KV transport {name!r}; choose auto or from {', '.join(TRANSPORTS)}")
    missing = [n for n in names if n not in available_transports()]
    if missing:
        raise ValueError(
            f"KV transport {', '.join(missing)} is not available here "
            f"(available: {', '.join(available_transports())})"
        )
    return names


def resolve_transport(name: str) -> str:
    """The transport a node configured with ``name`` prefers (what its NodeInfo shows)."""
    return transport_preferences(name)[0]


def create_receiver(
    name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_token: str = "",
    ucx_net_devices: str = "",
    ucx_tls: str = "",
) -> KVReceiver:
    """A decode-side receiver accepting ``name``'s transports (see ``transport_preferences``)."""
    from pdserve.kv_transfer.zmq_backend import ZmqReceiver

    names = transport_preferences(name)
    planes = []
    if "nixl" in names:
        from pdserve.kv_transfer.nixl_backend import NixlReceiverPlane

        planes.append(NixlReceiverPlane(ucx_net_devices=ucx_net_devices, ucx_tls=ucx_tls))
    if "nccl" in names:
        from pdserve.kv_transfer.nccl_backend import NcclReceiverPlane

        planes.append(NcclReceiverPlane())
    return ZmqReceiver(host, port, cluster_token, planes=planes, transports=names)


def create_sender(
    name: str,
    cluster_token: str = "",
    ucx_net_devices: str = "",
    ucx_tls: str = "",
) -> KVSender:
    """A prefill-side sender offering ``name``'s transports in order (see ``transport_preferences``)."""
    from pdserve.kv_transfer.zmq_backend import ZmqSender

    names = transport_preferences(name)
    planes = []
    if "nixl" in names:
        from pdserve.kv_transfer.nixl_backend import NixlSenderPlane

        planes.append(NixlSenderPlane(ucx_net_devices=ucx_net_devices, ucx_tls=ucx_tls))
    if "nccl" in names:
        from pdserve.kv_transfer.nccl_backend import NcclSenderPlane

        planes.append(NcclSenderPlane())
    return ZmqSender(cluster_token, planes=planes, transports=names)
