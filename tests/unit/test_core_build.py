"""The single-request builders: input errors, edge shapes, -inf tokens, dtypes, methods."""
from __future__ import annotations

import pytest
import torch

from ddtree import BuildMethod, build_ddtree_tree_from_logits, build_ddtree_trees, validate_tree
from ddtree.invariants import TreeInvariantError, reachable_node_count
from ddtree.tree import make_draft_tree

METHODS = [BuildMethod.HEAP, BuildMethod.FAST, BuildMethod.AUTO]


def same_tree(a, b) -> bool:
    return (
        a.parents == b.parents
        and torch.equal(a.node_token_ids, b.node_token_ids)
        and torch.equal(a.node_depths, b.node_depths)
    )


@pytest.mark.parametrize("method", METHODS)
def test_nan_names_the_row(method):
    logits = torch.randn(4, 10)
    logits[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"row 2 \(depth 3\) contains NaN \(first at token 7\)"):
        build_ddtree_tree_from_logits(logits, 8, method=method)


@pytest.mark.parametrize("method", METHODS)
def test_nan_in_a_row_the_tree_never_reaches_is_still_reported(method):
    logits = torch.randn(6, 50)
    logits[:, 0] = 50.0  # a single greedy chain...
    logits[5, 3] = float("nan")  # ...and a NaN at the last row
    with pytest.raises(ValueError, match="row 5"):
        build_ddtree_tree_from_logits(logits, 2, method=method)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_logit_in_a_row_read_through_block_maxima_but_never_normalised_is_reported(bad, monkeypatch):
    """Block reads of a tree that stops short of the last rows: those rows get no logsumexp,
    and their NaN / +inf is found from the row maxima the bounds took."""
    from ddtree import fast_build

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(15, 65536, generator=generator)
    logits[:4, 11] = 30.0  # a sure greedy start, then flat rows: the tree stays shallow
    logits[14, 5] = bad
    checked = []
    check = fast_build._RowReader.check_unread_rows

    def spy(reader):
        checked.append((reader.top_bounds is not None, [d for d in range(15) if d not in reader.log_z]))
        check(reader)

    monkeypatch.setattr(fast_build._RowReader, "check_unread_rows", spy)
    with pytest.raises(ValueError, match=r"row 14 \(depth 15\) contains (NaN|\+inf) \(first at token 5\)"):
        build_ddtree_tree_from_logits(logits, 256, method=BuildMethod.FAST)
    assert checked and checked[-1][0] and 14 in checked[-1][1]  # found there, not by a logsumexp


@pytest.mark.parametrize("method", METHODS)
def test_positive_infinity_is_rejected(method):
    logits = torch.randn(3, 10)
    logits[1, 4] = float("inf")
    with pytest.raises(ValueError, match=r"row 1 \(depth 2\) contains \+inf"):
        build_ddtree_tree_from_logits(logits, 8, method=method)


