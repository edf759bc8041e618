"""Transport-agnostic KV block movement between a prefill node and a decode node.

The API has two halves.

**Scheduler side** (decode node, in its engine thread):

* ``LLMEngine.reserve_remote`` allocates blocks for a prompt and the node records them
  in a ``ReservationTable`` under a **lease** (a deadline). The landing descriptor
  (request id, block ids, transport address) goes back to the proxy, which hands it
  to the prefill node.
* When the transport reports the request **committed** (every block written, first
  token received), ``LLMEngine.remote_kv_landed`` moves it into the running queue.
* **Abort** (client gone, proxy gives up) or **lease expiry**: the engine thread
  releases the reservation *first* (after which the receiver rejects every late
  frame for it) and only then frees the blocks. Blocks are therefore never written
  after they were freed, and a request never runs on partial KV.
* Who frees: the decode node frees what it reserved (on finish, abort or expiry);
  the prefill node frees its own blocks (``LLMEngine.release_held``; ``pin_held`` keeps them
  while a send may read them), or keeps them as prefix cache, only once the sender released
  them (``KVSendFuture.released``), since a transport may read them in place until then. That
  comes with the send's outcome, except after a failure while a peer may still read on its own
  (nixl, a dead or stuck decode node): the request fails at the send's timeout, and the blocks
  stay pinned until no READ offered can run any more (a late READ could otherwise carry
  another request's KV into a request it then commits).

**Worker side** (the backends; they move bytes and never touch scheduler state):

* ``KVReceiver`` (decode): ``register_kv_cache`` once, then serves handshakes and
  writes incoming blocks into reserved block ids after validating them against the
  reservation table (sizes, ids, layer ranges), and reports commits.
* ``KVSender`` (prefill): ``register_kv_cache`` once; ``handshake`` with a peer at
  first contact (mismatched model, dtype, block size, layout or shapes are refused
  then, with an error naming the field); ``send`` moves a request's blocks into the
  peer's reserved blocks and returns a ``KVSendFuture`` that resolves when the peer acked the
  commit, or fails with a clear error on timeout or a dead peer; the caller keeps the source
  blocks unchanged until its ``released`` resolved too.

**Transports as plugins.** Every transport speaks the same control protocol on one ZeroMQ
connection (handshake, transport set-up, renewals, commits: the control host, ``control``) and
moves the blocks on its own data plane, behind the typed interfaces of ``plane``
(``ReceiverPlane``, ``SenderPlane``, ``SenderSession``; their docstrings state the contract):

* ``zmq``: frames on that connection, runs of blocks straight out of a CPU cache, the rest
  gathered chunk by chunk into staging buffers kept per session while the previous chunk is on
  the wire; the last message carries the commit; runs everywhere.
* ``nixl``: the decode node READs the blocks in place, by descriptor (one per run of blocks in
  the engine's block-major caches, ``KVLayout``; lists prepared once per session for scattered
  blocks), out of the prefill node's registered KV cache into its own (UCX;
  VRAM on GPUs, DRAM on the CPU): no copy on either side; it takes the commit, carried by the
  last READ offer, once its READs ended, and acks: a one-block send is one message each way.
* ``nccl``: send/recv on a communicator per prefill-decode pair (torch.distributed's NCCL
  backend for CUDA caches, gloo for CPU caches: one code path), on its own CUDA stream.
* ``sim``: simulated nodes' tiny payloads as zmq frames, held back for the time the simulated
  model's real blocks take on the calibrated link; never offered by ``auto``.

Each is configured by its own options object (``ZmqOptions``, ``NixlOptions`` with its
``StagingOptions``, ``NcclOptions``, ``SimOptions``: frozen dataclasses whose defaults are the tuned values),
passed to ``create_sender``/``create_receiver`` (a node passes those its ``--kv-transfer-config``
names, ``options_from_config``, and the defaults for the rest); nothing
rewrites a module's globals. Every message on the connection lives in ``messages``. Adding a
transport means one new file (``<name>_backend.py``: its options, its two planes, a
``TransportPlugin``; nixl's, the largest, keeps them in three modules beside it) and one entry in
``REGISTRY`` below (plus its set-up structs and data messages in ``messages``, the one home of the
wire, if it needs any).

Modules: ``base`` (the two halves' interfaces, ``ReservationTable``, the caches' ``KVLayout`` and
the regions a send moves, block helpers), ``control`` (the control host's protocol) with its two
ends ``control_sender`` (``ControlSender``) and ``control_receiver`` (``ControlReceiver``),
``plane`` (the plane interfaces and ``TransportPlugin``), ``options`` (options from a config's plain
values, and their range checks), ``messages``, ``zmq_backend``,
``nixl_backend`` (``nixl_common``, ``nixl_receiver``, ``nixl_sender``; with ``staging``, its packing
slots) and ``nccl_backend``.

A node is configured with ``auto``, one name, or a comma-separated order of preference. A
sender offers its list at set-up and the receiver takes the first one it accepts too, so two
``auto`` nodes agree on the best transport both have; with nothing in common the set-up is
refused, naming both lists. ``auto`` is nixl > nccl > zmq (``REGISTRY``'s order) among what is
available on a host with CUDA, and zmq alone on a CPU-only host, where zmq is the default (pick
``nixl`` or ``nccl`` explicitly to move DRAM with them).
"""

import functools
import json
import logging
from collections.abc import Sequence

