"""The fast builders' bounded heap loop: what its floor and its push-by-the-next-pop save, and
that the builders hand it their floors. (That it pops what the oracle pops, floors included,
is the property test `test_fast_heap_loops_pop_what_best_first_pops`.)"""
from __future__ import annotations

import heapq
import math
import sys
import threading
from pathlib import Path

import pytest
import torch

from ddtree import build_ddtree_tree_from_logits, fast_build, heap_build, row_select
from ddtree import bounded_heap
from ddtree.bounded_heap import bounded_best_first

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from row_families import family_logits  # noqa: E402


def count_heap_calls(monkeypatch) -> dict[str, int]:
    """Count the loop's heap operations (it binds `heapq`'s functions on each call)."""
    calls = {"push": 0, "pop": 0, "pushpop": 0}

    def counted(name, function):
        def call(*args):
            calls[name] += 1
            return function(*args)

        return call

    fake = type(sys)("heapq_counted")
    fake.heappush = counted("push", heapq.heappush)
    fake.heappop = counted("pop", heapq.heappop)
    fake.heappushpop = counted("pushpop", heapq.heappushpop)
    monkeypatch.setattr(bounded_heap, "heapq", fake)
    return calls


def drafter_like_rows(seed: int) -> tuple[list[list[float]], list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(6, 400, generator=generator) * 2.5, dim=-1)
    values, ids = torch.sort(log_probs, dim=-1, descending=True)
    return values.tolist(), ids.tolist()


def test_a_floor_keeps_entries_that_cannot_pop_out_of_the_heap(monkeypatch):
    rows, ids = drafter_like_rows(3)
    budget = 200
    expected = heap_build.best_first(rows, ids, len(rows), budget)
    calls = count_heap_calls(monkeypatch)
    unbounded = bounded_best_first(rows, ids, len(rows), budget)
    pushes_without = calls["push"] + calls["pushpop"]
    calls.update(push=0, pop=0, pushpop=0)
    bounded = bounded_best_first(rows, ids, len(rows), budget, floor=min(expected.node_scores_list))
    pushes_with = calls["push"] + calls["pushpop"]
    for tree in (unbounded, bounded):
        assert tree.parents == expected.parents
        assert tree.node_token_ids_list == expected.node_token_ids_list
        assert tree.node_scores_list == expected.node_scores_list
    # every pop is one entry; without a floor about one more is pushed per pop (a sibling and a
    # child in, the node out), most of them never popped
    assert pushes_without > 1.5 * budget
    assert pushes_with < 1.2 * budget


def test_a_greedy_step_that_outscores_the_heap_never_goes_through_it(monkeypatch):
    """Rows whose top token is near-certain: each child is the next pop, so it is handed back by
    `heappushpop` at once, and the heap stays as small as the siblings left behind."""
    sizes = []
    real_pushpop = heapq.heappushpop

    def pushpop(heap, item):
        popped = real_pushpop(heap, item)
        sizes.append((popped is item, len(heap)))
        return popped

    calls = count_heap_calls(monkeypatch)
    bounded_heap.heapq.heappushpop = pushpop
    rows = [[-1e-6, -14.0, -15.0]] * 8
    ids = [[7, 8, 9]] * 8
    tree = bounded_best_first(rows, ids, 8, 8)
    assert tree.node_depths_list == list(range(1, 9))  # the greedy chain
    assert all(handed_back for handed_back, _ in sizes)  # no child went into the heap
    assert calls["pop"] == 0
    assert max(size for _, size in sizes) == 7  # the siblings left behind, one per depth
    assert tree.node_scores_list == heap_build.best_first(rows, ids, 8, 8).node_scores_list


def _spy_on_floors(monkeypatch) -> dict[str, list[float]]:
    """The floors `fast_build` hands the enumeration and the heap loops that run to the end."""
    floors: dict[str, list[float]] = {"enumeration": [], "loop": []}
    real_loop, real_enumerate = fast_build.heap_loop_for, fast_build.enumerate_tree

    def loop_spy(rows):
        loop = real_loop(rows)

        def run(*args, **kwargs):
            tree = loop(*args, **kwargs)  # raises where the lazy heap stops it
            floor = kwargs.get("floor", args[5] if len(args) > 5 else float("-inf"))
            floors["loop"].append(floor() if callable(floor) else floor)
            return tree

        return run

    def enumerate_spy(rows, depths, budget, threshold, *args):
        floors["enumeration"].append(threshold)
        return real_enumerate(rows, depths, budget, threshold, *args)

    monkeypatch.setattr(fast_build, "heap_loop_for", loop_spy)
    monkeypatch.setattr(fast_build, "enumerate_tree", enumerate_spy)
    return floors


def test_the_lazy_heap_through_blocks_enumerates_above_its_floor(monkeypatch):
    """Peaked rows at budget 1024 pop past their 16-rank reads: the rows are then read down to
    the block-maxima floor and the tree enumerated above it (the loop never finishes), the
    floor finite, at or below every score placed and tight on these rows."""
    floors = _spy_on_floors(monkeypatch)
    logits = family_logits("peaked", 0, 15, 151936)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert floors["loop"] == [] and len(floors["enumeration"]) == 1
    floor = floors["enumeration"][0]
    assert math.isfinite(floor) and floor <= min(tree.node_scores_list)
    assert min(tree.node_scores_list) - floor < 1.0  # the maxima floor is tight on these rows
    oracle = heap_build.build_heap_tree(logits, 1024)
    assert tree.parents == oracle.parents and tree.node_scores_list == oracle.node_scores_list


