"""The proxy-alone benchmark runs end to end: stand-in nodes, a real proxy (one worker and two),
clients; every stream completes and its tokens are counted."""

from __future__ import annotations

import json

from pdserve.benchmarks import proxy_alone


def test_proxy_alone_small_run(tmp_path, default_model_dir):
    out = tmp_path / "proxy_alone.json"
    rc = proxy_alone.main(
        ["--workers", "1,2", "--concurrency", "4", "--tokens", "16", "--duration-s", "2", "--warmup-s", "0.5"]
        + ["--decode-nodes", "1", "--client-processes", "1", "--output", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["workers"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        assert row["streams_completed"] > 0 and row["streams_failed"] == 0 and row["error_events"] == 0
        assert row["migrations"] == 0
        assert 0 < row["output_tok_s"] <= row["offered_tok_s"] * 1.2
        assert row["proxy_cpu_us_per_token"] > 0
    assert result["results"][0]["workers_over_one"] == 1.0
