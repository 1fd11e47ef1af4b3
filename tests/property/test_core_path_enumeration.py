"""`path_enumeration` against the oracle's best-first loop: the same nodes in the same pop
order with the same float64 scores, over rows whose paths tie exactly and often (grid values)
or never (random floats), with numpy finishing the order and without it."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree import heap_build, path_enumeration
from ddtree.path_enumeration import enumerate_tree

NUMPY = path_enumeration.numpy


def read_rows(rows: list[list[float]], ids: list[list[int]], kept: int | None = None, known_above: float = -math.inf):
    """Rows as a builder's reader holds them; `kept`: only each row's first ranks are read, and
    every unread rank lies at or below `known_above`."""
    cut = [row if kept is None else row[:kept] for row in rows]
    return SimpleNamespace(
        lp=dict(enumerate(cut)),
        ids=dict(enumerate(row if kept is None else row[:kept] for row in ids)),
        full={d: kept is None or len(row) <= kept for d, row in enumerate(rows)},
        known_above={d: -math.inf if kept is None or len(row) <= kept else known_above for d, row in enumerate(rows)},
    )


def assert_same_tree(actual, expected) -> None:
    assert actual is not None
    assert actual.parents == expected.parents
    assert actual.node_token_ids_list == expected.node_token_ids_list
    assert actual.node_depths_list == expected.node_depths_list
    assert actual.node_scores_list == expected.node_scores_list


grid_rows = st.lists(st.lists(st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -3.25]), min_size=1, max_size=8), min_size=1, max_size=5)
float_rows = st.lists(st.lists(st.floats(-12.0, 0.0, allow_nan=False), min_size=1, max_size=12), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    rows=grid_rows | float_rows,
    budget=st.integers(1, 60),
    below=st.floats(0.0, 3.0),
    finish=st.sampled_from(["numpy", "python"]),
    tie_members=st.sampled_from([0, 64]),
)
def test_enumeration_pops_what_best_first_pops(rows, budget, below, finish, tie_members):
    """Above any threshold at or below the oracle's last pop, on fully read rows. Grid rows'
    sums are exact, so the order check never hands back to the heap there; tie runs are put in
    rank-path order in numpy or in Python (`tie_members`: the most Python takes)."""
    rows = [sorted(row, reverse=True) for row in rows]
    ids = [[1000 * d + r for r in range(len(row))] for d, row in enumerate(rows)]
    expected = heap_build.best_first(rows, ids, len(rows), budget)
    threshold = min(expected.node_scores_list) - below
    saved = path_enumeration.numpy, path_enumeration.PYTHON_TIE_MEMBERS
    path_enumeration.numpy = NUMPY if finish == "numpy" else None
    path_enumeration.PYTHON_TIE_MEMBERS = tie_members
    try:
        actual = enumerate_tree(read_rows(rows, ids), len(rows), budget, threshold, limit=10**6)
    finally:
        path_enumeration.numpy, path_enumeration.PYTHON_TIE_MEMBERS = saved
    exact_sums = all(value * 4 == int(value * 4) for row in rows for value in row)
    if actual is None:
        assert not exact_sums  # only float rounding hands the order back to the heap
        return
    assert_same_tree(actual, expected)


def test_many_tied_paths_are_ordered_by_rank_path_in_numpy():
    """Rows of log-prob 0.0 and -1.0 only: hundreds of paths tie, more than Python sorts, and
    come out in the heap's order."""
    rows = [[0.0, 0.0, -1.0, -1.0, -1.0] for _ in range(5)]
    ids = [[10 * d + r for r in range(5)] for d in range(5)]
    expected = heap_build.best_first(rows, ids, 5, 300)
    actual = enumerate_tree(read_rows(rows, ids), 5, 300, -2.0, limit=10**6)
    assert_same_tree(actual, expected)


@pytest.mark.parametrize("finish", ["numpy", "python"])
def test_an_unread_rank_that_may_reach_the_threshold_gives_none(finish, monkeypatch):
    """Rows read two ranks deep, an unread rank (-0.3) above the threshold: no tree. Read three
    deep, every unread rank known to lie below it: the tree over the read ranks is the
    oracle's."""
    if finish == "python":
        monkeypatch.setattr(path_enumeration, "numpy", None)
    rows = [[-0.1, -0.2, -0.3, -5.0], [-0.1, -0.4, -0.6, -7.0]]
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert enumerate_tree(read_rows(rows, ids, kept=2, known_above=-0.3), 2, 4, -1.0, limit=100) is None
    expected = heap_build.best_first(rows, ids, 2, 4)
    actual = enumerate_tree(read_rows(rows, ids, kept=3, known_above=-5.0), 2, 4, -1.0, limit=100)
    assert_same_tree(actual, expected)


def test_too_many_paths_or_too_few_give_none():
    rows = [[0.0, -0.5, -1.0, -1.5]] * 3
    ids = [[1, 2, 3, 4]] * 3
    assert enumerate_tree(read_rows(rows, ids), 3, 4, -3.0, limit=10) is None  # the limit
    # at_least_budget: a threshold that is no floor, with fewer than `budget` paths above it
    assert enumerate_tree(read_rows(rows, ids), 3, 40, -0.5, limit=10**6, at_least_budget=True) is None
    assert enumerate_tree(read_rows(rows, ids), 3, 40, -0.5, limit=10**6) is not None


@pytest.mark.parametrize("finish", ["numpy", "python"])
@pytest.mark.parametrize("rows", [[[-1.0, -0.5, -2.0]], [[-0.5, -1.0], [0.25, -1.0]]], ids=["sibling", "child"])
def test_a_path_that_outscores_its_generator_hands_back_to_the_heap(finish, rows, monkeypatch):
    """Where a path would outscore the one that generates it (float rounding can make a sibling
    outscore the one before it; here a row out of order, or a log-prob above 0), the heap could
    not pop it first: the enumeration gives None and the caller lets the heap decide. The same
    rows in order give the oracle's tree."""
    if finish == "python":
        monkeypatch.setattr(path_enumeration, "numpy", None)
    ids = [[10 * d + r for r in range(len(row))] for d, row in enumerate(rows)]
    assert enumerate_tree(read_rows(rows, ids), len(rows), 3, -5.0, limit=100) is None
    ordered = [sorted(min(value, 0.0) for value in row)[::-1] for row in rows]
    expected = heap_build.best_first(ordered, ids, len(rows), 3)
    assert_same_tree(enumerate_tree(read_rows(ordered, ids), len(rows), 3, -5.0, limit=100), expected)
