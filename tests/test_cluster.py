"""Integration: real prefill node, decode node and proxy processes on loopback, driven by `openai`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "List two planets.",
    "Translate 'good morning' to Spanish.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(min_remote_prefill_tokens=0) as c:  # every prompt through the prefill node
        yield c


def _url(c: LocalCluster, role: str) -> str:
    return next(x.url for x in c.children if x.role.startswith(role))


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(str(default_model_dir), max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    completion = llm.generate(PROMPTS, params)
    return [o.outputs[0].text for o in chat], [o.outputs[0].text for o in completion]


def test_32_concurrent_requests_match_llm_generate(cluster, reference):
    from openai import AsyncOpenAI

    chat_ref, completion_ref = reference
    client = AsyncOpenAI(base_url=f"{_url(cluster, 'proxy')}/v1", api_key="none", max_retries=0, timeout=300)
    model = "SmolLM2-135M-Instruct"

    async def chat(prompt: str, stream: bool) -> str:
        kw = dict(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
        )
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content
        parts = []
        async for chunk in await client.chat.completions.create(**kw, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def complete(prompt: str, stream: bool) -> str:
        kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text
        parts = []
        async for chunk in await client.completions.create(**kw, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def run_all():
        jobs = []
        for p in PROMPTS:
            for stream in (False, True):
                jobs += [chat(p, stream), complete(p, stream)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    assert len(results) == 32
    expected = []
    for c, t in zip(chat_ref, completion_ref):
        expected += [c, t, c, t]  # chat, completion; non-stream then stream
    assert results == expected


def test_usage_counts_cached_tokens(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{_url(cluster, 'proxy')}/v1", api_key="none", max_retries=0, timeout=120)
    system = "You are a terse assistant. " * 20
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=4)
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=4)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 100
    assert (
        second.usage.prompt_tokens_details.cached_tokens >= (second.usage.prompt_tokens - 1) // 16 * 16 - 16
    )
    assert second.usage.completion_tokens == 4 or second.choices[0].finish_reason == "stop"


def test_one_token_requests_through_a_prefill_node(cluster):
    """The proxy opens the decode stream while the prefill runs: a one-token request can finish on
    the decode node before its stream is open, and its output must wait there for it."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{_url(cluster, 'proxy')}/v1", api_key="none", max_retries=0, timeout=120)
    for i in range(4):
        out = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=f"Count to {i + 3}: one, two", max_tokens=1, temperature=0
        )
        assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "length"
    decode = _metrics(_url(cluster, "decode"))
    assert decode["pdserve_kv_blocks_free"] == decode["pdserve_kv_blocks_total"]


def test_models_health_metrics(cluster):
    proxy = _url(cluster, "proxy")
    models = httpx.get(f"{proxy}/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(f"{proxy}/health").status_code == 200
    metrics = httpx.get(f"{proxy}/metrics").text
    for name in (
        "pdserve_requests_total",
        "pdserve_time_to_first_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_e2e_request_latency_seconds",
    ):
        assert name in metrics
    prefill = _metrics(_url(cluster, "prefill"))
    decode = _metrics(_url(cluster, "decode"))
    assert prefill["pdserve_prompt_tokens_computed_total"] > 0
    assert prefill["pdserve_kv_transfer_bytes_total"] == decode["pdserve_kv_transfer_bytes_total"] > 0
    assert prefill["pdserve_kv_transfer_seconds_count"] > 0
    # The decode node's first tokens came after the prefill node's forward and the KV transfer.
    assert decode["pdserve_node_time_to_first_token_seconds_count"] > 0
    decode_ttft = decode["pdserve_node_time_to_first_token_seconds_sum"]
    assert decode_ttft > prefill["pdserve_kv_transfer_seconds_sum"]
    assert decode["pdserve_kv_blocks_free"] == decode["pdserve_kv_blocks_total"]  # idle
    assert decode["pdserve_running_requests"] == decode["pdserve_waiting_requests"] == 0
    assert prefill["pdserve_prefix_cache_hit_tokens_total"] > 0  # the repeated system prompt


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
