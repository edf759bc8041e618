"""The engine's public API for node services: load counts, request ids, pins on held blocks,
launch listeners. Plain values in and out; the scheduler's own bookkeeping checked after each."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineLoad, LaunchedChunk
from pdserve.kernels.triton_utils import num_jit_compiles
from pdserve.sampling_params import SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16


@pytest.fixture
def engine():
    config = EngineConfig.from_kwargs(
        model="random:tiny", num_kv_blocks=32, block_size=16, max_model_len=256, num_threads=1
    )
    engine = LLMEngine(config)
    yield engine
    engine.scheduler.check_integrity()


def _run_until_held(engine: LLMEngine, request_id: str) -> None:
    engine.add_request(
        request_id, None, SamplingParams(max_tokens=1), prompt_token_ids=PROMPT, hold_blocks=True
    )
    while engine.held_block_ids(request_id) is None:
        engine.step()


def test_load_counts_queues_blocks_and_pending_prompt_tokens(engine):
    # The last field counts the process's Triton compiles: 0 on the CPU, the warm-up's on CUDA.
    assert engine.load() == EngineLoad(0, 0, 0, 0, 32, 32, 0, 0, 0, num_jit_compiles())
    engine.add_request("a", None, SamplingParams(max_tokens=3), prompt_token_ids=PROMPT)
    engine.add_request("b", None, SamplingParams(max_tokens=3), prompt_token_ids=[7] * 20)
    load = engine.load()
    assert (load.num_waiting, load.num_running, load.num_pending_prompt_tokens) == (2, 0, 60)
    assert engine.request_ids() == ["a", "b"] and engine.has_request("a") and not engine.has_request("x")
    engine.step()
    load = engine.load()
    assert (load.num_waiting, load.num_running, load.num_pending_prompt_tokens) == (0, 2, 0)
    assert load.num_free_blocks == engine.num_free_blocks == 32 - 3 - 2
    assert load.num_prompt_tokens_computed == 60
    while engine.has_work():
        engine.step()
    assert engine.request_ids() == [] and engine.load().num_free_blocks == 32


def test_blocks_for_tokens_and_computed_prefix_of_a_reservation(engine):
    assert [engine.blocks_for_tokens(n) for n in (0, 1, 16, 17, 41)] == [0, 1, 1, 2, 3]
    engine.add_request("p", None, SamplingParams(max_tokens=1), prompt_token_ids=PROMPT)
    while engine.has_work():
        engine.step()
    assert engine.reserve_remote("r", PROMPT + [99] * 10, SamplingParams(max_tokens=2)) is not None
    assert engine.num_computed_tokens("r") == 32  # two full blocks shared from the prefix cache
    assert engine.load().num_waiting_for_kv == 1 and engine.num_preemptions("r") == 0
    with pytest.raises(KeyError):
        engine.num_computed_tokens("unknown")
    engine.abort_request(["r"])


def test_a_pin_keeps_held_blocks_through_an_abort_until_unpinned(engine):
    _run_until_held(engine, "h")
    src = engine.held_block_ids("h")
    assert len(src) == 3 and engine.load().num_held == 1 and engine.request_ids() == ["h"]
    engine.pin_held("h")
    engine.abort_request(["h"])
    assert engine.held_block_ids("h") == src and engine.has_request("h")
    assert engine.num_free_blocks == 32 - 3
    engine.scheduler.check_integrity()
    engine.unpin_held("h")  # the release that came while pinned happens now
    assert engine.held_block_ids("h") is None and not engine.has_request("h")
    assert engine.num_free_blocks == 32
    with pytest.raises(KeyError):
        engine.pin_held("h")


def test_unpinning_without_a_release_keeps_the_blocks_held(engine):
    _run_until_held(engine, "h")
    engine.pin_held("h")
    engine.unpin_held("h")
    assert len(engine.held_block_ids("h")) == 3
    engine.release_held("h")
    assert engine.held_block_ids("h") is None and engine.num_free_blocks == 32


def test_launch_listeners_get_each_launched_chunk_as_plain_values(engine):
    seen: list[tuple[list[LaunchedChunk], object]] = []

    def listener(chunks: list[LaunchedChunk], layer_events: list | None) -> None:
        seen.append((chunks, layer_events))

    engine.add_launch_listener(listener)
    _run_until_held(engine, "h")
    ((chunks, layer_events),) = seen  # one step computed the whole prompt
    assert layer_events is None  # CPU: everything queued so far is written
    assert chunks == [LaunchedChunk("h", 0, 40, 40, 0, tuple(engine.held_block_ids("h")))]
    engine.remove_launch_listener(listener)
    engine.add_request("b", None, SamplingParams(max_tokens=2), prompt_token_ids=PROMPT)
    while engine.has_work():
        engine.step()
    assert len(seen) == 1
    engine.release_held("h")
