"""`pdserve bench serve` with token-id prompts (models without a tokenizer, random weights)."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks.serve_client import COMPLETIONS, RequestOptions, _Stream
from pdserve.benchmarks.serve_datasets import Message, parse_jsonl_line, render_prompt


def test_jsonl_token_id_prompt_becomes_a_raw_completions_prompt():
    conv = parse_jsonl_line({"prompt": [5, 6, 7], "output_len": 4}, 16)
    (turn,) = conv.turns
    assert turn.content == (5, 6, 7) and turn.output_len == 4
    body = RequestOptions(endpoint=COMPLETIONS, model="m").body([Message("user", turn.content)], 4)
    assert body["prompt"] == [5, 6, 7]
    with pytest.raises(ValueError, match="/v1/completions"):
        RequestOptions(model="m").body([Message("user", turn.content)], 4)
    with pytest.raises(ValueError, match="mixes"):
        render_prompt([Message("system", "x"), Message("user", (1,))])
    for bad in ([], [1, -2], [1.5], [True]):
        with pytest.raises(ValueError, match="token-id prompt"):
            parse_jsonl_line({"prompt": bad}, 16)


def test_chunks_with_logprobs_and_no_text_count_as_steps():
    s = _Stream(start=0.0)

    def chunk(text: str, tokens: list[str], finish=None) -> str:
        lp = {"tokens": tokens, "token_logprobs": [0.0] * len(tokens)}
        return json.dumps({"choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})

    assert s.event(chunk("", ["token_id:5"]), chat=False)
    assert s.event(chunk("", ["token_id:6"]), chat=False)
    assert s.event(chunk("", ["token_id:7"], "length"), chat=False)
    assert s.event(json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), chat=False)
    assert not s.event("[DONE]", chat=False)
    assert s.num_chunks == 3 and s.ttft is not None and len(s.itl) == 2
    assert s.token_ids == [5, 6, 7]


def test_token_id_conversation_carries_the_answers_ids_into_the_next_turn():
    conv = parse_jsonl_line({"system": [1, 2], "turns": [[3], [4, 5]], "output_len": [2, 3]}, 16)
    assert conv.preamble == (Message("system", (1, 2)),)
    assert [t.content for t in conv.turns] == [(3,), (4, 5)] and [t.output_len for t in conv.turns] == [2, 3]
    history = [*conv.preamble, Message("user", (3,)), Message("assistant", (9, 9)), Message("user", (4, 5))]
    assert render_prompt(history) == [1, 2, 3, 9, 9, 4, 5]
    with pytest.raises(ValueError, match="token-id turns"):
        parse_jsonl_line({"turns": [[3], []]}, 16)
