"""The pure tensor steps the SGLang worker runs between SGLang's forwards (CPU).

The tree walk here is the core's torch port of SGLang's verify_tree_greedy kernel
(ddtree.verify.walk_retrieve_arrays); predict is filled the way the kernel fills it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.verify import follow_verified_tree, walk_retrieve_arrays
from ddtree.sglang.round_metrics import RoundMetrics
from ddtree.sglang.tree_round import (
    TreeVerifyView,
    accepted_rows_first,
    build_round_trees,
    committed_tokens_and_bonus,
    draft_logits_from_hidden,
    front_positions,
    pack_round_inputs,
)


def _kernel_predict(target_predict: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """verify_tree_greedy writes the target's token at every accepted row, nothing elsewhere."""
    predict = torch.zeros(target_predict.numel(), dtype=torch.int32)
    rows = accept_index[accept_index >= 0]
    predict[rows] = target_predict.reshape(-1)[rows].to(torch.int32)
    return predict


def _one_round(seed: int, bs: int, depth: int, vocab: int, budget: int, width: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 3
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    prefix = torch.randint(1, 9, (bs,), generator=gen)
    trees = build_round_trees(logits, budget, budget)
    inputs, mask = pack_round_inputs(trees, bonus, prefix, width)
    # A target that often agrees with the draft's best child, sometimes not.
    target = torch.where(torch.rand(bs, width, generator=gen) < 0.7,
                         torch.roll(inputs.input_ids, -1, dims=1),
                         torch.randint(0, vocab, (bs, width), generator=gen))
    accept_index, drafts, walk_bonus = walk_retrieve_arrays(
        inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token,
        inputs.retrieve_next_sibling, target)
    return trees, inputs, mask, target, accept_index, drafts + 1, walk_bonus, prefix


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bs=st.integers(1, 4), depth=st.integers(1, 5),
       budget=st.integers(1, 12), extra=st.integers(0, 3))
def test_committed_tokens_match_the_spec_walk(seed, bs, depth, budget, extra):
    width = budget + 1 + extra  # verify width may exceed budget + 1 (padded, detached nodes)
    trees, inputs, _, target, accept_index, accept_lens, walk_bonus, _ = _one_round(seed, bs, depth, 16, budget, width)
    predict = _kernel_predict(target, accept_index)
    out_tokens, bonus = committed_tokens_and_bonus(predict, accept_index.to(torch.int32), accept_lens.to(torch.int32))
    assert torch.equal(bonus, walk_bonus)
    for b in range(bs):
        tree = trees.tree(b)
        accepted, spec_bonus = follow_verified_tree(tree.child_maps, target[b, : len(tree.parents)])
        n = len(accepted)
        assert int(accept_lens[b]) == n
        flat = accept_index[b, :n].tolist()
        assert flat == [b * width + i for i in accepted]
        # Committed: the accepted drafts' tokens, then the bonus; the bonus starts the next round.
        expected = [int(inputs.input_ids[b, i]) for i in accepted[1:]] + [spec_bonus]
        assert out_tokens[b, :n].tolist() == expected
        assert int(bonus[b]) == spec_bonus


def test_rejected_first_draft_commits_only_the_bonus():
    trees, inputs, _, _, _, _, _, _ = _one_round(3, 2, 3, 10, 5, 6)
    target = torch.full_like(inputs.input_ids, 10_000)  # matches no draft token
    accept_index, drafts, _ = walk_retrieve_arrays(inputs.input_ids, inputs.retrieve_index,
                                                   inputs.retrieve_next_token, inputs.retrieve_next_sibling, target)
    predict = _kernel_predict(target, accept_index)
    out_tokens, bonus = committed_tokens_and_bonus(predict, accept_index, drafts + 1)
    assert (drafts + 1).tolist() == [1, 1]
    assert out_tokens[:, 0].tolist() == [10_000, 10_000] and bonus.tolist() == [10_000, 10_000]


def test_accepted_hidden_rows_move_to_the_front_in_order():
    _, _, _, _, accept_index, accept_lens, _, prefix = _one_round(11, 3, 4, 12, 9, 10)
    width, hidden_size = 10, 5
    hidden = torch.arange(3 * width * hidden_size, dtype=torch.float32).view(3 * width, hidden_size)
    front = accepted_rows_first(hidden, accept_index, width).view(3, width, hidden_size)
    for b in range(3):
        for j in range(int(accept_lens[b])):
            assert torch.equal(front[b, j], hidden[int(accept_index[b, j])])
    assert front_positions(prefix, width).view(3, width)[:, 0].tolist() == prefix.tolist()
    assert front_positions(prefix, width).view(3, width)[1].tolist() == list(range(int(prefix[1]), int(prefix[1]) + width))


def test_full_mask_is_sglangs_layout():
    """FULL: per request, N rows of (prefix columns all true, then the tree row), as NGRAM
    builds it with torch.cat((ones(N, prefix), tree_mask), dim=1)."""
    trees, inputs, mask, _, _, _, _, prefix = _one_round(5, 3, 3, 9, 6, 8)
    expected = torch.cat([
        torch.cat([torch.ones(8, int(prefix[b]), dtype=torch.bool), inputs.tree_mask[b]], dim=1).reshape(-1)
        for b in range(3)
    ])
    assert torch.equal(mask, expected)
    view = TreeVerifyView.from_inputs(inputs, mask)
    assert (view.max_tree_depth, view.tree_topk, view.draft_token_num) == (8, -1, 8)
    assert view.draft_token.shape == (24,) and view.positions.shape == (24,)
    assert torch.equal(view.positions.view(3, 8)[:, 0], prefix)


def test_draft_logits_skip_the_bonus_position():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 4, 6, generator=gen)
    weight = torch.randn(11, 6, generator=gen)
    logits = draft_logits_from_hidden(hidden, weight)
    assert logits.shape == (2, 3, 11)
    assert torch.allclose(logits[1, 2], weight @ hidden[1, 3])


def test_a_topk_cap_below_the_budget_is_refused_until_the_core_supports_it():
    with pytest.raises(NotImplementedError, match="DDTREE_TOPK=4 < DDTREE_BUDGET=8"):
        build_round_trees(torch.zeros(1, 2, 5), 8, 4)


def test_round_metrics_sync_once_per_interval():
    seen = []
    metrics = RoundMetrics(2, "cpu", seen.append)
    assert metrics.record(torch.tensor([1, 3]), torch.tensor([8, 8]), lambda: 2.0) is None
    snapshot = metrics.record(torch.tensor([2]), torch.tensor([5]), lambda: 4.0)
    assert seen == [snapshot]
    assert (snapshot.rounds, snapshot.requests) == (2, 3)
    assert snapshot.mean_acceptance_length == pytest.approx(2.0)
    assert snapshot.mean_tree_size == pytest.approx(7.0)
    assert snapshot.mean_build_ms == pytest.approx(3.0)
    assert "acceptance length 2.000" in snapshot.line()
    off = RoundMetrics(0, "cpu", seen.append)
    assert off.record(torch.tensor([1]), torch.tensor([1])) is None and len(seen) == 1
