"""The margins a decode loop keeps with DecodeConfig(record_margins=True) (ddtree.margins): one
target margin per committed token and one drafter margin per depth of the target's path, each
what the offline choice had to spare; a hand-built tree checks the tree rule's numbers."""
from __future__ import annotations

import math

import pytest
import torch

from ddtree.decode import DecodeConfig, generate_ddtree, generate_dflash
from ddtree.drafters import NoisyTargetDrafter
from ddtree.lossless import build_tiny_target
from ddtree.margins import chain_draft_margins, top2_margins, tree_draft_margins
from ddtree.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


def test_margins_are_kept_only_when_asked(target):
    drafter = NoisyTargetDrafter(target, block_size=5, noise=0.5)
    plain = generate_dflash(target, drafter, torch.tensor([[1, 2, 3]]), DecodeConfig(max_new_tokens=8))
    assert plain.verify_margins is None and plain.draft_margins is None and plain.prefill_margin is None


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_one_target_margin_per_committed_token_and_one_drafter_margin_per_path_depth(target, method):
    drafter = NoisyTargetDrafter(target, block_size=5, noise=0.5)
    config = DecodeConfig(max_new_tokens=24, record_margins=True)
    prompt = torch.tensor([[5, 9, 2, 7]])
    if method == "dflash":
        result = generate_dflash(target, drafter, prompt, config)
    else:
        result = generate_ddtree(target, drafter, prompt, config, budget=8)
    assert max(result.acceptance_lengths) > 1  # the noisy target's drafts get accepted
    assert [len(m) for m in result.verify_margins] == result.acceptance_lengths
    assert [len(m) for m in result.draft_margins] == [min(a, 4) for a in result.acceptance_lengths]
    assert all(m >= 0 for round_ in result.verify_margins + result.draft_margins for m in round_)
    assert result.prefill_margin > 0


def test_top2_and_chain_margins_by_hand():
    logits = torch.tensor([[3.0, 1.0, 0.5], [0.0, 2.0, 1.5], [1.0, 0.0, 4.0]])
    assert top2_margins(logits) == pytest.approx([2.0, 0.5, 3.0])
    # accepted 3 (root + depths 1-2), the target then chose token 0 at depth 3 where the drafter had 4.0 vs 1.0
    assert chain_draft_margins(logits, accepted=3, bonus=0) == pytest.approx([2.0, 0.5, 3.0])
    assert chain_draft_margins(logits, accepted=4, bonus=1) == pytest.approx([2.0, 0.5, 3.0])  # block exhausted


def test_tree_margins_are_distances_to_the_admission_threshold():
    # root -> a (depth 1, log-prob -0.1) -> c (depth 2, -0.1 - 0.7); root -> b (depth 1, -1.0)
    tree = DraftTree(parents=[-1, 0, 0, 1], node_token_ids=[0, 1, 2], node_depths=[1, 1, 2],
                     node_scores=[-0.1, -1.0, -0.8])
    logits = torch.zeros(2, 3)  # depth 2 is uniform: every token has log-prob -log 3
    margins = tree_draft_margins(logits, tree, keep_indices=[0, 1], bonus=0)  # accepted a, target then chose 0
    assert margins == pytest.approx([-0.1 - (-1.0), -1.0 - (-0.1 - math.log(3))])
    assert tree_draft_margins(logits, tree, keep_indices=[0, 1, 3], bonus=1) == pytest.approx([0.9, 0.2])


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_forced_tokens_make_the_loop_accept_on_a_given_text(target, method):
    """Following the target's own greedy text changes nothing; following another text commits
    that text, and each round accepts exactly the drafts that match it."""
    drafter = NoisyTargetDrafter(target, block_size=5, noise=0.5)
    prompt = torch.tensor([[5, 9, 2, 7]])

    def run(forced=None):
        config = DecodeConfig(max_new_tokens=20, forced_tokens=forced)
        if method == "dflash":
            return generate_dflash(target, drafter, prompt, config)
        return generate_ddtree(target, drafter, prompt, config, budget=8)

    free = run()
    same = run(free.new_token_ids)
    assert (same.new_token_ids, same.acceptance_lengths) == (free.new_token_ids, free.acceptance_lengths)
    other = free.new_token_ids[:6] + [(t + 1) % target.vocab_size for t in free.new_token_ids[6:]]
    followed = run(other)
    assert followed.new_token_ids == other
    before = 0  # rounds that committed only tokens before the first changed one (index 6) are the same
    while 1 + sum(free.acceptance_lengths[: before + 1]) <= 5:
        before += 1
    assert followed.acceptance_lengths[:before] == free.acceptance_lengths[:before]
    assert followed.acceptance_lengths != free.acceptance_lengths
    with pytest.raises(ValueError, match="forced_tokens follow a text at T=0"):
        DecodeConfig(max_new_tokens=4, temperature=0.5, forced_tokens=[1])