@pytest.mark.parametrize("method", METHODS)
def test_a_float64_logit_beyond_float32_range_is_rejected(method):
    """The builders work in float32, as the reference does: 1e39 is +inf there, not a token."""
    logits = torch.tensor([[1.0, 2.0], [1e39, 1.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"row 1 \(depth 2\) contains 1e\+39, \+inf in float32 \(first at token 0\)"):
        build_ddtree_tree_from_logits(logits, 3, method=method)


@pytest.mark.parametrize("method", [BuildMethod.FAST, BuildMethod.AUTO])
@pytest.mark.parametrize("seed", range(24))
def test_a_transposed_input_gives_the_heap_tree_of_the_same_tensor(method, seed):
    """Column-major rows: torch then reduces across rows, and a row's logsumexp depends on the
    rows in the call; the fast path must make the heap's (the reference's) full call."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(4, 4096, generator=generator) * 1.5).t().contiguous().t()
    assert logits.stride(-1) != 1
    tree = build_ddtree_tree_from_logits(logits, 512, method=method)
    heap = build_ddtree_tree_from_logits(logits, 512, method=BuildMethod.HEAP)
    assert same_tree(tree, heap) and torch.equal(tree.node_scores, heap.node_scores)


def test_validate_tree_counts_reachable_tokens_as_the_builders_place_them():
    """-3e38 is a finite logit whose log-prob overflows to -inf in float32: never placed, so
    not reachable either."""
    logits = torch.tensor([[3e38, -3e38, 1.0]])
    assert reachable_node_count(logits, 3) == 2
    for method in METHODS:
        tree = build_ddtree_tree_from_logits(logits, 3, method=method)
        assert tree.node_token_ids.tolist() == [0, 2]
        validate_tree(tree, budget=3, logits=logits)


@pytest.mark.parametrize("bad_token", [-1, 3])
def test_validate_tree_rejects_a_token_outside_the_vocabulary(bad_token):
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    tree = build_ddtree_tree_from_logits(logits, 2)
    tampered = make_draft_tree(tree.parents, [tree.node_token_ids_list[0], bad_token], tree.node_depths, tree.node_scores)
    with pytest.raises(TreeInvariantError, match=rf"node 2 has token {bad_token}, outside the vocabulary \[0, 3\)"):
        validate_tree(tampered, budget=2, logits=logits)


@pytest.mark.parametrize(
    "logits, budget, message",
    [
        (torch.randn(3, 5), -3, "budget must be >= 0, got -3"),
        (torch.randn(5), 4, r"rank 2 \[D, V\], got rank 1 with shape \(5,\)"),
        (torch.randn(2, 3, 5), 4, r"rank 2 \[D, V\], got rank 3 with shape \(2, 3, 5\)"),
        (torch.randn(3, 0), 4, r"empty vocabulary: shape \(3, 0\)"),
        (torch.zeros(3, 5, dtype=torch.int64), 4, "must be float32, bfloat16, float16 or float64, got torch.int64"),
    ],
)
def test_bad_input_values_are_named(logits, budget, message):
    with pytest.raises(ValueError, match=message):
        build_ddtree_tree_from_logits(logits, budget)


def test_non_integer_budget_and_unknown_method():
    with pytest.raises(TypeError, match=r"budget must be an int, got 2.5 \(float\)"):
        build_ddtree_tree_from_logits(torch.randn(2, 3), 2.5)
    with pytest.raises(TypeError, match=r"budget must be an int, got True \(bool\)"):
        build_ddtree_tree_from_logits(torch.randn(2, 3), True)
    # integers from numpy or torch (a config value, a tensor's item) are integers too
    logits = torch.randn(2, 3)
    reference = build_ddtree_tree_from_logits(logits, 4)
    for budget in (torch.tensor(4), torch.tensor(4, dtype=torch.int32)):
        assert build_ddtree_tree_from_logits(logits, budget).parents == reference.parents
        assert build_ddtree_trees(logits.unsqueeze(0), budget).budget == 4
    with pytest.raises(TypeError, match=r"budget must be an int, got tensor\(4\.\) \(Tensor\)"):
        build_ddtree_tree_from_logits(logits, torch.tensor(4.0))
    with pytest.raises(ValueError, match="method must be one of heap, fast, auto, got 'beam'"):
        build_ddtree_tree_from_logits(torch.randn(2, 3), 2, method="beam")


def test_method_accepts_the_plain_string():
    logits = torch.randn(4, 30)
    assert same_tree(
        build_ddtree_tree_from_logits(logits, 10, method="heap"),
        build_ddtree_tree_from_logits(logits, 10, method=BuildMethod.FAST),
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape, budget", [((0, 7), 5), ((3, 7), 0), ((0, 1), 0)])
def test_root_alone(method, shape, budget):
    tree = build_ddtree_tree_from_logits(torch.randn(*shape), budget, method=method)
    assert tree.parents == [-1]
    assert tree.num_nodes == 0 and tree.max_depth == 0
    assert tree.child_maps == [{}]
    assert tree.visibility.tolist() == [[True]]
    validate_tree(tree, budget=budget)


@pytest.mark.parametrize("method", METHODS)
def test_budget_beyond_the_reachable_tree_gives_the_full_tree(method):
    logits = torch.randn(3, 2)  # 2 + 4 + 8 = 14 reachable paths
    tree = build_ddtree_tree_from_logits(logits, 4096, method=method)
    assert tree.num_nodes == 14
    validate_tree(tree, budget=4096, logits=logits)
    tokens_by_depth = {}
    for token, depth in zip(tree.node_token_ids.tolist(), tree.node_depths.tolist()):
        tokens_by_depth.setdefault(depth, []).append(token)
    assert {d: len(t) for d, t in tokens_by_depth.items()} == {1: 2, 2: 4, 3: 8}


@pytest.mark.parametrize("method", METHODS)
def test_vocabulary_of_one_is_a_chain(method):
    tree = build_ddtree_tree_from_logits(torch.randn(5, 1), 3, method=method)
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.node_token_ids.tolist() == [0, 0, 0]
    assert tree.node_scores.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("method", METHODS)
def test_negative_infinity_tokens_are_never_placed(method):
    logits = torch.tensor(
        [
            [2.0, float("-inf"), 1.0, float("-inf")],
            [float("-inf"), 0.5, float("-inf"), float("-inf")],
            [float("-inf")] * 4,  # no token possible: the tree cannot go past depth 2
        ]
    )
    tree = build_ddtree_tree_from_logits(logits, 100, method=method)
    assert sorted(zip(tree.node_depths.tolist(), tree.node_token_ids.tolist())) == [
        (1, 0), (1, 2), (2, 1), (2, 1),
    ]
    assert torch.isfinite(tree.node_scores).all()
    validate_tree(tree, budget=100, logits=logits)
    assert reachable_node_count(logits, 100) == 4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_inputs_match_their_float32_upcast(method, dtype):
    generator = torch.Generator().manual_seed(3)
    # distinct values per row so no exact ties exist after rounding to the narrow dtype
    logits = torch.stack([torch.randperm(200, generator=generator).float() / 16 for _ in range(6)]).to(dtype)
    tree = build_ddtree_tree_from_logits(logits, 64, method=method)
    reference = build_ddtree_tree_from_logits(logits.float(), 64, method=BuildMethod.HEAP)
    assert same_tree(tree, reference)
    assert torch.equal(tree.node_scores, reference.node_scores)
    validate_tree(tree, budget=64, logits=logits)


def test_fast_builder_does_not_touch_rows_the_tree_never_reaches(monkeypatch):
    calls = []
    original = torch.logsumexp

    def counting_logsumexp(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    logits = torch.randn(15, 5000)  # flat rows: a budget of 64 fits in depth 1
    monkeypatch.setattr(torch, "logsumexp", counting_logsumexp)
    tree = build_ddtree_tree_from_logits(logits, 64, method=BuildMethod.FAST)
    monkeypatch.undo()
    assert tree.max_depth == 1
    full_rows = [shape for shape in calls if shape[-1] == 5000]  # normalisations (not the depth guess)
    assert sum(shape[0] for shape in full_rows) <= 3  # rows 0 and 1 (and at most one more), never 15
    assert same_tree(tree, build_ddtree_tree_from_logits(logits, 64, method=BuildMethod.HEAP))


def test_exact_score_ties_follow_the_rank_path_order():
    # Every row is identical: many paths tie exactly; pop order must be lexicographic on ranks.
    row = torch.tensor([3.0, 2.0, 1.0, 0.0])
    logits = row.repeat(4, 1)
    heap = build_ddtree_tree_from_logits(logits, 40, method=BuildMethod.HEAP)
    fast = build_ddtree_tree_from_logits(logits, 40, method=BuildMethod.FAST)
    assert same_tree(heap, fast)
    assert torch.equal(heap.node_scores, fast.node_scores)


def test_batched_builder_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"rank 3 \[bs, D, V\], got rank 2 with shape \(3, 4\)"):
        build_ddtree_trees(torch.randn(3, 4), 4)
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        build_ddtree_trees(torch.randn(1, 3, 4), -1)
    with pytest.raises(ValueError, match="empty vocabulary"):
        build_ddtree_trees(torch.randn(2, 3, 0), 4)


def test_batched_trees_from_precomputed_top_log_probs():
    from ddtree import build_trees_from_top_log_probs
    from ddtree.batched import row_top_log_probs

    logits = torch.randn(3, 5, 40)
    log_probs, ids = row_top_log_probs(logits, 40)
    from_top = build_trees_from_top_log_probs(log_probs, ids, 20)
    direct = build_ddtree_trees(logits, 20)
    assert torch.equal(from_top.parents, direct.parents)
    assert torch.equal(from_top.token_ids, direct.token_ids)
    capped = build_trees_from_top_log_probs(log_probs[:, :, :2], ids[:, :, :2], 20)  # K = 2 < budget
    for b in range(3):
        tree = capped.tree(b)
        validate_tree(tree, budget=20)
        assert set(tree.node_token_ids.tolist()) <= set(ids[b, :, :2].reshape(-1).tolist())
    with pytest.raises(ValueError, match=r"must both be \[bs, D, K\], got \(3, 5, 40\) and \(3, 5, 2\)"):
        build_trees_from_top_log_probs(log_probs, ids[:, :, :2], 20)


@pytest.mark.parametrize(
    "shape, budget, expected",
    [
        ((15, 96), 16, BuildMethod.HEAP),  # the decode loop's tiny vocabulary
        ((15, 96), 256, BuildMethod.HEAP),
        ((15, 4096), 64, BuildMethod.HEAP),  # full-row reads below budget 1024
        ((15, 4096), 256, BuildMethod.HEAP),
        ((15, 32000), 16, BuildMethod.HEAP),
        ((15, 32000), 1023, BuildMethod.HEAP),
        ((15, 32000), 1024, BuildMethod.FAST),  # from 1024 the fast path decides (deep trees: block maxima)
        ((15, 65535), 512, BuildMethod.HEAP),
        ((15, 65536), 16, BuildMethod.FAST),  # block-maxima reads
        ((15, 151936), 1024, BuildMethod.FAST),
        ((1, 600), 1024, BuildMethod.HEAP),  # one row read whole either way
    ],
)
def test_auto_dispatch_picks_the_path_and_matches_the_heap(shape, budget, expected, monkeypatch):
    from ddtree import build as build_module
    from ddtree import fast_build, heap_build

    assert build_module.choose_method(shape[0], shape[1], budget) is expected
    taken = []
    monkeypatch.setattr(build_module, "build_heap_tree",
                        lambda *a, **k: taken.append(("heap", k)) or heap_build.build_heap_tree(*a, **k))
    monkeypatch.setattr(fast_build, "build_fast_tree", lambda *a: taken.append("fast") or fast_build.build_enumerated_tree(*a))
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + budget))
    tree = build_ddtree_tree_from_logits(logits, budget)
    # AUTO's heap path converts rows lazily; the oracle (method=HEAP) converts them whole
    assert taken == [("heap", {"lazy_rows": True}) if expected is BuildMethod.HEAP else "fast"]
    monkeypatch.undo()
    assert same_tree(tree, build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP))
    assert torch.equal(tree.node_scores, build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP).node_scores)


def test_near_uniform_rows_deeper_than_wide_match_the_heap():
    """The family floor is far too low here (thousands of near-equal paths per depth): the
    enumeration must give way to the heap loop instead of listing millions of candidates."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5)) * 0.05
    fast = build_ddtree_tree_from_logits(logits, 4096, method=BuildMethod.FAST)
    heap = build_ddtree_tree_from_logits(logits, 4096, method=BuildMethod.HEAP)
    assert fast.parents == heap.parents
    assert fast.node_token_ids.tolist() == heap.node_token_ids.tolist()
    assert fast.node_scores.tolist() == heap.node_scores.tolist()


def chain_scores_by_path(log_probs: list[list[float]], depth_limit: int) -> dict[tuple[int, ...], float]:
    """Every rank path's score, computed the reference's way (child: parent + lp[0]; sibling:
    previous sibling - lp[r-1] + lp[r]), independently of any heap."""
    scores: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    for d in range(depth_limit):
        row, level = log_probs[d], []
        for path, base in frontier:
            s = base + row[0]
            for r in range(len(row)):
                if r:
                    s = s - row[r - 1] + row[r]
                scores[path + (r,)] = s
                level.append((path + (r,), s))
        frontier = level
    return scores


@pytest.mark.parametrize("row_values", [[3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
def test_heap_pops_exact_score_ties_by_rank_path(row_values):
    """Identical integer rows: many paths tie exactly. The heap's order must be the sorted
    order by (score desc, rank path asc) of all paths, an oracle with no heap in it."""
    from ddtree.heap_build import top_log_probs

    depth_limit, budget = 3, 30
    logits = torch.tensor(row_values).repeat(depth_limit, 1)
    log_probs, _ = top_log_probs(logits, len(row_values))
    scores = chain_scores_by_path(log_probs.tolist(), depth_limit)
    ranked = sorted(scores, key=lambda path: (-scores[path], path))[:budget]
    # the sorted order is the pop order only if no path outscores its generator: check the data
    position = {path: i for i, path in enumerate(ranked)}
    for path in ranked:
        generator = path[:-1] + (path[-1] - 1,) if path[-1] else path[:-1]
        assert not generator or position.get(generator, budget) < position[path]
    assert len(set(scores[p] for p in ranked)) < len(ranked)  # the data does hold exact ties
    tree = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
    assert tree.node_scores.tolist() == [scores[p] for p in ranked]
    assert tree.node_depths.tolist() == [len(p) for p in ranked]
    paths = [()]
    for index in range(1, tree.num_nodes + 1):
        parent_path = paths[tree.parents[index]]
        siblings = sum(1 for j in range(1, index) if tree.parents[j] == tree.parents[index])
        paths.append(parent_path + (siblings,))  # children are popped in rank order
    assert paths[1:] == ranked


@pytest.mark.parametrize("zero_probability_from", [None, 20, 16])
def test_heap_rows_converted_lazily_give_the_tree_of_whole_rows(zero_probability_from):
    """Lazy HeapRows hand the loop `FIRST_RANKS` ranks per row and convert the rest on demand:
    the trees must equal the loop's over rows converted whole, also when a row's unusable
    (-inf) suffix begins in the part converted later or right at its start."""
    from ddtree.heap_build import FIRST_RANKS, best_first, build_heap_tree, top_log_probs

    generator = torch.Generator().manual_seed(11)
    vocab = 3 * FIRST_RANKS
    logits = torch.randn(4, vocab, generator=generator) * 0.3  # flat: wide trees, deep rank reads
    if zero_probability_from is not None:
        logits[0].scatter_(0, logits[0].argsort(descending=True)[zero_probability_from:], float("-inf"))
    for budget in (FIRST_RANKS - 1, FIRST_RANKS, FIRST_RANKS + 1, 2 * vocab):
        lp, ids = top_log_probs(logits, min(budget, vocab))
        rows = [[v for v in row if v > float("-inf")] for row in lp.tolist()]
        whole = best_first(rows, [row[: len(r)] for row, r in zip(ids.tolist(), rows)], 4, budget)
        lazy = build_heap_tree(logits, budget, lazy_rows=True)
        assert build_ddtree_tree_from_logits(logits, budget, BuildMethod.HEAP).parents == whole.parents
        assert lazy.parents == whole.parents
        assert lazy.node_token_ids_list == whole.node_token_ids_list
        assert lazy.node_scores_list == whole.node_scores_list
        # flat rows: every usable rank of row 0 outscores any depth-2 path, so past FIRST_RANKS
        # nodes at depth 1 the lazily converted part of row 0 was read
        width = vocab if zero_probability_from is None else zero_probability_from
        assert lazy.node_depths_list.count(1) == min(budget, width)
        validate_tree(lazy, budget=budget, logits=logits)


def test_lazy_heap_rows_fall_back_to_the_oracle_when_a_wider_read_reorders_ties(monkeypatch):
    """Rows read FIRST_RANKS deep are read again whole when the loop pops past them; torch.topk
    may then order exactly tied logits differently. The heap must not mix the two orders (a
    token could repeat under one parent): it rebuilds the tree with the oracle's reads."""
    from ddtree import heap_build

    logits = torch.zeros(3, 96)
    logits[:, :3] = torch.tensor([3.0, 2.0, 1.0])  # 93 tied tokens per row behind three leaders
    first = torch.topk(logits[0], heap_build.FIRST_RANKS).indices.tolist()
    assert torch.topk(logits[0], 64).indices.tolist()[: len(first)] != first  # the data reorders ties
    calls = []
    real = heap_build.build_heap_tree
    monkeypatch.setattr(heap_build, "build_heap_tree", lambda *a, **k: calls.append(k) or real(*a, **k))
    tree = heap_build.build_heap_tree(logits, 64, lazy_rows=True)
    assert calls == [{"lazy_rows": True}, {}]  # the lazy build gave way to the oracle's
    oracle = real(logits, 64)
    assert tree.parents == oracle.parents and tree.node_token_ids_list == oracle.node_token_ids_list
    validate_tree(tree, budget=64, logits=logits)


def _drafter_rows(seed: int, vocab: int) -> torch.Tensor:
    """[15, vocab] rows like a drafter's: one dominant token over a randn * 2 tail (the
    benchmark's `peaked` rows)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(15, vocab, generator=generator) * 2.0
    top = torch.randint(0, vocab, (15, 1), generator=generator)
    return logits.scatter_add_(1, top, torch.full((15, 1), 16.0))


@pytest.mark.parametrize("seed", range(6))
def test_fast_matches_the_heap_on_drafter_rows_of_a_large_vocabulary_at_budget_1024(seed):
    """Reads there are limited to a few times what a row has, so a block-maxima read often
    stops at its limit, where its count is only a lower bound (one of these seeds hit a count
    equal to the limit, and the reader once took it as exact and lost ranks)."""
    logits = _drafter_rows(seed + 1, 151936)
    fast = build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.FAST)
    heap = build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP)
    assert fast.parents == heap.parents and torch.equal(fast.node_depths, heap.node_depths)
    assert fast.node_scores.tolist() == heap.node_scores.tolist()
    differ = (fast.node_token_ids != heap.node_token_ids).nonzero().flatten()
    rows = heap.node_depths[differ] - 1  # token order may differ only among exactly tied logits
    assert torch.equal(logits[rows, fast.node_token_ids[differ]], logits[rows, heap.node_token_ids[differ]])


def test_a_read_stopped_at_its_limit_claims_nothing_below_what_it_read():
    from ddtree.fast_build import _RowReader
    from ddtree.row_select import BLOCK

    vocab = 65536
    logits = torch.full((2, vocab), float("-inf"))
    # one finite logit per block, so a read cut at the k-th block maximum returns exactly k
    logits[:, ::BLOCK] = -0.001 * torch.arange(vocab // BLOCK, dtype=torch.float32)
    reader = _RowReader(logits, 1024)
    reader.read([0, 1], 8)
    reader.read_down_to([0], [-1e9])  # wants every rank; may take 8x what it has
    read = len(reader.lp[0])
    assert 8 < read < reader.cap[0]
    next_unread = float(logits[0, read * BLOCK] - reader.log_z[0])
    assert reader.known_above[0] >= next_unread  # "every rank above known_above is read"


def test_a_tree_of_middling_depth_at_a_large_budget_reads_rows_once(monkeypatch):
    """A greedy two-token path estimated between READ_THROUGH_GUESS_LOG_PROB and
    DEEP_GUESS_LOG_PROB (not likely deep, yet a tree four levels deep at 1024): rows are read
    once through the block maxima, not probed row by row, and the tree is the heap's."""
    from ddtree import fast_build

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(15, 151936, generator=generator) * 2.0
    top = torch.randint(0, 151936, (15, 1), generator=generator)
    logits.scatter_add_(1, top, torch.full((15, 1), 13.5))
    guess = fast_build._guess_depth(fast_build._RowReader(logits, 1024))
    assert not guess.likely_deep and guess.reads_through  # the regime this test is about
    calls = []
    read_through = fast_build._read_through_maxima
    monkeypatch.setattr(fast_build, "_read_through_maxima", lambda *args: calls.append(args[1]) or read_through(*args))
    fast = build_ddtree_tree_from_logits(logits, 1024)
    assert calls == [1024]
    heap = build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP)
    assert fast.parents == heap.parents and fast.node_token_ids_list == heap.node_token_ids_list
    assert fast.node_scores_list == heap.node_scores_list and max(heap.node_depths_list) >= 3


@pytest.mark.parametrize(("rows", "taken"), [
    ("few-peaks", "lazy heap"),  # may be deep, not likely deep: the reference's own work
    ("flat", "enumeration"),  # a depth-one tree: the enumeration's cheapest case
    ("peaked", "block maxima"),  # likely deep at 1024: block reads from V = 24576 on
])
def test_full_row_reads_at_budget_1024_take_the_path_their_depth_guess_gives(rows, taken, monkeypatch):
    """From budget 1024 on, AUTO sends a vocabulary below 65536 to FAST, which picks by its
    depth guess; whichever path it takes, the tree is the oracle's."""
    from ddtree import fast_build

    generator = torch.Generator().manual_seed(3)
    if rows == "peaked":
        logits = _drafter_rows(3, 32000)
    else:
        logits = torch.randn(15, 32000, generator=generator)
    if rows == "few-peaks":  # the smoke's tree-bench rows: four tokens well above the rest
        peaks = torch.randint(0, 32000, (15, 4), generator=generator)
        logits.scatter_(1, peaks, torch.tensor([9.0, 7.5, 6.5, 6.0]).expand(15, 4))
    paths = []
    heap_tree = fast_build.build_heap_tree

    class SpiedBlockMaxima(fast_build.BlockMaxima):
        def __init__(self, *args):
            paths.append("block maxima")
            super().__init__(*args)

    monkeypatch.setattr(fast_build, "build_heap_tree", lambda *a, **k: paths.append("lazy heap") or heap_tree(*a, **k))
    monkeypatch.setattr(fast_build, "BlockMaxima", SpiedBlockMaxima)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert paths == ([] if taken == "enumeration" else [taken])
    monkeypatch.undo()
    heap = build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP)
    assert tree.parents == heap.parents and tree.node_token_ids.tolist() == heap.node_token_ids.tolist()
    assert tree.node_scores.tolist() == heap.node_scores.tolist()
