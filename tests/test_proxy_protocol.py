"""The proxy's OpenAI protocol: request validation into SamplingParams, error bodies, and the
responses and SSE chunks built from TokenEvents (checked against the openai client's types)."""

from __future__ import annotations

import json

import msgspec
import pytest

from pdserve.messages import LogprobsMsg, TokenEvent
from pdserve.proxy.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProxyError,
    chat_messages,
    check_model,
    completion_prompts,
    error_body,
    sampling_params,
)
from pdserve.proxy.responses import SSE_DONE, ChatBuilder, CompletionBuilder, TokenStrings, sse

MAX_LEN = 100
CAP = 32


def chat(**kw) -> ChatCompletionRequest:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(kw)


def completion(**kw) -> CompletionRequest:
    kw.setdefault("prompt", "hi")
    return CompletionRequest.model_validate(kw)


def params(request, num_prompt_tokens=10):
    return sampling_params(request, num_prompt_tokens, MAX_LEN, CAP)


def raises(status: int, param: str | None, fn, *args):
    with pytest.raises(ProxyError) as info:
        fn(*args)
    assert info.value.status == status
    assert info.value.param == param
    return info.value


# -- requests -> SamplingParams ------------------------------------------------------------


def test_defaults_follow_openai_and_vllm():
    p = params(completion())
    assert p.max_tokens == 16  # OpenAI's completions default
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logprobs is None and p.stop == () and not p.ignore_eos and p.skip_special_tokens
    # chat without max_tokens, or completions with an explicit null: the rest of the context, capped
    assert params(chat(), 10).max_tokens == CAP
    assert params(chat(), 90).max_tokens == 10
    assert params(completion(max_tokens=None), 90).max_tokens == 10


def test_fields_map_to_sampling_params():
    p = params(
        chat(
            temperature=0.0,
            top_p=0.9,
            top_k=-1,
            min_p=0.1,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            stop="###",
            stop_token_ids=[5],
            ignore_eos=True,
            max_tokens=20,
            min_tokens=2,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            user="u",
            unknown_field_is_ignored=True,
        )
    )
    assert p.greedy and p.top_p == 0.9 and p.top_k == 0 and p.min_p == 0.1 and p.seed == 7
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stop == ("###",) and p.stop_token_ids == (5,) and p.ignore_eos
    assert p.max_tokens == 20 and p.min_tokens == 2
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert params(completion(stop=["a", "b"])).stop == ("a", "b")


def test_max_completion_tokens_wins_over_max_tokens():
    assert params(chat(max_tokens=5, max_completion_tokens=7)).max_tokens == 7
    assert params(chat(max_tokens=5)).max_tokens == 5


def test_logprobs_mapping():
    assert params(chat()).logprobs is None
    assert params(chat(logprobs=True)).logprobs == 0
    assert params(chat(logprobs=True, top_logprobs=3)).logprobs == 3
    assert params(completion(logprobs=2)).logprobs == 2
    assert params(completion(logprobs=0)).logprobs == 0
    raises(400, "top_logprobs", params, chat(top_logprobs=2))
    raises(400, "top_logprobs", params, chat(logprobs=True, top_logprobs=21))
    raises(400, "logprobs", params, completion(logprobs=21))


def test_context_length():
    e = raises(400, "max_tokens", params, chat(max_tokens=91), 10)
    assert e.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in e.message and "(10 in the input, 91" in e.message
    assert params(chat(max_tokens=90), 10).max_tokens == 90
    raises(400, "messages", params, chat(), 100)
    raises(400, "prompt", params, completion(max_tokens=None), 120)
    raises(400, "max_completion_tokens", params, chat(max_completion_tokens=0))
    raises(400, "max_tokens", params, completion(max_tokens=-1))


