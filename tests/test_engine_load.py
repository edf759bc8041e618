"""The load a node reports for routing: pending prompt tokens net of the prefix cache."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams


def test_pending_prompt_tokens_count_only_what_is_not_cached():
    engine = LLMEngine(
        EngineConfig.from_kwargs(model="random:tiny", num_kv_blocks=64, block_size=16, max_model_len=512)
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prefix = list(range(1, 97))  # 6 full blocks
    engine.add_request("a", None, params, prompt_token_ids=prefix + [200, 201])
    assert engine.num_pending_prompt_tokens() == 98  # nothing cached yet
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_pending_prompt_tokens() == 0
    engine.add_request("b", None, params, prompt_token_ids=prefix + list(range(300, 320)))
    engine.add_request("c", None, params, prompt_token_ids=list(range(400, 450)))
    assert engine.num_pending_prompt_tokens() == (116 - 96) + 50
    engine.step()  # both admitted: the estimate gives way to what was computed
    assert engine.num_pending_prompt_tokens() == 0
