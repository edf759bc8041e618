"""Request migration on real processes: a decode node killed mid-stream, a prefill node killed
mid-prompt. The client sees one uninterrupted stream, greedy output identical to ``LLM.chat``."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.messages import AbortRequest, NodeLoad, ReserveRequest, decode, encode
from pdserve.metrics import parse_text
from tests import node_link

MODEL = "SmolLM2-135M-Instruct"
MSGPACK = {"content-type": "application/msgpack"}
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
MAX_TOKENS = 40
# Streams that resume mid-output must go on as if unmoved: output penalties count the tokens already
# streamed (``SamplingParams.resumed_tokens``; a grammar does too: test_structured_output.py). No
# grammar here: a short JSON answer can end before the kill and not move.
PENALTIES = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
EXTRA = {6: PENALTIES, 7: PENALTIES}
LONG_PROMPT = "Tell me everything about the history of the world. " * 100  # ~1000 tokens


@pytest.fixture(scope="module")
def cluster(start_cluster):
    # Small steps so that the long prompt takes several engine steps to prefill.
    with start_cluster(
        ["--max-num-batched-tokens", "128"],
        prefill_nodes=2,
        decode_nodes=3,  # one dies under the parallel-sampling request, one under the 8 streams
        routing="round-robin",  # spread the streams over both decode nodes
        redis_url="none",
        min_remote_prefill_tokens=0,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(str(default_model_dir), max_num_batched_tokens=512)
    chats = [[{"role": "user", "content": p}] for p in [*PROMPTS, LONG_PROMPT]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **EXTRA.get(i, {}))
        for i in range(len(chats))
    ]
    return [o.outputs[0].text for o in llm.chat(chats, params)]


def _alive(c: LocalCluster, role: str):
    return [x for x in c.children if x.role.startswith(role) and x.proc.poll() is None]


def _load(url: str) -> NodeLoad:
    return decode(httpx.get(f"{url}/internal/load", timeout=10).content, NodeLoad)


def _proxy(c: LocalCluster) -> str:
    return next(x.url for x in c.children if x.role.startswith("proxy"))


def _migrations(c: LocalCluster) -> dict[str, float]:
    metrics = parse_text(httpx.get(f"{_proxy(c)}/metrics", timeout=10).text)
    return {k: v for k, v in metrics.items() if k.startswith("pdserve_request_migrations_total")}


def _wait_idle(c: LocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = {x.role: _load(x.url) for x in _alive(c, "prefill") + _alive(c, "decode")}
        if all(
            lo.free_blocks == lo.total_blocks and lo.running == lo.waiting == lo.waiting_for_kv == 0
            for lo in loads.values()
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle after {timeout} s: {loads}")
        time.sleep(0.2)


class _Stream(threading.Thread):
    """One streaming chat request; records the text, the chunk count and how it ended."""

    def __init__(self, url: str, prompt: str, extra: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.extra = url, prompt, extra or {}
        self.text, self.chunks, self.status, self.error, self.done = "", 0, 0, "", False

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            **self.extra,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=180) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        continue
                    for choice in chunk["choices"]:
                        self.text += choice["delta"].get("content") or ""
                        self.chunks += 1
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def _fill(url: str) -> list[str]:
    """Reserve every free KV block of a decode node (leases no stream ever claims), so the proxy
    finds it full; returns the reservations' ids for ``/internal/abort``."""
    ids: list[str] = []
    size = 4096
    while size >= 8:
        rid = f"filler-{len(ids)}"
        msg = ReserveRequest(rid, [11] * size, SamplingParams(max_tokens=1), lease_s=600.0)
        r = node_link.call(url, msg, timeout=10)
        if r.status == 200:
            ids.append(rid)
        else:
            assert r.status in (429, 503), r
            size //= 2
    return ids


