"""Model sources: presets, HF folders, and clear errors for bad weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.models.loader import WeightError


def test_random_tiny_preset_generates():
    llm = LLM("random:tiny", max_num_batched_tokens=128)
    outs = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}, "hello"], SamplingParams(temperature=0, max_tokens=5)
    )
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    again = LLM("random:tiny", max_num_batched_tokens=128).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=5)
    )
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # seeded weights


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither 'default'"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="unknown preset"):
        LLM("random:gpt-5")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst / "model.safetensors"


def test_missing_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models["qwen2"], tmp_path / "m")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path)
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        LLM(str(path.parent))


def test_mismatched_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models["qwen3"], tmp_path / "m")
    tensors = load_file(path)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path)
    with pytest.raises(WeightError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight'.*shape \(3, 3\)"):
        LLM(str(path.parent))


def test_unexpected_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models["llama3"], tmp_path / "m")
    tensors = load_file(path)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(WeightError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        LLM(str(path.parent))
