"""Parity of the fast and batched builders with the heap oracle, and brute-force optimality.

FAST vs HEAP: exact equality (parents, tokens, depths, float64 scores) wherever no row holds
two equal logits, exact score ties between paths included; with tied logits the token chosen
among equals follows torch.topk, whose order depends on k, so there the tree shape and the
scores must agree. Batched vs HEAP: the same arrays for continuous random logits (scores to
1e-12: plain float64 sums); where path scores can tie exactly (grids, arbitrary floats) it
orders equal scores differently, so there the sorted scores must agree.
"""
from __future__ import annotations

import itertools
import math
import random
import sys
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree import BuildMethod, build_ddtree_tree_from_logits, build_ddtree_trees, validate_tree
from ddtree import fast_build, heap_build, row_select
from oracles import frontier_build
from oracles.frontier_build import build_frontier_tree
from ddtree.heap_build import top_log_probs
from ddtree.bounded_heap import bounded_best_first
from ddtree.rank_path_heap import best_first_by_rank_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from row_families import FAMILIES, family_logits  # noqa: E402  (the benchmark's seeded row families)


def rows_have_ties(logits: torch.Tensor) -> bool:
    finite = logits.float()
    for row in finite:
        values = row[torch.isfinite(row)]
        if values.unique().numel() != values.numel():
            return True
    return False


def shape_of(tree):
    return tree.parents, tree.node_depths.tolist()


def assert_same(expected, actual, exact_scores=True):
    assert actual.parents == expected.parents
    assert actual.node_token_ids.tolist() == expected.node_token_ids.tolist()
    assert actual.node_depths.tolist() == expected.node_depths.tolist()
    if exact_scores:
        assert actual.node_scores.tolist() == expected.node_scores.tolist()
    else:
        assert torch.allclose(actual.node_scores, expected.node_scores, rtol=1e-12, atol=1e-12)


def check_case(logits: torch.Tensor, budget: int, batched: bool = True, score_ties: bool = False) -> None:
    heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
    fast = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.FAST)
    validate_tree(heap, budget=budget, logits=logits)
    validate_tree(fast, budget=budget, logits=logits)
    tied = rows_have_ties(logits)
    candidates = [fast, build_ddtree_tree_from_logits(logits, budget)]  # + the public path (AUTO)
    validate_tree(candidates[1], budget=budget, logits=logits)
    if budget and logits.shape[0]:  # FAST picks the lazy heap for small budgets: test the frontier too
        candidates.append(build_frontier_tree(logits, budget))
        validate_tree(candidates[-1], budget=budget, logits=logits)
    if budget > fast_build.HEAP_LOOP_MAX_BUDGET and logits.shape[-1] < row_select.BLOCK_MIN_VOCAB:
        # FAST sends rows read by full-row top-k to the lazy heap: its own reads too
        with mock.patch.object(fast_build, "LAZY_HEAP_ON_FULL_ROWS", False):
            candidates.append(fast_build.build_enumerated_tree(logits, budget))
        validate_tree(candidates[-1], budget=budget, logits=logits)
    for tree in candidates:
        if tied:
            assert shape_of(tree) == shape_of(heap)
            assert tree.node_scores.tolist() == heap.node_scores.tolist()
        else:
            assert_same(heap, tree)
    if batched:
        tree = build_ddtree_trees(logits.unsqueeze(0), budget).tree(0)
        validate_tree(tree, budget=budget, logits=logits)
        if tied or score_ties:
            assert torch.allclose(tree.node_scores.sort().values, heap.node_scores.sort().values, rtol=1e-12, atol=1e-12)
        else:
            assert_same(heap, tree, exact_scores=False)


def random_logits(rng: random.Random, depth: int, vocab: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if kind == "flat":
        logits = torch.randn(depth, vocab, generator=generator) * rng.choice([0.05, 1.0, 4.0])
    elif kind == "peaked":  # drafter-like: one dominant token per row, a long tail
        logits = torch.randn(depth, vocab, generator=generator) * 2.0
        logits[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=generator)] += rng.choice([3.0, 8.0, 30.0])
    elif kind == "huge":  # log-probs in the thousands: float64 chains round differently
        logits = torch.randn(depth, vocab, generator=generator) * 3000.0
    else:  # "masked": some zero-probability tokens, sometimes whole rows
        logits = torch.randn(depth, vocab, generator=generator)
        logits[torch.rand(depth, vocab, generator=generator) < 0.4] = float("-inf")
    if dtype != torch.float32:
        # distinct values per row survive the narrow dtype: a permutation of a coarse grid
        grid = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(depth)]).float()
        logits = (grid * rng.choice([0.125, 0.5])).to(dtype)
    return logits


