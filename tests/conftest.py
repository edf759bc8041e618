"""Shared fixtures: torch threads, the default model folder, tiny random HF checkpoints, local
clusters of real processes."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

# Installs pdserve's finder before any test imports transformers: with the checkout's root on
# sys.path (``python -m pytest`` run in it), its kernels/ would shadow Hugging Face's ``kernels``.
import pdserve  # noqa: F401

if not torch.cuda.is_available():
    # Triton decides interpreter or compiler when a kernel is defined: set it before any import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores are shared between test processes; one intra-op thread avoids oversubscription.
torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "2")))


def _slow_enabled(config) -> bool:
    return os.environ.get("PDSERVE_SLOW") == "1" or "slow" in (config.getoption("-m", default="") or "")


def pytest_collection_modifyitems(config, items):
    if not _slow_enabled(config):
        skip_slow = pytest.mark.skip(reason="slow: set PDSERVE_SLOW=1 or pass -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault-injection suite's table (pdserve/benchmarks/faults.py), when its scenarios ran."""
    import sys

    faults = sys.modules.get("pdserve.benchmarks.faults")
    if faults is None or not faults.RESULTS:
        return
    terminalreporter.section("fault injection: every request ends, no block leaks")
    for line in faults.format_table(faults.RESULTS).splitlines():
        terminalreporter.write_line(line)
    report = os.environ.get("PDSERVE_FAULT_REPORT") or faults.REPORT_PATH
    if report:
        terminalreporter.write_line(f"report: {report}")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pdserve.config import ModelConfig
    from pdserve.default_model import ensure_default_model

    return ensure_default_model(ModelConfig().resolved_cache_dir)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give biases and norm weights non-trivial values, so loading them wrongly shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)


def make_tiny_hf_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a small random HF checkpoint of ``arch`` (qwen2, qwen3, llama3) into ``folder``."""
    import transformers

    common = dict(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        eos_token_id=7,
        bos_token_id=1,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    _randomize(model, seed)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_hf_model(root / arch, arch) for arch in ("qwen2", "qwen3", "llama3")}


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, for one test (installed by the README test command)."""
    from pdserve.cluster import LocalRedis

    server = LocalRedis(tmp_path / "redis.log")
    if not server.binary:
        pytest.fail("redis-server is missing: the README test command installs it with apt-get")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_cluster(
    tmp_path_factory, engine_flags: Sequence[str] = (), model: str = "default", **options
) -> Iterator:
    """A ``LocalCluster`` of real processes on the default model (or ``model``, e.g. a simulated
    one): a free port, one torch thread per node, logs in a fresh temporary folder, ``options``
    for the rest of its ``ClusterConfig``. Stopped (proxies drained, then nodes) on exit, whatever
    happened."""
    from pdserve.cluster import ClusterConfig, LocalCluster, free_port
    from pdserve.config import ModelConfig

    options.setdefault("port", free_port())
    options.setdefault("threads_per_node", 1)
    options.setdefault("log_dir", str(tmp_path_factory.mktemp("logs")))
    flags = list(engine_flags) if model == "default" else ["--model", model, *engine_flags]
    cluster = LocalCluster(ClusterConfig(**options), flags, ModelConfig(model=model))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def start_cluster(default_model_dir, tmp_path_factory):
    """The one way tests start a cluster: ``with start_cluster(flags, prefill_nodes=2) as c: ...``
    (in a module-scoped fixture, so a module's tests share it)."""
    return functools.partial(running_cluster, tmp_path_factory)


@pytest.fixture
def kv_benchmark(tmp_path):
    """Runs the kv_transfer benchmark's dry run on the CPU with ``flags`` (transports, anchors...),
    20 one-block sends and a breakdown of 5 sends a size; returns its JSON."""

    def run(*flags: str) -> dict:
        import json

        from pdserve.benchmarks import kv_transfer as bench

        out = tmp_path / "kv.json"
        bench.main(
            [
                "--dry-run",
                "--device",
                "cpu",
                *flags,
                "--one-block-count",
                "20",
                "--breakdown",
                "--size-breakdown-count",
                "5",
                "--output",
                str(out),
            ]
        )
        return json.loads(out.read_text())

    return run
