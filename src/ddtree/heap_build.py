"""The best-first heap builder: the reference semantics, kept plain as the oracle for tests.

The reference's steps: float32 log-probabilities from a full-row
`logsumexp`, float64 scores accumulated incrementally, ties popped lexicographically smaller
rank path first.

Deliberate difference from the reference: a token whose logit is -inf (zero probability) is
never placed. The reference would place it with a NaN score; here each row only offers its
finite-probability ranks, and a row with no finite logit ends the tree at that depth.
"""
from __future__ import annotations

import heapq
import math

import torch

from ddtree.bounded_heap import bounded_best_first
from ddtree.inputs import raise_bad_row
from ddtree.rank_path_heap import best_first_by_rank_path, rows_share_log_probs
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k log-probabilities exactly as the reference computes them.

    logits: [D, V] any float dtype, any device. Returns host tensors
    ([D, k] float32 log-probs sorted descending, [D, k] int64 token ids).
    """
    x = logits.float()
    return _top_of_normalised(x, k, torch.logsumexp(x, dim=-1, keepdim=True))


def _top_of_normalised(x: torch.Tensor, k: int, log_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [D, V] float32, log_z: [D, 1] its rows' logsumexp -> `top_log_probs`'s result."""
    top_logits, top_ids = torch.topk(x, k=k, dim=-1)
    return (top_logits - log_z).to("cpu", torch.float32), top_ids.to("cpu", torch.int64)


# With lazy rows, rows are first read and converted to Python lists this many ranks deep: a
# decode loop's tree uses few ranks of most rows, and reading and converting every rank
# (D x budget floats and ids) cost more than its heap loop. A row whose last rank is popped
# is read again, whole.
FIRST_RANKS = 16


class TieOrderChanged(Exception):
    """A wider re-read of a row ordered exactly tied logits differently from the first read."""


class HeapRows:
    """Rows for the heap loop: `log_probs[d]` / `token_ids[d]`, row d's finite log-probs and
    ids as Python lists, as read. With `reread`, the rows were read narrower than the tree
    may need, and `more(d)` extends row d in place from `reread(d)` (row d read whole, as
    host lists)."""

    def __init__(self, log_probs: torch.Tensor, token_ids: torch.Tensor, reread=None):  # [D, k] float32, int64
        self._reread = reread
        self.log_probs = log_probs.tolist()
        self.token_ids = token_ids.tolist()
        # _complete[d]: row d holds every usable rank it has (nothing left for `more`)
        self._complete = [reread is None] * len(self.log_probs)
        # A NaN or +inf logit makes its row's logsumexp, and so its top log-prob, NaN (as does
        # a row with no finite logit, which is allowed): the rows to inspect.
        self.suspect_rows = [d for d, row in enumerate(self.log_probs) if row and row[0] != row[0]]
        for d, row in enumerate(self.log_probs):
            if row and not math.isfinite(row[-1]):
                self._trim(d, row, self.token_ids[d])

    def _trim(self, d: int, row: list[float], ids: list[int]) -> None:
        """Sorted rows: unusable ranks are a suffix (-inf for a zero-probability token, NaN
        throughout a row with no finite logit). Cut it; the row then has nothing more."""
        n = len(row)
        while n and not math.isfinite(row[n - 1]):
            n -= 1
        if n < len(row):
            del row[n:], ids[n:]
            self._complete[d] = True

    def more(self, d: int) -> bool:
        """Extend row d to its whole read (in place); False if it had no more. Raises
        `TieOrderChanged` if the wider read does not begin with the ranks already handed out."""
        if self._complete[d]:
            return False
        self._complete[d] = True
        row, ids = self.log_probs[d], self.token_ids[d]
        done = len(row)
        wider_log_probs, wider_ids = self._reread(d)
        if wider_ids[:done] != ids:
            raise TieOrderChanged(d)
        row.extend(wider_log_probs[done:])
        ids.extend(wider_ids[done:])
        self._trim(d, row, ids)
        return len(row) > done


