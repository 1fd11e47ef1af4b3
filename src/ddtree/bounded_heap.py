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
    while len(tokens) < budget:
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
        row = log_probs[depth - 1]
        parents.append(parent)
        node_ranks.append(rank)
        tokens.append(token_ids[depth - 1][rank])
        depths.append(depth)
        scores.append(logw)
        if rank + 1 == len(row) and more is not None:
            more(depth - 1)  # extends the row in place, if it has more
            if floor_now:
                ceiling = -floor_now()  # `more` may have worked a floor out
        if rank + 1 < len(row):
            sibling = row[rank] - logw - row[rank + 1]
            if sibling <= ceiling:
                push(heap, (sibling, parent, depth, rank + 1))
        child_entry = None
        if depth < depth_limit:
            next_row = log_probs[depth]
            if next_row:
                child = -(logw + next_row[0])
                if child <= ceiling:
                    child_entry = (child, len(tokens), depth + 1, 0)

    return make_draft_tree(parents, tokens, depths, scores)