@pytest.mark.parametrize(
    "request_, param",
    [
        (chat(n=0), "n"),
        (chat(n=129), "n"),
        (completion(n=2, best_of=1), "best_of"),
        (completion(best_of=2, stream=True), "best_of"),
        (completion(suffix="x"), "suffix"),
        (chat(logit_bias={"1": 100.5}), "logit_bias"),
        (chat(logit_bias={"-1": 5.0}), "logit_bias"),
        (chat(logit_bias={"x": 5.0}), "logit_bias"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(temperature=-0.5), "temperature"),
        (chat(top_p=0.0), "top_p"),
        (chat(min_p=1.5), "min_p"),
        (chat(presence_penalty=3.0), "presence_penalty"),
        (chat(repetition_penalty=0.0), "repetition_penalty"),
        (chat(stop=[""]), "stop"),
        (chat(min_tokens=50, max_tokens=10), "min_tokens"),
    ],
)
def test_rejected_fields_name_their_param(request_, param):
    raises(400, param, params, request_)


def test_include_usage_only_when_streaming():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage


def test_seed_bounds_are_pydantic_errors():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        chat(seed=2**64)
    assert chat(seed=-1).seed == -1


def test_check_model():
    served = ("smol", "SmolLM2-135M-Instruct")
    assert check_model(None, served) == "smol"
    assert check_model("", served) == "smol"
    assert check_model("SmolLM2-135M-Instruct", served) == "SmolLM2-135M-Instruct"
    e = raises(404, "model", check_model, "gpt-4", served)
    assert e.code == "model_not_found" and "`gpt-4`" in e.message


def test_completion_prompt_forms():
    assert completion_prompts(completion(prompt="abc")) == ["abc"]
    assert completion_prompts(completion(prompt=["abc"])) == ["abc"]
    assert completion_prompts(completion(prompt=[1, 2, 3])) == [[1, 2, 3]]
    assert completion_prompts(completion(prompt=[[4, 5]])) == [[4, 5]]
    assert completion_prompts(completion(prompt=["1"])) == ["1"]  # a string stays a string
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    raises(400, "prompt", completion_prompts, completion(prompt=["a", ""]))
    raises(400, "prompt", completion_prompts, completion(prompt=["a"] * 257))
    raises(400, "prompt", completion_prompts, completion(prompt=""))
    raises(400, "prompt", completion_prompts, completion(prompt=[]))


def test_parallel_sampling_logit_bias_and_echo_logprobs_map_to_sampling_params():
    p = params(completion(n=3, best_of=5, logit_bias={"7": -100, "9": 2.5}, echo=True, logprobs=2))
    assert (p.n, p.best_of, p.num_sequences) == (3, 5, 5)
    assert p.logit_bias == {7: -100.0, 9: 2.5}
    assert p.prompt_logprobs == 2 and p.logprobs == 2
    assert params(completion(echo=True)).prompt_logprobs is None
    assert params(completion(logprobs=1)).prompt_logprobs is None
    assert params(chat(n=4, stream=True)).num_sequences == 4
    assert params(completion(n=2, best_of=2, stream=True)).best_of == 2  # nothing to rank


def test_chat_messages_flatten_text_parts_and_refuse_the_rest():
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": "bot"},
        ],
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",
        response_format={"type": "text"},
    )
    assert chat_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    raises(400, "messages[0].content", chat_messages, chat(messages=[{"role": "user", "content": image}]))
    raises(400, "functions", chat_messages, chat(functions=[{"name": "f"}]))


def test_error_body_and_retry_after():
    assert error_body(400, "bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert error_body(502, "x")["error"]["type"] == "server_error"
    e = ProxyError(429, "full", retry_after=0.2)
    assert e.body()["error"]["type"] == "rate_limit_error"
    assert e.headers == {"retry-after": "1"}
    assert ProxyError(503, "x").headers == {}


# -- TokenEvents -> responses and SSE ------------------------------------------------------


class ByteLevel:  # stands in for tokenizers.decoders.ByteLevel, found by class name
    pass


class StubTokenizer:
    """Ids 0-2 are words, 3 and 4 the two halves of 'é' in byte-level BPE, 9 a special token."""

    pieces = {0: "Hello", 1: "Ġworld", 2: "!", 3: "Ã", 4: "©", 9: "<|im_end|>"}
    texts = {0: "Hello", 1: " world", 2: "!", 3: "\ufffd", 4: "\ufffd", 9: "<|im_end|>"}

    class backend_tokenizer:  # noqa: N801 - mirrors the HF attribute
        decoder = ByteLevel()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.texts[i] for i in ids)

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id]


