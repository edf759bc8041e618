"""What both sides of the NIXL transport share: its options, nixl's Python API (whichever build is
installed) and agents, and a cache's memory as NIXL names it. The transport itself:
``kv_transfer.nixl_backend``."""

from __future__ import annotations

import contextlib
import importlib
import uuid
from dataclasses import dataclass, field
from types import ModuleType

import torch

from pdserve import envs
from pdserve.kv_transfer.base import KVLayout, region_bytes, slab_bytes
from pdserve.kv_transfer.options import require
from pdserve.kv_transfer.staging import StagePool, StagingOptions


@dataclass(frozen=True)
class NixlOptions:
    max_desc_bytes: int = 0
    """Longest descriptor of a READ (a multiple of the slab size; 0: runs are never cut). Cutting
    long runs lets UCX move pieces of one READ on several lanes where the transport has them."""
    max_read_s: float = 10.0
    """A READ still running after this long is cancelled (it takes milliseconds on any sane link);
    it bounds how long the engine thread's ``ReservationTable.release`` can wait."""
    prepared_max_blocks: int = 512
    """A READ of at most this many blocks (block-major, every layer) takes a descriptor per block
    by index from the lists prepared once even where its blocks are consecutive (NIXL merges the
    consecutive ones again); longer ones one descriptor per run, built for the READ (``coalesce``,
    ``get_xfer_descs``, ``initialize_xfer``: ~35 us of the control thread at 128 blocks on the
    2-core box, against ~10 by index). The READ alone (``pdserve.benchmarks.nixl_read_setup``, one
    H200, two processes, medians): built 28.8 / 31.9 / 58.5 / 153.5 / 535.1 us against prepared
    19.6 / 23.3 / 51.6 / 150.2 / 550.9 at 1 / 8 / 32 / 128 / 512 blocks of 2 MiB. Whole sends
    (``kv_s18_variants_same_gpu_h200.json``, one H200, 4 runs each): 256 MiB (128 blocks) in
    446-578 us best with a limit of 64, 382-445 with 512; 16 and 64 MiB, whose READs were
    prepared either way, moved as much between the runs of the same code (~50 us)."""
    descriptors_per_piece: int = 100
    """A send is packed into staging slots (gather, one READ a slot, scatter) when READ in place it
    would take more than this many descriptors for each piece it takes packed. Between two processes
    on one H100 (``docs/benchmarks/kv_transfer_same_gpu_h100.json``) a descriptor cost ~8 us of a
    READ, a packed piece ~0.8 ms of both nodes' time: in-place READs of blocks in order ran at 67
    GB/s (64 MiB) to 581 (1 GiB), packed ones at 28-55; shuffled blocks, one descriptor per 64 KiB
    slab, at 8-12 in place and 28-55 packed."""
    pack_on_cpu: bool = False
    """DRAM caches are read in place (packing costs two more copies on the CPU, and a descriptor
    little); tests set this to run the packed path on the CPU."""
    settle_spin_s: float = 1e-3
    """On a GPU, after a send's last READ started, the control thread polls it in a tight loop until
    it ends, for at most this long, before it goes back to its turns (each a ``YIELD_S`` sleep
    and the loop's own work): the commit and ack go out as the READ ends. On one H200 a READ of
    256 MiB (~150-200 us) outlasted the 75 us this was before, and each turn after it cost more
    than the ~12-17 us measured back to back (``nixl_read_setup_polls_h200.json``): 256 MiB sends
    in 321 / 337 us best with 1 ms (and ``prepared_max_blocks`` 512), 382-445 with 75 us
    (``kv_s18_variants_same_gpu_h200.json``). The GIL is held meanwhile, once per send, for as
    long as its READ runs (a 1 GiB READ ~0.6 ms); a decode engine's thread that asks for it gets
    it after the core process's switch interval at most (``engine_core.GIL_SWITCH_INTERVAL_S``,
    0.5 ms). 0 turns it off."""
    layer_chunk_bytes: int = 32 << 20
    """With per-layer events, a send is offered in READs of layer chunks of about this size, each as
    soon as its layers are written."""
    staging: StagingOptions = field(default_factory=StagingOptions)
    """The staging slots packed sends go through, on both sides."""
    ucx_net_devices: str = ""
    """UCX's network devices (NIXL's ``ucx_devices``; e.g. ``mlx5_0:1``); "" lets UCX choose."""
    ucx_tls: str = ""
    """UCX_TLS for the process's agents ("" leaves the operator's or UCX's choice)."""
    progress_thread: bool = False
    """Run NIXL's progress thread in each agent (NIXL's own default). Off: the decode node's control
    loop progresses UCX while its READs run, the prefill node's peer thread every millisecond while
    it waits (``kv_transfer.nixl_backend``); idle, the thread costs ~40% of a core, and on one H100
    (P and D processes on it) it made no send faster: nixl at 16 / 64 / 256 MiB 58-74 / 206-307 /
    453-593 GB/s with it, 65-92 / 224-297 / 522-673 without (``kv_s17_prog_*``)."""

    def __post_init__(self) -> None:
        require(
            self,
            positive=("max_read_s", "layer_chunk_bytes"),
            non_negative=("max_desc_bytes", "prepared_max_blocks", "descriptors_per_piece", "settle_spin_s"),
        )


