"""Commit helpers on real cache tensors, and the metrics' definitions."""
from __future__ import annotations

import pytest
import torch

from ddtree import (
    TreeSummary,
    acceptance_histogram,
    acceptance_length,
    build_ddtree_tree_from_logits,
    commit_round,
    compact_appended_window_,
    keep_indices_batch,
    mean_acceptance_length,
    summarize_ddtree,
)

SEED_KEYS = [
    "budget", "actual_nodes", "max_depth", "mean_depth", "leaf_count", "branch_count",
    "accepted_node_count", "accepted_draft_count", "accepted_path_depth", "bonus_token_id",
]


def test_commit_round_tokens_bonus_and_keep_rows():
    verify_tokens = torch.tensor([50, 10, 11, 12, 13, 14])
    commit = commit_round(verify_tokens, [0, 1, 5], 77)
    assert commit.tokens == [50, 10, 14]
    assert commit.bonus_token == 77
    assert commit.keep_indices == [0, 1, 5]
    assert commit.acceptance_length == 3
    with pytest.raises(ValueError, match="must start with the root 0, got \\[1, 2\\]"):
        commit_round(verify_tokens, [1, 2], 0)
    with pytest.raises(ValueError, match="accepted index 9 is outside the 6 verify tokens"):
        commit_round(verify_tokens, [0, 9], 0)


def test_compaction_moves_accepted_rows_to_the_front_of_the_window():
    # [batch, heads, T, head_dim] like a HF cache layer: 4 committed rows + a 6-row tree window
    cache = torch.arange(2 * 3 * 10 * 4, dtype=torch.float32).reshape(2, 3, 10, 4)
    original = cache.clone()
    new_length = compact_appended_window_(cache, past_length=4, keep_indices=[0, 3, 5])
    assert new_length == 7
    assert torch.equal(cache[:, :, :4], original[:, :, :4])  # committed context untouched
    assert torch.equal(cache[:, :, 4:7], original[:, :, [4, 7, 9]])


def test_compaction_on_another_dim_and_overlapping_moves():
    cache = torch.randn(8, 5)  # sequence on dim 0
    original = cache.clone()
    assert compact_appended_window_(cache, 2, torch.tensor([1, 2, 3, 5]), dim=0) == 6
    assert torch.equal(cache[2:6], original[[3, 4, 5, 7]])
    assert torch.equal(cache[:2], original[:2])


def test_compaction_no_ops_and_errors():
    cache = torch.randn(1, 1, 6, 2)
    original = cache.clone()
    assert compact_appended_window_(cache, 3, [0, 1]) == 5  # already in place
    assert compact_appended_window_(cache, 3, []) == 3
    assert torch.equal(cache, original)
    with pytest.raises(ValueError, match=r"keep_indices \[0, 3\] must lie in \[0, 3\)"):
        compact_appended_window_(cache, 3, [0, 3])
    with pytest.raises(ValueError, match="4 rows to keep but the appended window holds 3"):
        compact_appended_window_(cache, 3, [0, 1, 2, 2])
    with pytest.raises(ValueError, match="past_length 7 outside a cache of 6 rows"):
        compact_appended_window_(cache, 7, [0])


def test_keep_indices_batch_from_flat_accept_index():
    keep, counts = keep_indices_batch(torch.tensor([[0, 2, -1], [4, 5, 7]]), width=4)
    assert keep.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert counts.tolist() == [2, 3]


def test_summary_has_exactly_the_seed_keys_in_order():
    tree = build_ddtree_tree_from_logits(torch.tensor([[5.0, 4.0, 1.0], [4.0, 3.0, 2.0], [3.0, 2.0, 1.0]]), 5)
    summary = summarize_ddtree(tree, 5, [0, 1, 2, 3], 9)
    assert isinstance(summary, TreeSummary)
    assert list(summary.to_dict()) == SEED_KEYS
    assert summary.to_dict()["accepted_path_depth"] == 3
    assert summary.to_dict()["accepted_node_count"] == 4


def test_summary_of_a_root_alone_and_bad_accepted():
    tree = build_ddtree_tree_from_logits(torch.randn(3, 4), 0)
    summary = summarize_ddtree(tree, 0, [0], 5).to_dict()
    assert summary == dict(zip(SEED_KEYS, [0, 0, 0, 0.0, 1, 0, 1, 0, 0, 5]))
    with pytest.raises(ValueError, match="must start with the root 0"):
        summarize_ddtree(tree, 0, [], 5)
    with pytest.raises(ValueError, match="accepted index 3 is outside a tree of 0 nodes"):
        summarize_ddtree(tree, 0, [0, 3], 5)


def test_tau_is_the_mean_of_per_request_means():
    # request A: rounds 1, 3 -> 2.0; request B: one round of 6 -> 6.0; tau = 4.0 (not 10/3)
    assert mean_acceptance_length([[1, 3], [6]]) == 4.0
    assert mean_acceptance_length([[2], []]) == 2.0
    with pytest.raises(ValueError, match="at least one request with at least one round"):
        mean_acceptance_length([[], []])
    assert acceptance_length([0, 4, 9]) == 3


def test_acceptance_histogram():
    assert acceptance_histogram([[1, 3], [3, 5, 1]]) == {1: 2, 2: 0, 3: 2, 4: 0, 5: 1}
    assert acceptance_histogram([]) == {}
    with pytest.raises(ValueError, match="count the root and are >= 1, got 0"):
        acceptance_histogram([[0, 1]])
