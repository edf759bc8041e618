"""`pdserve proxy --workers N`: several proxy processes on one port behind a real cluster."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.metrics import parse_text
from pdserve.utils import child_pids, is_alive

MODEL = "SmolLM2-135M-Instruct"
WORKERS = 2


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster(redis_url="none", min_remote_prefill_tokens=0, proxy_workers=WORKERS) as c:
        yield c


def _proxy(cluster):
    return next(c for c in cluster.children if c.role.startswith("proxy"))


def _complete(url: str, prompt: str, max_tokens: int = 8) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(timeout=120) as client:  # a connection of its own: any worker may take it
        r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_workers_share_the_port_and_metrics(cluster):
    proxy = _proxy(cluster)
    assert len(child_pids(proxy.proc.pid)) == WORKERS
    prompts = [f"Count to {i}:" for i in range(4)] * 4
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: _complete(proxy.url, p), prompts))
    assert texts[:4] * 4 == texts  # greedy: every worker gives each prompt the same answer
    deadline = time.monotonic() + 10
    while True:  # another worker's figures are at most a snapshot interval old
        samples = parse_text(httpx.get(proxy.url + "/metrics", timeout=30).text)
        if samples.get('pdserve_requests_total{status="200"}') == len(prompts):
            break
        assert time.monotonic() < deadline, samples
        time.sleep(0.2)
    assert samples["pdserve_proxy_workers"] == WORKERS
    assert samples["pdserve_requests_running"] == 0
    node_up = [v for k, v in samples.items() if k.startswith("pdserve_node_up")]
    assert node_up and all(v == 1.0 for v in node_up)  # merged by max, not summed
    # Each worker froze its start-up heap and counts its collector's passes since (summed here).
    assert samples['pdserve_gc_frozen_objects{process="proxy"}'] > 10_000 * WORKERS
    assert samples['pdserve_gc_collections_total{process="proxy",generation="0"}'] > 0
    assert 'pdserve_gc_pause_seconds_total{process="proxy",generation="2"}' in samples


def test_a_second_proxy_on_the_port_fails_before_starting(cluster):
    """Workers share the port through SO_REUSEPORT; the supervisor's lone bind first keeps another
    `pdserve proxy` (of the same user, who could join the group) off a port in use."""
    import subprocess
    import sys

    port = _proxy(cluster).url.rsplit(":", 1)[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "proxy", "--port", port, "--workers", "2"]
        + ["--decode-urls", "127.0.0.1:1", "--redis-url", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


def test_sigterm_drains_every_worker(cluster):
    """A stream in flight when the supervisor gets SIGTERM still finishes; then every process exits."""
    proxy = _proxy(cluster)
    workers = child_pids(proxy.proc.pid)
    result: dict = {}

    def stream() -> None:
        try:
            _stream()
        except Exception as e:  # noqa: BLE001 - the test reports it
            result["error"] = repr(e)

    def _stream() -> None:
        body = {
            "model": MODEL,
            "prompt": "Tell me a story.",
            "max_tokens": 64,
            "ignore_eos": True,  # 64 tokens: still streaming when the signal comes
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            result["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]
        result["ended"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    signalled = time.monotonic()
    os.kill(proxy.proc.pid, signal.SIGTERM)
    t.join(60)
    assert "error" not in result, result.get("error")
    assert result["ended"] > signalled + 0.1, "the stream was over before the signal: nothing drained"
    assert result["status"] == 200
    assert result["events"][-1] == "data: [DONE]"
    assert not any('"error"' in e for e in result["events"])
    proxy.proc.wait(timeout=30)
    assert proxy.proc.returncode == 0
    assert not any(is_alive(w) for w in workers)
