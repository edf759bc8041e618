"""The proxy-latency benchmark runs end to end against stand-in nodes: both paths (the nodes'
protocol driven directly, and a real proxy) complete every one-token request, streamed or not."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import proxy_latency


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_latency_small_run(tmp_path, default_model_dir, stream):
    out = tmp_path / "proxy_latency.json"
    args = ["--nodes", "stand-in", "--requests", "6", "--warmup", "2", "--output", str(out)]
    assert proxy_latency.main(args + (["--stream"] if stream else [])) == 0
    result = json.loads(out.read_text())
    assert len(result["samples_s"]["direct"]) == len(result["samples_s"]["proxy"]) == 6
    for path in ("direct", "proxy"):
        assert 0 < result[path]["p50_ms"] <= result[path]["p90_ms"] < 10_000
    assert result["added"]["p50_ms"] == pytest.approx(result["proxy"]["p50_ms"] - result["direct"]["p50_ms"])