def test_decode_node_killed_under_a_parallel_sampling_request_each_sequence_moves(cluster, reference):
    """n = 2, greedy: the decode node dies while both sequences stream; each goes on from its own
    tokens on another decode node, under its own index, and both end as the undisturbed answer."""
    before = _migrations(cluster).get('pdserve_request_migrations_total{role="decode"}', 0.0)
    victim, *others = _alive(cluster, "decode")
    fillers = {node.url: _fill(node.url) for node in others}  # the request lands on the victim
    texts, finished, errors = ["", ""], [None, None], []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }

    def read() -> None:
        with httpx.stream("POST", f"{_proxy(cluster)}/v1/chat/completions", json=body, timeout=180) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    texts[choice["index"]] += choice["delta"].get("content") or ""
                    finished[choice["index"]] = choice.get("finish_reason") or finished[choice["index"]]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while min(len(t) for t in texts) < 12:  # both sequences are decoding
        assert time.monotonic() < deadline and reader.is_alive(), (texts, errors)
        time.sleep(0.02)
    for url, ids in fillers.items():  # room for the sequences to move to
        for rid in ids:
            r = httpx.post(f"{url}/internal/abort", content=encode(AbortRequest(rid)), headers=MSGPACK)
            assert r.status_code == 200, r.text
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    reader.join(timeout=180)
    assert not reader.is_alive(), "the request hung after its decode node died"
    assert errors == [] and finished == ["length", "length"], (errors, finished)
    assert texts == [reference[0], reference[0]]
    moved = _migrations(cluster).get('pdserve_request_migrations_total{role="decode"}', 0.0) - before
    assert moved == 1
    _wait_idle(cluster)


def test_decode_node_killed_under_8_streams_every_one_completes_identically(cluster, reference):
    before = _migrations(cluster).get('pdserve_request_migrations_total{role="decode"}', 0.0)
    victim, spare = _alive(cluster, "decode")
    fillers = _fill(spare.url)  # every stream lands on the victim
    streams = [_Stream(_proxy(cluster), p, EXTRA.get(i)) for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while not all(s.chunks >= 4 for s in streams):  # every stream is decoding
        assert time.monotonic() < deadline, [s.chunks for s in streams]
        assert not any(s.done or s.error for s in streams), "a stream ended before the kill"
        time.sleep(0.02)
    assert _load(victim.url).running == len(PROMPTS)
    for rid in fillers:  # room on the spare for the streams to move to
        r = httpx.post(f"{spare.url}/internal/abort", content=encode(AbortRequest(rid)), headers=MSGPACK)
        assert r.status_code == 200, r.text
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    for s in streams:
        s.join(timeout=180)
    assert not any(s.is_alive() for s in streams), "a stream hung after its decode node died"
    for s, want in zip(streams, reference):
        assert (s.status, s.error, s.done) == (200, "", True), (s.prompt, s.status, s.error)
        assert s.text == want, s.prompt
    moved = _migrations(cluster).get('pdserve_request_migrations_total{role="decode"}', 0.0) - before
    assert moved == len(PROMPTS)
    _wait_idle(cluster)


def _engine_core(pid: int) -> int:
    """The engine core process a node spawned (multiprocessing's spawn: ``spawn_main``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    cores = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return cores[0]


def test_prefill_node_killed_mid_prompt_is_retried_on_another(cluster, reference):
    """Only the prefill node's engine core is killed (kill -9 of whole nodes is the decode test's,
    and the fault suite's): the node exits with it, and the prompt moves like after a node death."""
    before = _migrations(cluster).get('pdserve_request_migrations_total{role="prefill"}', 0.0)
    stream = _Stream(_proxy(cluster), LONG_PROMPT)
    stream.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None:
        assert time.monotonic() < deadline, "the long prompt never showed up on a prefill node"
        for node in _alive(cluster, "prefill"):
            lo = _load(node.url)
            if lo.running or lo.waiting:
                victim = node
                break
        time.sleep(0.02)
    os.kill(_engine_core(victim.proc.pid), signal.SIGKILL)
    assert victim.proc.wait(timeout=10) != 0
    stream.join(timeout=180)
    assert not stream.is_alive(), "the request hung after its prefill node died"
    assert (stream.status, stream.error, stream.done) == (200, "", True), stream.error
    assert stream.text == reference[-1]
    moved = _migrations(cluster).get('pdserve_request_migrations_total{role="prefill"}', 0.0) - before
    assert moved == 1
    _wait_idle(cluster)