def event(ids, text, finish=None, logprobs=None, cached=4, stop_reason=None) -> TokenEvent:
    lps = None
    if logprobs is not None:
        lps = [LogprobsMsg(t, -0.5, 1, [(t, -0.5), (2, -1.0), (0, -2.0)][:logprobs]) for t in ids]
    return TokenEvent(
        "r1",
        ids,
        text,
        logprobs=lps,
        finish_reason=finish,
        stop_reason=stop_reason,
        num_prompt_tokens=7,
        num_cached_tokens=cached,
    )


EVENTS = [event([0], "Hello"), event([1], " world"), event([2, 9], "!", finish="stop", stop_reason=9)]


def parse_sse(chunks: list[bytes]) -> list:
    out = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        body = chunk[len(b"data: ") : -2]
        out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


def run_stream(builder, events) -> list:
    chunks = builder.start()
    for ev in events:
        c = builder.add(ev)
        if c is not None:
            chunks.append(c)
    return parse_sse(chunks + builder.finish())


def builder(cls, stream=False, **kw):
    kw.setdefault("token_strings", TokenStrings(StubTokenizer()))
    return cls("id-1", "smol", 1700000000, 7, stream=stream, **kw)


def test_chat_response_and_usage():
    b = builder(ChatBuilder)
    for ev in EVENTS:
        assert b.add(ev) is None
    body = json.loads(b.response().model_dump_json())
    assert body == {
        "id": "id-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": 9,
            }
        ],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 4,
            "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
        "system_fingerprint": None,
    }
    openai = pytest.importorskip("openai")
    parsed = openai.types.chat.ChatCompletion.model_validate(body)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_stream_chunks():
    chunks = run_stream(builder(ChatBuilder, stream=True, include_usage=True), EVENTS)
    assert chunks[-1] == "[DONE]"
    first, *content, usage = chunks[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in content] == [
        {"content": "Hello"},
        {"content": " world"},
        {"content": "!"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "id-1" for c in chunks[:-1])
    assert all("usage" not in c for c in chunks[:-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    openai = pytest.importorskip("openai")
    for c in chunks[:-1]:
        openai.types.chat.ChatCompletionChunk.model_validate(c)


def test_stream_without_usage_ends_with_done_only():
    chunks = run_stream(builder(ChatBuilder, stream=True), EVENTS)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks[:-1])


def test_every_token_streams_a_chunk_and_events_with_nothing_new_do_not():
    """As vLLM: a token that completes no character (half of "é", or any token of a model without a
    tokenizer) still streams a chunk with empty content; an event with no token and no text (a
    held-back stop-string candidate released later) sends nothing until it finishes."""
    events = [event([3], ""), event([4], "é"), event([], ""), event([9], "", finish="stop")]
    chunks = run_stream(builder(ChatBuilder, stream=True), events)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert deltas == [{"content": ""}, {"content": "é"}, {"content": ""}]
    events = [
        event([3], "", logprobs=0),
        event([4], "é", logprobs=0),
        event([9], "", finish="stop", logprobs=0),
    ]
    chunks = run_stream(builder(ChatBuilder, stream=True, logprobs=0), events)
    assert len(chunks) == 5  # role, 3 events, [DONE]


def test_chat_logprobs_with_true_bytes():
    b = builder(ChatBuilder, logprobs=2)
    b.add(event([1], " world", logprobs=2))
    b.add(event([3, 4], "é", finish="length", logprobs=2))
    body = json.loads(b.response().model_dump_json())
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [" world", "\ufffd", "\ufffd"]
    assert content[0]["bytes"] == list(b" world")
    assert bytes(content[1]["bytes"] + content[2]["bytes"]).decode() == "é"  # halves reassemble
    assert content[0]["top_logprobs"] == [
        {"token": " world", "logprob": -0.5, "bytes": list(b" world")},
        {"token": "!", "logprob": -1.0, "bytes": [33]},
    ]
    openai = pytest.importorskip("openai")
    openai.types.chat.ChatCompletion.model_validate(body)


def test_completion_response_logprobs_and_offsets():
    b = builder(CompletionBuilder, logprobs=1)
    for ev in [event([0], "Hello", logprobs=1), event([1], " world", finish="length", logprobs=1)]:
        b.add(ev)
    body = json.loads(b.response().model_dump_json())
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["text"] == "Hello world"
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["logprobs"] == {
        "text_offset": [0, 5],
        "token_logprobs": [-0.5, -0.5],
        "tokens": ["Hello", " world"],
        "top_logprobs": [{"Hello": -0.5}, {" world": -0.5}],
    }
    assert body["usage"]["total_tokens"] == 9
    openai = pytest.importorskip("openai")
    openai.types.Completion.model_validate(body)


def test_completion_top_logprobs_always_list_the_sampled_token():
    b = builder(CompletionBuilder, logprobs=0)
    b.add(event([1], " world", finish="stop", logprobs=0))
    assert b.response().choices[0].logprobs.top_logprobs == [{" world": -0.5}]
    b = builder(CompletionBuilder, logprobs=2)
    lp = LogprobsMsg(1, -3.0, 3, [(0, -0.1), (2, -0.2)])
    b.add(TokenEvent("r1", [1], " world", logprobs=[lp], finish_reason="stop"))
    assert b.response().choices[0].logprobs.top_logprobs == [{"Hello": -0.1, "!": -0.2, " world": -3.0}]


def test_completion_stream_with_echo_and_usage():
    b = builder(CompletionBuilder, stream=True, include_usage=True, echo_text="Say: ")
    chunks = run_stream(b, EVENTS)
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["Say: Hello", " world", "!"]
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 4
    assert chunks[4] == "[DONE]"
    openai = pytest.importorskip("openai")
    # openai's Completion type (used for chunks too) insists on a finish_reason, which only
    # the last content chunk has; OpenAI's own intermediate chunks carry null as well.
    for c in chunks[2:-1]:
        openai.types.Completion.model_validate(c)


def test_non_stream_echo():
    b = builder(CompletionBuilder, echo_text="Say: ")
    for ev in EVENTS:
        b.add(ev)
    assert b.response().choices[0].text == "Say: Hello world!"


def test_cached_tokens_take_the_largest_report():
    b = builder(ChatBuilder)
    b.add(event([0], "a", cached=0))
    b.add(event([1], "b", cached=16, finish="stop"))
    assert b.usage().prompt_tokens_details.cached_tokens == 16


def test_logprob_floor_and_no_tokenizer_strings():
    strings = TokenStrings(None)
    assert strings.string(42) == "token_id:42"
    b = builder(ChatBuilder, logprobs=0, token_strings=strings)
    b.add(TokenEvent("r1", [42], "", logprobs=[LogprobsMsg(42, float("-inf"), 9, [])], finish_reason="stop"))
    content = b.response().choices[0].logprobs.content
    assert content[0].token == "token_id:42" and content[0].logprob == -9999.0


def test_sse_of_errors():
    chunk = sse(ProxyError(502, "prefill failed").body())
    assert (
        chunk
        == b'data: {"error":{"message":"prefill failed","type":"server_error","param":null,"code":null}}\n\n'
    )
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "text", ["Hello", "", 'quote " backslash \\ slash /', "tab\tnl\n\x00\x1f\x7f", "é日本🙂\u2028"]
)
@pytest.mark.parametrize("finish", [(None, None), ("stop", 9), ("stop", "###"), ("length", None)])
def test_spliced_chunks_equal_the_models(text, finish):
    from pdserve.proxy.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        CompletionChoice,
        CompletionResponse,
        Delta,
    )

    ev = TokenEvent("r1", [1], text, finish_reason=finish[0], stop_reason=finish[1])
    kw = dict(id="id-1", created=1700000000, model="smol")
    chat_chunk = ChatChunkChoice(delta=Delta(content=text), finish_reason=finish[0], stop_reason=finish[1])
    if text or finish[0]:
        assert builder(ChatBuilder, stream=True).add(ev) == sse(
            ChatCompletionChunk(choices=[chat_chunk], **kw)
        )
        choice = CompletionChoice(text=text, finish_reason=finish[0], stop_reason=finish[1])
        assert builder(CompletionBuilder, stream=True).add(ev) == sse(
            CompletionResponse(choices=[choice], **kw)
        )