KINDS = ["flat", "peaked", "huge", "masked"]


@pytest.mark.slow
@pytest.mark.parametrize("block", range(6))
def test_seeded_sweep_small_shapes(block, monkeypatch):
    """3000 random cases over small shapes: V < budget, D = 1, budget 1, all kinds. Half the
    blocks probe rows one rank at a time, so the frontier's re-read path runs constantly, and
    the lazy heap rows (AUTO's small-vocabulary path) are converted one rank at a time; a
    third switch likely deep trees to block reads."""
    if block % 2:
        monkeypatch.setattr(frontier_build, "PROBE_RANKS", 1)
        monkeypatch.setattr(fast_build, "PROBE_RANKS", 1)
        monkeypatch.setattr(heap_build, "FIRST_RANKS", 1)
    if block % 3 == 0:  # a likely deep tree switches to block reads at any budget and vocabulary
        monkeypatch.setattr(fast_build, "DEEP_BLOCK_MIN_BUDGET", 1)
        monkeypatch.setattr(fast_build, "DEEP_BLOCK_MIN_VOCAB", 1)
    rng = random.Random(1000 + block)
    for _ in range(500):
        depth = rng.choice([1, 1, 2, 3, 4, 6, 15])
        vocab = rng.choice([1, 2, 3, 5, 8, 20, 64])
        budget = rng.choice([1, 1, 2, 3, 5, 8, 16, 33, 100])
        kind = rng.choice(KINDS)
        dtype = rng.choice([torch.float32] * 4 + [torch.bfloat16, torch.float16])
        check_case(random_logits(rng, depth, vocab, kind, dtype), budget, score_ties=dtype != torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_seeded_sweep_small_shapes_through_block_maxima(block_size, monkeypatch):
    """The block-maxima reads (normally vocab >= 65536 only) on small shapes: blocks of 1, of
    3 (a short tail block whenever 3 does not divide V) and of 4, with the enumeration on."""
    monkeypatch.setattr(row_select, "BLOCK_MIN_VOCAB", 1)
    monkeypatch.setattr(row_select, "BLOCK", block_size)
    monkeypatch.setattr(fast_build, "PROBE_RANKS", [1, 3, 32][block_size % 3])
    monkeypatch.setattr(fast_build, "HEAP_LOOP_MAX_BUDGET", [0, 64][block_size % 2])
    # the block-maxima floor at every budget, on coarse and narrow grids too
    monkeypatch.setattr(fast_build, "BLOCK_FLOOR_MIN_BUDGET", [1, 2, 30][block_size % 3])
    monkeypatch.setattr(fast_build, "BLOCK_FLOOR_STEPS", [512, 7, 64][block_size % 3])
    monkeypatch.setattr(fast_build, "BLOCK_FLOOR_SPAN", [24.0, 2.0, 0.25][block_size % 3])
    # the lazy heap for every likely deep tree, for none, or as shipped; rows re-read often
    monkeypatch.setattr(fast_build, "LAZY_HEAP_CHAIN_LOG_PROB", [-1e9, math.inf, -10.0][block_size % 3])
    monkeypatch.setattr(fast_build, "LAZY_FIRST_RANKS", [1, 16, 2][block_size % 3])
    monkeypatch.setattr(fast_build, "LAZY_READ_GROWTH", [2, 16, 3][block_size % 3])
    rng = random.Random(500 + block_size)
    for _ in range(400):
        depth = rng.choice([1, 2, 3, 6, 15])
        vocab = rng.choice([1, 2, 5, 20, 64, 300])
        budget = rng.choice([1, 2, 5, 16, 33, 100, 300])
        kind = rng.choice(KINDS)
        dtype = rng.choice([torch.float32] * 4 + [torch.bfloat16, torch.float16])
        check_case(random_logits(rng, depth, vocab, kind, dtype), budget, batched=False, score_ties=dtype != torch.float32)


@pytest.mark.parametrize("block_size", [1, 3, 32])
def test_block_maxima_floor_never_exceeds_the_budget_th_best_score(block_size, monkeypatch):
    """The floor from block maxima alone is a lower bound of the tree's last score (or -inf
    when the reachable tree is smaller than the budget), on every kind of row, after first
    reads of 1 to 32 ranks; and on drafter-like rows it is found."""
    monkeypatch.setattr(row_select, "BLOCK_MIN_VOCAB", 1)
    monkeypatch.setattr(row_select, "BLOCK", block_size)
    rng = random.Random(70 + block_size)
    found = 0
    for _ in range(150):
        depth = rng.choice([1, 2, 3, 6, 15])
        vocab = rng.choice([2, 20, 300, 3000])
        budget = rng.choice([1, 5, 33, 300, 1000])
        kind = rng.choice(KINDS)
        logits = random_logits(rng, depth, vocab, kind)
        reader = fast_build._RowReader(logits, budget)
        reader.read(list(range(depth)), rng.choice([1, 4, 32]))
        chain = fast_build._greedy_chain(reader)
        floor = fast_build._block_maxima_floor(reader, chain, budget)
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        if heap.num_nodes < budget:
            assert floor == float("-inf"), (kind, depth, vocab, budget)
        else:
            assert floor <= heap.node_scores[-1].item(), (kind, depth, vocab, budget, floor, heap.node_scores[-1].item())
        found += kind == "peaked" and floor != float("-inf")
    assert found > 10


def test_block_maxima_floor_is_the_same_where_torch_has_no_numpy(monkeypatch):
    """The floor search reads its histogram through a numpy view; a torch without numpy
    (`Tensor.numpy` raises) reads it as lists and finds the same floors."""
    monkeypatch.setattr(row_select, "BLOCK_MIN_VOCAB", 1)
    rng = random.Random(71)
    cases = []
    for _ in range(40):
        depth, vocab, budget = rng.choice([2, 6, 15]), rng.choice([300, 3000]), rng.choice([33, 300, 1000])
        reader = fast_build._RowReader(random_logits(rng, depth, vocab, rng.choice(KINDS)), budget)
        reader.read(list(range(depth)), rng.choice([1, 4, 32]))
        cases.append((reader, fast_build._greedy_chain(reader), budget))
    with_numpy = [fast_build._block_maxima_floor(*case) for case in cases]

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert [fast_build._block_maxima_floor(*case) for case in cases] == with_numpy
    assert sum(floor != float("-inf") for floor in with_numpy) > 10


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_seeded_sweep_large_vocabulary(seed):
    """Qwen-sized rows (151936 = 4748 blocks of 32) and a vocabulary with a short tail block:
    the default block-maxima reads against the heap."""
    rng = random.Random(900 + seed)
    for _ in range(4):
        depth = rng.choice([1, 7, 15])
        vocab = rng.choice([151936, 65536 + 21])
        budget = rng.choice([16, 64, 256, 1024])
        check_case(random_logits(rng, depth, vocab, rng.choice(["flat", "peaked", "masked"])), budget, batched=False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_seeded_sweep_realistic_shapes(seed, monkeypatch):
    monkeypatch.setattr(frontier_build, "PROBE_RANKS", [32, 4, 1][seed])
    monkeypatch.setattr(fast_build, "PROBE_RANKS", [32, 4, 1][seed])
    rng = random.Random(seed)
    for _ in range(8):
        depth = rng.choice([1, 7, 15])
        vocab = rng.choice([300, 4000, 32000])
        budget = rng.choice([16, 64, 256, 1024])
        check_case(random_logits(rng, depth, vocab, rng.choice(["flat", "peaked"])), budget)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_row_families_match_the_heap(family):
    """Every row family of the tree-build benchmark (power-law rows with and without
    sharpening, temperature copies, mixed depths, ...): the Qwen-sized vocabulary at budget
    1024, then smaller shapes at drawn budgets; FAST, AUTO, the frontier and the batched
    builder against the heap. Rows of a family share values (the same peaks, the same
    power-law ladder), so paths tie or nearly tie across rows: the batched builder, whose float64
    sums are not the reference's chains, is held to the heap's sorted scores there."""
    check_case(family_logits(family, 0, 15, 151936), 1024, score_ties=True)
    rng = random.Random(zlib.crc32(family.encode()))
    for seed in range(1, 4):
        depth, vocab = rng.choice([1, 7, 15]), rng.choice([300, 4000, 32000])
        check_case(family_logits(family, seed, depth, vocab), rng.choice([16, 64, 256, 512, 1024]), score_ties=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_row_families_match_the_heap_at_small_budgets(family):
    """The Qwen-sized vocabulary at budgets 16 and 128, where trees that stop short of the
    last rows are read once through the block maxima and the others are probed: the public
    builder against the heap (the other builders are held to it at 1024 above)."""
    logits = family_logits(family, 1, 15, 151936)
    tied = rows_have_ties(logits)
    for budget in (16, 128):
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        public = build_ddtree_tree_from_logits(logits, budget)
        if tied:
            assert shape_of(public) == shape_of(heap)
            assert public.node_scores.tolist() == heap.node_scores.tolist()
        else:
            assert_same(heap, public)


@pytest.mark.parametrize(("family", "path", "bounded"), [
    ("power-1.5", "read once", True), ("power-1.0-sharp", "read once", True),
    ("power-2.0", "read once", True), ("peaked", "lazy heap", True), ("power-2.5-sharp", "lazy heap", True),
    ("mixed-depths", "read once", True), ("flat", "probes", False), ("few-peaks", "probes", False)])
def test_the_path_below_budget_512_follows_how_deep_the_tree_likely_goes(family, path, bounded, monkeypatch):
    """From READ_THROUGH_MIN_BUDGET to 511, a tree guessed likely deep has its greedy chain
    through every row bounded from the block maxima: bounded at LAZY_HEAP_CHAIN_LOG_PROB or
    above (trees 13-15 deep), the lazy heap over rows read 16 ranks deep; below
    EVERY_ROW_GUESS_LOG_PROB (power-law rows falling ~1 nat a row, trees 6-12 deep; mixed-depths,
    sharp at the root and flat below), one read through the block maxima. Rows not guessed
    deep (flat, few-peaks: one or two levels) are probed, and their bounds never computed. The
    trees are the heap's either way."""
    calls, bound_calls = [], []
    read_through, lazy, bounds = fast_build._read_through_maxima, fast_build._lazy_heap_through_blocks, fast_build._top_log_prob_bounds
    monkeypatch.setattr(fast_build, "_read_through_maxima", lambda *args: calls.append(("read once", args[1])) or read_through(*args))
    monkeypatch.setattr(fast_build, "_lazy_heap_through_blocks", lambda *args: calls.append(("lazy heap", args[1])) or lazy(*args))
    monkeypatch.setattr(fast_build, "_top_log_prob_bounds", lambda reader: bound_calls.append(1) or bounds(reader))
    logits = family_logits(family, 0, 15, 151936)
    for budget in (16, 256):
        tree = build_ddtree_tree_from_logits(logits, budget)
        assert shape_of(tree) == shape_of(build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP))
    assert calls == ([] if path == "probes" else [(path, 16), (path, 256)])
    assert bool(bound_calls) == bounded
    calls.clear()
    build_ddtree_tree_from_logits(logits, fast_build.READ_THROUGH_MIN_BUDGET - 1)
    assert calls == []


@pytest.mark.parametrize(("family", "floors"), [("power-2.5-sharp", 0), ("peaked", 1)])
def test_the_lazy_heap_through_blocks_works_out_a_floor_only_when_it_pops_past_a_row(family, floors, monkeypatch):
    """Trees 15 deep at budget 1024: sharp power-law rows need at most 9 ranks of a row, so the
    16 read first suffice and no floor is worked out; peaked rows need a hundred or two of two
    or three rows, so the first pop past a row's read ranks works out one floor and reads every
    row down to it. Either way the tree is the heap's, bit for bit."""
    calls = []
    floor = fast_build._block_maxima_floor
    monkeypatch.setattr(fast_build, "_block_maxima_floor", lambda *args: calls.append(args[2]) or floor(*args))
    logits = family_logits(family, 0, 15, 151936)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert calls == [1024] * floors
    monkeypatch.undo()
    assert_same(build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP), tree)


@pytest.mark.parametrize(("family", "depth", "budget"), [("peaked", 31, 20), ("power-2.5", 20, 17)])
def test_the_lazy_heap_through_blocks_on_more_rows_than_the_budget(family, depth, budget, monkeypatch):
    """A drafter block deeper than the budget (block size 32 at budget 20): rows from `budget`
    on have no usable rank and end every path. Read one rank deep, the loop pops past rows at
    once, so the floor is worked out over the rows that can hold nodes only."""
    monkeypatch.setattr(fast_build, "LAZY_FIRST_RANKS", 1)
    logits = family_logits(family, 0, depth, 151936)
    assert_same(build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP),
                build_ddtree_tree_from_logits(logits, budget))


