"""DDTree speculative decoding core: draft trees, verify inputs, commit helpers, metrics.

Pure torch; imports nothing from the operator side. The stable API keeps the seed's names.
"""
from ddtree.batched import TreeBatch, build_ddtree_trees, build_trees_from_top_log_probs
from ddtree.build import BuildMethod, build_ddtree_tree_from_logits
from ddtree.commit import RoundCommit, commit_round, compact_appended_window_, keep_indices_batch
from ddtree.graphed import GraphedTreeBuilder
from ddtree.invariants import TreeInvariantError, assert_prefix_closed, validate_tree
from ddtree.metrics import (
    TreeSummary,
    acceptance_histogram,
    acceptance_length,
    mean_acceptance_length,
    summarize_ddtree,
)
from ddtree.tree import DraftTree
from ddtree.verify import (
    MaskLayout,
    VerifyInputs,
    build_verify_inputs,
    follow_verified_tree,
    pack_custom_mask,
    walk_retrieve_arrays,
)

__all__ = [
    "BuildMethod",
    "DraftTree",
    "GraphedTreeBuilder",
    "MaskLayout",
    "RoundCommit",
    "TreeBatch",
    "TreeInvariantError",
    "TreeSummary",
    "VerifyInputs",
    "acceptance_histogram",
    "acceptance_length",
    "assert_prefix_closed",
    "build_ddtree_tree_from_logits",
    "build_ddtree_trees",
    "build_trees_from_top_log_probs",
    "build_verify_inputs",
    "commit_round",
    "compact_appended_window_",
    "follow_verified_tree",
    "keep_indices_batch",
    "mean_acceptance_length",
    "pack_custom_mask",
    "summarize_ddtree",
    "validate_tree",
    "walk_retrieve_arrays",
]