# -- several choices: n, best_of, several prompts, echo with prompt logprobs --------------------


def at(index: int, ev: TokenEvent, **kw) -> TokenEvent:
    return msgspec.structs.replace(ev, index=index, **kw)


def test_n_choices_interleaved_in_a_stream_keep_their_index():
    b = builder(ChatBuilder, stream=True, include_usage=True, n=2)
    events = [at(0, EVENTS[0]), at(1, event([1], " world")), at(1, event([2], "!", finish="stop"))]
    events += [at(0, event([1], " world", finish="length"))]
    chunks = run_stream(b, events)
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # one role chunk per choice
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:2])
    content = [(c["choices"][0]["index"], c["choices"][0]["delta"]["content"]) for c in chunks[2:6]]
    assert content == [(0, "Hello"), (1, " world"), (1, "!"), (0, " world")]
    assert chunks[6]["usage"]["completion_tokens"] == 4 and chunks[7] == "[DONE]"
    openai = pytest.importorskip("openai")
    for c in chunks[:-1]:
        openai.types.chat.ChatCompletionChunk.model_validate(c)


def test_best_of_returns_the_n_most_likely_in_order():
    b = builder(CompletionBuilder, n=2, num_sequences=3)
    for index, logprob in [(0, -3.0), (1, -1.0), (2, -2.0)]:
        lp = LogprobsMsg(0, logprob, 1, [])
        b.add(TokenEvent("r1", [0], f"s{index}", logprobs=[lp], finish_reason="length", index=index))
    body = b.response()
    assert [(c.index, c.text) for c in body.choices] == [(0, "s1"), (1, "s2")]
    assert all(c.logprobs is None for c in body.choices)  # kept only to rank
    assert body.usage.completion_tokens == 3


