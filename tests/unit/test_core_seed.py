"""The seed's own smoke script, unchanged except its sys.path line, and the spec's golden vector."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree import (
    BuildMethod,
    build_ddtree_tree_from_logits,
    build_ddtree_trees,
    follow_verified_tree,
    summarize_ddtree,
    validate_tree,
)

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "src" / "ddtree"

# The python heredoc of shared/seeds/000_44c6339df762f231.txt; only the sys.path line differs.
SEED_SCRIPT = """\
import sys, torch
sys.path.insert(0, {package_dir!r})
from sglang_ddtree_utils import build_ddtree_tree_from_logits, follow_verified_tree, summarize_ddtree, assert_prefix_closed
logits = torch.tensor([[5.0,4.0,1.0],[4.0,3.0,2.0],[3.0,2.0,1.0]])
tree = build_ddtree_tree_from_logits(logits, budget=5)
assert_prefix_closed(tree)
accepted, bonus = follow_verified_tree(tree.child_maps, [int(tree.node_token_ids[0]), 123, 456, 789, 111, 222])
print(tree.parents)
print(tree.node_token_ids.tolist())
print(tree.node_depths.tolist())
print(summarize_ddtree(tree, 5, accepted, bonus).to_dict())
"""

SEED_OUTPUT = """\
[-1, 0, 1, 2, 0, 1]
[0, 0, 0, 1, 1]
[1, 2, 3, 1, 2]
{'budget': 5, 'actual_nodes': 5, 'max_depth': 3, 'mean_depth': 1.8, 'leaf_count': 3, 'branch_count': 2, 'accepted_node_count': 2, 'accepted_draft_count': 1, 'accepted_path_depth': 1, 'bonus_token_id': 123}
"""

GOLDEN_LOGITS = [[5.0, 4.0, 1.0], [4.0, 3.0, 2.0], [3.0, 2.0, 1.0]]


@pytest.mark.slow
def test_seed_smoke_script_prints_the_seed_lines(tmp_path):
    script = tmp_path / "seed_smoke.py"
    script.write_text(SEED_SCRIPT.format(package_dir=str(PACKAGE_DIR)))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == SEED_OUTPUT


@pytest.mark.parametrize("method", list(BuildMethod))
def test_golden_vector_every_method(method):
    logits = torch.tensor(GOLDEN_LOGITS)
    tree = build_ddtree_tree_from_logits(logits, 5, method=method)
    assert tree.parents == [-1, 0, 1, 2, 0, 1]
    assert tree.node_token_ids.tolist() == [0, 0, 0, 1, 1]
    assert tree.node_depths.tolist() == [1, 2, 3, 1, 2]
    assert tree.node_token_ids.dtype == torch.int64 and tree.node_depths.dtype == torch.int64
    validate_tree(tree, budget=5, logits=logits)
    accepted, bonus = follow_verified_tree(tree.child_maps, [0, 123, 456, 789, 111, 222])
    assert (accepted, bonus) == ([0, 1], 123)
    assert summarize_ddtree(tree, 5, accepted, bonus).to_dict() == {
        "budget": 5, "actual_nodes": 5, "max_depth": 3, "mean_depth": 1.8, "leaf_count": 3,
        "branch_count": 2, "accepted_node_count": 2, "accepted_draft_count": 1,
        "accepted_path_depth": 1, "bonus_token_id": 123,
    }


def test_golden_vector_batched_builder():
    batch = build_ddtree_trees(torch.tensor([GOLDEN_LOGITS, GOLDEN_LOGITS]), 5)
    for i in range(2):
        tree = batch.tree(i)
        assert tree.parents == [-1, 0, 1, 2, 0, 1]
        assert tree.node_token_ids.tolist() == [0, 0, 0, 1, 1]
        assert tree.node_depths.tolist() == [1, 2, 3, 1, 2]


def test_golden_scores_are_the_reference_float64_chain():
    logits = torch.tensor(GOLDEN_LOGITS)
    lp = (logits - torch.logsumexp(logits, dim=-1, keepdim=True)).tolist()  # float32 -> float
    tree = build_ddtree_tree_from_logits(logits, 5)
    first = lp[0][0]
    expected = [
        first,
        first + lp[1][0],
        first + lp[1][0] + lp[2][0],
        first - lp[0][0] + lp[0][1],
        first + lp[1][0] - lp[1][0] + lp[1][1],
    ]
    assert tree.node_scores.dtype == torch.float64
    assert tree.node_scores.tolist() == expected


def test_root_rejected_walk():
    tree = build_ddtree_tree_from_logits(torch.tensor(GOLDEN_LOGITS), 5)
    posterior = [7, 123, 456, 789, 111, 222]  # the target wants token 7: no child of the root has it
    accepted, bonus = follow_verified_tree(tree.child_maps, posterior)
    assert accepted == [0]
    assert bonus == 7
    summary = summarize_ddtree(tree, 5, accepted, bonus).to_dict()
    assert summary["accepted_node_count"] == 1
    assert summary["accepted_draft_count"] == 0
    assert summary["accepted_path_depth"] == 0
    assert summary["bonus_token_id"] == 7