def test_the_lazy_heap_through_blocks_reads_a_row_wider_where_no_floor_is_found(monkeypatch):
    """Without a floor, the row popped past is read LAZY_READ_GROWTH x wider, up to its cap,
    as often as the loop needs: the heap's tree all the same."""
    widths = []
    read = fast_build._RowReader.read
    monkeypatch.setattr(fast_build, "_block_maxima_floor", lambda *args: -math.inf)
    monkeypatch.setattr(fast_build._RowReader, "read", lambda self, rows, k, *a, **kw: widths.append(k) or read(self, rows, k, *a, **kw))
    logits = family_logits("peaked", 0, 15, 151936)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert widths[0] == fast_build.LAZY_FIRST_RANKS and 256 in widths[1:]  # 16, then 16x wider
    monkeypatch.undo()
    assert_same(build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP), tree)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    seed=st.integers(0, 2**20),
    depth=st.integers(1, 15),
    vocab=st.sampled_from([2, 7, 40, 300, 2000]),
    budget=st.integers(1, 1100),
)
@pytest.mark.slow
def test_hypothesis_row_families(family, seed, depth, vocab, budget):
    check_case(family_logits(family, seed, depth, vocab), budget, score_ties=True)


@pytest.mark.slow
def test_dflash_family_is_a_repeatable_drafted_block():
    """The `dflash-tiny` rows come from a DFlash forward pass: one row per draft position, the
    same rows whatever the caller's thread count (generated on one thread, which is given
    back), other rows for another seed, and its T = 0.5 copy is the rows over 0.5."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = family_logits("dflash-tiny", 5, 6, 300)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        again = family_logits("dflash-tiny", 5, 6, 300)
    finally:
        torch.set_num_threads(threads)
    assert first.shape == (6, 300) and first.dtype == torch.float32 and bool(first.isfinite().all())
    assert torch.equal(first, again)
    assert not torch.equal(first[0], first[1])  # positions see different attention contexts
    assert not torch.equal(first, family_logits("dflash-tiny", 6, 6, 300))
    assert torch.equal(family_logits("dflash-tiny@T0.5", 5, 6, 300), first / 0.5)
    assert family_logits("dflash-tiny", 5, 0, 300).shape == (0, 300)


@settings(max_examples=400, deadline=None)
@given(
    rows=st.lists(st.lists(st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -3.25]), max_size=8), min_size=1, max_size=5),
    budget=st.integers(0, 60),
    first_read=st.none() | st.integers(1, 8),
    loop=st.sampled_from([bounded_best_first, best_first_by_rank_path]),
    floor_kind=st.sampled_from(["none", "last pop", "below it", "after the first more"]),
    below=st.floats(0.0, 4.0),
    grow_all=st.booleans(),
)
def test_fast_heap_loops_pop_what_best_first_pops(rows, budget, first_read, loop, floor_kind, below, grow_all):
    """The fast builders' loops (bounded, and keyed by rank path) against the oracle's loop on
    rows drawn from a few grid values, so that many paths tie exactly: the same nodes in the
    same pop order, the same float64 scores. With a floor: the lowest score the oracle pops
    (the tightest valid one) or below it, given up front or only once `more` is first asked.
    With `first_read`, each row starts from its first ranks only and `more` adds the rest, as
    the lazy heap does: to the row asked for, or (`grow_all`) to every row at once, as a floor
    read does."""
    rows = [sorted(row, reverse=True) for row in rows]
    ids = [[1000 * d + r for r in range(len(row))] for d, row in enumerate(rows)]
    expected = heap_build.best_first(rows, ids, len(rows), budget)
    lowest = min(expected.node_scores_list, default=0.0) - below
    floor = {"none": -math.inf, "last pop": lowest, "below it": lowest - 1.0}.get(floor_kind, lowest)
    asked = []
    if floor_kind == "after the first more":
        floor = lambda: lowest if asked else -math.inf  # noqa: E731
    if first_read is None:
        actual = loop(rows, ids, len(rows), budget, floor=floor)
    else:
        read = [row[:first_read] for row in rows]
        read_ids = [row[:first_read] for row in ids]

        def more(d: int) -> bool:
            asked.append(d)
            done = len(read[d])
            for grown in range(len(rows)) if grow_all else [d]:
                read[grown].extend(rows[grown][len(read[grown]) :])
                read_ids[grown].extend(ids[grown][len(read_ids[grown]) :])
            return len(read[d]) > done

        actual = loop(read, read_ids, len(rows), budget, more, floor)
    assert actual.parents == expected.parents
    assert actual.node_token_ids_list == expected.node_token_ids_list
    assert actual.node_depths_list == expected.node_depths_list
    assert actual.node_scores_list == expected.node_scores_list


def test_rows_of_one_shape_are_built_by_the_rank_path_loop(monkeypatch):
    """Power-law rows of one exponent (one ladder of log-probs at every depth) read once at
    budget 1024 go through the loop keyed by rank path, and give the heap's tree bit for bit."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[3])
        return best_first_by_rank_path(*args, **kwargs)

    monkeypatch.setattr(heap_build, "best_first_by_rank_path", spy)  # `heap_loop_for` picks the loop
    logits = family_logits("power-2.0", 0, 15, 151936)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert calls == [1024]
    assert_same(build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP), tree)


