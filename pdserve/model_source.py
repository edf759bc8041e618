"""Where a model comes from: the default model, an HF folder or a random-weight preset with real
shapes. Torch-free, so the proxy resolves a model's tokenizer without loading torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import DEFAULT_MODEL, ModelConfig

# HF-style configs of the presets. Shapes are the real models'; weights are N(0, 0.02).
_PRESETS: dict[str, dict] = {
    "tiny": {
        # vocab of SmolLM2, so the default model's tokenizer serves it
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "dtype": "float32",
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 128001,
        "bos_token_id": 128000,
        "dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
    },
}

RANDOM_PREFIX = "random:"
SIM_PREFIX = "sim:"
"""``sim:<shape>@<gpu>``: a preset's shape on a simulated GPU (``pdserve.engine.sim``)."""


def preset_names() -> list[str]:
    return [RANDOM_PREFIX + name for name in _PRESETS]


def sim_names() -> list[str]:
    return [f"{SIM_PREFIX}{name}@<gpu>" for name in _PRESETS]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's architecture, weights and tokenizer come from."""

    model_id: str
    """Stable name: namespaces block hashes and is what /v1/models lists."""
    hf_config: dict
    weights_dir: Path | None
    """None for random-weight presets."""
    tokenizer_dir: Path | None
    """None when the model has no tokenizer: prompts must then be token ids."""
    simulated_gpu: str = ""
    """For ``sim:<shape>@<gpu>``: the GPU whose step times the engine models (its forward is not
    run); empty for a real model."""


def resolve_model(config: ModelConfig) -> ModelSource:
    from pdserve.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    name = config.model
    if name == DEFAULT_MODEL:
        folder = ensure_default_model(config.resolved_cache_dir)
        return ModelSource(DEFAULT_MODEL_NAME, read_hf_config(folder), folder, folder)
    if name.startswith(RANDOM_PREFIX):
        preset = name[len(RANDOM_PREFIX) :]
        if preset not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {preset_names()}")
        tokenizer_dir = None
        if _PRESETS[preset]["vocab_size"] == 49152:
            tokenizer_dir = ensure_default_model(config.resolved_cache_dir)
        return ModelSource(name, dict(_PRESETS[preset]), None, tokenizer_dir)
    if name.startswith(SIM_PREFIX):
        shape, _, gpu = name[len(SIM_PREFIX) :].partition("@")
        if shape not in _PRESETS or not gpu:
            raise ValueError(
                f"unknown simulated model {name!r}; write one of {sim_names()}, e.g. sim:llama-3-8b@h100"
            )
        # Simulated tokens stay inside the default model's vocabulary: its tokenizer serves every shape.
        tokenizer_dir = ensure_default_model(config.resolved_cache_dir)
        return ModelSource(name, dict(_PRESETS[shape]), None, tokenizer_dir, simulated_gpu=gpu)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither 'default', a random preset ({', '.join(preset_names())}), "
            f"a simulated one (sim:<shape>@<gpu>) nor an HF-format folder "
            "(pdserve loads nothing from the network)"
        )
    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return ModelSource(folder.name, read_hf_config(folder), folder, folder if has_tokenizer else None)


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not an HF model folder: config.json is missing")
    return json.loads(path.read_text())
