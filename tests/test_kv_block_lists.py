"""The block-list helpers every KV transfer runs on its critical path (``kv_transfer.base``): their
fast paths for a run of consecutive ids (one list comparison in C) agree with the plain
definitions on any list."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.base import ReservationTable, _Reservation, block_runs, consecutive, valid_block_ids


def _runs_by_definition(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


# Lists that are often a run (a prompt's fresh blocks), else anything, repeats included.
ids = st.one_of(
    st.builds(lambda first, n: list(range(first, first + n)), st.integers(-2, 40), st.integers(0, 40)),
    st.lists(st.integers(-2, 40), max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(ids, ids)
def test_block_runs_and_consecutive_match_their_definitions(src, dst):
    n = min(len(src), len(dst))
    src, dst = src[:n], dst[:n]
    assert block_runs(src, dst) == _runs_by_definition(src, dst)
    assert block_runs(tuple(src), range(len(dst))) == _runs_by_definition(src, list(range(len(dst))))
    assert consecutive(src) == (bool(src) and src == list(range(src[0], src[0] + len(src))))


@settings(max_examples=300, deadline=None)
@given(ids, st.integers(0, 42))
def test_valid_block_ids_matches_its_definition(block_ids, num_blocks):
    expected = (
        bool(block_ids)
        and len(set(block_ids)) == len(block_ids)
        and all(0 <= b < num_blocks for b in block_ids)
    )
    assert valid_block_ids(block_ids, num_blocks) == expected


def test_block_runs_refuses_lists_of_different_lengths():
    for src, dst in (([0, 1, 2], [0, 1]), ([0], [])):
        try:
            block_runs(src, dst)
        except ValueError:
            continue
        raise AssertionError(f"{src} / {dst} taken")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True), st.data())
def test_a_write_is_checked_and_counted_the_same_in_any_order(reserved, data):
    """The table's checks take the reservation's own list in C; any other list of the same blocks,
    or a list with one not reserved, is judged as by the set."""
    layers = 3
    table = ReservationTable(layers)
    table.add("r", reserved, time.time() + 60)
    write = data.draw(st.permutations(reserved))
    stranger = data.draw(st.integers(31, 40))
    assert table.begin("r", write, 0, layers) == ""
    table.end("r", write, 0, layers)
    assert "not all reserved" in table.begin("r", [*write[:-1], stranger], 0, layers)
    r = _Reservation(list(reserved), time.time() + 60, frozenset(reserved), 60.0)
    r.landed.append((0, layers, write))
    assert r.num_missing(layers) == 0
    r = _Reservation(list(reserved), time.time() + 60, frozenset(reserved), 60.0)
    r.landed.append((0, layers, write[:-1]))
    assert r.num_missing(layers) == layers  # the last block, every layer