def test_greedy_steps_of_log_prob_zero_keep_the_loop_with_its_floor(monkeypatch):
    """At T = 0.5 some peaked rows' best token has log-prob exactly 0.0, so nodes tie with their
    greedy children: the loop goes on over the complete rows, bounded by the same floor."""
    floors = _spy_on_floors(monkeypatch)
    logits = family_logits("peaked@T0.5", 0, 15, 151936)
    tops = logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)
    assert (tops == 0.0).any()  # the case this test is about
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert floors["enumeration"] == [] and len(floors["loop"]) == 1
    assert math.isfinite(floors["loop"][0]) and floors["loop"][0] <= min(tree.node_scores_list)
    oracle = heap_build.build_heap_tree(logits, 1024)
    assert tree.parents == oracle.parents and tree.node_scores_list == oracle.node_scores_list


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["peaked", "power-2.5-sharp"])
def test_the_lazy_heaps_histogram_is_taken_in_advance_on_flat_tails(threads, family, monkeypatch):
    """Rows whose first reads have a flat tail (peaked: the loop pops past them at 1024) take
    the block maxima's histogram on the building thread right after the first reads'
    gathering, before the loop and before this thread's own rows' logsumexp; the sharp power
    law's rows fall too fast for it (their tree fits in the first reads) and take none. The
    tree is the oracle's either way."""
    events = []
    real_histogram = fast_build._maxima_histogram
    real_rows_log_z = row_select.rows_log_z

    def histogram_spy(*args):
        events.append(("histogram", threading.current_thread() is threading.main_thread()))
        return real_histogram(*args)

    def rows_log_z_spy(*args):
        events.append(("own rows", True))
        return real_rows_log_z(*args)

    monkeypatch.setattr(fast_build, "_maxima_histogram", histogram_spy)
    monkeypatch.setattr(row_select, "rows_log_z", rows_log_z_spy)  # this thread's share of the pass
    _oracles_tree_on_threads(family, threads)
    histograms = [i for i, event in enumerate(events) if event[0] == "histogram"]
    if family == "peaked":
        assert len(histograms) == 1 and events[histograms[0]][1]  # one, on this thread
        if threads == 2:  # before this thread's rows (taken beside the worker's)
            assert ("own rows", True) in events[histograms[0] :]
    else:
        assert histograms == []


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["peaked", "power-2.5-sharp"])
def test_flat_tails_take_the_floor_before_the_loop_pops(threads, family, monkeypatch):
    """Flat tails take their histogram in advance and the floor comes before any pop, on one
    thread or two: the loop never starts and the tree is enumerated. The sharp power law's loop
    runs to the end."""
    started = []
    real_loop_for = fast_build.heap_loop_for

    def loop_spy(rows):
        loop = real_loop_for(rows)

        def run(*args, **kwargs):
            started.append(kwargs.get("floor", args[5] if len(args) > 5 else None))
            return loop(*args, **kwargs)

        return run

    monkeypatch.setattr(fast_build, "heap_loop_for", loop_spy)
    _oracles_tree_on_threads(family, threads)
    assert len(started) == (0 if family == "peaked" else 1)


def _oracles_tree_on_threads(family: str, threads: int) -> None:
    """Build `family`'s rows at budget 1024 with `threads` intra-op threads: the oracle's tree."""
    logits = family_logits(family, 0, 15, 151936)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tree = build_ddtree_tree_from_logits(logits, 1024)
    finally:
        torch.set_num_threads(saved)
    oracle = heap_build.build_heap_tree(logits, 1024)
    assert tree.parents == oracle.parents and tree.node_scores_list == oracle.node_scores_list


@pytest.mark.parametrize(
    ("family", "budget", "rows"),
    [("peaked", 1024, 10), ("peaked", 64, 10), ("power-1.5", 1024, 8), ("power-1.5", 64, 7)],
)
def test_the_worker_starts_on_fewer_rows_of_trees_read_through_the_maxima(family, budget, rows, monkeypatch):
    """Right after the depth guess the worker is given 10 of 15 rows of a tree the lazy heap
    will build (peaked: estimate ~ -0.3), on 8 (7 below the floors' budgets) of one guessed
    below FAR_READ_ESTIMATE (power-1.5: ~ -1.9), which is read through the maxima and
    leaves this thread less work of its own. The tree is the oracle's."""
    started = []
    real = fast_build.start_rows_early
    monkeypatch.setattr(fast_build, "start_rows_early", lambda reader, count: started.append(count) or real(reader, count))
    logits = family_logits(family, 0, 15, 151936)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tree = build_ddtree_tree_from_logits(logits, budget)
    finally:
        torch.set_num_threads(saved)
    assert started == [rows]
    oracle = heap_build.build_heap_tree(logits, budget)
    assert tree.parents == oracle.parents and tree.node_scores_list == oracle.node_scores_list
