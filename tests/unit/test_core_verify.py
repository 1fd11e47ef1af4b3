"""Verify inputs of a batch: hand-built trees, masks in both layouts, and the retrieve-array walk."""
from __future__ import annotations

import re

import random

import pytest
import torch

from ddtree import (
    MaskLayout,
    TreeBatch,
    build_ddtree_tree_from_logits,
    build_ddtree_trees,
    build_verify_inputs,
    follow_verified_tree,
    pack_custom_mask,
    walk_retrieve_arrays,
)
from ddtree.tree import make_draft_tree

GOLDEN_LOGITS = torch.tensor([[5.0, 4.0, 1.0], [4.0, 3.0, 2.0], [3.0, 2.0, 1.0]])


def hand_tree(parents, tokens):
    """A tree from its parent array; depths follow from the parents."""
    depths = []
    for index in range(1, len(parents)):
        depths.append(1 if parents[index] == 0 else depths[parents[index] - 1] + 1)
    return make_draft_tree(
        parents,
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(depths, dtype=torch.int64),
        torch.zeros(len(tokens), dtype=torch.float64),
    )


def test_follow_accepts_list_flat_tensor_and_reference_layout():
    tree = build_ddtree_tree_from_logits(GOLDEN_LOGITS, 5)
    posterior = [0, 1, 456, 789, 111, 9]  # root -> 0 (node 1) -> 1 (node 5) -> 9 stops
    expected = ([0, 1, 5], 9)
    assert follow_verified_tree(tree.child_maps, posterior) == expected
    assert follow_verified_tree(tree.child_maps, torch.tensor(posterior)) == expected
    assert follow_verified_tree(tree.child_maps, torch.tensor([posterior])) == expected
    with pytest.raises(ValueError, match=r"posterior has 3 tokens for a tree of 6 indices"):
        follow_verified_tree(tree.child_maps, [0, 1, 2])
    with pytest.raises(ValueError, match=r"shape \[N\+1\] or \[1, N\+1\], got \(2, 6\)"):
        follow_verified_tree(tree.child_maps, torch.zeros(2, 6, dtype=torch.int64))


def test_follow_walks_to_a_leaf():
    tree = build_ddtree_tree_from_logits(GOLDEN_LOGITS, 5)
    accepted, bonus = follow_verified_tree(tree.child_maps, [0, 0, 0, 42, 111, 222])
    assert accepted == [0, 1, 2, 3]
    assert bonus == 42


def test_hand_built_tree_retrieve_arrays_positions_and_padding():
    tree = hand_tree([-1, 0, 1, 2, 0, 1], [10, 11, 12, 13, 14])
    inputs = build_verify_inputs([tree], torch.tensor([99]), torch.tensor([7]), width=8)
    assert inputs.input_ids.tolist() == [[99, 10, 11, 12, 13, 14, 0, 0]]
    assert inputs.positions.tolist() == [[7, 8, 9, 10, 8, 9, 7, 7]]
    assert inputs.retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert inputs.retrieve_next_token.tolist() == [[1, 2, 3, -1, -1, -1, -1, -1]]
    assert inputs.retrieve_next_sibling.tolist() == [[-1, 4, 5, -1, -1, -1, -1, -1]]
    assert inputs.tree_sizes.tolist() == [6]
    mask = inputs.tree_mask[0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 0],  # detached padding: itself only
        [0, 0, 0, 0, 0, 0, 0, 1],
    ]


def test_second_request_indices_and_a_wide_root():
    wide = hand_tree([-1, 0, 0, 0, 2], [5, 6, 7, 8])  # root with three children, node 2 has one
    chain = hand_tree([-1, 0, 1], [3, 4])
    inputs = build_verify_inputs([chain, wide], torch.tensor([1, 2]), torch.tensor([0, 100]))
    assert inputs.width == 5
    assert inputs.retrieve_index[1].tolist() == [5, 6, 7, 8, 9]
    assert inputs.retrieve_next_token.tolist() == [[1, 2, -1, -1, -1], [1, -1, 4, -1, -1]]
    assert inputs.retrieve_next_sibling.tolist() == [[-1, -1, -1, -1, -1], [-1, 2, 3, -1, -1]]
    assert inputs.positions.tolist() == [[0, 1, 2, 0, 0], [100, 101, 101, 101, 102]]


