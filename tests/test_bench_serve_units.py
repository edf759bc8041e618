"""Pure logic of `pdserve bench serve`: statistics, goodput, sweeps, arrivals, workloads, SSE parsing."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest

from pdserve.benchmarks.serve_client import CHAT, COMPLETIONS, RequestOptions, _Stream
from pdserve.benchmarks.serve_datasets import (
    WORDS,
    Conversation,
    DatasetConfig,
    Message,
    Turn,
    build_dataset,
    parse_jsonl_line,
    render_prompt,
)
from pdserve.benchmarks.serve_load import arrival_times
from pdserve.benchmarks.serve_metrics import (
    SLO,
    RequestRecord,
    Stats,
    goodput_between,
    max_goodput_rate,
    output_tok_s_between,
    percentile,
    summarize,
)
from pdserve.benchmarks.serve_report import jsonable, record_from_json, record_json


def rec(
    ttft: float | None, e2e: float, out: int, *, inp: int | None = 10, error: str = "", itl=()
) -> RequestRecord:
    return RequestRecord(
        success=not error,
        start_s=0.0,
        e2e_s=e2e,
        ttft_s=ttft,
        itl_s=tuple(itl),
        num_input_tokens=inp,
        num_output_tokens=out,
        usage_reported=inp is not None,
        error=error,
    )


# -- statistics ------------------------------------------------------------------------------


def test_steady_throughput_counts_only_the_tokens_inside_the_window():
    def at(start, ttft, e2e, out, error=""):
        return dataclasses.replace(rec(ttft, e2e, out, error=error), start_s=start)

    records = [
        at(0.0, 1.0, 11.0, 11),  # first token at 1, then one a second up to 11
        at(5.0, 0.5, 0.5, 1),  # a one-token answer at 5.5
        at(2.0, 1.0, 3.0, 5, error="reset"),  # failed: none of its tokens count
        at(20.0, 1.0, 2.0, 3),  # after the window
    ]
    # tokens at 2..6 of the first request (its ten later tokens spread over [1, 11]) and the answer
    assert output_tok_s_between(records, 2.0, 6.0) == pytest.approx((4 + 1) / 4)
    # the whole-run figure over [0, 22] counts the drain: 15 tokens in 22 s
    assert summarize(records, 22.0).output_throughput == pytest.approx(15 / 22)
    assert goodput_between(records, SLO(ttft_ms=800), 0.0, 10.0) == pytest.approx(1 / 10)
    with pytest.raises(ValueError):
        output_tok_s_between(records, 3.0, 3.0)


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_by_hand():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input; midway between 2 and 3
    assert percentile([10, 20], 90) == pytest.approx(19.0)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_are_milliseconds():
    s = Stats.of_seconds([0.1, 0.2, 0.3, 0.4], (50, 99))
    assert s.count == 4 and s.mean == pytest.approx(250.0)
    assert s.std == pytest.approx(math.sqrt(0.0125) * 1000)
    assert s.p(50) == pytest.approx(250.0) and s.p(99) == pytest.approx(397.0)
    assert s.to_dict()["p50"] == pytest.approx(250.0)
    assert math.isnan(Stats.of_seconds([]).mean)


def test_tpot_excludes_the_first_token():
    assert rec(0.5, 2.5, 5).tpot_s == pytest.approx(0.5)  # 4 gaps after the first token in 2 s
    assert rec(0.5, 0.5, 1).tpot_s is None
    assert rec(None, 1.0, 0, error="HTTP 500").tpot_s is None


def test_slo_met_on_hand_made_records():
    slo = SLO(ttft_ms=500, tpot_ms=100)
    assert slo.met(rec(0.5, 0.9, 5))  # TTFT exactly at the limit, TPOT 100 ms exactly
    assert not slo.met(rec(0.501, 0.9, 5))
    assert not slo.met(rec(0.1, 1.0, 5))  # TPOT 225 ms
    assert slo.met(rec(0.1, 0.1, 1))  # one token: no TPOT, only TTFT counts
    assert not slo.met(rec(None, 0.2, 0, error="HTTP 429"))
    assert SLO(ttft_ms=None, tpot_ms=100).met(rec(30.0, 30.2, 3))
    assert not SLO().is_set
    with pytest.raises(AssertionError):
        SLO(ttft_ms=0)


def test_summary_counts_goodput_and_failures():
    records = [
        rec(0.1, 1.0, 10, itl=[0.1] * 9),  # TPOT 100 ms: meets
        rec(0.2, 2.0, 10, inp=20, itl=[0.2] * 9),  # TPOT 200 ms: misses TPOT
        rec(0.9, 1.8, 10, itl=[0.1] * 9),  # TTFT 900 ms: misses TTFT
        rec(0.3, 0.3, 1),  # no TPOT: meets
        rec(None, 0.05, 0, inp=None, error="HTTP 429: busy"),
    ]
    s = summarize(records, duration_s=4.0, slo=SLO(500, 150), qs=(50, 90), num_skipped=1)
    assert (s.num_requests, s.num_completed, s.num_failed, s.num_skipped) == (6, 4, 1, 1)
    assert s.total_input_tokens == 50 and s.total_output_tokens == 31 and s.input_tokens_known
    assert s.request_throughput == 1.0 and s.output_throughput == pytest.approx(31 / 4)
    assert s.num_slo_met == 2 and s.slo_attainment == pytest.approx(2 / 6) and s.request_goodput == 0.5
    assert s.ttft_ms.count == 4 and s.ttft_ms.p(50) == pytest.approx(250.0)
    assert s.tpot_ms.count == 3 and s.itl_ms.count == 27 and s.e2e_ms.count == 4
    d = s.to_dict()
    assert d["num_failed"] == 1 and d["total_token_throughput"] == pytest.approx((50 + 31) / 4)
    no_slo = summarize(records[:1], 1.0)
    assert no_slo.slo_attainment is None and no_slo.request_goodput is None


def test_unknown_input_tokens_are_flagged():
    s = summarize([rec(0.1, 0.2, 2, inp=None)], 1.0)
    assert not s.input_tokens_known and s.total_input_tokens == 0


def test_record_invariants():
    with pytest.raises(AssertionError):
        RequestRecord(
            success=True,
            start_s=0.0,
            e2e_s=1.0,
            ttft_s=None,
            itl_s=(),
            num_input_tokens=1,
            num_output_tokens=0,
            usage_reported=False,
            error="boom",
        )


def test_max_goodput_rate_is_the_highest_rate_meeting_the_target():
    points = [(4.0, 0.85), (1.0, 1.0), (2.0, 0.9), (8.0, 0.2)]
    assert max_goodput_rate(points) == 2.0  # 0.9 counts: at least 90 %
    assert max_goodput_rate(points, target=0.8) == 4.0
    assert max_goodput_rate([(1.0, 0.5), (2.0, None)]) is None
    assert max_goodput_rate([(1.0, 1.0), (math.inf, 1.0)]) == 1.0  # everything-at-once is no rate
    assert max_goodput_rate([]) is None


def test_records_round_trip_through_json():
    r = rec(0.25, 1.0, 4, itl=[0.25, 0.25, 0.25])
    assert record_from_json(json.loads(json.dumps(record_json(r, detailed=True)))) == r
    assert record_from_json(record_json(r, detailed=False)).itl_s == ()


def test_jsonable_replaces_non_finite_numbers():
    out = jsonable({"a": math.nan, "b": [1.0, math.inf], "c": (2, "x")})
    assert out == {"a": None, "b": [1.0, None], "c": [2, "x"]}
    json.dumps(out, allow_nan=False)


# -- arrivals --------------------------------------------------------------------------------


def test_arrival_times():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_times(4000, 5.0, "poisson", seed=1)
    assert poisson == arrival_times(4000, 5.0, "poisson", seed=1) != arrival_times(4000, 5.0, seed=2)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and gaps.min() > 0
    assert gaps.mean() == pytest.approx(0.2, rel=0.05) and gaps.std() == pytest.approx(0.2, rel=0.08)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, "bursty")


# -- workloads -------------------------------------------------------------------------------


def test_random_dataset_lengths_and_determinism():
    cfg = DatasetConfig(num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, seed=7)
    convs = build_dataset(cfg)
    assert len(convs) == 50 and convs == build_dataset(cfg) != build_dataset(DatasetConfig(seed=8))
    lens = [len(c.turns[0].content.split()) for c in convs]
    outs = [c.turns[0].output_len for c in convs]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 5
    assert min(outs) >= 5 and max(outs) <= 15
    assert all(w in WORDS for c in convs for w in c.turns[0].content.split())
    assert all(len(c.turns) == 1 and c.preamble == () for c in convs)
    fixed = build_dataset(DatasetConfig(num_prompts=5, input_len=12, output_len=3))
    assert {len(c.turns[0].content.split()) for c in fixed} == {12} and {
        c.turns[0].output_len for c in fixed
    } == {3}


def test_random_dataset_with_a_tokenizer_has_exact_lengths(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    convs = build_dataset(DatasetConfig(num_prompts=10, input_len=33, seed=3), tok)
    for c in convs:
        assert len(tok.encode(c.turns[0].content, add_special_tokens=False)) == 33


def test_shared_prefix_groups_interleave():
    cfg = DatasetConfig(
        name="shared-prefix", prefix_groups=3, prompts_per_group=4, prefix_len=30, input_len=5
    )
    convs = build_dataset(cfg)
    assert len(convs) == 12
    prefixes = [c.preamble[0].content for c in convs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert all(len(p.split()) == 30 and c.preamble[0].role == "system" for p, c in zip(prefixes, convs))
    assert len({c.turns[0].content for c in convs}) == 12  # every question distinct
    runs = [len(list(g)) for _, g in itertools.groupby(prefixes)]
    assert max(runs) < 4  # shuffled, not group after group
    assert len(build_dataset(dataclasses.replace(cfg, num_prompts=5))) == 5


def test_multi_turn_conversations():
    convs = build_dataset(DatasetConfig(name="multi-turn", num_prompts=4, num_turns=3, input_len=6))
    assert len(convs) == 4 and all(len(c.turns) == 3 for c in convs)


def test_jsonl_lines(tmp_path):
    lines = [
        {"prompt": "hello", "output_len": 7},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"turns": ["a", "b"], "system": "sys", "max_tokens": [3, 4]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = build_dataset(DatasetConfig(name="jsonl", path=str(path), output_len=9))
    assert convs[0] == Conversation((Turn("hello", 7),))
    assert convs[1] == Conversation((Turn("hi", 9),), (Message("system", "be brief"),))
    assert convs[2] == Conversation((Turn("a", 3), Turn("b", 4)), (Message("system", "sys"),))
    assert len(build_dataset(DatasetConfig(name="jsonl", path=str(path), num_prompts=7))) == 7
    for bad in (
        {"text": "x"},
        {"messages": [{"role": "assistant", "content": "x"}]},
        {"prompt": "x", "output_len": 0},
    ):
        with pytest.raises(ValueError):
            parse_jsonl_line(bad, 8)
    with pytest.raises(ValueError):
        DatasetConfig(name="jsonl")


def test_dataset_config_validation():
    for bad in (dict(name="sharegpt"), dict(range_ratio=1.0), dict(num_prompts=0), dict(num_turns=0)):
        with pytest.raises(ValueError):
            DatasetConfig(**bad)


# -- requests and the SSE stream -------------------------------------------------------------


def test_request_bodies():
    msgs = [Message("system", "S"), Message("user", "U")]
    chat = RequestOptions(endpoint=CHAT, model="m", extra_body={"top_k": 5}).body(msgs, 16)
    assert chat["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert chat["max_tokens"] == 16 and chat["ignore_eos"] is True and chat["top_k"] == 5
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    plain = RequestOptions(endpoint=COMPLETIONS, model="m", ignore_eos=False, include_usage=False).body(
        msgs, 4
    )
    assert plain["prompt"] == render_prompt(msgs) == "S\n\nU"
    assert "ignore_eos" not in plain and "stream_options" not in plain and "messages" not in plain
    with pytest.raises(ValueError):
        RequestOptions(endpoint="/v1/responses")


def test_stream_events_time_text_chunks_and_keep_usage():
    s = _Stream(start=0.0)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert s.event(json.dumps(role), chat=True) and s.ttft is None  # no text yet: no first token
    for piece in ("Hel", "lo"):
        assert s.event(json.dumps({"choices": [{"delta": {"content": piece}}]}), chat=True)
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    assert s.event(json.dumps(usage), chat=True)
    assert not s.event("[DONE]", chat=True)
    assert s.num_chunks == 2 and len(s.itl) == 1 and s.ttft is not None and "".join(s.parts) == "Hello"
    assert s.usage == usage["usage"] and not s.error

    c = _Stream(start=0.0)
    assert c.event(json.dumps({"choices": [{"text": " a"}]}), chat=False) and c.num_chunks == 1
    assert not c.event(json.dumps({"error": {"message": "lease expired"}}), chat=False)
    assert c.error == "error event: lease expired"
    assert not _Stream(0.0).event("{not json", chat=False)


# -- command line and plots ------------------------------------------------------------------


def test_bench_command_line():
    from pdserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--base-url", "http://h:1/v1", "--sweep-rates", "1,2.5"])
    assert args.sweep_rates == (1.0, 2.5) and args.request_rate == math.inf and args.ignore_eos
    assert args.endpoint == CHAT and args.dataset == "random" and args.num_prompts is None
    vllm_names = ["--random-input-len", "7", "--random-output-len", "3", "--dataset-name", "shared-prefix"]
    args = parser.parse_args(["bench", "serve", "--base-url", "x", *vllm_names, "--no-ignore-eos"])
    assert (args.input_len, args.output_len, args.dataset, args.ignore_eos) == (7, 3, "shared-prefix", False)
    for name in ("transfer", "kernels", "gpu-engine"):
        args = parser.parse_args(["bench", name, "--dry-run", "--out", "x.json", "-h"])
        assert args.script_args == ["--dry-run", "--out", "x.json", "-h"]


def test_plots_from_records(tmp_path):
    from pdserve.benchmarks.serve_plots import plot_latency_cdfs, plot_sweep

    records = [rec(0.1 * i, 0.1 * i + 1.0, 5, itl=[0.25] * 4) for i in range(1, 6)]
    cdf = plot_latency_cdfs([("a", records), ("b", records[:2])], SLO(300, 400), tmp_path / "c.png")
    series = [("x", [1.0, 2.0, math.inf], [1.0, 0.5, 0.1], [10.0, 15.0, 16.0]), ("y", [1.0], [None], [9.0])]
    sweep = plot_sweep(series, 0.9, tmp_path / "s.png")
    assert cdf.read_bytes()[:4] == sweep.read_bytes()[:4] == b"\x89PNG"


def test_jsonl_sweep_runs_take_their_own_slices(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": [{i}, 1, 2]}}\n' for i in range(10)))
    runs = [
        build_dataset(DatasetConfig(name="jsonl", path=str(path), num_prompts=3, run_index=i))
        for i in range(4)
    ]
    heads = [[c.turns[0].content[0] for c in run] for run in runs]
    assert heads[:3] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert heads[3] == [9, 0, 1]  # wraps, with a warning
