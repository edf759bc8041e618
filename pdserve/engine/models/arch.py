"""The architecture description pdserve needs, read from an HF ``config.json``.

One frozen dataclass covers the Llama family (Llama 2/3, SmolLM2, Mistral without
sliding window), Qwen2/2.5 (bias on q/k/v) and Qwen3 (per-head q/k RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    """default, linear or llama3."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"unsupported rope scaling type {self.type!r} (supported: default, linear, llama3)"
            )


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    dtype: torch.dtype = torch.bfloat16
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_size * dtype.itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], max_model_len: int | None = None) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        max_pos = cfg.get("max_position_embeddings", 2048)
        if arch == "MistralForCausalLM":
            window = cfg.get("sliding_window")
            if window is not None and window < (max_model_len or max_pos):
                raise ValueError(
                    f"Mistral sliding_window {window} is shorter than max_model_len "
                    f"{max_model_len or max_pos}; sliding-window attention is not supported "
                    f"(pass max_model_len <= {window})"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "Qwen3ForCausalLM":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=cfg.get("hidden_act", "silu"),
            dtype=_TORCH_DTYPES.get(dtype_name, torch.bfloat16),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
