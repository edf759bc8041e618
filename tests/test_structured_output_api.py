"""Structured output and tool calling through the OpenAI API, on a P/D pair and on a co-located node.

One cluster (a prefill node and a both node) and two proxies over it: ``pd`` (prefill node -> KV
transfer -> the both node as decode node: the first token is sampled under the mask on the prefill
node, the rest on the decode side) and ``colocated`` (the both node alone). The full run of 20
schemas x 5 prompts is ``python -m pdserve.benchmarks.structured_output``; here a few of them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from pdserve.benchmarks.json_schemas import PROMPTS, SCHEMAS
from pdserve.metrics import parse_text

MODEL = "SmolLM2-135M-Instruct"
PICKED = [SCHEMAS[i] for i in (0, 7, 16)]  # person, todo (nested array of objects), pattern_code

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["timezone"],
        },
    },
}


@pytest.fixture(scope="module")
def cluster(start_cluster):
    # Two nodes: the both node is the P/D pair's decode node and, alone, the co-located one.
    with start_cluster(
        prefill_nodes=1,
        decode_nodes=0,
        both_nodes=1,
        redis_url="none",
        extra_node_flags="--kv-cache-memory-gib 0.1 --max-model-len 2048",
    ) as c:
        yield c


@pytest.fixture(scope="module")
def proxies(cluster) -> dict[str, str]:
    (prefill,) = cluster.node_urls("prefill")
    (both,) = cluster.node_urls("both")
    return {
        "pd": cluster.add_proxy(
            "--prefill-urls", prefill, "--decode-urls", both, "--min-remote-prefill-tokens", "0"
        ),
        "colocated": cluster.add_proxy("--both-urls", both),
    }


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def decisions(url: str) -> dict[str, float]:
    prefix = "pdserve_routing_decisions_total{"
    out = {}
    for name, value in parse_text(httpx.get(f"{url}/metrics").text).items():
        if name.startswith(prefix):
            out[name.split('reason="')[1].split('"')[0]] = value
    return out


@pytest.mark.parametrize("topology", ["pd", "colocated"])
def test_json_schema_outputs_validate(proxies, topology):
    c = client(proxies[topology])

    def ask(job):
        i, (name, schema), prompt = job
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
            temperature=0.8,
            seed=i,
            max_tokens=200,
        )
        return schema, r.choices[0]

    jobs = [(i, s, p) for i, (s, p) in enumerate((s, p) for s in PICKED for p in PROMPTS[:2])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(ask, jobs))
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    expected = "remote_prefill" if topology == "pd" else "colocated"
    assert decisions(proxies[topology]).get(expected, 0) >= len(jobs)


@pytest.mark.parametrize("topology", ["pd", "colocated"])
def test_malformed_constraints_are_400(proxies, topology):
    c = client(proxies[topology])
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError, match="invalid structured output json") as err:
        c.chat.completions.create(model=MODEL, messages=messages, response_format=bad_schema, max_tokens=8)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="invalid structured output regex"):
        c.completions.create(
            model=MODEL, prompt="x", max_tokens=8, extra_body={"structured_outputs": {"regex": "a("}}
        )
    # Shape errors never reach a node.
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        c.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}
        )


def test_regex_choice_and_json_object(proxies):
    c = client(proxies["pd"])
    r = c.completions.create(
        model=MODEL,
        prompt="My favourite number is",
        max_tokens=20,
        temperature=0.8,
        extra_body={"structured_outputs": {"regex": r" [0-9]{2,3}\."}},
    )
    assert r.choices[0].text[0] == " " and r.choices[0].text[-1] == "." and r.choices[0].text[1:-1].isdigit()
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": 'Return a JSON object with a single key "name" holding a cat\'s name.',
            }
        ],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_call_round_trip(proxies, stream):
    """call -> tool result -> answer, through the openai client, on the P/D pair."""
    c = client(proxies["pd"])
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kwargs = dict(model=MODEL, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in c.chat.completions.create(messages=messages, tool_choice=choice, stream=True, **kwargs):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] += d.id or ""
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        assert finish == "tool_calls" and list(calls) == [0]
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
    else:
        r = c.chat.completions.create(messages=messages, tool_choice=choice, **kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert name == "get_weather" and call_id.startswith("call_")
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees Celsius and sunny"},
    ]
    r = c.chat.completions.create(messages=messages, tool_choice="none", **kwargs)
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls


def test_required_tool_choice_calls_one_of_the_tools(proxies):
    c = client(proxies["colocated"])
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.8,
        seed=3,
        max_tokens=80,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    with pytest.raises(openai.BadRequestError, match="names no tool"):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
