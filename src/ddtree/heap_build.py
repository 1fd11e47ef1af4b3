"""The best-first heap builder: the reference semantics, kept plain as the oracle for tests.

Spec steps 2-4 (`shared/spec/ddtree-algorithm.md`): float32 log-probabilities from a full-row
`logsumexp`, float64 scores accumulated incrementally, ties popped lexicographically smaller
rank path first (a Python tuple comparison on `ranks`).

Deliberate difference from the reference: a token whose logit is -inf (zero probability) is
never placed. The reference would place it with a NaN score; here each row only offers its
finite-probability ranks, and a row with no finite logit ends the tree at that depth.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

import torch

from ddtree.inputs import check_rows_finite
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree


class HeapEntry(NamedTuple):
    """One candidate rank path. Field order is the heap order: best score, then smaller path."""

    neg_logw: float
    ranks: tuple[int, ...]
    parent_index: int
    depth: int
    rank: int
    logw: float


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k log-probabilities exactly as the reference computes them.

    logits: [D, V] any float dtype, any device. Returns host tensors
    ([D, k] float32 log-probs sorted descending, [D, k] int64 token ids).
    """
    x = logits.float()
    top_logits, top_ids = torch.topk(x, k=k, dim=-1)
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    return (top_logits - log_z).to("cpu", torch.float32), top_ids.to("cpu", torch.int64)


class HeapRows:
    """Row access for the heap loop: row d's finite log-probs and ids as Python lists."""

    def __init__(self, log_probs: torch.Tensor, token_ids: torch.Tensor):  # [D, k] float32, [D, k] int64
        usable = torch.isfinite(log_probs).sum(dim=-1).tolist()  # sorted rows: finite ranks are a prefix
        self._lp = [row[:n] for row, n in zip(log_probs.tolist(), usable)]
        self._ids = [row[:n] for row, n in zip(token_ids.tolist(), usable)]

    def log_probs(self, d: int) -> list[float]:
        return self._lp[d]

    def ids(self, d: int) -> list[int]:
        return self._ids[d]


def best_first(rows, depth_limit: int, budget: int) -> DraftTree:
    """The reference's best-first loop. `rows.log_probs(d)` / `rows.ids(d)`: row d's usable
    ranks (finite log-probs, sorted descending) as lists, read only when a pop needs the row."""
    parents = [-1]
    tokens: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap: list[HeapEntry] = []
    first_row = rows.log_probs(0)
    if first_row:
        heap.append(HeapEntry(-first_row[0], (0,), 0, 1, 0, first_row[0]))

    while heap and len(tokens) < budget:
        entry = heapq.heappop(heap)
        depth, rank, logw = entry.depth, entry.rank, entry.logw
        row = rows.log_probs(depth - 1)
        index = len(tokens) + 1
        parents.append(entry.parent_index)
        tokens.append(rows.ids(depth - 1)[rank])
        depths.append(depth)
        scores.append(logw)
        if rank + 1 < len(row):
            sibling = logw - row[rank] + row[rank + 1]
            ranks = entry.ranks[:-1] + (rank + 1,)
            heapq.heappush(heap, HeapEntry(-sibling, ranks, entry.parent_index, depth, rank + 1, sibling))
        if depth < depth_limit:
            next_row = rows.log_probs(depth)
            if next_row:
                child = logw + next_row[0]
                heapq.heappush(heap, HeapEntry(-child, entry.ranks + (0,), index, depth + 1, 0, child))

    return make_draft_tree(
        parents,
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(depths, dtype=torch.int64),
        torch.tensor(scores, dtype=torch.float64),
    )


def build_heap_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. Every row normalised up front,
    exactly as the reference does it."""
    depth_limit, vocab = logits.shape
    if budget == 0 or depth_limit == 0:
        return root_only_tree()
    check_rows_finite(logits)
    return best_first(HeapRows(*top_log_probs(logits, min(budget, vocab))), depth_limit, budget)
