"""Tree and acceptance metrics with the paper's definitions.

Acceptance length of a round = number of accepted tree indices, root included (the paper's
tau counts the bonus/root token). tau of a run = mean over requests of each request's mean.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Sequence

from ddtree.inputs import check_accepted_path
from ddtree.tree import DraftTree


@dataclass(frozen=True)
class TreeSummary:
    """One round's tree and its verification outcome. Field order is the seed's key order."""

    budget: int
    actual_nodes: int
    max_depth: int
    mean_depth: float
    leaf_count: int  # nodes with no child; the root only when it is alone
    branch_count: int  # nodes (root included) with two or more children
    accepted_node_count: int  # acceptance length, root included
    accepted_draft_count: int
    accepted_path_depth: int
    bonus_token_id: int

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


def summarize_ddtree(tree: DraftTree, budget: int, accepted: Sequence[int], bonus: int) -> TreeSummary:
    """accepted: tree indices from `follow_verified_tree` (starts with 0); bonus: its token."""
    accepted = check_accepted_path(accepted)
    count = tree.num_nodes
    if max(accepted) > count:
        raise ValueError(f"accepted index {max(accepted)} is outside a tree of {count} nodes")
    depths = tree.node_depths.tolist()
    child_counts = [len(children) for children in tree.child_maps]
    leaves = sum(1 for c in child_counts[1:] if c == 0) if count else 1
    last = accepted[-1]
    return TreeSummary(
        budget=int(budget),
        actual_nodes=count,
        max_depth=max(depths) if depths else 0,
        mean_depth=sum(depths) / count if count else 0.0,
        leaf_count=leaves,
        branch_count=sum(1 for c in child_counts if c >= 2),
        accepted_node_count=len(accepted),
        accepted_draft_count=len(accepted) - 1,
        accepted_path_depth=depths[last - 1] if last else 0,
        bonus_token_id=int(bonus),
    )


def acceptance_length(accepted: Sequence[int]) -> int:
    """Per-round acceptance length: accepted tree indices, root included."""
    return len(accepted)


def mean_acceptance_length(per_request_lengths: Sequence[Sequence[int]]) -> float:
    """tau: mean over requests of (mean over that request's rounds). Requests without rounds
    are skipped; ValueError when no request has a round."""
    means = [sum(lengths) / len(lengths) for lengths in per_request_lengths if len(lengths)]
    if not means:
        raise ValueError("tau needs at least one request with at least one round")
    return sum(means) / len(means)


def acceptance_histogram(per_request_lengths: Sequence[Sequence[int]]) -> dict[int, int]:
    """Rounds per acceptance length over all requests, keys ascending from 1 to the maximum
    (lengths that never occurred are present with 0, so the histogram plots as-is)."""
    counts = Counter(int(n) for lengths in per_request_lengths for n in lengths)
    if not counts:
        return {}
    low = min(counts)
    if low < 1:
        raise ValueError(f"acceptance lengths count the root and are >= 1, got {low}")
    return {n: counts.get(n, 0) for n in range(1, max(counts) + 1)}
