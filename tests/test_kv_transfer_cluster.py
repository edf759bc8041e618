"""Real prefill node, decode node and proxy processes moving the default model's KV over nixl
(DRAM via UCX) and over nccl (gloo on the CPU): outputs token-identical to ``LLM.generate``."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams, kv_transfer
from pdserve.cluster import LocalCluster
from pdserve.messages import NodeLoad, decode

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "List two planets."]
LONG = "Summarize the following notes about ships and harbors. " * 30  # ~340 tokens: 3 prefill steps
MAX_TOKENS = 16


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            "nixl",
            marks=pytest.mark.skipif(
                "nixl" not in kv_transfer.available_transports(), reason="nixl not installed"
            ),
        ),
        "nccl",
    ],
)
def cluster(request, start_cluster):
    flags = ["--kv-transport", request.param, "--max-num-batched-tokens", "128"]
    # Options the transport takes from --kv-transfer-config (a longer limit than its default: the
    # sends are no different, and both nodes log what they got).
    limit = {"nixl": "max_read_s", "nccl": "recv_timeout_s"}[request.param]
    flags += ["--kv-transfer-config", json.dumps({request.param: {limit: 45}})]
    if request.param == "nccl":
        # Nodes on the CPU schedule synchronously by default; run the async engine loop here:
        # prefill chunks shipped while the next step runs, landings, late stops, streaming.
        flags.append("--async-scheduling")
    with start_cluster(flags) as c:
        yield request.param, c


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(str(default_model_dir), max_num_batched_tokens=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    completion = llm.generate([*PROMPTS, LONG], params)
    return [o.outputs[0].text for o in chat], [o.outputs[0].text for o in completion]


def _child(c: LocalCluster, role: str):
    return next(x for x in c.children if x.role.startswith(role))


def _url(c: LocalCluster, role: str) -> str:
    return _child(c, role).url


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_outputs_match_llm_generate(cluster, reference):
    transport, c = cluster
    chat_ref, completion_ref = reference
    proxy = _url(c, "proxy")
    for node in ("prefill", "decode"):
        info = httpx.get(f"{_url(c, node)}/internal/info", timeout=10)
        assert transport.encode() in info.content  # the node runs the transport it was given
    with httpx.Client(base_url=f"{proxy}/v1", timeout=120) as client:
        for prompt, want in zip(PROMPTS, chat_ref):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS,
            }
            r = client.post("/chat/completions", json={**body, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
        for prompt, want in zip([*PROMPTS, LONG], completion_ref):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = client.post("/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
    sent = _metric(_url(c, "prefill"), "pdserve_kv_transfer_bytes_total")
    assert sent > 0 and sent == _metric(_url(c, "decode"), "pdserve_kv_transfer_bytes_total")
    deadline = time.monotonic() + 20
    while True:  # every reservation released, every pool back to idle
        loads = [
            decode(httpx.get(f"{_url(c, n)}/internal/load", timeout=10).content, NodeLoad)
            for n in ("prefill", "decode")
        ]
        if all(lo.free_blocks == lo.total_blocks and lo.waiting_for_kv == lo.running == 0 for lo in loads):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def test_each_node_took_the_transfer_options_it_was_given(cluster):
    transport, c = cluster
    limit = {"nixl": "max_read_s", "nccl": "recv_timeout_s"}[transport]
    for child, side in ((_child(c, "prefill"), "sender"), (_child(c, "decode"), "receiver")):
        lines = [
            line for line in child.log.read_text().splitlines() if f"KV {side}: {transport} with" in line
        ]
        assert len(lines) == 1 and f"{limit}=45.0" in lines[0], child.log.read_text()[-2000:]


def test_decode_node_keeps_its_cached_prefix_and_receives_only_the_rest(cluster):
    _, c = cluster
    proxy, decode_url = _url(c, "proxy"), _url(c, "decode")
    prompt = "Describe the harbor at dawn, ship by ship, in plain words. " * 25  # ~330 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    deltas, texts = [], []
    for _ in range(2):
        before = _metric(decode_url, "pdserve_kv_transfer_bytes_total")
        r = httpx.post(f"{proxy}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        deltas.append(_metric(decode_url, "pdserve_kv_transfer_bytes_total") - before)
    assert texts[0] == texts[1]
    # ~21 blocks of 16 tokens the first time; the second time only the block after the cached
    # prefix (get_computed_blocks leaves the last token, so its block, to be computed).
    assert 0 < deltas[1] <= deltas[0] / 10, deltas