def test_the_lazy_heap_takes_the_rank_path_loop_for_rows_of_one_shape(monkeypatch):
    """AUTO's lazy heap (a vocabulary read by full-row top-k, budget below 1024) on power-law
    rows of one exponent: the rank-path loop, rows re-read as it pops past them, the oracle's
    tree bit for bit; peaked rows keep the plain loop."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[3])
        return best_first_by_rank_path(*args, **kwargs)

    monkeypatch.setattr(heap_build, "best_first_by_rank_path", spy)
    for family, rank_path_loop in (("power-2.0", True), ("peaked", False)):
        calls.clear()
        logits = family_logits(family, 0, 15, 32000)
        tree = build_ddtree_tree_from_logits(logits, 512)
        assert calls == ([512] if rank_path_loop else [])
        assert_same(build_ddtree_tree_from_logits(logits, 512, method=BuildMethod.HEAP), tree)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(0, 6),
    vocab=st.integers(1, 10),
    budget=st.integers(0, 40),
    data=st.data(),
)
@pytest.mark.slow
def test_hypothesis_arbitrary_float_rows(depth, vocab, budget, data):
    """Any finite float32 logits, ties and -inf included."""
    values = st.one_of(
        st.floats(-60, 60, width=32, allow_nan=False),
        st.sampled_from([0.0, 1.0, -1.0, float("-inf")]),
    )
    rows = data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=depth, max_size=depth))
    logits = torch.tensor(rows, dtype=torch.float32).reshape(depth, vocab)
    check_case(logits, budget, score_ties=True)


def brute_force_best(logits: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """All rank paths, sorted by (score desc, rank path asc), first `budget` -> token paths."""
    depth_limit, vocab = logits.shape
    if budget == 0 or depth_limit == 0:
        return []
    log_probs, ids = top_log_probs(logits, vocab)
    lp, tok = log_probs.tolist(), ids.tolist()
    paths = []
    for depth in range(1, depth_limit + 1):
        for ranks in itertools.product(range(vocab), repeat=depth):
            score = sum(lp[d][r] for d, r in enumerate(ranks))
            if score != float("-inf"):
                paths.append((-score, ranks))
    paths.sort()
    return [tuple(tok[d][r] for d, r in enumerate(ranks)) for _, ranks in paths[:budget]]


def token_paths(tree) -> list[tuple[int, ...]]:
    paths = [()]
    for index in range(1, tree.num_nodes + 1):
        paths.append(paths[tree.parents[index]] + (int(tree.node_token_ids[index - 1]),))
    return paths[1:]


@settings(max_examples=120, deadline=None)
@given(
    depth=st.integers(1, 4),
    vocab=st.integers(1, 5),
    budget=st.integers(1, 30),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.3, 1.0, 5.0]),
)
@pytest.mark.slow
def test_brute_force_optimality(depth, vocab, budget, seed, scale):
    logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    best = brute_force_best(logits, budget)
    for method in (BuildMethod.HEAP, BuildMethod.FAST):
        tree = build_ddtree_tree_from_logits(logits, budget, method=method)
        assert token_paths(tree) == best
    assert token_paths(build_frontier_tree(logits, budget)) == best
    assert token_paths(build_ddtree_trees(logits.unsqueeze(0), budget).tree(0)) == best


def test_batch_of_different_requests_matches_one_by_one():
    rng = random.Random(7)
    logits = torch.cat([random_logits(rng, 5, 50, kind).unsqueeze(0) for kind in ["flat", "peaked", "masked"] * 3])
    batch = build_ddtree_trees(logits, 24)
    assert batch.token_ids.shape == (9, 24) and batch.parents.shape == (9, 25)
    assert batch.visibility.shape == (9, 25, 25)
    for b in range(9):
        heap = build_ddtree_tree_from_logits(logits[b], 24, method=BuildMethod.HEAP)
        tree = batch.tree(b)
        assert_same(heap, tree, exact_scores=False)
        assert torch.equal(batch.visibility[b, : tree.num_nodes + 1, : tree.num_nodes + 1], heap.visibility)
        padding = batch.parents[b, tree.num_nodes + 1 :]
        assert (padding == -1).all()


@pytest.mark.slow
@pytest.mark.parametrize("probe", [1, 3, 32])
def test_enumeration_path_on_small_shapes(probe, monkeypatch):
    """FAST with the heap loop switched off: every finite-floor case goes through the Python
    enumeration and its re-reads (probe 1 and 3 make rows grow constantly)."""
    monkeypatch.setattr(fast_build, "HEAP_LOOP_MAX_BUDGET", 0)
    monkeypatch.setattr(fast_build, "LAZY_HEAP_ON_FULL_ROWS", False)
    monkeypatch.setattr(fast_build, "PROBE_RANKS", probe)
    rng = random.Random(77 + probe)
    for _ in range(300):
        depth = rng.choice([1, 2, 3, 6, 15])
        vocab = rng.choice([1, 2, 5, 20, 64, 300])
        budget = rng.choice([1, 2, 5, 16, 33, 100, 300])
        logits = random_logits(rng, depth, vocab, rng.choice(KINDS))
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        fast = fast_build.build_enumerated_tree(logits, budget)
        validate_tree(fast, budget=budget, logits=logits)
        if rows_have_ties(logits):
            assert shape_of(fast) == shape_of(heap)
            assert fast.node_scores.tolist() == heap.node_scores.tolist()
        else:
            assert_same(heap, fast)


@pytest.mark.parametrize("budget", [64, 1024])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_logit_in_a_row_the_tree_never_reaches_still_raises(bad, budget):
    """power-1.5 rows make a tree 5 deep at budget 64 and 8 deep at 1024: FAST reads them once
    through the block maxima, normalises rows 0-8 at most and checks the rest through their
    block maxima, which must still see a NaN / +inf there."""
    logits = family_logits("power-1.5", 0, 15, 151936)
    assert build_ddtree_tree_from_logits(logits, budget).max_depth <= 9
    logits[14, 777] = bad
    for method in (BuildMethod.FAST, BuildMethod.AUTO):
        with pytest.raises(ValueError, match="row 14 .*(NaN|\\+inf) .*token 777"):
            build_ddtree_tree_from_logits(logits, budget, method=method)
