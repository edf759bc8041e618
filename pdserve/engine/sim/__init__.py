"""The simulated engine: ``--model sim:<shape>@<gpu>`` (e.g. ``sim:llama-3-8b@h100``).

Everything of an engine runs for real (scheduler, block pool, KV cache manager, prefix cache,
requests, detokenizer) except the model's forward and the sampler, which ``LLMEngine`` replaces at
construction by ``SimModelRunner`` and ``SimSampler`` (``runner``): each step sleeps for the time
``StepTimeModel`` (``step_time``) gives it on the GPU that ``SimCalibration`` (``calibration``)
describes, measured by this project's own GPU benchmarks. A node built on such an engine serves,
routes, reserves, leases and ships KV as a real one does (the ``sim`` KV transport models the
link's time), at a few percent of a CPU core, so a cluster of dozens of nodes runs on one host.
Its figures are a model's: nodes say so (``pdserve_simulated 1``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.config import EngineConfig, dtype_name
from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.sim.calibration import LinkModel, SimCalibration, load_calibration

__all__ = ["LinkModel", "SimCalibration", "Simulation", "load_calibration", "simulated_config"]


@dataclass(frozen=True)
class Simulation:
    """What a simulated engine tells its node: the GPU it models and its KV link."""

    gpu: str
    calibration: SimCalibration
    kv_bytes_per_block: int
    """Bytes a KV block of the simulated model holds on the GPU (what the link would move)."""

    @property
    def link(self) -> LinkModel:
        return self.calibration.link


def simulated_config(config: EngineConfig, arch: ArchConfig) -> EngineConfig:
    """The engine config of a simulated node: the host's CPU holds the (tiny) KV cache, the
    checkpoint's dtype is what is modelled, and steps are scheduled asynchronously as on CUDA
    unless asked otherwise."""
    model, scheduler = config.model, config.scheduler
    dtype = dtype_name(arch.dtype) if model.dtype == "auto" else model.dtype
    async_scheduling = True if scheduler.async_scheduling is None else scheduler.async_scheduling
    return dataclasses.replace(
        config,
        model=dataclasses.replace(model, dtype=dtype),
        scheduler=dataclasses.replace(scheduler, async_scheduling=async_scheduling),
        device=dataclasses.replace(config.device, device="cpu"),
    )
