"""Failure paths on real processes: lease expiry, client disconnect, a prefill node killed mid-prompt,
a prefill whose landing comes late, wrong or never.

After each, every node's pool is back at its idle free count and the proxy still serves.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pdserve.cluster import LocalCluster
from pdserve.messages import (
    LandingDescriptor,
    NodeLoad,
    PrefillLanding,
    PrefillRequest,
    ReserveRequest,
    decode,
)
from pdserve.sampling_params import SamplingParams
from tests import node_link

MODEL = "SmolLM2-135M-Instruct"
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module")
def cluster(start_cluster):
    # Small steps so a long prompt takes several engine steps to prefill.
    with start_cluster(
        ["--max-num-batched-tokens", "128"],
        prefill_nodes=2,
        min_remote_prefill_tokens=0,
    ) as c:
        yield c


def _nodes(c: LocalCluster, role: str):
    return [x for x in c.children if x.role.startswith(role) and x.proc.poll() is None]


def _load(url: str) -> NodeLoad:
    return decode(httpx.get(f"{url}/internal/load", timeout=10).content, NodeLoad)


def _wait_idle(c: LocalCluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = {x.role: _load(x.url) for x in _nodes(c, "prefill") + _nodes(c, "decode")}
        idle = all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        )
        if idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


def _proxy(c: LocalCluster) -> str:
    return next(x.url for x in c.children if x.role.startswith("proxy"))


def _ask(c: LocalCluster, text: str = "Say hello.") -> dict:
    r = httpx.post(
        f"{_proxy(c)}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_lease_expiry_frees_reserved_blocks(cluster):
    decode_url = _nodes(cluster, "decode")[0].url
    params = SamplingParams(max_tokens=4)
    r = node_link.call(decode_url, ReserveRequest("lease-test", list(range(10, 300)), params, lease_s=1.0))
    assert r.status == 200, r
    load = _load(decode_url)
    assert load.waiting_for_kv == 1 and load.free_blocks < load.total_blocks
    # No prefill ever comes: the stream must end with an error once the lease runs out.
    start = time.monotonic()
    with node_link.NodeLink(decode_url) as link:
        events = link.stream("lease-test", 30)
    assert time.monotonic() - start < 10
    assert events[-1].finish_reason == "error" and "lease" in events[-1].error
    _wait_idle(cluster)
    _ask(cluster)


def test_client_disconnect_mid_stream_aborts_on_both_nodes(cluster):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{_proxy(cluster)}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got >= 3:
                break  # hang up mid-stream
    _wait_idle(cluster)
    _ask(cluster)


def test_prefill_node_killed_mid_prompt(cluster):
    long_prompt = "Tell me everything about the history of the world. " * 150  # ~1500 tokens
    result: dict = {}

    def send():
        try:
            r = httpx.post(
                f"{_proxy(cluster)}/v1/completions",
                json={"model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0},
                timeout=120,
            )
            result["status"], result["body"] = r.status_code, r.json()
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            result["error"] = repr(e)

    t = threading.Thread(target=send)
    start = time.monotonic()
    t.start()
    victim = None
    while victim is None and time.monotonic() - start < 30:
        for node in _nodes(cluster, "prefill"):
            lo = _load(node.url)
            if lo.running or lo.waiting:
                victim = node
                break
        time.sleep(0.05)
    assert victim is not None, "the long prompt never showed up on a prefill node"
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    t.join(timeout=60)
    assert not t.is_alive(), "the request hung after its prefill node died"
    assert "error" not in result, result
    # The request moved to the surviving prefill node (tests/test_migration.py checks the output).
    assert result["status"] == 200 and result["body"]["choices"][0]["text"], result
    _wait_idle(cluster)  # the decode node released the dead attempt's reservation
    _ask(cluster)  # the surviving prefill node serves


def test_long_prompt_sent_chunk_by_chunk_matches_llm(cluster, default_model_dir):
    """Prefill in 128-token steps ships finished blocks as it goes; the output is unchanged."""
    from pdserve import LLM, SamplingParams

    prompt = "Summarize the following notes about ships and harbors. " * 40  # ~450 tokens
    before = {x.role: _metric(x.url, "pdserve_kv_transfer_bytes_total") for x in _nodes(cluster, "prefill")}
    r = httpx.post(
        f"{_proxy(cluster)}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    llm = LLM(str(default_model_dir), max_num_batched_tokens=128)
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == expected
    after = {x.role: _metric(x.url, "pdserve_kv_transfer_bytes_total") for x in _nodes(cluster, "prefill")}
    assert sum(after.values()) > sum(before.get(k, 0) for k in after)
    _wait_idle(cluster)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_prefill_queue_longer_than_the_lease_still_serves(cluster):
    """The prefill node renews decode leases while prompts wait in its queue."""
    import asyncio

    from pdserve.proxy.config import ProxyConfig
    from pdserve.proxy.server import ProxyServer

    prefill = [x.url for x in _nodes(cluster, "prefill")]
    decode = [x.url for x in _nodes(cluster, "decode")]
    config = ProxyConfig(port=0, prefill_urls=tuple(prefill), decode_urls=tuple(decode), lease_s=1.0)
    prompt = "Describe the water cycle in detail, step by step. " * 60  # ~600 tokens: ~5 steps each

    async def run(url: str) -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            rs = await asyncio.gather(
                *(
                    client.post(f"{url}/v1/completions", json={**body, "prompt": f"{i}. {prompt}"})
                    for i in range(8)
                )
            )
            return [r.status_code for r in rs]

    with ProxyServer(config) as proxy:
        start = time.monotonic()
        statuses = asyncio.run(run(proxy.url))
        elapsed = time.monotonic() - start
    assert statuses == [200] * 8
    assert elapsed > 2.0, f"the queue took {elapsed:.1f} s: too short to outlive a 1 s lease"
    _wait_idle(cluster)


def _wait_held(url: str, timeout: float = 20.0) -> None:
    """Until the node's prompt is computed and its blocks wait (nothing queued or running, blocks
    not free): a prefill after its first token, waiting for its landing."""
    deadline = time.monotonic() + timeout
    while True:
        lo = _load(url)
        if lo.running == lo.waiting == 0 and lo.free_blocks < lo.total_blocks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no prompt held on {url} after {timeout} s: {lo}")
        time.sleep(0.05)


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_landing_after_the_first_token_ships_the_held_blocks(cluster):
    """A prefill sent before its decode node reserved (the proxy overlaps the two): the prompt runs,
    its blocks wait after the first token, and the landing that comes later ships them; the tokens
    are those of a prefill sent with its landing."""
    prefill_url = _nodes(cluster, "prefill")[0].url
    decode_url = _nodes(cluster, "decode")[0].url
    prompt = list(range(10, 300))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    with node_link.NodeLink(prefill_url) as p, node_link.NodeLink(decode_url) as d:
        for rid, late in (("landing-late", True), ("landing-inline", False)):
            if late:
                call = p.start(PrefillRequest(rid, prompt, params))
                _wait_held(prefill_url)
            reserved = d.call(ReserveRequest(rid, prompt, params, lease_s=30.0))
            assert reserved.status == 200, reserved
            if late:
                landed = p.call(PrefillLanding(reserved.body))
                assert landed.status == 200, landed
            else:
                call = p.start(PrefillRequest(rid, prompt, params, reserved.body))
            result = p.reply(call, 60)
            assert result.status == 200 and result.body.ok, result
            events = d.stream(rid)
            assert events[-1].finish_reason == "length", events[-1]
            outputs[rid] = _tokens(events)
    assert len(outputs["landing-late"]) == 6
    assert outputs["landing-late"] == outputs["landing-inline"]
    _wait_idle(cluster)


def test_landing_refused_aborted_or_never_sent_frees_the_blocks(cluster):
    prefill_url = _nodes(cluster, "prefill")[0].url
    prompt = list(range(10, 300))
    params = SamplingParams(max_tokens=4, temperature=0)
    far = time.time() + 30
    with node_link.NodeLink(prefill_url) as p:
        # A landing for no prefill here.
        nobody = LandingDescriptor("nobody", "decode", "tcp://127.0.0.1:9", [1], 16, far)
        reply = p.call(PrefillLanding(nobody))
        assert reply.status == 404, reply

        # A landing that does not fit the prompt (19 blocks): refused, and its prefill fails as
        # soon as the prompt is computed, not at the landing timeout.
        call = p.start(PrefillRequest("wrong-landing", prompt, params))
        wrong = LandingDescriptor("wrong-landing", "decode", "tcp://127.0.0.1:9", [1, 2], len(prompt), far)
        reply = p.call(PrefillLanding(wrong))
        assert reply.status == 500 and "blocks" in reply.error, reply
        started = time.monotonic()
        reply = p.reply(call, 30)
        assert reply.status == 502 and "blocks" in reply.error, reply
        assert time.monotonic() - started < 10
        _wait_idle(cluster)

        # Aborted while its blocks wait for the landing.
        call = p.start(PrefillRequest("aborted-waiting", prompt, params))
        _wait_held(prefill_url)
        p.abort("aborted-waiting")
        reply = p.reply(call, 30)
        assert reply.status != 200, reply
        _wait_idle(cluster)

        # Its deadline passes before any landing comes.
        call = p.start(PrefillRequest("never-landed", prompt, params, deadline=time.time() + 2))
        reply = p.reply(call, 30)
        assert reply.status != 200, reply
        _wait_idle(cluster)

        # The prefill call's link closes (its proxy gone) while its blocks wait.
    with node_link.NodeLink(prefill_url) as q:
        q.start(PrefillRequest("link-gone", prompt, params))
        _wait_held(prefill_url)
    _wait_idle(cluster)
    _ask(cluster)


def test_serial_reserve_then_prefill_gives_the_same_tokens(cluster):
    """--no-overlap-reserve: the prefill call waits for the reservation and carries its landing."""
    from pdserve.proxy.config import ProxyConfig
    from pdserve.proxy.server import ProxyServer

    prefill = [x.url for x in _nodes(cluster, "prefill")]
    decode = [x.url for x in _nodes(cluster, "decode")]
    config = ProxyConfig(
        port=0, prefill_urls=tuple(prefill), decode_urls=tuple(decode), overlap_reserve=False
    )
    body = {"model": MODEL, "prompt": "The harbor at dawn was", "max_tokens": 12, "temperature": 0}
    overlapped = httpx.post(f"{_proxy(cluster)}/v1/completions", json=body, timeout=120)
    with ProxyServer(config) as proxy:
        serial = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=120)
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    assert overlapped.status_code == serial.status_code == 200, (overlapped.text, serial.text)
    assert serial.json()["choices"][0]["text"] == overlapped.json()["choices"][0]["text"]
    assert 'pdserve_routing_decisions_total{policy="prefix-aware",reason="remote_prefill' in metrics
    _wait_idle(cluster)
