"""Graceful shutdown on real processes: SIGTERM drains the proxy, a decode node, a prefill node.

Each drained process finishes what it holds (streams run to their end with the output of an
undisturbed run), refuses new work meanwhile, then exits; past --shutdown-timeout-s the requests
left end with an error event. The remaining pools are idle after each test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from pdserve.cluster import LocalCluster
from pdserve.messages import NodeLoad, ReserveRequest, StreamRequest, decode
from pdserve.sampling_params import SamplingParams
from tests import node_link

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Once upon a time", "The sea is", "My favourite food is", "In the year 3000"]
MAX_TOKENS = 16
SHUTDOWN_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(
        ["--max-num-batched-tokens", "256", "--max-model-len", "2048"],
        prefill_nodes=2,
        decode_nodes=2,
        redis_url="none",
        min_remote_prefill_tokens=0,
        extra_node_flags=f"--shutdown-timeout-s {SHUTDOWN_TIMEOUT_S} --kv-cache-memory-gib 0.25",
    ) as c:
        yield c


def _child(c: LocalCluster, role: str):
    return next(x for x in c.children if x.role == role)


def _load(url: str) -> NodeLoad:
    return decode(httpx.get(f"{url}/internal/load", timeout=10).content, NodeLoad)


def _wait_idle(c: LocalCluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        nodes = [x for x in c.children if not x.role.startswith("proxy") and x.proc.poll() is None]
        loads = {x.role: _load(x.url) for x in nodes}
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


def _body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


class Stream(threading.Thread):
    """One streaming completion read in a thread: its text, its error events, and when it began."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.text, self.errors, self.done, self.status = "", [], False, 0
        self.started = threading.Event()
        self.exc: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:
                            self.errors.append(data["error"])
                        else:
                            self.text += data["choices"][0]["text"]
                            self.started.set()
        except Exception as e:  # noqa: BLE001 - checked by the test
            self.exc = e
        finally:
            self.started.set()


def _complete(url: str, prompts: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=_body(p)) for p in prompts))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["text"] for r in rs]

    return asyncio.run(run())


def _streams(url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[Stream]:
    streams = [Stream(url, _body(p, max_tokens)) for p in prompts]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60), "a stream produced nothing"
    return streams


def _join(streams: list[Stream], timeout: float = 60) -> None:
    for s in streams:
        s.join(timeout)
        assert not s.is_alive(), "a stream hung"
        assert s.exc is None, repr(s.exc)


def _exits(child, timeout: float) -> float:
    start = time.monotonic()
    child.proc.wait(timeout=timeout)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def reference(cluster) -> list[str]:
    """The prompts' outputs through the undisturbed cluster."""
    return _complete(_child(cluster, "proxy-0").url, PROMPTS)


def test_sigterm_proxy_finishes_streams_then_refuses(cluster, reference):
    proxy = _child(cluster, "proxy-0")
    streams = _streams(proxy.url, PROMPTS)
    os.kill(proxy.proc.pid, signal.SIGTERM)
    _join(streams)
    assert [s.text for s in streams] == reference
    assert all(s.status == 200 and s.done and not s.errors for s in streams)
    assert _exits(proxy, 20) < 20
    assert proxy.proc.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{proxy.url}/health", timeout=5)
    _wait_idle(cluster)


def test_sigterm_decode_node_finishes_streams(cluster, reference):
    prefill, victim = _child(cluster, "prefill-0"), _child(cluster, "decode-0")
    proxy = cluster.add_proxy("--prefill-urls", prefill.url, "--decode-urls", victim.url)
    streams = _streams(proxy, PROMPTS)
    start = time.monotonic()
    os.kill(victim.proc.pid, signal.SIGTERM)
    # While it drains: unhealthy, no new work, no load reports (the proxy stops routing to it).
    deadline = time.monotonic() + 5
    while (health := httpx.get(f"{victim.url}/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
        time.sleep(0.01)
    assert health.status_code == 503
    msg = ReserveRequest("drain-new", list(range(10, 40)), SamplingParams(max_tokens=2), lease_s=5.0)
    r = node_link.call(victim.url, msg, timeout=5)
    assert r.status == 503 and r.retry_after, r
    assert httpx.get(f"{victim.url}/internal/load", timeout=5).status_code == 503
    _join(streams)
    assert [s.text for s in streams] == reference
    assert all(s.status == 200 and s.done and not s.errors for s in streams)
    victim.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 10)
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 10
    _wait_idle(cluster)


def test_sigterm_prefill_node_mid_prompt(cluster):
    victim, decode_node = _child(cluster, "prefill-1"), _child(cluster, "decode-1")
    proxy = cluster.add_proxy("--prefill-urls", victim.url, "--decode-urls", decode_node.url)
    long_prompt = "Tell me everything about the history of the world. " * 150  # ~1500 tokens: ~6 steps
    result: dict = {}

    def send() -> None:
        r = httpx.post(f"{proxy}/v1/completions", json=_body(long_prompt, 8), timeout=120)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not (lo := _load(victim.url)).running and not lo.waiting:
        assert time.monotonic() < deadline, "the prompt never showed up on the prefill node"
        time.sleep(0.02)
    os.kill(victim.proc.pid, signal.SIGTERM)
    t.join(60)
    assert not t.is_alive(), "the request hung"
    assert result["status"] == 200, result
    assert len(result["body"]["choices"][0]["text"]) > 0
    victim.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 10)
    _wait_idle(cluster)


def test_drain_timeout_ends_streams_with_an_error(cluster):
    """A reservation whose KV never comes outlives the drain: its stream ends with an error event."""
    victim = _child(cluster, "decode-1")
    msg = ReserveRequest("drain-stuck", list(range(10, 60)), SamplingParams(max_tokens=4), lease_s=300.0)
    with node_link.NodeLink(victim.url) as link:
        r = link.call(msg, 10)
        assert r.status == 200, r
        assert link.call(StreamRequest("drain-stuck"), 10).status == 200
        start = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGTERM)
        events = link.read("drain-stuck", 60)
    ended = time.monotonic() - start
    assert SHUTDOWN_TIMEOUT_S - 1 < ended < SHUTDOWN_TIMEOUT_S + 10, ended
    assert events[-1].finish_reason == "error" and "shutting down" in events[-1].error, events
    victim.proc.wait(timeout=15)
    _wait_idle(cluster)  # the prefill nodes left


def test_in_flight_middleware_ends_a_stream_with_an_error_event():
    """The proxy's drain, in process: a stream still running at the end gets an error and [DONE]."""
    from pdserve.proxy.server import InFlight

    async def app(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    async def run() -> tuple[list[dict], list[dict]]:
        inflight = InFlight(app)
        sent: list[dict] = []
        refused: list[dict] = []

        async def receive():
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        async def collect(message):
            refused.append(message)

        task = asyncio.ensure_future(inflight({"type": "http"}, receive, send))
        await asyncio.sleep(0.05)
        assert inflight.num_inflight == 1
        inflight.draining = True
        await inflight({"type": "http"}, receive, collect)
        assert await inflight.end_all(timeout=5) == 1
        await task
        assert inflight.num_inflight == 0
        return sent, refused

    sent, refused = asyncio.run(run())
    assert refused[0]["status"] == 503
    last = sent[-1]
    assert last["more_body"] is False
    assert b'"error"' in last["body"] and last["body"].endswith(b"data: [DONE]\n\n")
