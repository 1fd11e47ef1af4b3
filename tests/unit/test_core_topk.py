"""Sharded top-K log-probs (ddtree.topk): a vocabulary split over tensor-parallel ranks, each
keeping its local top-K and logsumexp, merges into the single-device top-K log-probs, and the
trees built from them equal build_ddtree_trees on the full logits."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.batched import build_ddtree_trees, build_trees_from_top_log_probs, row_top_log_probs
from ddtree.topk import ShardTopK, merge_top_k, shard_top_k, stack_shards

TREE_FIELDS = ("token_ids", "depths", "parents", "num_nodes", "visibility")


def _random_cuts(gen: torch.Generator, vocab: int, shards: int) -> list[int]:
    """Uneven boundaries 0 = c0 < c1 < ... < c_R = vocab."""
    inner = torch.randperm(vocab - 1, generator=gen)[: shards - 1].add(1).sort().values.tolist()
    return [0, *inner, vocab]


def _merged(logits: torch.Tensor, cuts: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [shard_top_k(logits[..., lo:hi], k, lo) for lo, hi in zip(cuts, cuts[1:])]
    return merge_top_k(stack_shards(parts), k).log_probs()


def _assert_same_trees(ours, reference) -> None:
    for field in TREE_FIELDS:
        assert torch.equal(getattr(ours, field), getattr(reference, field)), field
    finite = torch.isfinite(reference.scores)
    assert torch.equal(torch.isfinite(ours.scores), finite)
    assert torch.allclose(ours.scores[finite], reference.scores[finite], rtol=0, atol=1e-5)


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uneven_shards_merge_to_the_full_row_top_k(seed, shards):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 400, generator=gen) * 4  # [bs, D, V]
    cuts = _random_cuts(gen, 400, shards)
    log_probs, ids = _merged(logits, cuts, 24)
    ref_log_probs, ref_ids = row_top_log_probs(logits, 24)
    assert torch.equal(ids, ref_ids)  # continuous random logits: no ties
    # Not bit-exact: the global logsumexp is logsumexp(local logsumexps), a different float32
    # reduction than logsumexp over the full row. A few ulps at |log p| ~ 10.
    assert torch.allclose(log_probs, ref_log_probs, rtol=0, atol=4e-6)
    assert bool((torch.diff(log_probs, dim=-1) <= 0).all())


def test_one_shard_is_bit_identical_to_the_single_device_path():
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 4, 300, generator=gen) * 3).to(torch.bfloat16)
    log_probs, ids = merge_top_k(stack_shards([shard_top_k(logits, 16)]), 16).log_probs()
    ref_log_probs, ref_ids = row_top_log_probs(logits, 16)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(log_probs, ref_log_probs)


def test_merges_compose_segments_then_ranks():
    """A rank may hold two segments (base + added vocab): merging them first, then across
    ranks, equals merging all four slices at once."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 200, generator=gen)
    slices = [(0, 40), (40, 100), (100, 170), (170, 200)]
    parts = [shard_top_k(logits[..., lo:hi], 8, lo) for lo, hi in slices]
    rank0 = merge_top_k(stack_shards(parts[:2]), 8)
    rank1 = merge_top_k(stack_shards(parts[2:]), 8)
    two_level = merge_top_k(stack_shards([rank0, rank1]), 8)
    flat = merge_top_k(stack_shards(parts), 8)
    assert torch.equal(two_level.token_ids, flat.token_ids)
    assert torch.equal(two_level.values, flat.values)
    assert torch.allclose(two_level.lse, flat.lse, rtol=0, atol=2e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), bs=st.integers(1, 3), depth=st.integers(1, 5),
       vocab=st.integers(8, 120), shards=st.sampled_from([2, 4]), budget=st.integers(1, 24),
       extra=st.integers(0, 5))
def test_trees_from_merged_shards_equal_build_ddtree_trees(seed, bs, depth, vocab, shards, budget, extra):
    """K >= budget (and K > V, so narrow shards pad with -inf) gives the exact trees."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 3
    log_probs, ids = _merged(logits, _random_cuts(gen, vocab, shards), budget + extra)
    _assert_same_trees(build_trees_from_top_log_probs(log_probs, ids, budget), build_ddtree_trees(logits, budget))


def test_a_cap_below_the_budget_uses_only_the_top_k_of_every_depth():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 4, 300, generator=gen) * 2
    budget, k = 32, 3
    log_probs, ids = _merged(logits, [0, 90, 91, 300], k)
    capped = build_trees_from_top_log_probs(log_probs, ids, budget)
    single = build_trees_from_top_log_probs(*row_top_log_probs(logits, k), budget)
    _assert_same_trees(capped, single)
    top_ids = torch.topk(logits, k, dim=-1).indices  # [bs, D, k]
    for b in range(2):
        n = int(capped.num_nodes[b])
        assert n == budget  # 3 ** 4 paths > 32: the cap still fills the budget
        for node in range(n):
            depth = int(capped.depths[b, node])
            assert int(capped.token_ids[b, node]) in top_ids[b, depth - 1].tolist()
    # The uncapped tree differs: it uses ranks beyond 3 somewhere.
    full = build_ddtree_trees(logits, budget)
    assert not torch.equal(full.token_ids, capped.token_ids)


def test_nan_rows_and_empty_shards_place_nothing():
    logits = torch.randn(2, 2, 50)
    logits[1, 0, 17] = float("nan")  # request 1's depth-1 row is unusable
    parts = [shard_top_k(logits[..., 0:0], 6, 0), shard_top_k(logits[..., 0:50], 6, 0)]
    assert bool(torch.isneginf(parts[0].values).all()) and bool(torch.isneginf(parts[0].lse).all())
    log_probs, ids = merge_top_k(stack_shards(parts), 6).log_probs()
    trees = build_trees_from_top_log_probs(log_probs, ids, 6)
    assert int(trees.num_nodes[1]) == 0
    assert torch.equal(trees.token_ids[0], build_ddtree_trees(logits[:1], 6).token_ids[0])


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match=r"logits must be \[bs, D, Vs\], got shape \(3, 4\)"):
        shard_top_k(torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        shard_top_k(torch.zeros(1, 1, 4), 0)
    with pytest.raises(ValueError, match=r"\[R, bs, D, K\]"):
        merge_top_k(ShardTopK(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64), torch.zeros(1, 2)), 2)