NIXL_BUILDS = ("nixl_cu13", "nixl_cu12")
"""nixl's per-CUDA builds (PyPI ``nixl-cu13``, ``nixl-cu12``), tried in this order without the meta
package ``nixl``, which picks the build matching torch's CUDA but installs both (the tests install
one, see pyproject.toml)."""


def nixl_api() -> ModuleType:
    """nixl's Python API (``nixl_agent``, ``nixl_agent_config``, ...): the meta package's when it is
    installed, else that of the one build that is. Raises ImportError without either."""
    try:
        import nixl._api as api
    except ModuleNotFoundError as e:
        if e.name != "nixl":
            raise
        for build in NIXL_BUILDS:
            try:
                return importlib.import_module(f"{build}._api")
            except ModuleNotFoundError as missing:
                if missing.name != build:
                    raise
        raise ImportError(f"nixl is not installed (neither `nixl` nor one of {NIXL_BUILDS})") from e
    return api


def nixl_version() -> str:
    """The installed nixl's version: the meta package's, else that of the build that is installed
    (``NIXL_BUILDS``; a machine may have a build without the meta package, as the tests install
    it); "" when none says."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl", *(build.replace("_", "-") for build in NIXL_BUILDS)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def nixl_available() -> bool:
    try:
        nixl_api()
    except Exception:  # ImportError, or a wheel that cannot load its libraries here
        return False
    return True


def make_agent(role: str, options: NixlOptions):
    api = nixl_api()
    # UCX reads its environment when the backend starts, just below: CUDA IPC READs on unless the
    # operator chose otherwise (``envs.UCX_CUDA_IPC_GET_ZCOPY_DEFAULT`` says why), ``ucx_tls``.
    envs.set_up_ucx(options.ucx_tls)
    config = api.nixl_agent_config(
        enable_prog_thread=options.progress_thread,
        backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = api.nixl_agent(f"pdserve-{role}-{uuid.uuid4().hex[:12]}", config)
    devices = options.ucx_net_devices
    agent.create_backend("UCX", {"ucx_devices": devices} if devices else {})
    return agent


def on_device(t: torch.Tensor):
    """Make the tensor's CUDA context current on this thread (UCX asks the driver about pointers)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def device_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


def gpu_uuid(t: torch.Tensor) -> str:
    """The UUID of the GPU holding ``t`` (the same GPU whatever a process's device numbering); ""
    for a CPU tensor or where torch does not say."""
    if not t.is_cuda:
        return ""
    return str(getattr(torch.cuda.get_device_properties(t.device), "uuid", "") or "")


class CacheEnd:
    """A plane's side of its cache, the same on both nodes (``take_cache``): its layout, GPU and
    staging pool, and an agent of its own with the whole cache and the pool registered once."""

    options: NixlOptions

    def take_cache(self, kv: torch.Tensor, role: str) -> None:
        self.kv = kv
        self.slab_bytes = slab_bytes(kv)
        self.layout = KVLayout.of(kv)
        self.gpu = gpu_uuid(kv)
        self.pool = StagePool(kv, self.options.staging)
        with on_device(kv):
            self.agent = make_agent(role, self.options)
            self._registered = self.agent.register_memory(region_bytes(kv))
            self._registered_pool = self.agent.register_memory(self.pool.buf)
            self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