from pdserve.kv_transfer import nccl_backend, nixl_backend, options, sim_backend, zmq_backend
from pdserve.kv_transfer.base import (
    KVHandshakeRefused,
    KVReceiver,
    KVRefused,
    KVSender,
    KVSendFuture,
    KVTransferError,
    ReservationTable,
    check_compatible,
)
from pdserve.kv_transfer.control_receiver import ControlReceiver
from pdserve.kv_transfer.control_sender import ControlSender
from pdserve.kv_transfer.nccl_backend import NcclOptions
from pdserve.kv_transfer.nixl_common import NixlOptions
from pdserve.kv_transfer.plane import TransportPlugin
from pdserve.kv_transfer.sim_backend import SimOptions
from pdserve.kv_transfer.staging import StagingOptions
from pdserve.kv_transfer.zmq_backend import ZmqOptions

__all__ = [
    "KVReceiver",
    "KVHandshakeRefused",
    "KVRefused",
    "KVSender",
    "KVSendFuture",
    "KVTransferError",
    "NcclOptions",
    "NixlOptions",
    "REGISTRY",
    "SimOptions",
    "ReservationTable",
    "StagingOptions",
    "TRANSPORTS",
    "TransportPlugin",
    "ZmqOptions",
    "auto_transports",
    "available_transports",
    "check_compatible",
    "create_receiver",
    "create_sender",
    "options_from_config",
    "resolve_transport",
    "transport_preferences",
]

REGISTRY: dict[str, TransportPlugin] = {
    "nixl": nixl_backend.PLUGIN,
    "nccl": nccl_backend.PLUGIN,
    "zmq": zmq_backend.PLUGIN,
    "sim": sim_backend.PLUGIN,
}
"""Every transport, best first (the order ``auto`` prefers; ``auto`` leaves out those not
``in_auto``)."""

TRANSPORTS = tuple(REGISTRY)

logger = logging.getLogger(__name__)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def available_transports() -> tuple[str, ...]:
    """Transports that can run here, best first (nccl runs on gloo without CUDA)."""
    return tuple(name for name, plugin in REGISTRY.items() if plugin.available())


def auto_transports() -> tuple[str, ...]:
    """What ``auto`` offers and accepts: all available transports, best first, on a CUDA host; those
    meant for the CPU (zmq) on a CPU-only one."""
    cuda = _cuda()
    return tuple(
        name
        for name in available_transports()
        if REGISTRY[name].in_auto and (cuda or REGISTRY[name].auto_on_cpu)
    )


def transport_preferences(name: str) -> tuple[str, ...]:
    """``auto``, one transport, or a comma-separated order of preference -> available names."""
    if name == "auto":
        return auto_transports()
    names = tuple(dict.fromkeys(part.strip() for part in name.split(",") if part.strip()))
    unknown = [n for n in names if n not in REGISTRY]
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


def options_from_config(config: str) -> tuple[object, ...]:
    """A node's ``--kv-transfer-config``: a JSON object of option objects by transport, e.g.
    ``{"nixl": {"ucx_net_devices": "mlx5_0:1", "staging": {"num_slots": 2}}, "zmq":
    {"max_frame_bytes": 4194304}}``, as each transport's options (``NixlOptions``, ...: the fields
    named, the defaults for the rest); "" gives none (every transport's defaults). Raises ValueError
    naming the transport and field of anything it cannot take: an unknown transport or field, a
    value of the wrong type or out of range. The sim transport's options are the simulated engine's
    (its calibrated link), not set here."""
    if not config.strip():
        return ()
    try:
        values = json.loads(config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object by transport, got {config!r}")
    settable = [name for name, plugin in REGISTRY.items() if plugin.in_auto]
    unknown = [name for name in values if name not in settable]
    if unknown:
        raise ValueError(
            f"--kv-transfer-config names {', '.join(map(repr, unknown))}: options are given for "
            f"{', '.join(settable)} (a simulated engine sets the sim transport's)"
        )
    return tuple(
        options.from_mapping(REGISTRY[name].options, given, f"--kv-transfer-config {name}")
        for name, given in values.items()
    )


def _plugins(name: str, options: Sequence[object], side: str) -> list[tuple[TransportPlugin, object]]:
    """The plugins ``name`` selects, in order of preference, each with its options object from
    ``options`` (matched by type; the defaults where none is given); logs those that are not the
    defaults (what a node's ``--kv-transfer-config`` set), for the ``side`` they configure."""
    known = tuple(plugin.options for plugin in REGISTRY.values())
    stray = [type(o).__name__ for o in options if not isinstance(o, known)]
    if stray:
        raise TypeError(f"not a KV transport's options: {', '.join(stray)}")
    chosen = []
    for transport in transport_preferences(name):
        plugin = REGISTRY[transport]
        given = [o for o in options if isinstance(o, plugin.options)]
        chosen.append((plugin, given[-1] if given else plugin.options()))
        if given and given[-1] != plugin.options():
            logger.info("KV %s: %s with %r", side, transport, given[-1])
    return chosen


def create_receiver(
    name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_token: str = "",
    options: Sequence[object] = (),
    lane_port: int = 0,
) -> KVReceiver:
    """A decode-side receiver accepting ``name``'s transports (see ``transport_preferences``),
    each configured by its options object in ``options`` (defaults for the others), taking lanes
    on ``lane_port`` (0: a free port)."""
    planes = [plugin.receiver_plane(opts) for plugin, opts in _plugins(name, options, "receiver")]
    return ControlReceiver(planes, host, port, cluster_token, lane_port)


def create_sender(
    name: str, cluster_token: str = "", options: Sequence[object] = (), connections: int = 1
) -> KVSender:
    """A prefill-side sender offering ``name``'s transports in order (see ``transport_preferences``),
    each configured by its options object in ``options`` (defaults for the others), over
    ``connections`` connections to each peer (``ControlSender``)."""
    planes = [plugin.sender_plane(opts) for plugin, opts in _plugins(name, options, "sender")]
    return ControlSender(planes, cluster_token, connections)
