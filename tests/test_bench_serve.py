"""Integration: `pdserve bench serve` as a subprocess against a real local cluster.

Its JSON must agree with what the servers counted themselves: requests, prompt tokens and
output tokens on the proxy's /metrics, prompt tokens on the prefill node's /metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdserve.cluster import LocalCluster
from pdserve.metrics import parse_text

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(start_cluster):
    with start_cluster() as c:
        yield c


def _url(c: LocalCluster, role: str) -> str:
    return next(x.url for x in c.children if x.role.startswith(role))


def _scrape(url: str) -> dict[str, float]:
    return parse_text(httpx.get(f"{url}/metrics", timeout=10).text)


class ServerCounts:
    """What the cluster counted between two scrapes."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.urls = {role: _url(cluster, role) for role in ("proxy", "prefill", "decode")}
        self.before = {role: _scrape(url) for role, url in self.urls.items()}

    def delta(self) -> dict[str, dict[str, float]]:
        after = {role: _scrape(url) for role, url in self.urls.items()}
        return {
            role: {k: v - self.before[role].get(k, 0.0) for k, v in after[role].items()} for role in after
        }


def _bench(base_url: str, out: Path, *flags: str, expect_rc: int = 0) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "serve",
        "--base-url",
        base_url + "/v1",
        "--output-json",
        str(out),
        "--disable-tqdm",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != expect_rc:
        failed = _errors(json.loads(out.read_text())) if out.exists() else []
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\nerrors: {failed}")
    return json.loads(out.read_text())


def _errors(result: dict) -> list[str]:
    """What the failed requests of a run said (with when they started and how long they took)."""
    return [
        f"{r['error']} (started at {r.get('start_s', 0):.2f} s, after {r.get('e2e_s') or 0:.2f} s)"
        for run in result["runs"]
        for r in run["requests"]
        if r.get("error")
    ]


def _check_against_metrics(run: dict, delta: dict, num_requests: int) -> None:
    proxy = delta["proxy"]
    assert run["num_requests"] == run["num_completed"] == num_requests, _errors({"runs": [run]})
    assert run["num_failed"] == 0 and run["num_usage_reported"] == num_requests
    assert proxy['pdserve_requests_total{status="200"}'] == num_requests
    assert proxy["pdserve_time_to_first_token_seconds_count"] == num_requests
    assert proxy["pdserve_e2e_request_latency_seconds_count"] == num_requests
    assert run["total_input_tokens"] == proxy["pdserve_prompt_tokens_total"]
    assert run["total_output_tokens"] == proxy["pdserve_generation_tokens_total"]
    assert run["total_cached_tokens"] == proxy["pdserve_cached_prompt_tokens_total"]
    # Each prompt ran once, on the prefill node or (local prefill) on the decode node: its tokens
    # were computed there or served from that node's prefix cache.
    node_tokens = {
        role: delta[role]["pdserve_prompt_tokens_computed_total"]
        + delta[role]["pdserve_prefix_cache_hit_tokens_total"]
        for role in ("prefill", "decode")
    }
    assert run["total_input_tokens"] == sum(node_tokens.values()), node_tokens
    assert run["ttft_ms"]["count"] == num_requests and run["e2e_ms"]["count"] == num_requests


def test_random_chat_counts_match_server_metrics(cluster, tmp_path):
    base = _url(cluster, "proxy")
    counts = ServerCounts(cluster)
    flags = ["--dataset", "random", "--num-prompts", "16", "--input-len", "24", "--output-len", "8"]
    flags += ["--range-ratio", "0.5", "--request-rate", "16", "--seed", "3", "--model", MODEL]
    flags += ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--plot-dir", str(tmp_path / "plots")]
    result = _bench(base, tmp_path / "random.json", *flags)
    delta = counts.delta()

    (run,) = result["runs"]
    _check_against_metrics(run, delta, 16)
    requests = run["requests"]
    # ignore_eos: every answer has exactly the asked length, and the lengths were spread.
    assert len({r["num_input_tokens"] for r in requests}) > 1
    assert run["total_output_tokens"] == sum(r["num_output_tokens"] for r in requests) >= 16 * 4
    assert run["slo_attainment"] == 1.0 and run["request_goodput"] > 0
    assert run["request_throughput"] == pytest.approx(16 / run["duration_s"])
    assert result["endpoint"] == "/v1/chat/completions" and result["model"] == MODEL
    assert (tmp_path / "plots" / "serve_latency_cdf.png").stat().st_size > 10_000


