"""Integration: prefix-aware routing over two prefill nodes with a real Redis index — prompts follow
their cached prefix, Redis can die and come back without failing a request or restarting a node,
and a killed prefill node leaves the index within its heartbeat TTL."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import redis

from pdserve.cluster import LocalCluster
from pdserve.metrics import parse_text
from pdserve.prefix_index import PrefixIndex

MODEL = "SmolLM2-135M-Instruct"
TTL_S = 2.0


def system(tag: str) -> str:
    return f"Context {tag}: " + " ".join(
        f"fact {tag}{i} is that item {i} weighs {i * 7} grams." for i in range(30)
    )


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(
        prefill_nodes=2,
        decode_nodes=1,
        min_remote_prefill_tokens=0,
        extra_node_flags=f"--heartbeat-ttl-s {TTL_S}",
    ) as c:
        yield c


def proxy_url(c: LocalCluster) -> str:
    return f"http://127.0.0.1:{c.cfg.port}"


def metrics(url: str) -> dict[str, float]:
    return parse_text(httpx.get(f"{url}/metrics").text)


def decision(c: LocalCluster, reason: str) -> float:
    return metrics(proxy_url(c)).get(
        f'pdserve_routing_decisions_total{{policy="prefix-aware",reason="{reason}"}}', 0.0
    )


def prefill_total(c: LocalCluster, name: str) -> float:
    return sum(metrics(u)[name] for u in c.node_urls("prefill"))


def ask(c: LocalCluster, tag: str, questions: list[str], concurrency: int = 1) -> list[str]:
    async def run() -> list[str]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(q: str) -> str:
                messages = [{"role": "system", "content": system(tag)}, {"role": "user", "content": q}]
                body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
                async with sem:
                    r = await client.post(f"{proxy_url(c)}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            return await asyncio.gather(*(one(q) for q in questions))

    return asyncio.run(run())


def test_prompts_follow_their_cached_prefix(cluster):
    computed = prefill_total(cluster, "pdserve_prompt_tokens_computed_total")
    cached_before = decision(cluster, "remote_prefill_cached")
    ask(cluster, "A", ["Question one?"])
    first = prefill_total(cluster, "pdserve_prompt_tokens_computed_total") - computed
    assert first > 300
    ask(cluster, "A", [f"Question {i}?" for i in range(2, 10)], concurrency=3)
    total = prefill_total(cluster, "pdserve_prompt_tokens_computed_total") - computed
    assert total < 1.5 * first  # the prefix was computed once, not once per node
    assert decision(cluster, "remote_prefill_cached") - cached_before == 8


def test_redis_dies_and_comes_back_without_failed_requests(cluster):
    r = cluster.redis
    unavailable = metrics(proxy_url(cluster)).get("pdserve_prefix_index_unavailable_total", 0.0)
    r.kill()
    cached = decision(cluster, "remote_prefill_cached")
    ask(cluster, "B", [f"Question {i}?" for i in range(4)], concurrency=2)  # all answered
    assert metrics(proxy_url(cluster))["pdserve_prefix_index_unavailable_total"] > unavailable
    assert decision(cluster, "remote_prefill_cached") == cached  # routed on load alone

    r.start()  # same port, empty: the nodes notice and republish, nothing restarts
    client = redis.Redis(port=r.port)
    deadline = time.monotonic() + 15
    while len(client.keys("pdserve:*:blocks:*")) < 3:
        assert time.monotonic() < deadline, "nodes did not republish into the restarted Redis"
        time.sleep(0.2)
    hits = prefill_total(cluster, "pdserve_prefix_cache_hit_tokens_total")
    time.sleep(1.5)  # past the proxy's back-off after the failed lookups
    ask(cluster, "C", ["Question one?"])
    ask(cluster, "C", [f"Question {i}?" for i in range(2, 6)])
    assert decision(cluster, "remote_prefill_cached") - cached >= 4
    assert prefill_total(cluster, "pdserve_prefix_cache_hit_tokens_total") - hits > 4 * 300


def test_killed_prefill_node_leaves_the_index_within_its_ttl(cluster):
    victim = next(c for c in cluster.children if c.role == "prefill-1")
    info = httpx.get(f"{victim.url}/metrics")  # alive before
    assert info.status_code == 200

    async def live_nodes() -> set[str]:
        index = PrefixIndex(cluster.redis_url, MODEL, timeout_s=2.0)
        try:
            return set(await index.lookup([]))
        finally:
            await index.close()

    before = asyncio.run(live_nodes())
    assert len(before) == 3
    os.killpg(victim.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while len(asyncio.run(live_nodes())) != 2:
        assert time.monotonic() - killed < TTL_S + 1.5, "dead node still in the index"
        time.sleep(0.1)
    assert ask(cluster, "D", [f"Question {i}?" for i in range(4)], concurrency=2)
    assert all(len(x) > 0 for x in ask(cluster, "A", ["Question 11?"]))
