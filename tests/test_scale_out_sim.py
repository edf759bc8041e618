"""The scale-out study's pure parts: shapes, workload slices, the proxy's size, the sweep's rates and
knee, scaling against linear, the JSON that runs merge into, the CPU ceiling."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from pdserve.benchmarks import scale_out_sim_report as report
from pdserve.benchmarks.scale_out_sim import (
    CLIENT_SHARE,
    CLIENT_TOK_S,
    Shape,
    default_clients,
    default_proxy_workers,
    offered_tok_s,
    parse_args,
    write_slice,
)


def test_shapes():
    assert Shape.parse("8P8D") == Shape("8P8D", 8, 8, 0)
    assert Shape.parse("2P6D").pairs == 4
    assert Shape.parse("16C") == Shape("16C", 0, 0, 16) and Shape.parse("16C").pairs == 8
    with pytest.raises(ValueError, match="<n>P<m>D"):
        Shape.parse("8x8")


ARGS = SimpleNamespace(
    vocab=1000, prefix_len=40, prefixes=2, turns=3, turn_min=5, turn_max=9,
    input_min=10, input_max=20, output_min=4, output_max=8,
)  # fmt: skip


def test_slices(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_slice(a, "shared-prefix", 12, 2.0, random.Random(1), ARGS)
    write_slice(b, "shared-prefix", 12, 2.0, random.Random(1), ARGS, shift=7919)
    la, lb = ([json.loads(x) for x in p.read_text().splitlines()] for p in (a, b))
    assert len(la) == 12 and len({tuple(c["system"]) for c in la}) == 4  # 2 prefixes per pair x 2 pairs
    assert all(len(c["turns"]) == 3 and len(c["output_len"]) == 3 for c in la)
    # A shifted slice: the same lengths and sharing, other token ids, all inside [300, vocab).
    assert [[len(t) for t in c["turns"]] for c in la] == [[len(t) for t in c["turns"]] for c in lb]
    assert [c["output_len"] for c in la] == [c["output_len"] for c in lb]
    assert not {tuple(c["system"]) for c in la} & {tuple(c["system"]) for c in lb}
    assert all(300 <= t < 1000 for c in la + lb for t in c["system"] + sum(c["turns"], []))
    write_slice(a, "fresh", 5, 1.0, random.Random(2), ARGS)
    lines = [json.loads(x) for x in a.read_text().splitlines()]
    assert len(lines) == 5 and all(10 <= len(x["prompt"]) <= 20 and 4 <= x["output_len"] <= 8 for x in lines)


def _point(rate, attainment, tok_s=0.0, pairs=1.0, failed=0):
    return {
        "rate": rate,
        "rate_per_pair": rate / pairs,
        "slo_attainment": attainment,
        "output_tok_s": tok_s * 0.7,  # the whole run's, drain included: not what the knee reports
        "goodput_req_s": rate * (attainment or 0) * 0.7,
        "steady_output_tok_s": tok_s,
        "steady_goodput_req_s": rate * (attainment or 0),
        "failed": failed,
    }


def test_the_proxy_grows_with_the_decode_nodes_within_half_the_cores():
    assert [default_proxy_workers(Shape.parse(n), 16) for n in ("1P1D", "2P2D", "4P4D", "8P8D")] == [
        1,
        2,
        4,
        8,
    ]
    assert default_proxy_workers(Shape.parse("16C"), 16) == 8  # half the cores
    assert default_proxy_workers(Shape.parse("8P8D"), 16, streams_per_worker=2) == 4
    assert default_proxy_workers(Shape.parse("8P8D"), 2) == 1


def test_enough_load_clients_that_none_nears_saturation_within_a_quarter_of_the_cores():
    assert (
        offered_tok_s("shared-prefix", 10.0, ARGS) == 10 * 3 * 6 and offered_tok_s("fresh", 10.0, ARGS) == 60
    )
    per_client = CLIENT_TOK_S * CLIENT_SHARE
    assert per_client / CLIENT_TOK_S < report.SATURATED
    assert default_clients(0.0, 16) == 1 and default_clients(per_client, 16) == 1
    assert default_clients(per_client * 1.01, 16) == 2
    # 8P8D's expected knee (8 decode nodes of ~3,000 tok/s) gets clients none of which is near a core.
    n = default_clients(8 * 3000.0, 16)
    assert 8 * 3000.0 / n <= per_client and n <= 16 // 4
    assert default_clients(1e9, 16) == 4 and default_clients(1e9, 2) == 1  # the host's cap


def test_a_sweep_rises_until_a_rate_misses_then_bisects():
    coarse = [8.0, 16.0, 24.0, 32.0]
    points = []
    for attainment in (1.0, 0.99, 0.5):  # 8 and 16 meet the SLOs, 24 does not
        rate = report.next_rate(points, coarse, refine=2)
        points.append(_point(rate, attainment))
    assert [p["rate"] for p in points] == [8.0, 16.0, 24.0]
    assert report.next_rate(points, coarse, refine=2) == 20.0  # never 32: past the knee
    points.append(_point(20.0, 0.95))
    assert report.next_rate(points, coarse, refine=2) == 22.0
    points.append(_point(22.0, 0.7))
    assert report.next_rate(points, coarse, refine=2) is None  # two bisections done
    k = report.knee(points)
    assert k["knee_rate"] == 20.0 and not k["knee_is_lower_bound"] and not k["knee_below_rates"]
    # Every rate met the SLOs: the knee is only a lower bound; the first missed: below the rates.
    assert report.knee([_point(8.0, 1.0), _point(16.0, 0.95)])["knee_is_lower_bound"]
    missed = [_point(8.0, 0.2)]
    assert report.next_rate(missed, coarse, refine=2) is None
    assert report.knee(missed)["knee_below_rates"] and report.knee(missed)["output_tok_s_at_knee"] == 0.0


def test_a_sweep_that_starts_at_the_smaller_shapes_knee_climbs_or_steps_down():
    coarse = [8.0, 16.0, 20.0, 24.0, 32.0]
    assert report.next_rate([], coarse, refine=1, start=20.0) == 20.0
    up = [_point(20.0, 0.95)]
    assert report.next_rate(up, coarse, refine=1, start=20.0) == 24.0  # never back to 8 or 16
    up.append(_point(24.0, 0.4))
    assert report.next_rate(up, coarse, refine=1, start=20.0) == 22.0
    down = [_point(20.0, 0.5)]
    assert report.next_rate(down, coarse, refine=1, start=20.0) == 16.0
    down.append(_point(16.0, 0.6))
    assert report.next_rate(down, coarse, refine=1, start=20.0) == 8.0
    down.append(_point(8.0, 1.0))
    assert report.next_rate(down, coarse, refine=1, start=20.0) == 12.0
    down.append(_point(12.0, 0.93))
    assert report.next_rate(down, coarse, refine=1, start=20.0) is None
    assert report.knee(down)["knee_rate"] == 12.0


def _shape(study, name, prefill, decode, both, points, routing=None):
    entry = report.shape_entry(study, name, prefill, decode, both)
    entry["shared-prefix"] = {"points": points, "complete": True}
    if routing:
        entry["routing"] = {
            "complete": True,
            "prefix-aware": {"prompt_tokens_computed": routing[0], "failed": 0},
            "round-robin": {"prompt_tokens_computed": routing[1], "failed": 0},
        }


STUDY = {**{k: 1 for k in report.STUDY_KEYS}, "model": "sim:llama-3-8b@h100"}


def test_a_study_of_real_nodes_is_not_marked_simulated_and_takes_gpus():
    assert report.new_study(STUDY)["simulated"]
    assert not report.new_study({**STUDY, "model": "random:llama-3-8b"})["simulated"]
    args = parse_args(["--model", "random:llama-3-8b", "--gpus", "0,1,2,3", "--shapes", "1P1D,2P2D,4C"])
    assert args.gpus == "0,1,2,3" and [s.name for s in args.shape_list] == ["1P1D", "2P2D", "4C"]


def test_scaling_against_the_smallest_shape_of_each_kind():
    study = report.new_study(STUDY)
    _shape(study, "1P1D", 1, 1, 0, [_point(30.0, 0.95, 1000.0), _point(40.0, 0.5, 1100.0)])
    _shape(
        study, "8P8D", 8, 8, 0, [_point(240.0, 0.92, 6800.0, pairs=8), _point(320.0, 0.3, 7000.0, pairs=8)]
    )
    _shape(study, "2C", 0, 0, 2, [_point(20.0, 0.95, 900.0)])
    _shape(study, "16C", 0, 0, 16, [_point(160.0, 0.99, 7200.0, pairs=8)])
    out = report.scaling(study["shapes"], "shared-prefix")
    assert out["pd"]["base"] == "1P1D" and list(out["pd"]["shapes"]) == ["1P1D", "8P8D"]
    assert out["pd"]["shapes"]["8P8D"]["share_of_linear"] == pytest.approx(0.85)
    assert out["pd"]["shapes"]["8P8D"]["knee_rate_per_pair"] == 30.0
    assert out["colocated"]["shapes"]["16C"]["share_of_linear"] == pytest.approx(1.0)
    assert out["colocated"]["shapes"]["16C"]["knee_is_lower_bound"]


def test_runs_merge_into_one_study_and_only_the_same_study(tmp_path):
    path = tmp_path / "study.json"
    first = report.open_study(path, STUDY, replace=False)
    _shape(first, "1P1D", 1, 1, 0, [_point(8.0, 1.0, 500.0), _point(16.0, 0.5, 600.0)], routing=(900, 900))
    first["shapes"]["1P1D"]["fresh"] = {"points": [_point(8.0, 1.0)], "complete": False}  # a cut run
    report.write(first, path)
    second = report.open_study(path, STUDY, replace=False)
    assert report.is_done(second, "1P1D", "shared-prefix") and report.is_done(second, "1P1D", "routing")
    assert not report.is_done(second, "1P1D", "fresh") and not report.is_done(second, "2P2D", "shared-prefix")
    _shape(
        second,
        "2P2D",
        2,
        2,
        0,
        [_point(16.0, 1.0, 1000.0, pairs=2), _point(32.0, 0.4, 1100.0, pairs=2)],
        (1000, 1500),
    )
    report.write(second, path)
    merged = report.read(path)
    assert set(merged["shapes"]) == {"1P1D", "2P2D"}
    s = merged["summary"]
    assert s["scaling"]["shared-prefix"]["pd"]["shapes"]["2P2D"]["share_of_linear"] == pytest.approx(1.0)
    assert s["incomplete"] == ["1P1D fresh"]
    # One prefill node has no choice to make: only 2P2D's routing is judged.
    assert s["routing"]["shapes"]["1P1D"]["fewer"] is None and s["routing"]["shapes"]["2P2D"]["fewer"]
    assert s["routing"]["prefix_aware_fewer_at_every_shape"] is True
    with pytest.raises(report.StudyMismatch, match="slo_ttft_ms"):
        report.open_study(path, {**STUDY, "slo_ttft_ms": 2}, replace=False)
    assert report.open_study(path, {**STUDY, "slo_ttft_ms": 2}, replace=True)["shapes"] == {}
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "scale_out_sim", "rows": []}))
    with pytest.raises(report.StudyMismatch, match="not written by this driver"):
        report.open_study(tmp_path / "other.json", STUDY, replace=False)


def test_the_busiest_part_is_named():
    before = {"decode-0": 0.0, "prefill-0": 0.0, "proxy-0": 0.0, "proxy-0.w0": 0.0, "proxy-0.w1": 0.0}
    after = {"decode-0": 2.0, "prefill-0": 1.0, "proxy-0": 0.2, "proxy-0.w0": 3.8, "proxy-0.w1": 2.0}
    cpu = report.cpu_shares(
        before, after, 4.0, {"host_busy_cores": 3.0, "host_cores": 16, "clients": (2, 2.0)}
    )
    assert cpu["proxy"] == {"workers": 2, "total": 1.5, "worker_max": 0.95, "worker_mean": 0.725}
    assert cpu["roles"]["decode"]["max"] == 0.5 and cpu["clients"]["total"] == 0.5
    b = report.busiest(cpu)
    assert b["part"] == "proxy worker" and b["saturated"] and list(b["ranked"])[1] == "decode node"
