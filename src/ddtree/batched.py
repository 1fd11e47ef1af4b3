"""`build_ddtree_trees`: one tree per request for a batch, on the logits' device.

Static shapes for a given (bs, D, budget), no host synchronisation, no per-node or
per-request Python loop: CUDA-graph friendly. The only Python loops run over depths.

Method (spec: the best-first set is the `budget` best rank paths). Per depth d the frontier
F_d is the top-`budget` depth-d paths, and F_d extends F_{d-1}: a depth-d path whose prefix is
not in F_{d-1} has `budget` better depth-d paths (the rank-0 children of F_{d-1}). With F_{d-1}
and row d sorted descending, pair (i, j) can only make the top `budget` if
(i + 1) * (j + 1) <= budget, so each depth scores ~budget * ln(budget) pairs, not budget^2.
The tree is the `budget` best of the union of all frontiers, ordered by score; a stable sort
over the depth-major union keeps every parent ahead of its equal-scoring children.

Differences from the heap builder, all only on exact score ties or float64 rounding:
scores are plain float64 sums (not the reference's incremental chains; the two agree
unless partial sums round), and nodes of exactly equal score are ordered by depth, then
by frontier order, rather than by rank path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ddtree.inputs import check_budget, check_logits_shape
from ddtree.topk import shard_top_k
from ddtree.tree import DraftTree, ancestor_visibility, make_draft_tree


@dataclass
class TreeBatch:
    """Trees of one batch padded to the budget B. Node i of request b is column i-1 of the node
    arrays and column i of `parents`; columns past num_nodes[b] are detached padding."""

    token_ids: torch.Tensor  # [bs, B] int64, pop order; padding 0
    depths: torch.Tensor  # [bs, B] int64, 1..D; padding 0
    parents: torch.Tensor  # [bs, B+1] int64; [:, 0] = -1 (root); padding -1
    num_nodes: torch.Tensor  # [bs] int64, root excluded
    scores: torch.Tensor  # [bs, B] float64 logw; padding -inf
    visibility: torch.Tensor  # [bs, B+1, B+1] bool ancestor-or-self; padding rows: self only

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def budget(self) -> int:
        return self.token_ids.shape[1]

    def tree(self, index: int) -> DraftTree:
        """Request `index` as a host `DraftTree` (synchronises with the device)."""
        count = int(self.num_nodes[index])
        return make_draft_tree(
            self.parents[index, : count + 1].tolist(),
            self.token_ids[index, :count].cpu(),
            self.depths[index, :count].cpu(),
            self.scores[index, :count].cpu(),
        )

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], budget: int | None = None, device=None) -> "TreeBatch":
        """Pad host trees to a common width (default: the largest tree)."""
        width = max((t.num_nodes for t in trees), default=0) if budget is None else budget
        bs = len(trees)
        token_ids = torch.zeros(bs, width, dtype=torch.int64)
        depths = torch.zeros(bs, width, dtype=torch.int64)
        parents = torch.full((bs, width + 1), -1, dtype=torch.int64)
        scores = torch.full((bs, width), float("-inf"), dtype=torch.float64)
        num_nodes = torch.zeros(bs, dtype=torch.int64)
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            if n > width:
                raise ValueError(f"tree {b} has {n} nodes, more than the batch width {width}")
            token_ids[b, :n] = tree.node_token_ids
            depths[b, :n] = tree.node_depths
            parents[b, : n + 1] = torch.tensor(tree.parents, dtype=torch.int64)
            scores[b, :n] = tree.node_scores
            num_nodes[b] = n
        max_depth = int(depths.max()) if depths.numel() else 0
        batch = cls(token_ids, depths, parents, num_nodes, scores, ancestor_visibility(parents, max_depth))
        return batch if device is None else batch.to(device)

    def to(self, device) -> "TreeBatch":
        return TreeBatch(*(getattr(self, f).to(device) for f in _FIELDS))


_FIELDS = ("token_ids", "depths", "parents", "num_nodes", "scores", "visibility")


@lru_cache(maxsize=64)
def _pair_count(budget: int, rank_cap: int) -> int:
    return sum(min(rank_cap, budget // (i + 1)) for i in range(budget))


def _frontier_pairs(budget: int, rank_cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All (i, j) with (i+1)(j+1) <= budget and j < rank_cap, built on the device (no copy).
    Returns ([M] int64 frontier slot, [M] int64 rank)."""
    total = _pair_count(budget, rank_cap)
    slots = torch.arange(budget, device=device)
    per_slot = torch.clamp(budget // (slots + 1), max=rank_cap)  # [budget]
    slot = torch.repeat_interleave(slots, per_slot, output_size=total)
    offsets = torch.cumsum(per_slot, 0) - per_slot
    rank = torch.arange(total, device=device) - offsets[slot]
    return slot, rank


def _empty_batch(bs: int, budget: int, device: torch.device) -> TreeBatch:
    parents = torch.full((bs, budget + 1), -1, dtype=torch.int64, device=device)
    return TreeBatch(
        token_ids=torch.zeros(bs, budget, dtype=torch.int64, device=device),
        depths=torch.zeros(bs, budget, dtype=torch.int64, device=device),
        parents=parents,
        num_nodes=torch.zeros(bs, dtype=torch.int64, device=device),
        scores=torch.full((bs, budget), float("-inf"), dtype=torch.float64, device=device),
        visibility=ancestor_visibility(parents, 0),
    )


def row_top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [bs, D, V] -> ([bs, D, k] float32 log-probs sorted desc; [bs, D, k] int64 ids):
    `shard_top_k` of the whole vocabulary, so a single shard is this, bit for bit."""
    return shard_top_k(logits, k).log_probs()  # non-finite entries (-inf tokens, NaN rows) are dropped by the builder


def build_ddtree_trees(
    logits: torch.Tensor,  # [bs, D, V] float32 / bfloat16 / float16
    budget: int,
) -> TreeBatch:
    """Batched best-first trees. NaN rows are not reported (that would need a host sync):
    they contribute no nodes. Use `build_ddtree_tree_from_logits` to validate one request."""
    check_logits_shape(logits, rank=3)
    budget = check_budget(budget)
    bs, depth_limit, vocab = logits.shape
    if budget == 0 or depth_limit == 0 or bs == 0:
        return _empty_batch(bs, budget, logits.device)
    log_probs, ids = row_top_log_probs(logits, min(budget, vocab))
    return build_trees_from_top_log_probs(log_probs, ids, budget)


def build_trees_from_top_log_probs(
    log_probs: torch.Tensor,  # [bs, D, K] float32 per-row top-K log-probs, sorted descending
    token_ids: torch.Tensor,  # [bs, D, K] int64 their token ids
    budget: int,
) -> TreeBatch:
    """The batched trees from per-row top-K log-probs computed elsewhere (e.g. a local top-K
    and logsumexp merged across tensor-parallel ranks). Exact when K >= min(budget, V); a
    smaller K caps every row at K ranks. Non-finite log-probs are never placed."""
    budget = check_budget(budget)
    if log_probs.dim() != 3 or tuple(token_ids.shape) != tuple(log_probs.shape):
        raise ValueError(
            f"log_probs and token_ids must both be [bs, D, K], got {tuple(log_probs.shape)} and {tuple(token_ids.shape)}"
        )
    bs, depth_limit, width = log_probs.shape
    device = log_probs.device
    if budget == 0 or depth_limit == 0 or bs == 0 or width == 0:
        return _empty_batch(bs, budget, device)
    rank_cap = min(budget, width)
    log_probs = log_probs[:, :, :rank_cap].float()
    ids = token_ids[:, :, :rank_cap].to(torch.int64)
    lp = torch.where(torch.isfinite(log_probs), log_probs, float("-inf"))  # [bs, D, K] float32

    # Frontier of depth 1: row 0's ranks (slot j = rank j); each later depth: the best `budget`
    # of its pair grid. float64 + float32 adds in float64, so the float32 pair log-probs give
    # the same sums as float64 ones at half the memory. Each depth is three kernels; which
    # pair each slot took is decoded once, after the loop.
    score = torch.full((bs, budget), float("-inf"), dtype=torch.float64, device=device)
    score[:, :rank_cap] = lp[:, 0]
    scores, chosen = [score], []
    if depth_limit > 1:
        pair_slot, pair_rank = _frontier_pairs(budget, rank_cap, device)
        pair_log_probs = lp[:, 1:, pair_rank]  # [bs, D-1, M]
        for d in range(1, depth_limit):
            score, best = torch.topk(score[:, pair_slot] + pair_log_probs[:, d - 1], budget, dim=-1)  # sorted
            scores.append(score)
            chosen.append(best)
        del pair_log_probs  # [bs, D-1, M]: 6 MB at bs 16, budget 1024; not held through the visibility

    # The tree: the `budget` best of all frontiers, depth-major so ties keep parents first.
    all_scores = torch.cat(scores, dim=1)  # [bs, D*B]
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :budget]  # [bs, B]
    node_scores = torch.gather(all_scores, 1, order)
    valid = torch.isfinite(node_scores)  # [bs, B] placed nodes are a prefix
    depth0 = order // budget  # [bs, B] depth - 1
    if chosen:
        all_chosen = torch.cat(chosen, dim=1)  # [bs, (D-1)*B] pair index of each deeper slot
        pair = torch.gather(all_chosen, 1, (order - budget).clamp(min=0))  # junk at depth 1
        node_rank = torch.where(depth0 > 0, pair_rank[pair], order)
        position = torch.full((bs, depth_limit * budget), -1, dtype=torch.int64, device=device)
        position.scatter_(1, order, torch.arange(1, budget + 1, device=device).expand(bs, budget))
        parent_flat = ((depth0 - 1) * budget + pair_slot[pair]).clamp(min=0)
        parent_index = torch.where(depth0 > 0, torch.gather(position, 1, parent_flat), 0)
    else:
        node_rank, parent_index = order, torch.zeros_like(order)

    parents = torch.full((bs, budget + 1), -1, dtype=torch.int64, device=device)
    parents[:, 1:] = torch.where(valid, parent_index, -1)
    token_flat = (depth0 * rank_cap + node_rank).clamp(max=depth_limit * rank_cap - 1)
    token_ids = torch.gather(ids.reshape(bs, depth_limit * rank_cap), 1, token_flat)
    return TreeBatch(
        token_ids=torch.where(valid, token_ids, 0),
        depths=torch.where(valid, depth0 + 1, 0),
        parents=parents,
        num_nodes=valid.sum(dim=1),
        scores=node_scores,
        visibility=ancestor_visibility(parents, depth_limit),
    )