def test_multi_turn_answers_grow_the_history(cluster, tmp_path):
    base = _url(cluster, "proxy")
    counts = ServerCounts(cluster)
    flags = ["--dataset", "multi-turn", "--num-prompts", "3", "--num-turns", "3"]
    flags += ["--input-len", "12", "--output-len", "5", "--max-concurrency", "2"]
    result = _bench(base, tmp_path / "multi.json", *flags)
    (run,) = result["runs"]
    _check_against_metrics(run, counts.delta(), 9)
    by_conv: dict[int, list[dict]] = {}
    for r in run["requests"]:
        by_conv.setdefault(r["conversation"], []).append(r)
    assert sorted(by_conv) == [0, 1, 2]
    for turns in by_conv.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        for prev, nxt in zip(turns, turns[1:]):
            # The next turn was sent after the answer arrived, with the answer in its prompt.
            assert nxt["start_s"] >= prev["start_s"] + prev["e2e_s"] - 1e-3
            assert nxt["num_input_tokens"] > prev["num_input_tokens"] + prev["num_output_tokens"]


def test_shared_prefix_sweep_on_completions(cluster, tmp_path):
    base = _url(cluster, "proxy")
    counts = ServerCounts(cluster)
    flags = ["--endpoint", "/v1/completions", "--dataset", "shared-prefix", "--prefix-groups", "2"]
    flags += ["--prompts-per-group", "3", "--prefix-len", "48", "--input-len", "6", "--output-len", "4"]
    flags += [
        "--sweep-rates",
        "2,inf",
        "--arrival",
        "constant",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
    ]
    flags += ["--plot-dir", str(tmp_path / "plots"), "--label", "sp", "--save-detailed"]
    result = _bench(base, tmp_path / "sp.json", *flags)
    delta = counts.delta()

    assert [r["request_rate"] for r in result["runs"]] == ["2", "inf"]
    total = {k: sum(r[k] for r in result["runs"]) for k in ("total_input_tokens", "total_output_tokens")}
    assert total["total_output_tokens"] == delta["proxy"]["pdserve_generation_tokens_total"] == 12 * 4
    assert total["total_input_tokens"] == delta["proxy"]["pdserve_prompt_tokens_total"]
    assert delta["proxy"]['pdserve_requests_total{status="200"}'] == 12
    # Questions of a group share its system prompt (48 words + a blank line): 500 ms apart, the
    # two later questions of each group find its 3 full blocks in the prefill node's cache.
    assert result["runs"][0]["total_cached_tokens"] >= 4 * 48
    assert result["sweep"]["max_goodput_rate"] == 2.0  # inf is no rate one can offer
    assert all(len(r["itl_s"]) == 3 for run in result["runs"] for r in run["requests"])
    assert (tmp_path / "plots" / "sp_goodput_sweep.png").exists()


def test_failed_requests_are_counted(cluster, tmp_path):
    base = _url(cluster, "proxy")
    counts = ServerCounts(cluster)
    flags = ["--num-prompts", "4", "--input-len", "8", "--output-len", "2", "--model", "no-such-model"]
    result = _bench(base, tmp_path / "fail.json", *flags, expect_rc=1)
    (run,) = result["runs"]
    assert run["num_failed"] == 4 and run["num_completed"] == 0
    assert counts.delta()["proxy"]['pdserve_requests_total{status="404"}'] == 4
    assert all(r["error"].startswith("HTTP 404") for r in run["requests"])
