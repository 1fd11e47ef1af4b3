"""The best-first heap builder: the reference semantics, kept plain as the oracle for tests.

Spec steps 2-4 (`shared/spec/ddtree-algorithm.md`): float32 log-probabilities from a full-row
`logsumexp`, float64 scores accumulated incrementally, ties popped lexicographically smaller
rank path first.

Deliberate difference from the reference: a token whose logit is -inf (zero probability) is
never placed. The reference would place it with a NaN score; here each row only offers its
finite-probability ranks, and a row with no finite logit ends the tree at that depth.
"""
from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import torch

from ddtree.inputs import raise_bad_row
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree


class HeapEntry(NamedTuple):
    """One candidate rank path. Field order is the heap order: best score first; the unique
    sequence number ends every comparison there (exact score ties are resolved by rank path
    in `best_first`, without building a path per push)."""

    neg_logw: float
    sequence: int
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
    """Rows for the heap loop: `log_probs[d]` / `token_ids[d]`, row d's finite log-probs and
    ids as Python lists."""

    def __init__(self, log_probs: torch.Tensor, token_ids: torch.Tensor):  # [D, k] float32, [D, k] int64
        self.log_probs = log_probs.tolist()
        self.token_ids = token_ids.tolist()
        # A NaN or +inf logit makes its row's logsumexp, and so its top log-prob, NaN (as does
        # a row with no finite logit, which is allowed): the rows to inspect.
        self.suspect_rows = [d for d, row in enumerate(self.log_probs) if row and row[0] != row[0]]
        for d, row in enumerate(self.log_probs):  # sorted rows: unusable ranks are a suffix (-inf
            n = len(row)  # for a zero-probability token, NaN throughout a row with no finite logit)
            while n and not math.isfinite(row[n - 1]):
                n -= 1
            if n < len(row):
                self.log_probs[d], self.token_ids[d] = row[:n], self.token_ids[d][:n]


def best_first(log_probs, token_ids, depth_limit: int, budget: int) -> DraftTree:
    """The reference's best-first loop. `log_probs[d]` / `token_ids[d]`: row d's usable ranks
    (finite log-probs, sorted descending) as lists; `log_probs` may read a row when a pop first
    needs it (`token_ids[d]` is then looked up after `log_probs[d]`). Plain lists index fastest.

    The reference breaks exact score ties by the smaller rank path; here the pop gathers every
    entry tied at the top score and takes the smallest path (built from the parents only
    then), which is the same order without a rank-path tuple per push.
    """
    parents = [-1]
    node_ranks = [0]  # rank of each placed node (root: unused)
    tokens: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap: list[HeapEntry] = []
    sequence = 0
    first_row = log_probs[0]
    if first_row:
        heap.append(HeapEntry(-first_row[0], sequence, 0, 1, 0, first_row[0]))

    def rank_path(entry: HeapEntry) -> list[int]:
        path = [entry.rank]
        node = entry.parent_index
        while node:
            path.append(node_ranks[node])
            node = parents[node]
        path.reverse()
        return path

    pop, push = heapq.heappop, heapq.heappush
    entry_of = tuple.__new__  # HeapEntry(...) without its Python-level __new__: ~40% of the loop
    while heap and len(tokens) < budget:
        entry = pop(heap)
        if heap and heap[0].neg_logw == entry.neg_logw:  # an exact score tie: the smaller rank path first
            tied = [entry]
            while heap and heap[0].neg_logw == entry.neg_logw:
                tied.append(pop(heap))
            tied.sort(key=rank_path)
            entry = tied[0]
            for other in tied[1:]:
                push(heap, other)
        _, _, parent, depth, rank, logw = entry
        row = log_probs[depth - 1]
        index = len(tokens) + 1
        parents.append(parent)
        node_ranks.append(rank)
        tokens.append(token_ids[depth - 1][rank])
        depths.append(depth)
        scores.append(logw)
        if rank + 1 < len(row):
            sibling = logw - row[rank] + row[rank + 1]
            sequence += 1
            push(heap, entry_of(HeapEntry, (-sibling, sequence, parent, depth, rank + 1, sibling)))
        if depth < depth_limit:
            next_row = log_probs[depth]
            if next_row:
                child = logw + next_row[0]
                sequence += 1
                push(heap, entry_of(HeapEntry, (-child, sequence, index, depth + 1, 0, child)))

    return make_draft_tree(
        parents,
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(depths, dtype=torch.int64),
        torch.tensor(scores, dtype=torch.float64),
    )


def build_heap_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. Every row normalised up front,
    exactly as the reference does it; a row holding NaN or +inf raises `ValueError`."""
    depth_limit, vocab = logits.shape
    if budget == 0 or depth_limit == 0:
        return root_only_tree()
    rows = HeapRows(*top_log_probs(logits, min(budget, vocab)))
    for row in rows.suspect_rows:  # one cheap check instead of a pass: NaN / +inf raise here
        raise_bad_row(row, logits[row])
    return best_first(rows.log_probs, rows.token_ids, depth_limit, budget)
