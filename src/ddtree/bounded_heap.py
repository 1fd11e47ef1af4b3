"""The reference's best-first loop for the fast builders, bounded below by a known floor.

`heap_build.best_first` is the oracle and stays plain. This copy pops the same nodes in the same
order with the same float64 scores (a property test holds it to the oracle), and does less
heap work on the way:
- An entry scoring below `floor` is never pushed. `floor` is a lower bound on the score of the
  budget-th pop that the caller already has (`fast_build`'s floors, float slack taken off), so
  at least `budget` entries outscore such an entry and pop first: it, and anything it would
  generate, never pops within the budget. The heap then holds only what can still pop.
- A pop's child is pushed by the next pop (`heappushpop`): one sift instead of two, and none
  when the child outscores the whole heap, as a greedy step on a confident row does.
- Each row's length and best log-prob are noted when the loop first reads the row, not looked
  up on every pop (rows read once at budget 1024: the loop 0.88x the time, builds 0.96-0.98x).
Measured on the rows of drafter-like trees at budget 1024 (benchmarks/RESULTS.md): the loop
takes 0.73-0.83x the oracle's time with a floor at the last pop (the block-maxima floor sits
0.04-0.1 nats under it on peaked rows), and half on trees of near-certain greedy steps.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from ddtree.tree import DraftTree, make_draft_tree

# A float, or a callable giving the current floor: asked at the start and after each call of
# `more` (a `more` that reads rows down to a floor raises it).
PopFloor = float | Callable[[], float]
_NEG_INF = float("-inf")
_UNREAD = object()  # a row the loop has not read yet


def bounded_best_first(log_probs, token_ids, depth_limit: int, budget: int, more=None, floor: PopFloor = _NEG_INF) -> DraftTree:
    """As `heap_build.best_first` (`log_probs[d]` / `token_ids[d]`: row d's usable ranks, sorted
    descending, and their ids; `more(d)`, when given, extends row d's lists in place when its
    last rank is popped), never pushing an entry that scores below `floor` (see above)."""
    parents = [-1]
    node_ranks = [0]  # rank of each placed node (root: unused)
    tokens: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # entries (-logw, parent index, depth, rank); exact score ties pop by rank path, as the
    # oracle's do
    heap: list[tuple[float, int, int, int]] = []
    first_row = log_probs[0]
    child_entry = (-first_row[0], 0, 1, 0) if first_row else None  # pushed by the next pop

    def rank_path(entry: tuple[float, int, int, int]) -> list[int]:
        path = [entry[3]]
        node = entry[1]
        while node:
            path.append(node_ranks[node])
            node = parents[node]
        path.reverse()
        return path

    floor_now = floor if callable(floor) else None
    ceiling = -(floor_now() if floor_now else floor)  # entries are negated scores
    pop, push, pushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
    # each row's length and best log-prob, noted when the loop first reads the row (a
    # `_HeapView` reads rows on first use) instead of on every pop; `more` grows rows
    lengths = [len(first_row)] + [0] * depth_limit
    tops = [first_row[0] if first_row else None] + [_UNREAD] * depth_limit
    placed = 0
    while placed < budget:
        if child_entry is not None:
            entry = pushpop(heap, child_entry)
        elif heap:
            entry = pop(heap)
        else:
            break
        neg_logw = entry[0]
        if heap and heap[0][0] == neg_logw:  # an exact score tie: the smaller rank path first
            tied = [entry]
            while heap and heap[0][0] == neg_logw:
                tied.append(pop(heap))
            tied.sort(key=rank_path)
            entry = tied[0]
            for other in tied[1:]:
                push(heap, other)
        _, parent, depth, rank = entry
        logw = -neg_logw  # exact: negation only flips the sign
        row_index = depth - 1
        parents.append(parent)
        node_ranks.append(rank)
        tokens.append(token_ids[row_index][rank])
        depths.append(depth)
        scores.append(logw)
        placed += 1
        next_rank = rank + 1
        if next_rank == lengths[row_index] and more is not None:
            lengths[row_index] = len(log_probs[row_index])  # a `more` for another row may have grown it
            if next_rank == lengths[row_index]:
                more(row_index)  # extends the row in place, if it has more
                lengths[row_index] = len(log_probs[row_index])
                if floor_now:
                    ceiling = -floor_now()  # `more` may have worked a floor out
        if next_rank < lengths[row_index]:
            row = log_probs[row_index]
            sibling = row[rank] - logw - row[next_rank]
            if sibling <= ceiling:
                push(heap, (sibling, parent, depth, next_rank))
        child_entry = None
        if depth < depth_limit:
            best = tops[depth]
            if best is _UNREAD:
                next_row = log_probs[depth]
                lengths[depth] = len(next_row)
                best = tops[depth] = next_row[0] if next_row else None
            if best is not None:
                child = -(logw + best)
                if child <= ceiling:
                    child_entry = (child, placed, depth + 1, 0)

    return make_draft_tree(parents, tokens, depths, scores)
