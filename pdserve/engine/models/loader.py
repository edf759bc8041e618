"""Build a model on its device and fill it: from an HF folder's safetensors or with random weights.

Checkpoint tensors keep their HF names; q/k/v and gate/up land in slices of the
fused ``qkv_proj`` and ``gate_up_proj``. Every slice must be written exactly once
with the right shape, or loading fails with an error naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.models.arch import ArchConfig
from pdserve.engine.models.llama import CausalLM


class WeightError(ValueError):
    """Missing, unexpected or mis-shaped checkpoint tensors."""


@dataclass(frozen=True)
class _Slot:
    param: str
    start: int | None = None  # row range inside a fused parameter
    stop: int | None = None


def _slots(arch: ArchConfig, name: str) -> _Slot:
    """Where checkpoint tensor ``name`` goes."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    for src, (dst, start, stop) in fused.items():
        if f".{src}." in name:
            return _Slot(name.replace(src, dst), start, stop)
    return _Slot(name)


def expected_checkpoint_names(arch: ArchConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(p + f"self_attn.{proj}.weight")
            if (proj != "o_proj" and arch.qkv_bias) or (proj == "o_proj" and arch.o_bias):
                names.append(p + f"self_attn.{proj}.bias")
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(p + f"mlp.{proj}.weight")
            if arch.mlp_bias:
                names.append(p + f"mlp.{proj}.bias")
    return names


def build_model(arch: ArchConfig, max_positions: int, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """An uninitialized model: parameters allocated on ``device`` in ``dtype``, never on the host first."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(arch, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    model.model.rotary.init_table()
    return model.eval().requires_grad_(False)


def load_weights(model: CausalLM, folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {folder}")

    def tensors() -> Iterator[tuple[str, str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, file.name, f.get_tensor(name)

    load_named_tensors(model, tensors(), str(folder))


def load_named_tensors(model: CausalLM, tensors: Iterable[tuple[str, str, torch.Tensor]], where: str) -> None:
    """Copy ``(hf_name, origin, tensor)`` triples into the model; every expected tensor exactly once."""
    arch = model.arch
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(expected_checkpoint_names(arch))
    seen: set[str] = set()
    for name, origin, tensor in tensors:
        if name not in expected:
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # some tied checkpoints still store the head
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise WeightError(f"unexpected tensor {name!r} in {origin}")
        slot = _slots(arch, name)
        target = params[slot.param]
        if slot.start is not None:
            target = target[slot.start : slot.stop]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightError(
                f"tensor {name!r} in {origin} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        seen.add(name)
    missing = sorted(expected - seen, key=lambda n: (len(n), n))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"missing tensor {missing[0]!r}{more} in {where}")


def init_random_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights with real shapes: N(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
