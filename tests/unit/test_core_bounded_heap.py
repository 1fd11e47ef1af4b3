"""The fast builders' bounded heap loop: what its floor and its push-by-the-next-pop save, and
that the builders hand it their floors. (That it pops what the oracle pops, floors included,
is the property test `test_fast_heap_loops_pop_what_best_first_pops`.)"""
from __future__ import annotations

import heapq
import math
import sys
from pathlib import Path

import torch

from ddtree import build_ddtree_tree_from_logits, fast_build, heap_build
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


def test_the_lazy_heap_through_blocks_hands_the_loop_its_floor(monkeypatch):
    """Peaked rows at budget 1024 pop past their 16-rank reads; from then on the loop is bounded
    by the block-maxima floor: finite, and at or below every score it placed."""
    floors = []
    real = fast_build.heap_loop_for

    def spy(rows):
        loop = real(rows)

        def run(*args):
            tree = loop(*args)
            floors.append(args[5]())
            return tree

        return run

    monkeypatch.setattr(fast_build, "heap_loop_for", spy)
    logits = family_logits("peaked", 0, 15, 151936)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert len(floors) == 1 and math.isfinite(floors[0])
    assert floors[0] <= min(tree.node_scores_list)
    assert min(tree.node_scores_list) - floors[0] < 1.0  # the maxima floor is tight on these rows
    oracle = heap_build.build_heap_tree(logits, 1024)
    assert tree.parents == oracle.parents and tree.node_scores_list == oracle.node_scores_list