def best_first(log_probs, token_ids, depth_limit: int, budget: int, more=None) -> DraftTree:
    """The reference's best-first loop. `log_probs[d]` / `token_ids[d]`: row d's usable ranks
    (finite log-probs, sorted descending) as lists; `log_probs` may read a row when a pop first
    needs it (`token_ids[d]` is then looked up after `log_probs[d]`). Plain lists index fastest.
    `more(d)`, when given, is asked for further ranks of row d when its last one is popped: it
    extends both lists in place and says whether it added any.

    Heap entries are plain tuples (-logw, parent index, depth, rank): best score first. The
    reference breaks exact score ties by the smaller rank path; here the pop gathers every
    entry tied at the top score and takes the smallest path (built from the parents only
    then), which is the same order without a rank-path tuple per push. So the fields after
    the score only make the heap's comparisons well defined, never the pop order.
    """
    parents = [-1]
    node_ranks = [0]  # rank of each placed node (root: unused)
    tokens: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap: list[tuple[float, int, int, int]] = []
    first_row = log_probs[0]
    if first_row:
        heap.append((-first_row[0], 0, 1, 0))

    def rank_path(entry: tuple[float, int, int, int]) -> list[int]:
        path = [entry[3]]
        node = entry[1]
        while node:
            path.append(node_ranks[node])
            node = parents[node]
        path.reverse()
        return path

    pop, push = heapq.heappop, heapq.heappush
    while heap and len(tokens) < budget:
        entry = pop(heap)
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
        if rank + 1 < len(row) or (more is not None and more(depth - 1)):
            push(heap, (row[rank] - logw - row[rank + 1], parent, depth, rank + 1))
        if depth < depth_limit:
            next_row = log_probs[depth]
            if next_row:
                push(heap, (-(logw + next_row[0]), len(tokens), depth + 1, 0))

    return make_draft_tree(parents, tokens, depths, scores)


def heap_loop_for(log_probs: list[list[float]]):
    """The fast builders' heap loop for these rows: `bounded_heap.bounded_best_first`, or for
    rows of one shape, whose paths tie exactly and often, the rank-path loop, which orders ties
    without a sort per tie (`rank_path_heap.rows_share_log_probs`). Both pop what `best_first`
    pops, in its order, and take a `floor`."""
    return best_first_by_rank_path if rows_share_log_probs(log_probs) else bounded_best_first


def build_heap_tree(logits: torch.Tensor, budget: int, lazy_rows: bool = False) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. Every row normalised up front,
    exactly as the reference does it; a row holding NaN or +inf raises `ValueError`.
    `lazy_rows`: rows are read `FIRST_RANKS` deep and read again whole only when the loop pops
    that far; the same tree wherever exactly tied logits are not reordered by the wider
    read (where they are, the tree is built as without `lazy_rows`). Off, the oracle reads
    them `min(budget, V)` deep, as the reference does."""
    depth_limit, vocab = logits.shape
    if budget == 0 or depth_limit == 0:
        return root_only_tree()
    k = min(budget, vocab)
    if not lazy_rows or k <= FIRST_RANKS:
        return _heap_tree(logits, HeapRows(*top_log_probs(logits, k)), budget)
    x = logits.float()
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)  # the same call as the oracle's: the same bits

    def reread(d: int) -> tuple[list[float], list[int]]:
        log_probs, ids = _top_of_normalised(x[d : d + 1], k, log_z[d : d + 1])
        return log_probs[0].tolist(), ids[0].tolist()

    rows = HeapRows(*_top_of_normalised(x, FIRST_RANKS, log_z), reread)
    # rows of one shape: their paths tie exactly and often, which the rank-path loop orders
    # without a sort per tie (power-law rows at V = 32000: 0.64-0.71x the time at budget 1024,
    # 0.90-0.94x at 256; mixed-depths 0.81x at 1024)
    try:
        return _heap_tree(logits, rows, budget, heap_loop_for(rows.log_probs))
    except TieOrderChanged:
        return build_heap_tree(logits, budget)


def _heap_tree(logits: torch.Tensor, rows: HeapRows, budget: int, loop=best_first) -> DraftTree:
    for row in rows.suspect_rows:  # one cheap check instead of a pass: NaN / +inf raise here
        raise_bad_row(row, logits[row])
    return loop(rows.log_probs, rows.token_ids, logits.shape[0], budget, rows.more)
