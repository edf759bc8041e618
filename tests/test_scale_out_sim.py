"""The scale-out study's pure parts: shapes, workload slices, scaling against linear."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from pdserve.benchmarks.scale_out_sim import Shape, scaling, write_slice


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


def test_scaling_against_the_smallest_shape():
    def shape(nodes, both, tok_s, lower=False):
        return {
            "nodes": nodes,
            "both": both,
            "w": {"output_tok_s_at_knee": tok_s, "knee_is_lower_bound": lower},
        }

    shapes = {
        "1P1D": shape(2, 0, 1000.0),
        "8P8D": shape(16, 0, 6800.0),
        "2C": shape(2, 2, 900.0),
        "16C": shape(16, 16, 7200.0, lower=True),
    }
    out = scaling(shapes, "w")
    assert out["pd"]["base"] == "1P1D"
    assert out["pd"]["shapes"]["8P8D"]["share_of_linear"] == pytest.approx(0.85)
    assert out["colocated"]["shapes"]["16C"]["share_of_linear"] == pytest.approx(1.0)
    assert out["colocated"]["shapes"]["16C"]["knee_is_lower_bound"]
