"""Model sources resolved by ``pdserve.model_source``, built and loaded here."""

from __future__ import annotations

import torch

from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.models.loader import build_model, init_random_weights, load_weights
from pdserve.model_source import ModelSource


def load_model(
    source: ModelSource,
    arch: ArchConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> CausalLM:
    model = build_model(arch, max_positions, device, dtype)
    if source.weights_dir is None:
        init_random_weights(model, seed)
    else:
        load_weights(model, source.weights_dir)
    return model
