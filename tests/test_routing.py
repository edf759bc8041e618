"""Integration: co-located (`--role both`) nodes behind the proxy, and conditional disaggregation
(the decode node computes short or mostly cached prompts itself), against LLM.chat outputs."""

from __future__ import annotations

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.metrics import parse_text

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
SHORT = ["What is the capital of France?", "Name a color.", "What is 2 plus 2?", "Say hello."]
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8  # ~100 tokens


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(prefill_nodes=1, decode_nodes=1, both_nodes=1) as c:
        yield c


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_batched_tokens=512)


def chat(url: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]


def reference(llm: LLM, conversations: list[list[dict]]) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.chat(conversations, params)]


def metrics(url: str) -> dict[str, float]:
    return parse_text(httpx.get(f"{url}/metrics").text)


def decisions(url: str) -> dict[str, float]:
    prefix = "pdserve_routing_decisions_total{"
    out = {}
    for name, value in metrics(url).items():
        if name.startswith(prefix):
            labels = dict(kv.split("=") for kv in name[len(prefix) : -1].split(","))
            out[labels["reason"].strip('"')] = value
    return out


def test_colocated_node_serves_whole_requests(cluster, llm):
    (both,) = cluster.node_urls("both")
    proxy = cluster.add_proxy("--both-urls", both, "--redis-url", cluster.redis_url)
    convs = [[{"role": "user", "content": p}] for p in SHORT]
    convs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
    convs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bye."}])
    got = [chat(proxy, c) for c in convs]
    assert [text for text, _ in got] == reference(llm, convs)
    assert decisions(proxy) == {"colocated": len(convs)}
    assert got[-1][1]["prompt_tokens_details"]["cached_tokens"] >= 96  # the shared system prompt
    m = metrics(both)
    assert m["pdserve_kv_transfer_bytes_total"] == 0  # nothing moved: prefill and decode in one place
    assert m["pdserve_jit_compiles_total"] == 0  # the CPU engine runs the kernels' torch references


def test_short_and_mostly_cached_prompts_skip_the_prefill_node(cluster, llm):
    (prefill,) = cluster.node_urls("prefill")
    (decode,) = cluster.node_urls("decode")
    proxy = cluster.add_proxy(
        "--prefill-urls",
        prefill,
        "--decode-urls",
        decode,
        "--redis-url",
        cluster.redis_url,
        "--min-remote-prefill-tokens",
        "64",
    )
    before = metrics(prefill)["pdserve_prompt_tokens_computed_total"]
    shorts = [[{"role": "user", "content": p}] for p in SHORT]
    texts = [chat(proxy, c)[0] for c in shorts]
    # The chat template's default system prompt is a cached block after the first one.
    made = decisions(proxy)
    assert made["short_prompt"] >= 1 and made["short_prompt"] + made.get("decode_holds_prefix", 0) == 4
    assert metrics(prefill)["pdserve_prompt_tokens_computed_total"] == before
    # One token: a local request may finish at once; its output waits for the stream to open.
    for c in shorts:
        assert chat(proxy, c, max_tokens=1)[1]["completion_tokens"] == 1
    made = decisions(proxy)

    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    answer1, usage1 = chat(proxy, turn1)  # ~100 uncached tokens: the prefill node computes them
    assert decisions(proxy).get("remote_prefill") == 1
    after_turn1 = metrics(prefill)["pdserve_prompt_tokens_computed_total"]
    assert after_turn1 - before == usage1["prompt_tokens"]
    turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And a tree?"}]
    answer2, usage2 = chat(proxy, turn2)  # the decode node holds turn 1: it computes the rest itself
    assert decisions(proxy).get("decode_holds_prefix") == made.get("decode_holds_prefix", 0) + 1
    assert metrics(prefill)["pdserve_prompt_tokens_computed_total"] == after_turn1
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage1["prompt_tokens"] // 16 * 16 - 16

    assert texts + [answer1, answer2] == reference(llm, shorts + [turn1, turn2])


def test_mixed_cluster_under_concurrency(cluster, llm):
    """The default proxy over a prefill, a decode and a both node: every path at once."""
    import asyncio

    proxy = f"http://127.0.0.1:{cluster.cfg.port}"
    convs = [[{"role": "user", "content": p}] for p in SHORT]
    convs += [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in SHORT]
    convs = convs * 2

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> str:
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = await client.post(f"{proxy}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(one(client, c) for c in convs))

    assert asyncio.run(run()) == reference(llm, convs)
    made = decisions(proxy)
    assert sum(made.values()) == len(convs) and made.get("colocated", 0) > 0
    for url in cluster.node_urls("prefill") + cluster.node_urls("decode") + cluster.node_urls("both"):
        m = metrics(url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]  # nothing leaked