def test_several_prompts_give_choices_in_prompt_order_and_sum_usage():
    b = builder(CompletionBuilder, n=2, num_prompts=2, echo_texts=["A:", "B:"])
    b.num_prompt_tokens = 10
    for index in (3, 1, 0, 2):  # events of both prompts, any order
        b.add(at(index, event([0], f"c{index}", finish="stop", cached=index)))
    body = b.response()
    assert [(c.index, c.text) for c in body.choices] == [(0, "A:c0"), (1, "A:c1"), (2, "B:c2"), (3, "B:c3")]
    assert body.usage.prompt_tokens == 10 and body.usage.completion_tokens == 4
    assert body.usage.prompt_tokens_details.cached_tokens == 1 + 3  # each prompt's largest report


def test_echo_with_logprobs_lists_the_prompt_tokens_first():
    prompt_lps = [None, LogprobsMsg(1, -2.0, 3, [(0, -0.1)])]
    for stream in (False, True):
        b = builder(
            CompletionBuilder, stream=stream, logprobs=1, echo_text="Hello world", prompt_token_ids=[[0, 1]]
        )
        first = at(0, event([2], "!", finish="stop", logprobs=1), prompt_logprobs=prompt_lps)
        if stream:
            (chunk,) = run_stream(b, [first])[:1]
            choice = chunk["choices"][0]
        else:
            b.add(first)
            choice = json.loads(b.response().model_dump_json())["choices"][0]
        assert choice["text"] == "Hello world!"
        assert choice["logprobs"] == {
            "text_offset": [0, 5, 11],
            "token_logprobs": [None, -2.0, -0.5],
            "tokens": ["Hello", " world", "!"],
            "top_logprobs": [None, {"Hello": -0.1, " world": -2.0}, {"!": -0.5}],
        }
        # OpenAI sends null for the first token (the openai client parses it without validating).
