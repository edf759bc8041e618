"""Backpressure and deadlines on real processes: nodes with a tiny --max-waiting-requests.

A node over its bound refuses new work with 429 and Retry-After; the proxy (with no admission
wait) turns a full cluster into 429 for the client; admitted requests complete. A request past
its deadline is refused, or dropped wherever it is, with its blocks freed. Pools end idle.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdserve.cluster import LocalCluster
from pdserve.messages import (
    AbortRequest,
    NodeLoad,
    PrefillRequest,
    PrefillResult,
    Reply,
    ReserveRequest,
    decode,
)
from pdserve.sampling_params import SamplingParams
from tests import node_link

MODEL = "SmolLM2-135M-Instruct"
BOUND = 2


@pytest.fixture(scope="module")
def cluster(start_cluster):
    engine = ["--max-num-batched-tokens", "256", "--max-model-len", "2048"]
    with start_cluster(
        engine,
        prefill_nodes=1,
        decode_nodes=2,
        redis_url="none",
        min_remote_prefill_tokens=0,
        extra_node_flags=f"--max-waiting-requests {BOUND} --kv-cache-memory-gib 0.25",
        extra_proxy_flags="--admission-wait-s 0",
    ) as c:
        yield c


def _url(c: LocalCluster, role: str) -> str:
    return next(x.url for x in c.children if x.role == role)


def _load(url: str) -> NodeLoad:
    return decode(httpx.get(f"{url}/internal/load", timeout=10).content, NodeLoad)


def _wait_idle(c: LocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = {x.role: _load(x.url) for x in c.children if not x.role.startswith("proxy")}
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


def _prompt(i: int, n: int) -> list[int]:
    return [100 + (i * 7 + j) % 30000 for j in range(n)]


def _reserve(url: str, rid: str, prompt: list[int], deadline: float = 0.0, lease_s: float = 60.0) -> Reply:
    msg = ReserveRequest(rid, prompt, SamplingParams(max_tokens=2), lease_s=lease_s, deadline=deadline)
    return node_link.call(url, msg, timeout=30)


def _abort(url: str, rid: str) -> None:
    node_link.call(url, AbortRequest(rid), timeout=10)


def test_full_cluster_gets_429_with_retry_after(cluster):
    """Eight long-ish requests at once on two decode nodes that queue two each: some are refused
    (429 + Retry-After from the proxy), the others complete, all of them promptly."""
    proxy = _url(cluster, "proxy-0")
    words = "Describe the water cycle in detail, step by step. " * 30  # ~300 tokens

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(
                    client.post(f"{proxy}/v1/completions", json={**body, "prompt": f"{i}. {words}"})
                    for i in range(8)
                )
            )

    started = time.monotonic()
    responses = asyncio.run(run())
    took = time.monotonic() - started
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, [r.text for r in responses]
    # A request held up by another's prompt stuck in a queue (an early prefill whose cancellation
    # was lost) ends late or with its lease run out: the burst takes seconds, not tens of them.
    assert took < 20, f"the burst took {took:.1f} s"
    assert 200 in statuses and 429 in statuses, statuses
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 16
        else:  # refused by a full decode node or with every prefill node's queue full: both 429
            assert "retry-after" in r.headers and "error" in r.json(), r.text
    _wait_idle(cluster)


def test_decode_node_refuses_reservations_over_its_bound(cluster):
    url = _url(cluster, "decode-0")
    ids = [f"bp-d{i}" for i in range(BOUND + 1)]
    try:
        for rid in ids[:BOUND]:
            assert _reserve(url, rid, _prompt(len(rid), 40)).status == 200
        r = _reserve(url, ids[BOUND], _prompt(9, 40))
        assert r.status == 429 and r.retry_after >= 1, r
        assert r.error_type == "overloaded", r
        assert _load(url).waiting_for_kv == BOUND
    finally:
        for rid in ids:
            _abort(url, rid)
    _wait_idle(cluster)


def test_prefill_node_refuses_prompts_over_its_bound(cluster):
    """Four prompts at once on a prefill node that queues two: one runs, two wait, the last gets 429."""
    prefill = _url(cluster, "prefill-0")
    decodes = [_url(cluster, "decode-0"), _url(cluster, "decode-1")]
    placed = []
    for i in range(4):
        node, rid, prompt = decodes[i % 2], f"bp-p{i}", _prompt(1000 + i, 600)
        r = _reserve(node, rid, prompt)
        assert r.status == 200, r
        placed.append((node, rid, prompt, r.body))

    try:
        with node_link.NodeLink(prefill) as link:
            calls = [
                link.start(PrefillRequest(rid, prompt, SamplingParams(max_tokens=2), landing))
                for _, rid, prompt, landing in placed
            ]
            replies = [link.reply(c, 120) for c in calls]
        statuses = [r.status for r in replies]
        assert 429 in statuses and statuses.count(200) >= 1, replies
        for r in replies:
            if r.status == 429:
                assert r.retry_after, r
            else:
                assert r.status == 200 and isinstance(r.body, PrefillResult) and r.body.ok, r
    finally:
        for node, rid, _, _ in placed:
            _abort(node, rid)  # the refused ones still hold their reservation; the others finish
    _wait_idle(cluster)


def test_expired_deadline_is_refused_without_taking_blocks(cluster):
    url = _url(cluster, "decode-1")
    free = _load(url).free_blocks
    r = _reserve(url, "bp-expired", _prompt(3, 40), deadline=time.time() - 1)
    assert r.status == 504 and "deadline" in r.error, r
    assert _load(url).free_blocks == free
    _wait_idle(cluster)


def test_short_deadline_drops_a_reservation_before_its_lease(cluster):
    url = _url(cluster, "decode-1")
    r = _reserve(url, "bp-short", _prompt(4, 100), deadline=time.time() + 1.0, lease_s=120.0)
    assert r.status == 200, r
    start = time.monotonic()
    with node_link.NodeLink(url) as link:
        events = link.stream("bp-short", 60)
    assert time.monotonic() - start < 20  # long before the 120 s lease
    assert events[-1].finish_reason == "error" and "deadline" in events[-1].error, events
    _wait_idle(cluster)


def test_deadline_drops_a_prompt_on_the_prefill_node(cluster):
    """A long prompt whose deadline passes while it waits or runs is dropped, its blocks freed."""
    prefill, node = _url(cluster, "prefill-0"), _url(cluster, "decode-0")
    prompt = _prompt(7, 1500)  # ~6 steps of 256 tokens
    r = _reserve(node, "bp-late", prompt)
    assert r.status == 200, r
    landing = r.body
    msg = PrefillRequest("bp-late", prompt, SamplingParams(max_tokens=2), landing, deadline=time.time() + 0.5)
    try:
        r = node_link.call(prefill, msg, timeout=60)
        # Dropped by the engine (500 with the reason) or, if admission came too late, refused (504).
        assert r.status in (500, 504) and "deadline" in r.error, r
    finally:
        _abort(node, "bp-late")  # as the proxy does when a prefill fails
    _wait_idle(cluster)
