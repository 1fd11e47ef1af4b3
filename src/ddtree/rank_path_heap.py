"""The reference's best-first loop with the rank path in every heap entry: for rows whose
paths tie exactly and often (rows of one shape, e.g. one sampling distribution at every depth).

`heap_build.best_first` keeps its entries small and, on an exact score tie, pops every tied
entry and sorts them by rank path, which is cheapest when ties are rare. Where they are
common that sort runs hundreds of times per build; here each entry carries its rank path as
a tuple, so the heap's own comparison breaks the tie (score first, then the smaller path, the
reference's order) at the cost of one short tuple per push. Same pop order, same scores.
"""
from __future__ import annotations

import heapq

from ddtree.bounded_heap import PopFloor
from ddtree.tree import DraftTree, make_draft_tree

_NEG_INF = float("-inf")


# `rows_share_log_probs` compares this many leading ranks of each row
SHARED_RANKS = 8


def rows_share_log_probs(log_probs: list[list[float]]) -> bool:
    """Whether two of the rows share two exactly equal log-probs among their leading ranks
    (rows of one shape, e.g. one sampling distribution at every depth): paths that take the
    two in swapped order then often tie exactly, and `best_first` sorts every tie by rank path
    (3-4x its usual cost there), which `best_first_by_rank_path` does not. (One shared value,
    e.g. a top log-prob of -6e-8 on every peaked row, makes no such pair.)"""
    rows = [set(row[:SHARED_RANKS]) for row in log_probs]
    return any(len(a & b) >= 2 for i, a in enumerate(rows) for b in rows[i + 1 :])


def best_first_by_rank_path(log_probs, token_ids, depth_limit: int, budget: int, more=None, floor: PopFloor = _NEG_INF) -> DraftTree:
    """As `heap_build.best_first` (`log_probs[d]`: row d's usable ranks, sorted descending, as
    a list; `token_ids[d]` their ids; `more(d)`, when given, extends row d in place when its
    last rank is popped); entries below `floor` are never pushed and a pop's child is pushed
    by the next pop, as in `bounded_heap.bounded_best_first`."""
    parents = [-1]
    tokens: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # entries (-logw, rank path, parent index, depth): paths are unique, so the comparison
    # never reaches the fields after them
    heap: list[tuple[float, tuple[int, ...], int, int]] = []
    first_row = log_probs[0]
    # the last pop's child, pushed by the next pop (as in `bounded_heap`)
    child_entry = (-first_row[0], (0,), 0, 1) if first_row else None
    floor_now = floor if callable(floor) else None
    ceiling = -(floor_now() if floor_now else floor)  # entries are negated scores
    pop, push, pushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
    placed = 0
    while placed < budget:
        if child_entry is not None:
            neg_logw, path, parent, depth = pushpop(heap, child_entry)
        elif heap:
            neg_logw, path, parent, depth = pop(heap)
        else:
            break
        rank = path[-1]
        logw = -neg_logw  # exact: negation only flips the sign
        row = log_probs[depth - 1]
        parents.append(parent)
        tokens.append(token_ids[depth - 1][rank])
        depths.append(depth)
        scores.append(logw)
        placed += 1
        # the next sibling: the same float ops as `best_first`'s
        if rank + 1 == len(row) and more is not None:
            more(depth - 1)  # extends the row in place, if it has more
            if floor_now:
                ceiling = -floor_now()  # `more` may have worked a floor out
        if rank + 1 < len(row):
            sibling = row[rank] - logw - row[rank + 1]
            if sibling <= ceiling:
                push(heap, (sibling, path[:-1] + (rank + 1,), parent, depth))
        child_entry = None
        if depth < depth_limit:
            next_row = log_probs[depth]
            if next_row:
                child = -(logw + next_row[0])
                if child <= ceiling:
                    child_entry = (child, path + (0,), placed, depth + 1)
    return make_draft_tree(parents, tokens, depths, scores)
