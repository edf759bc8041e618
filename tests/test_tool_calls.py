"""Tool calling in the proxy, pure logic: choices, constraints, the families' parsers, streaming
deltas, and how response_format / structured_outputs become a constraint."""

from __future__ import annotations

import json

import pytest

from pdserve.messages import TokenEvent
from pdserve.proxy.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProxyError,
    chat_messages,
    structured_outputs,
)
from pdserve.proxy.responses import ChatBuilder
from pdserve.proxy.tools import (
    HERMES,
    LLAMA3_JSON,
    Call,
    ToolCallStream,
    parse_hermes,
    parse_llama3_json,
    parser_for_template,
    tool_plan,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_parsers_by_family():
    args = '{"city": "Paris"}'
    qwen = f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert parse_hermes(qwen) == ("Let me check.", [Call("get_weather", args)])
    block = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    two = block % "a" + "\n" + block % "b"
    assert parse_hermes(two) == (None, [Call("a", "{}"), Call("b", "{}")])
    smollm = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    assert parse_hermes(smollm)[1] == [Call("a", '{"x": 1}'), Call("b", "{}")]
    assert parse_hermes('<tool_call>{"name": "a", "arguments": {}}')[1] == [Call("a", "{}")]  # cut at EOS
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_hermes("plain answer") == ("plain answer", [])

    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    llama += '{"name": "now", "parameters": {}}'
    assert parse_llama3_json(llama) == (None, [Call("get_weather", args), Call("now", "{}")])
    assert parse_llama3_json('{"name": "x", "parameters": "{\\"a\\": 1}"}')[1] == [Call("x", '{"a": 1}')]
    assert parse_llama3_json("The answer is {1}") == ("The answer is {1}", [])
    assert parse_llama3_json('{"name": "x", "parameters": {}} trailing') == (
        '{"name": "x", "parameters": {}} trailing',
        [],
    )

    assert parser_for_template("{{ '<tool_call>' }}") == HERMES
    assert parser_for_template("<|start_header_id|>...<|eot_id|>") == LLAMA3_JSON
    assert parser_for_template("<|im_start|>{{ message['content'] }}") == HERMES  # SmolLM2


def test_choices_and_their_constraints():
    assert tool_plan(chat(), HERMES) is None
    auto = tool_plan(chat(tools=[WEATHER]), HERMES)
    assert auto.mode == "auto" and auto.constraint is None and auto.tools == [WEATHER]
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none"), HERMES).mode == "none"

    named = tool_plan(
        chat(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}), HERMES
    )
    assert named.mode == "named" and json.loads(named.constraint.json) == {"type": "object", "properties": {}}
    assert named.parse('{"a": 1}') == (None, [Call("now", '{"a": 1}')])

    required = tool_plan(chat(tools=[WEATHER, NOW], tool_choice="required"), HERMES)
    schema = json.loads(required.constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    out = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert required.parse(out) == (None, [Call("get_weather", '{"city": "Oslo"}')])

    for kw, match in [
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}), "names no tool"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice must be"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": "get_weather"}), "names no tool"),
        (dict(tools=[{"type": "retrieval"}]), "each tool must be"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "function.name"),
    ]:
        with pytest.raises(ProxyError, match=match):
            tool_plan(chat(**kw), HERMES)


def test_history_with_tool_calls_reaches_the_template_with_parsed_arguments():
    request = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    messages = chat_messages(request)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    request.messages[1].tool_calls[0]["function"]["arguments"] = "{oops"
    with pytest.raises(ProxyError, match="not valid JSON"):
        chat_messages(request)


def _stream(plan, pieces: list[str]) -> tuple[str, list[dict]]:
    s = ToolCallStream(plan)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, d = s.feed(piece, i == len(pieces) - 1)
        content += c
        calls += d
    return content, calls


def test_streamed_calls_and_content():
    auto = tool_plan(chat(tools=[WEATHER]), HERMES)
    content, calls = _stream(
        auto,
        [
            "Sure",
            ". <tool",
            '_call>{"name": "get_weather", ',
            '"arguments": {"city": "Rome"}}',
            "</tool_call>",
        ],
    )
    assert content == "Sure. " and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]
    content, calls = _stream(auto, ["No tools <", "needed", "."])
    assert content == "No tools <needed." and calls == []
    s = ToolCallStream(auto)
    assert s.feed("Hello <to", False) == ("Hello ", [])  # a possible start marker is held back

    llama = tool_plan(chat(tools=[WEATHER]), LLAMA3_JSON)
    content, calls = _stream(llama, ['{"name": "get_weather", "parameters": {"city": "Rome"}}', ""])
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    assert _stream(llama, ["Paris is sunny", "."]) == ("Paris is sunny.", [])

    named = tool_plan(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), HERMES
    )
    content, calls = _stream(named, ['{"city"', ': "Rome"}', ""])
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    assert {c["index"] for c in calls} == {0} and calls[0]["id"].startswith("call_")


def test_chat_builder_reports_tool_calls():
    plan = tool_plan(chat(tools=[WEATHER], tool_choice="required"), HERMES)
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    whole = ChatBuilder("id", "m", 0, 3, stream=False, tools=plan)
    whole.add(TokenEvent("r", [1, 2], text, finish_reason="stop"))
    body = json.loads(whole.response().model_dump_json())
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    streamed = ChatBuilder("id", "m", 0, 3, stream=True, tools=plan)
    assert streamed.add(TokenEvent("r", [1], text[:10])) is None  # held until the calls are whole
    last = json.loads(streamed.add(TokenEvent("r", [2], text[10:], finish_reason="stop"))[6:])
    choice = last["choices"][0]
    assert (
        choice["finish_reason"] == "tool_calls"
        and choice["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    plain = ChatBuilder("id", "m", 0, 3, stream=False, tools=tool_plan(chat(tools=[WEATHER]), HERMES))
    plain.add(TokenEvent("r", [1], "Just text.", finish_reason="stop"))
    body = json.loads(plain.response().model_dump_json())
    assert body["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in body["choices"][0]["message"]


def test_response_format_and_structured_outputs():
    assert structured_outputs(chat()) is None
    assert structured_outputs(chat(response_format={"type": "text"})) is None
    assert structured_outputs(chat(response_format={"type": "json_object"})).json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = structured_outputs(
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            }
        )
    )
    assert json.loads(spec.json) == schema
    spec = structured_outputs(
        CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"], "disable_fallback": True})
    )
    assert spec.choice == ("a", "b")
    assert structured_outputs(
        CompletionRequest(prompt="x", structured_outputs={"json": '{"type": "string"}'})
    ).json
    for kw, match in [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "json_schema.schema"),
        (dict(response_format={"type": "yaml"}), "not supported"),
        (dict(structured_outputs={"whitespace_pattern": " "}), "whitespace_pattern is not supported"),
        (dict(structured_outputs={"regex": 3}), "wrong type"),
        (dict(structured_outputs={}), "exactly one"),
        (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "not both"),
    ]:
        with pytest.raises(ProxyError, match=match):
            structured_outputs(chat(**kw))
