"""The offline API end to end on the default model: stop strings, seeds, logprobs, chat, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=512)


def test_stop_string_truncates_text(llm):
    base = llm.generate("The days of the week are Monday,", SamplingParams(temperature=0, max_tokens=30))[0]
    text = base.outputs[0].text
    assert "Wednesday" in text, text
    out = llm.generate(
        "The days of the week are Monday,", SamplingParams(temperature=0, max_tokens=30, stop=["Wednesday"])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Wednesday"
    assert out.text == text[: text.index("Wednesday")]
    kept = llm.generate(
        "The days of the week are Monday,",
        SamplingParams(temperature=0, max_tokens=30, stop=["Wednesday"], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: text.index("Wednesday") + len("Wednesday")]


def test_stop_token_ids_and_length(llm):
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop_id = base.token_ids[3]
    out = llm.generate(
        "Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    short = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 2


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Tell me a story about a fox.", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=10 + i) for i in range(3)]
    batch = llm.generate(
        ["Hi", "Tell me a story about a fox.", "What is 2+2?", "Name a color."],
        [others[0], seeded, others[1], others[2]],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate("Tell me a story about a fox.", other_seed)[0].outputs[0].token_ids != alone


def test_logprobs_match_model_distribution(llm):
    out = llm.generate("Paris is the capital of", SamplingParams(temperature=0, max_tokens=3, logprobs=5))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    first = completion.logprobs[0]
    assert first.rank == 1 and first.token_id == completion.token_ids[0]
    assert [t for t, _ in first.top][0] == first.token_id and len(first.top) == 5
    # Teacher-forced check against a full forward through transformers.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    ref = torch.log_softmax(logits.float(), -1)
    assert abs(ref[first.token_id].item() - first.logprob) < 1e-4
    assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text


def test_invalid_inputs_are_refused(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]})
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 9000})
    # Nothing leaked by the refused requests.
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.engine.has_unfinished_requests()


def test_cli_generate_prints_text(default_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "16",
            "--num-threads",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
