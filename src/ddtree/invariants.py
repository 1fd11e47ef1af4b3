"""What a DDTree promises (spec, "Building the tree"), checked on a built tree.

`TreeInvariantError` is an AssertionError: these are internal guarantees, not input errors.
"""
from __future__ import annotations

import math

import torch

from ddtree.tree import DraftTree, ancestor_visibility


class TreeInvariantError(AssertionError):
    pass


def assert_prefix_closed(tree: DraftTree) -> None:
    """Root first, every node's parent placed before it: every prefix of a path is a node."""
    parents = tree.parents
    if not parents or parents[0] != -1:
        raise TreeInvariantError(f"parents[0] must be -1 (the root), got {parents[:1]}")
    for index in range(1, len(parents)):
        if not 0 <= parents[index] < index:
            raise TreeInvariantError(
                f"node {index} has parent {parents[index]}: parents must be placed before their children"
            )


def reachable_node_count(logits: torch.Tensor, budget: int) -> int:
    """min(budget, sum_d prod_{i<d} finite_i) with finite_i = min(budget, tokens of row i whose
    float32 log-prob is finite): the builders' rule (a finite logit far below the row's
    logsumexp can still have a log-prob of -inf, and is never placed)."""
    x = logits.float().cpu()
    finite_log_probs = torch.isfinite(x - torch.logsumexp(x, dim=-1, keepdim=True)).sum(dim=-1).tolist()
    total, width = 0, 1
    for finite in finite_log_probs:
        width *= min(budget, finite)
        total += width
        if total >= budget or width == 0:
            break
    return min(budget, total)


def validate_tree(tree: DraftTree, budget: int | None = None, logits: torch.Tensor | None = None) -> None:
    """Every structural promise; with `budget` the size limit; with `logits` ([D, V]) the depth
    limit, the exact node count, tokens of finite probability and scores equal to path sums."""
    assert_prefix_closed(tree)
    count = tree.num_nodes
    tokens = tree.node_token_ids.tolist()
    depths = tree.node_depths.tolist()
    scores = tree.node_scores.tolist()
    for name, values in (("node_token_ids", tokens), ("node_depths", depths), ("node_scores", scores)):
        if len(values) != count:
            raise TreeInvariantError(f"{name} has {len(values)} entries for {count} nodes")
    if tree.node_token_ids.dtype != torch.int64 or tree.node_depths.dtype != torch.int64:
        raise TreeInvariantError(
            f"node_token_ids / node_depths must be int64, got {tree.node_token_ids.dtype} / {tree.node_depths.dtype}"
        )
    for index in range(1, count + 1):
        parent = tree.parents[index]
        expected = 1 if parent == 0 else depths[parent - 1] + 1
        if depths[index - 1] != expected:
            raise TreeInvariantError(f"node {index} has depth {depths[index - 1]}, its parent {parent} implies {expected}")
    for index in range(1, count):
        if scores[index] > scores[index - 1]:
            raise TreeInvariantError(f"scores rise in pop order at node {index + 1}: {scores[index - 1]} -> {scores[index]}")
    if len(tree.child_maps) != count + 1:
        raise TreeInvariantError(f"child_maps has {len(tree.child_maps)} entries for {count + 1} indices")
    expected_maps: list[dict[int, int]] = [{} for _ in range(count + 1)]
    for index in range(1, count + 1):
        siblings = expected_maps[tree.parents[index]]
        if tokens[index - 1] in siblings:
            raise TreeInvariantError(
                f"nodes {siblings[tokens[index - 1]]} and {index} share parent {tree.parents[index]} and token {tokens[index - 1]}"
            )
        siblings[tokens[index - 1]] = index
    if tree.child_maps != expected_maps:
        raise TreeInvariantError("child_maps do not match parents and node_token_ids")
    expected_visibility = ancestor_visibility(torch.tensor(tree.parents, dtype=torch.int64), max(depths, default=0))
    if tree.visibility.dtype != torch.bool or not torch.equal(tree.visibility.cpu(), expected_visibility):
        raise TreeInvariantError("visibility is not the ancestor-or-self mask of parents")
    if budget is not None and count > budget:
        raise TreeInvariantError(f"{count} nodes exceed the budget {budget}")
    if logits is not None:
        _check_against_logits(tree, budget, logits, tokens, depths, scores)


def _check_against_logits(tree, budget, logits, tokens, depths, scores) -> None:
    depth_limit, vocab = logits.shape
    if depths and max(depths) > depth_limit:
        raise TreeInvariantError(f"depth {max(depths)} exceeds the {depth_limit} logits rows")
    outside = [i for i, token in enumerate(tokens, start=1) if not 0 <= token < vocab]
    if outside:
        raise TreeInvariantError(f"node {outside[0]} has token {tokens[outside[0] - 1]}, outside the vocabulary [0, {vocab})")
    if budget is not None:
        expected = reachable_node_count(logits, budget)
        if tree.num_nodes != expected:
            raise TreeInvariantError(f"{tree.num_nodes} nodes, expected min(budget, reachable) = {expected}")
    x = logits.float().cpu()
    log_probs = torch.log_softmax(x, dim=-1).double()  # [D, V]
    # float32 log-probs carry an error of a few ulps of the logits' magnitude per row, plus the
    # rounding of a float32 sum over the vocabulary, which torch's logsumexp and log_softmax
    # add up in different orders (it grows like sqrt(V): 2e-5 nats a row at V = 151936)
    finite = x[torch.isfinite(x)]
    magnitude = (float(finite.abs().max()) if finite.numel() else 0.0) + math.sqrt(x.shape[-1])
    per_row_error = 4 * torch.finfo(torch.float32).eps * magnitude
    path_sum = [0.0]
    for index in range(1, tree.num_nodes + 1):
        lp = float(log_probs[depths[index - 1] - 1, tokens[index - 1]])
        if not math.isfinite(lp):
            raise TreeInvariantError(f"node {index} places token {tokens[index - 1]} of zero probability")
        path_sum.append(path_sum[tree.parents[index]] + lp)
        tolerance = 1e-4 + depths[index - 1] * per_row_error
        if not math.isclose(path_sum[index], scores[index - 1], rel_tol=1e-5, abs_tol=tolerance):
            raise TreeInvariantError(f"node {index} scores {scores[index - 1]}, its path sums to {path_sum[index]}")