def test_mismatched_batch_shapes_are_named():
    tree = hand_tree([-1, 0], [3])
    with pytest.raises(ValueError, match=r"root_token_ids must have shape \[2\] \(one per request\), got \(3,\)"):
        build_verify_inputs([tree, tree], torch.tensor([1, 2, 3]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="verify width 1 is smaller than budget \\+ 1 = 2"):
        build_verify_inputs(TreeBatch.from_trees([tree]), torch.tensor([1]), torch.tensor([0]), width=1)
    big = hand_tree([-1, 0, 1, 2], [3, 4, 5])
    with pytest.raises(ValueError, match=r"verify width 3 is smaller than the largest tree's 3 nodes \+ 1 = 4"):
        build_verify_inputs([tree, big], torch.tensor([1, 2]), torch.tensor([0, 0]), width=3)
    inputs = build_verify_inputs([tree, tree], torch.tensor([1, 2]), torch.tensor([0, 0]))
    for lens in (torch.tensor([2]), torch.tensor([2, 0, 1]), torch.tensor([[2, 0]])):
        # one context length for a batch of two would silently apply to both
        message = re.escape(f"must have shape [2] (one per request), got {tuple(lens.shape)}")
        with pytest.raises(ValueError, match="context_lens " + message):
            inputs.attention_mask(lens, 3)
        with pytest.raises(ValueError, match="context_lens " + message):
            inputs.additive_attention_mask(lens, 3)
        for layout in MaskLayout:
            with pytest.raises(ValueError, match="prefix_lens " + message):
                inputs.custom_mask(lens, layout)


def test_attention_masks_bool_and_additive():
    tree = hand_tree([-1, 0, 0], [3, 4])
    inputs = build_verify_inputs([tree, hand_tree([-1, 0], [9])], torch.tensor([1, 2]), torch.tensor([4, 2]), width=3)
    visible = inputs.attention_mask(torch.tensor([4, 2]), context_width=4)
    assert visible.shape == (2, 3, 7)
    assert visible[0].int().tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    # request 1: two context tokens; its padding row sees the context and itself only
    assert visible[1].int().tolist() == [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1]]
    additive = inputs.additive_attention_mask(torch.tensor([4, 2]), 4, dtype=torch.float16)
    assert additive.shape == (2, 1, 3, 7) and additive.dtype == torch.float16
    assert torch.equal(additive[:, 0] == 0, visible)
    assert (additive[:, 0][~visible] == torch.finfo(torch.float16).min).all()


def test_custom_mask_layouts():
    tree = hand_tree([-1, 0, 1], [3, 4])
    other = hand_tree([-1, 0], [8])
    inputs = build_verify_inputs([tree, other], torch.tensor([1, 2]), torch.tensor([2, 1]), width=3)
    qlen = inputs.custom_mask(torch.tensor([2, 1]), MaskLayout.QLEN)
    assert qlen.tolist() == inputs.tree_mask.reshape(-1).tolist()
    full = inputs.custom_mask(torch.tensor([2, 1]), MaskLayout.FULL)
    expected = []
    for b, prefix in enumerate([2, 1]):
        for row in inputs.tree_mask[b].tolist():
            expected += [True] * prefix + row
    assert full.tolist() == expected
    assert pack_custom_mask(inputs.tree_mask, torch.tensor([2, 1]), MaskLayout.FULL, total_prefix=3).tolist() == expected


def _random_posterior(tree, rng, width, follow_prob=0.8):
    """Target tokens that mostly follow some child (so walks go deep), else a fresh token."""
    posterior = []
    for index in range(width):
        children = list(tree.child_maps[index].keys()) if index <= tree.num_nodes else []
        if children and rng.random() < follow_prob:
            posterior.append(rng.choice(children))
        else:
            posterior.append(rng.randrange(1000, 2000))
    return posterior


@pytest.mark.parametrize("seed", range(4))
def test_retrieve_array_walk_reproduces_follow_verified_tree(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, depth, vocab, budget = 6, rng.choice([1, 3, 6]), rng.choice([2, 5, 40]), rng.choice([1, 7, 30])
    logits = torch.randn(bs, depth, vocab) * rng.choice([0.5, 3.0])
    batch = build_ddtree_trees(logits, budget)
    trees = [batch.tree(b) for b in range(bs)]
    inputs = build_verify_inputs(batch, torch.arange(bs), torch.zeros(bs, dtype=torch.int64), width=budget + 3)
    posteriors = [_random_posterior(t, rng, budget + 3) for t in trees]
    accept_index, accept_length, bonus = walk_retrieve_arrays(
        inputs.input_ids,
        inputs.retrieve_index,
        inputs.retrieve_next_token,
        inputs.retrieve_next_sibling,
        torch.tensor(posteriors),
    )
    for b, tree in enumerate(trees):
        accepted, expected_bonus = follow_verified_tree(tree.child_maps, posteriors[b])
        walked = [i - b * inputs.width for i in accept_index[b].tolist() if i >= 0]
        assert walked == accepted
        assert int(accept_length[b]) == len(accepted) - 1
        assert int(bonus[b]) == expected_bonus


def test_walk_with_root_rejected_everywhere():
    tree = hand_tree([-1, 0, 0], [3, 4])
    inputs = build_verify_inputs([tree, tree], torch.tensor([1, 1]), torch.tensor([0, 0]))
    predict = torch.tensor([[7, 7, 7], [4, 5, 6]])  # request 0 rejects the root's children
    accept_index, accept_length, bonus = walk_retrieve_arrays(
        inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token, inputs.retrieve_next_sibling, predict
    )
    assert accept_index.tolist() == [[0, -1, -1], [3, 5, -1]]
    assert accept_length.tolist() == [0, 1]
    assert bonus.tolist() == [7, 6]


@pytest.mark.parametrize("count", [1, 2, 7, 8, 9, 64, 127, 128, 255, 256])
def test_bitset_visibility_equals_the_tensor_walk(count):
    """Small host trees build their mask from integer bitsets; it and its complement must equal
    the per-depth gather walk for every shape, at any size up to the cut-over."""
    from ddtree.tree import BITSET_MAX_NODES, ancestor_visibility, bitset_hidden, bitset_visibility

    assert count <= BITSET_MAX_NODES
    rng = random.Random(count)
    for _ in range(20):
        parents = [-1] + [rng.randrange(i) for i in range(1, count)]
        depth = [0] * count
        for i in range(1, count):
            depth[i] = depth[parents[i]] + 1
        expected = ancestor_visibility(torch.tensor(parents), max(depth))
        assert torch.equal(bitset_visibility(parents), expected)
        assert torch.equal(bitset_hidden(parents), expected.logical_not())
