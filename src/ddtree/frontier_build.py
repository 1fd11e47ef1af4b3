"""The fast exact builders: rows read only as far as the tree needs them.

Why it is exact. The best-first set is the `budget` best rank paths by (score desc, rank path
lex asc). Any `budget` valid paths give a lower bound `floor` on the budget-th best score; a
path scoring below it can never be placed, so a row only needs the ranks whose log-prob can
still lift the best prefix of its depth (the greedy chain) to `floor`.

Two builders share that idea:
- `build_enumerated_tree` (= `build_fast_tree`, BuildMethod.FAST): described at its section
  below. The default fast path.
- `build_frontier_tree`: reads rows with `_Rows` / `_read_rows_and_estimate_floor` (row 0 in
  full, later rows `PROBE_RANKS` at a time) and runs a per-depth tensor frontier: candidate
  scores are the reference's incremental float64 chains (child: logw + lp[0]; next sibling:
  logw - lp[r] + lp[r+1]), computed for a whole frontier by one sequential `cumsum`; the tree
  is the budget best of what is kept, ordered by (score, rank path). Kept as a second exact
  builder that the parity tests hold to the heap.

Both results are checked: every placed node's generator (previous sibling, or parent for
rank 0) must be placed before it. That holds whenever scores never rise along a generator
edge, which is what makes the reference's pop order equal to the sorted order; if float
rounding ever breaks it, a heap loop builds the tree instead.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from typing import NamedTuple

import torch

from ddtree.heap_build import best_first, build_heap_tree
from ddtree.inputs import check_rows_finite, raise_bad_row
from ddtree.row_select import Read, row_source
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree

_NEG_INF = float("-inf")


def _slack(*values: float) -> float:
    """Absolute margin for approximate (non-chain) score comparisons: over-reading is harmless."""
    return 1e-5 * (1.0 + sum(abs(v) for v in values if math.isfinite(v)))


def _normalise_rows(owner: "_Rows | _RowReader", missing: list[int]) -> None:
    """Fill `owner.log_z` for the rows `missing` (ascending, not yet normalised) with one
    logsumexp over the span they cover, widened to >= 2 rows so the float32 sums are bit-equal
    to the reference's full [D, V] call (see `_Rows`). Raises on NaN / +inf rows; lowers `owner.dead_from` at a row with
    no finite logit. Shared by `_Rows` and `_RowReader`."""
    if not missing:
        return
    start, stop = missing[0], missing[-1] + 1
    if stop - start == 1 and owner.depth_limit > 1:
        start, stop = (start, stop + 1) if stop < owner.depth_limit else (start - 1, stop)
    log_z = torch.logsumexp(owner.logits[start:stop].float(), dim=-1)  # [c] float32
    for offset, value in enumerate(log_z.tolist()):
        row = start + offset
        if math.isnan(value) or value == math.inf:
            raise_bad_row(row, owner.logits[row])
        if value == _NEG_INF:
            owner.dead_from = min(owner.dead_from, row)
        owner.log_z.setdefault(row, value)


class _Rows:
    """Rows of [D, V] logits, normalised and top-k'd in chunks, only when the tree reaches them.

    Each chunk is one batched call per op (a row at a time would cost more per row on a CPU).
    The logsumexp is always taken over >= 2 rows (or all of a one-row input): torch reduces a
    lone row with a thread-split sum, but each row of a multi-row call serially, as the
    reference's [D, V] call does, so this keeps log-probs bit-equal to the reference.
    """

    def __init__(self, logits: torch.Tensor, rank_cap: int, budget: int):
        self.logits = logits  # [D, V] any float dtype, any device
        self.depth_limit = logits.shape[0]
        self.rank_cap = rank_cap  # K = min(budget, V)
        self.budget = budget
        self.log_z: dict[int, float] = {}  # row -> float32 logsumexp (as a Python float)
        self.log_probs: dict[int, torch.Tensor] = {}  # row -> [k] float32 host, sorted descending
        self.ids: dict[int, torch.Tensor] = {}  # row -> [k] int64 host
        self.dead_from = self.depth_limit  # first row without a finite logit
        self.complete_above: dict[int, float] = {}  # row -> every usable rank with lp >= it is read

    def _normalise(self, start: int, stop: int) -> None:
        _normalise_rows(self, [d for d in range(start, stop) if d not in self.log_z])

    def fetch(self, start: int, stop: int, floor: float, best: float, probe: int | None = None) -> None:
        """Read rows [start, stop): the ranks any prefix scoring <= `best` needs to reach `floor`,
        at most `probe` of them. `complete_above[d]` records what is known: every usable rank
        with a log-prob >= it has been read (-inf: the whole usable row)."""
        self._normalise(start, stop)
        stop = min(stop, self.dead_from)
        if start >= stop:
            return
        x = self.logits[start:stop].float()  # [c, V]
        log_z = torch.tensor([self.log_z[d] for d in range(start, stop)], dtype=torch.float32)
        caps = [min(self.rank_cap, self.budget - d) for d in range(start, stop)]  # rank r at depth d+1 needs r+d+1 <= budget
        if floor == _NEG_INF:
            counts, cuts = caps, [_NEG_INF] * len(caps)
        else:
            cut = (floor - best) + log_z.double()
            cut -= 1e-5 * (1.0 + cut.abs())  # over-reading a few ranks is harmless
            counts = (x >= cut.to(x.device, torch.float32).unsqueeze(1)).sum(dim=1).tolist()
            cut_lp = (floor - best) - _slack(floor, best)
            cuts = [cut_lp if c < cap else _NEG_INF for c, cap in zip(counts, caps)]
            counts = [min(c, cap) for c, cap in zip(counts, caps)]
        wanted = [min(c, probe) if probe else c for c in counts]
        k = max(wanted)
        if k == 0:
            values = torch.empty(stop - start, 0, dtype=torch.float32)
            ids = torch.empty(stop - start, 0, dtype=torch.int64)
        else:
            values, ids = torch.topk(x, k, dim=-1)
            values, ids = values.to("cpu", torch.float32), ids.to("cpu", torch.int64)
        log_probs = values - log_z.unsqueeze(1)  # [c, k] float32, the reference's own subtraction
        finite = torch.isfinite(log_probs).sum(dim=1).tolist()  # drop zero-probability (-inf) tokens
        for offset, d in enumerate(range(start, stop)):
            n = min(wanted[offset], finite[offset])
            self.log_probs[d] = log_probs[offset, :n]
            self.ids[d] = ids[offset, :n]
            truncated = wanted[offset] < counts[offset] and n == wanted[offset]
            self.complete_above[d] = float(log_probs[offset, n - 1]) if truncated else cuts[offset]
            if n < wanted[offset]:
                self.complete_above[d] = _NEG_INF  # ran out of finite logits: the whole row

    def top(self, d: int, threshold: float, k_cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([k] float32 log-probs, [k] int64 ids): the fetched ranks with log-prob >= threshold."""
        row = self.log_probs[d]
        k = min(row.numel(), k_cap)
        if threshold != _NEG_INF and k:
            k = min(k, int((row >= threshold - _slack(threshold)).sum()))
        return row[:k], self.ids[d][:k]


class _Block(NamedTuple):
    """Candidates of one depth, prefix-major: gids first_gid.. in order; within a prefix the
    ranks are 0, 1, 2, ... so a rank r > 0 candidate's previous sibling is gid - 1."""

    depth: int
    first_gid: int
    parent_gid: torch.Tensor  # [G] int64, -1 = the root
    rank: torch.Tensor  # [G] int64
    token_ids: torch.Tensor  # [G] int64
    scores: torch.Tensor  # [G] float64


def chain_scores(base: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Reference scores of every (prefix, rank) pair, rounding included.

    base: [F] float64 prefix scores; log_probs: [k] float64 (from float32), sorted descending.
    Returns [F, k] float64 with s[:, 0] = base + lp[0], s[:, r] = s[:, r-1] - lp[r-1] + lp[r].
    A CPU cumsum adds strictly left to right, so interleaving (-lp[r-1], +lp[r]) reproduces the
    reference's sequence of float64 roundings.
    """
    k = log_probs.numel()
    first = base + log_probs[0]
    if k == 1:
        return first.unsqueeze(1)
    steps = torch.empty(base.numel(), 2 * k - 1, dtype=torch.float64)
    steps[:, 0] = first
    steps[:, 1::2] = -log_probs[:-1]
    steps[:, 2::2] = log_probs[1:]
    return steps.cumsum_(dim=1)[:, ::2]


def ragged_chain_scores(
    base: torch.Tensor,  # [F] float64 prefix scores, sorted descending
    counts: torch.Tensor,  # [F] int64 ranks wanted per prefix, non-increasing, >= 1
    log_probs: torch.Tensor,  # [k] float64 with k >= counts[0]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chain_scores` for prefix f over ranks 0..counts[f]-1 only, flattened prefix-major.
    Returns ([G] float64 scores, [G] int64 prefix index, [G] int64 rank). Prefixes are grouped
    by the power of two above their count, so the work stays within twice the output size
    instead of F * k."""
    width = log_probs.numel()
    ranks = torch.arange(width)
    prefixes = torch.arange(base.numel())
    if base.numel() * width <= 2 * int(counts.sum()) + 4096:
        spans = [(0, base.numel(), width)]
    else:
        bucket = torch.ceil(torch.log2(counts.double())).long()
        _, sizes = torch.unique_consecutive(bucket, return_counts=True)
        spans, start = [], 0
        for size in sizes.tolist():
            spans.append((start, start + size, min(width, 1 << int(bucket[start]))))
            start += size
    scores, prefix, rank = [], [], []
    for start, stop, w in spans:
        used = ranks[:w] < counts[start:stop].unsqueeze(1)  # [n, w]
        scores.append(chain_scores(base[start:stop], log_probs[:w])[used])
        prefix.append(prefixes[start:stop].unsqueeze(1).expand(-1, w)[used])
        rank.append(ranks[:w].expand(stop - start, -1)[used])
    if len(spans) == 1:
        return scores[0], prefix[0], rank[0]
    return torch.cat(scores), torch.cat(prefix), torch.cat(rank)


def _predicted_reach(best: float, floor: float, depth: int) -> int:
    """How many rows from `depth` on the greedy chain will likely still reach `floor`, assuming
    each further row costs it what the rows so far cost on average (a chunk-size guess only)."""
    per_row = best / (depth - 1)  # <= 0
    if per_row == 0.0:
        return 1 << 30
    return 1 + int((floor - best) / per_row)


def build_fast_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. The exact tree, rows read lazily
    (`build_enumerated_tree`, below)."""
    return build_enumerated_tree(logits, budget)


# Rows after the first are read `PROBE_RANKS` ranks at a time at first: a cheap top-k whose
# tree gives a much better floor; the few rows that then need more are read again exactly.
PROBE_RANKS = 32


class _Pass(NamedTuple):
    blocks: list[_Block]
    total: int  # gids handed out
    pool_gid: torch.Tensor  # [P] int64 candidates scoring >= floor
    pool_score: torch.Tensor  # [P] float64
    floor: float  # the budget-th best score among the candidates (or -inf)
    best_prefix: dict[int, float]  # row -> best prefix score it was read for


def build_frontier_tree(logits: torch.Tensor, budget: int, rows: _Rows | None = None) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 1 and D >= 1."""
    depth_limit, vocab = logits.shape
    if rows is None:
        check_rows_finite(logits)
        rows = _Rows(logits, min(budget, vocab), budget)
    start_floor = _read_rows_and_estimate_floor(rows, budget, depth_limit)
    for _ in range(3):  # rows were read for a valid floor, so the first pass is normally exact
        result = _frontier_pass(rows, budget, depth_limit, start_floor)
        # A probed row is enough when every rank it has not read scores below what it needs.
        stale = [
            d
            for d, best in result.best_prefix.items()
            if rows.complete_above[d] > result.floor - best - _slack(result.floor, best)
        ]
        if not stale:
            return _assemble(logits, budget, result)
        for d in stale:  # read exactly what the (now higher) floor needs
            rows.fetch(d, d + 1, result.floor, result.best_prefix[d])
    return build_heap_tree(logits, budget)


def _read_rows_and_estimate_floor(rows: _Rows, budget: int, depth_limit: int) -> float:
    """Read the rows the tree can reach and return a lower bound on the budget-th best score.

    Row 0 is read in full (K ranks); later rows `PROBE_RANKS` at a time: row 1 first, then,
    if the greedy chain still competes at depth 2, all remaining rows in one batched call.
    The bound is the budget-th best of a family of valid paths (depth-1 ranks and every
    sibling of the greedy chain); rows whose unread ranks could still reach it are re-read.
    """
    rows.fetch(0, 1, _NEG_INF, 0.0)
    if rows.dead_from == 0 or rows.log_probs[0].numel() == 0:
        return _NEG_INF
    family = [rows.log_probs[0].double()]  # scores of the family's paths, per depth
    chain = [0.0, float(rows.log_probs[0][0])]  # chain[d] = greedy path score at depth d
    floor = _NEG_INF
    for stop in (2, depth_limit):
        start = len(chain) - 1  # next row to read
        if start >= min(stop, depth_limit, rows.dead_from) or chain[-1] < floor:
            break
        rows.fetch(start, stop, _NEG_INF, 0.0, probe=PROBE_RANKS)
        for d in range(start, min(stop, rows.dead_from)):
            row = rows.log_probs[d].double()
            if row.numel() == 0:
                break
            family.append(chain[d] + row)
            chain.append(chain[d] + float(row[0]))
        scores = torch.cat(family)
        if scores.numel() >= budget:
            floor = float(torch.topk(scores, budget, sorted=False).values.min())
            floor -= _slack(floor) * 1e-4  # plain sums here, chains in the tree: stay below
    # Rows whose probe ended above the bound may hold more of the best paths: read them 4x
    # wider (one batched top-k) and tighten the bound with what they add, a few times.
    probe = PROBE_RANKS
    while floor != _NEG_INF and probe < rows.rank_cap:
        wide = [d for d in range(1, len(chain) - 1) if rows.complete_above[d] > floor - chain[d]]
        if not wide:
            break
        probe *= 4
        rows.fetch(wide[0], wide[-1] + 1, _NEG_INF, 0.0, probe=probe)
        family = [rows.log_probs[0].double()] + [chain[d] + rows.log_probs[d].double() for d in range(1, len(chain) - 1)]
        floor = float(torch.topk(torch.cat(family), budget, sorted=False).values.min())
        floor -= _slack(floor) * 1e-4
    for d in [d for d in range(1, len(chain)) if d in rows.log_probs]:  # rows the chain reaches
        if floor == _NEG_INF:  # no bound (fewer paths than the budget): read them whole
            if rows.complete_above[d] != _NEG_INF:
                rows.fetch(d, d + 1, _NEG_INF, 0.0)
        elif rows.complete_above[d] > floor - chain[d] - _slack(floor, chain[d]):
            rows.fetch(d, d + 1, floor, chain[d])
    return floor


def _frontier_pass(rows: _Rows, budget: int, depth_limit: int, start_floor: float = _NEG_INF) -> _Pass:
    blocks: list[_Block] = []
    next_gid = 0
    floor = start_floor  # a lower bound on the budget-th best score
    pool_gid = torch.empty(0, dtype=torch.int64)  # [P] candidates scoring >= floor
    pool_score = torch.empty(0, dtype=torch.float64)  # [P]
    frontier_gid = torch.tensor([-1], dtype=torch.int64)  # [F] the root
    frontier_score = torch.zeros(1, dtype=torch.float64)  # [F] sorted descending
    best_prefix: dict[int, float] = {}

    for depth in range(1, depth_limit + 1):
        best = float(frontier_score[0])
        if best < floor:
            break  # log-probs are <= 0: nothing deeper can reach the floor
        if depth - 1 not in rows.log_probs:
            if floor == _NEG_INF:
                rows.fetch(depth - 1, depth, floor, best)
            else:
                span = _predicted_reach(best, floor, depth)
                rows.fetch(depth - 1, min(depth_limit, depth - 1 + span), floor, best, probe=PROBE_RANKS)
        if depth - 1 >= rows.dead_from:
            break  # a row without a finite logit ends every path
        best_prefix[depth - 1] = best
        threshold = floor - best if floor != _NEG_INF else _NEG_INF
        log_probs, token_ids = rows.top(depth - 1, threshold, budget - depth + 1)
        k = log_probs.numel()
        if k == 0:
            break
        lp = log_probs.double()
        if floor == _NEG_INF:
            counts = torch.full_like(frontier_gid, k)
        else:  # ranks each prefix needs: lp[r] >= floor - score (a prefix of the sorted row)
            reach = floor - frontier_score - _slack(floor)
            counts = torch.searchsorted(-lp, -reach, right=True)  # [F] non-increasing
            alive = int((counts > 0).sum())
            if alive == 0:
                break
            frontier_gid, frontier_score, counts = frontier_gid[:alive], frontier_score[:alive], counts[:alive]
        scores, prefix, rank = ragged_chain_scores(frontier_score, counts, lp)  # [G] each, prefix-major
        blocks.append(_Block(depth, next_gid, frontier_gid[prefix], rank, token_ids[rank], scores))
        gids = torch.arange(next_gid, next_gid + scores.numel())
        next_gid += scores.numel()

        keep = scores >= floor
        pool_gid = torch.cat([pool_gid, gids[keep]])
        pool_score = torch.cat([pool_score, scores[keep]])
        if pool_score.numel() >= budget:
            floor = float(torch.topk(pool_score, budget, sorted=False).values.min())
            above = pool_score >= floor
            pool_gid, pool_score = pool_gid[above], pool_score[above]
        frontier = keep & (scores >= floor)
        frontier_score, order = torch.sort(scores[frontier], descending=True, stable=True)
        frontier_gid = gids[frontier][order]
        if frontier_gid.numel() == 0:
            break

    return _Pass(blocks, next_gid, pool_gid, pool_score, floor, best_prefix)


def _assemble(logits: torch.Tensor, budget: int, result: _Pass) -> DraftTree:
    blocks, total, pool_gid, pool_score = result.blocks, result.total, result.pool_gid, result.pool_score
    if pool_gid.numel() == 0:
        return root_only_tree()
    parent = torch.empty(total, dtype=torch.int64)  # [G] gid of the parent, -1 = root
    token = torch.empty(total, dtype=torch.int64)  # [G]
    depth = torch.empty(total, dtype=torch.int64)  # [G]
    rank = torch.empty(total, dtype=torch.int64)  # [G]
    score = torch.empty(total, dtype=torch.float64)  # [G]
    for block in blocks:
        span = slice(block.first_gid, block.first_gid + block.scores.numel())
        parent[span] = block.parent_gid
        token[span] = block.token_ids
        rank[span] = block.rank
        depth[span] = block.depth
        score[span] = block.scores

    order = torch.sort(pool_score, descending=True, stable=True).indices
    window = pool_score[order[: budget + 1]]
    if bool((window[1:] == window[:-1]).any()):
        order = _lex_order(pool_gid, pool_score, parent, rank, depth)
    chosen = pool_gid[order[:budget]]  # [N] gids in pop order
    count = chosen.numel()

    position = torch.full((total,), -1, dtype=torch.int64)  # gid -> pop position
    position[chosen] = torch.arange(count)
    generator = torch.where(rank[chosen] > 0, chosen - 1, parent[chosen])
    generator_position = torch.where(generator >= 0, position[generator.clamp(min=0)], -1)
    placed_before = (generator < 0) | ((generator_position >= 0) & (generator_position < torch.arange(count)))
    if not bool(placed_before.all()):
        return build_heap_tree(logits, budget)  # scores rose along an edge: let the heap decide

    parent_gid = parent[chosen]
    parents = torch.where(parent_gid >= 0, position[parent_gid.clamp(min=0)] + 1, 0)
    return make_draft_tree(
        [-1] + parents.tolist(),
        token[chosen],
        depth[chosen],
        score[chosen],
    )


def _lex_order(
    pool_gid: torch.Tensor,  # [P] int64
    pool_score: torch.Tensor,  # [P] float64
    parent: torch.Tensor,  # [G] int64
    rank: torch.Tensor,  # [G] int64
    depth: torch.Tensor,  # [G] int64
) -> torch.Tensor:
    """Order of the pool by (score desc, rank path lexicographically asc): exact ties only."""
    count = pool_gid.numel()
    max_depth = int(depth[pool_gid].max())
    paths = torch.full((count, max_depth), -1, dtype=torch.int64)  # [P, Dmax]; -1 sorts a prefix first
    rows = torch.arange(count)
    current = pool_gid.clone()
    for _ in range(max_depth):
        live = current >= 0
        if not bool(live.any()):
            break
        node = current[live]
        paths[rows[live], depth[node] - 1] = rank[node]
        current = torch.where(live, parent[current.clamp(min=0)], -1)
    order = torch.arange(count)
    for column in reversed(range(max_depth)):
        order = order[torch.sort(paths[order, column], stable=True).indices]
    return order[torch.sort(pool_score[order], descending=True, stable=True).indices]


# ---------------------------------------------------------------------------------------------
# The enumerating builder: the default fast path (`build_fast_tree`).
#
# 1. Read rows: one batched logsumexp per chunk of rows (rows 0-1, then every further row the
#    greedy chain reaches; all rows at once when the block maxima predict a deep chain), a few
#    ranks per row at first. Large vocabularies read ranks through block maxima
#    (`ddtree.row_select`): only the blocks that can hold them are touched.
# 2. Floor: the budget-th best of a family of valid paths whose scores need no extra reads:
#    "greedy to depth d, rank r at depth d+1, greedy again to depth e" scores
#    chain[e] - lp[d][0] + lp[d][r]. Every row then needs exactly the ranks with
#    lp >= floor - chain[d]; rows whose read ranks stop above that are read down to it.
# 3. Enumerate, in plain Python over float lists, every path scoring >= floor with the
#    reference's own float64 chains (child: logw + lp[0]; sibling: logw - lp[r] + lp[r+1]),
#    sort by (score desc, rank path asc), keep `budget`. The generator check (previous
#    sibling or parent placed before) proves the sorted order is the heap's pop order.
# Anything unexpected (no finite floor, a path that runs past the read ranks, a failed check,
# a floor so loose that the candidates explode) hands the rows as read to the heap loop.
# ---------------------------------------------------------------------------------------------


class _RowReader:
    """Rows of [D, V] logits as Python lists of their top log-probs, read in batched chunks.

    `lp[d]` / `ids[d]`: row d's read ranks (finite log-probs, sorted descending, float32 values
    as Python floats) and token ids; `full[d]`: every usable rank (up to the row's cap) is read.
    Ranks are found through block maxima (`ddtree.row_select`), so a read touches the few
    blocks that hold them, not the whole row; logsumexp always covers >= 2 rows (or a whole
    one-row input), like `_Rows`.
    """

    def __init__(self, logits: torch.Tensor, budget: int):
        self.logits = logits  # [D, V] any float dtype, any device
        depth_limit, vocab = logits.shape
        self.depth_limit = depth_limit
        self.source = row_source(logits)  # rows are checked for NaN / +inf as they are
        # normalised (`_normalise_rows`), the rest by `check_unread_rows`
        # rank r at depth d+1 needs its d ancestors and r elder siblings placed first
        self.cap = [max(0, min(budget, vocab, budget - d)) for d in range(depth_limit)]
        self.log_z: dict[int, float] = {}
        self.lp: dict[int, list[float]] = {}
        self.ids: dict[int, list[int]] = {}
        self.full: dict[int, bool] = {}
        # known_above[d]: every usable rank of row d with a log-prob > it has been read
        self.known_above: dict[int, float] = {}
        self.dead_from = depth_limit  # first row without a finite logit
        self.family_best = _NEG_INF  # `_family_floor`'s last budget-th best score (no margin)

    def _normalise(self, rows: list[int]) -> None:
        _normalise_rows(self, [d for d in rows if d not in self.log_z])

    def check_unread_rows(self) -> None:
        """Raise for NaN / +inf in rows never normalised (a normalised row was checked then)."""
        unread = [d for d in range(self.depth_limit) if d not in self.log_z]
        if unread:
            check_rows_finite(self.logits[unread[0] : unread[-1] + 1], first_row=unread[0])

    def read(self, rows: list[int], k: int, first_row_k: int | None = None) -> None:
        """Read the top min(k, cap) ranks of each of `rows` (ascending); row 0, if among them,
        `first_row_k` ranks when given."""
        self._normalise(rows)
        rows = [d for d in rows if d < self.dead_from]
        wanted = [min(first_row_k if d == 0 and first_row_k else k, self.cap[d]) for d in rows]
        for d in [d for d, w in zip(rows, wanted) if w == 0]:
            self.lp[d], self.ids[d], self.full[d], self.known_above[d] = [], [], True, _NEG_INF
        rows, wanted = [d for d, w in zip(rows, wanted) if w], [w for w in wanted if w]
        if rows:
            self._store(rows, self.source.top(rows, wanted, self._log_z(rows)), wanted, None)

    def read_down_to(self, rows: list[int], needs: list[float]) -> None:
        """Read, for each of `rows` (ascending, already normalised), every rank whose log-prob
        is >= its `needs` entry."""
        margins = [2 * _slack(need) for need in needs]  # over-reading a few ranks is harmless
        cuts = torch.tensor([n - m + self.log_z[d] for d, n, m in zip(rows, needs, margins)], dtype=torch.float64)
        limits = [self.cap[d] for d in rows]
        if not self.source.wide_reads_are_cheap:
            # A loose floor can ask for far more ranks than the tree will use: read at most 4x
            # what the row has, then let the floor rise with what was read.
            limits = [min(limit, 4 * max(len(self.lp[d]), 8)) for d, limit in zip(rows, limits)]
        read, counts = self.source.at_least(rows, cuts.to(torch.float32), limits, self._log_z(rows))
        wanted = [min(count, limit) for count, limit in zip(counts, limits)]
        exact = [w == min(count, self.cap[d]) for d, w, count in zip(rows, wanted, counts)]
        known = [n - m / 2 if e else None for n, m, e in zip(needs, margins, exact)]
        self._store(rows, read, wanted, known)

    def _log_z(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor([self.log_z[d] for d in rows], dtype=torch.float32)  # [c] host

    def _store(self, rows: list[int], read: Read, wanted: list[int], known: list[float | None] | None) -> None:
        """Keep each row's read ranks (at most its `wanted`); `known[i]`: every rank with a
        log-prob >= it is now read (None: unknown)."""
        for i, (d, want) in enumerate(zip(rows, wanted)):
            lp_row = read.log_probs[i]
            n = len(lp_row)
            if n == 0 and known is not None and known[i] is not None and d in self.lp:
                # nothing reaches the need: what was read stands, and nothing above it is unread
                self.known_above[d] = min(self.known_above[d], known[i])
                continue
            self.lp[d], self.ids[d] = lp_row, read.ids[i]
            self.full[d] = n < want or want == self.cap[d]
            if self.full[d]:
                self.known_above[d] = _NEG_INF
            else:  # ranks equal to the last one read may be unread
                exact = known is not None and known[i] is not None
                self.known_above[d] = min(known[i], lp_row[n - 1]) if exact else lp_row[n - 1]


class _HeapView:
    """`best_first`'s `log_probs(d)` / `ids(d)` over a `_RowReader`. With a finite floor the
    rows as read suffice (ranks below the floor are never popped within the budget); without
    one, or for a row not read yet, the row is read whole (up to its cap) on first use."""

    def __init__(self, reader: _RowReader, floor: float):
        self.reader = reader
        self.cut_rows_suffice = floor != _NEG_INF

    def log_probs(self, d: int) -> list[float]:
        reader = self.reader
        if d >= reader.dead_from:
            return []
        if d not in reader.lp or not (reader.full[d] or self.cut_rows_suffice):
            reader.read([d], reader.cap[d])
        return reader.lp[d] if d < reader.dead_from else []

    def ids(self, d: int) -> list[int]:
        return self.reader.ids[d]


# Ranks a block-maxima read takes first at small budgets: such a read costs what it returns, and
# a drafter-like row needs only a few ranks at budgets <= 64 (the floor then reads the rest).
SMALL_BUDGET_BLOCK_PROBE = 4


def _first_reads(budget: int, wide_reads_are_cheap: bool, likely_deep: bool) -> tuple[int, int]:
    """Ranks first read from rows 0-1 and from the deeper rows. Small budgets read whole
    (capped) rows at once, as the reference does (a top-k that small costs about as much as a
    probe), except through block maxima on a likely deep tree: there a read costs what it
    returns and each row needs only a few ranks. Larger budgets probe `PROBE_RANKS`; with
    full-row reads deeper rows are probed wider (a drafter-like row at budget 1024 needs ~100
    ranks) so that one top-k, not two, usually suffices."""
    if budget <= 2 * PROBE_RANKS:
        first = min(budget, SMALL_BUDGET_BLOCK_PROBE) if wide_reads_are_cheap and likely_deep else budget
        return first, first
    if wide_reads_are_cheap:
        return PROBE_RANKS, PROBE_RANKS
    return PROBE_RANKS, PROBE_RANKS * max(1, budget // 256)


def _greedy_chain(reader: _RowReader) -> list[float]:
    """chain[d] = the best depth-d path score (plain float64 sums) over contiguous read rows."""
    chain = [0.0]
    d = 0
    while d in reader.lp and d < reader.dead_from and reader.lp[d]:
        chain.append(chain[-1] + reader.lp[d][0])
        d += 1
    return chain


def _family_floor(reader: _RowReader, chain: list[float], budget: int) -> float:
    """The budget-th best score of the family "greedy, one deviation, greedy", minus a margin
    for float64 chain rounding; -inf when the family has fewer than `budget` paths.

    The family only grows as rows are read wider or deeper, so its budget-th best never falls:
    deviations already below the last one found (`reader.family_best`) are left out."""
    depths = len(chain) - 1
    prune = reader.family_best
    kept = []  # per row: how many of its ranks can still matter (rank 0 is the chain itself)
    for d in range(depths):
        row = reader.lp[d]
        kept.append(bisect_right(row, chain[d] - prune, key=_negated) if prune != _NEG_INF else len(row))
    size = sum((depths - d) * max(0, kept[d] - 1) for d in range(depths)) + depths
    if size < budget:
        return _NEG_INF
    if size <= 512:  # a few hundred floats: plain Python beats a dozen tensor ops
        family = list(chain[1:])
        for d in range(depths):
            row = reader.lp[d]
            for e in range(d + 1, depths + 1):
                shift = chain[e] - row[0]
                family.extend([shift + value for value in row[1 : kept[d]]])
        floor = heapq.nlargest(budget, family)[-1]
    else:
        flat: list[float] = []
        firsts: list[float] = []
        counts: list[int] = []
        for d in range(depths):
            row = reader.lp[d]
            flat.extend(row[1 : kept[d]])
            firsts.append(row[0])
            counts.append(max(0, kept[d] - 1))
        ends = torch.tensor(chain[1:], dtype=torch.float64)  # [E] chain[e] for e = 1..E
        scores = [ends]
        if flat:
            count_t = torch.tensor(counts)
            delta = torch.tensor(flat, dtype=torch.float64) - torch.tensor(firsts, dtype=torch.float64).repeat_interleave(count_t)
            row_of = torch.arange(depths).repeat_interleave(count_t)  # [M] the row each deviation is in
            grid = ends.unsqueeze(1) + delta.unsqueeze(0)  # [E, M] depth e+1 paths deviating at row_of
            scores.append(grid[row_of.unsqueeze(0) <= torch.arange(depths).unsqueeze(1)])
        scores = torch.cat(scores)
        floor = float(torch.kthvalue(scores, scores.numel() - budget + 1).values)  # the budget-th best
    reader.family_best = max(reader.family_best, floor)
    return floor - _slack(floor) * 1e-4


def _negated(value: float) -> float:
    return -value


# A greedy two-token path more likely than this (log-prob) predicts a deep tree. Only the
# chunking of the reads depends on it, never the result.
DEEP_GUESS_LOG_PROB = -2.0


def _probably_deep(reader: _RowReader) -> bool:
    bounds = reader.source.top_log_prob_bounds([0, 1])
    return sum(bounds) >= DEEP_GUESS_LOG_PROB  # NaN (a NaN row) is False: read as usual


def _read_until_complete(reader: _RowReader, budget: int, likely_deep: bool) -> tuple[list[float], float]:
    """Read rows until every path scoring >= floor lies within the read ranks.
    Returns (greedy chain, floor); floor -inf means no bound was found (rows read whole)."""
    depth_limit = reader.depth_limit
    first, deep = _first_reads(budget, reader.source.wide_reads_are_cheap, likely_deep)
    rows = list(range(min(2, depth_limit)))
    if likely_deep and first == deep:
        rows = list(range(depth_limit))  # one batched read instead of two
    # A shallow tree at a large budget takes most of its nodes from row 0: read it to K now
    # when a read costs what it returns, rather than probe it first.
    wide_row_0 = not likely_deep and budget > 2 * PROBE_RANKS and reader.source.wide_reads_are_cheap
    reader.read(rows, first, first_row_k=reader.cap[0] if wide_row_0 else None)
    for _ in range(64):
        chain = _greedy_chain(reader)
        reached = len(chain) - 1  # rows chained so far
        more_rows = reached < min(depth_limit, reader.dead_from) and reached not in reader.lp
        if not more_rows and all(reader.full[d] for d in range(reached)) and budget <= HEAP_LOOP_MAX_BUDGET:
            return chain, _NEG_INF  # every row read whole: the heap loop needs no floor
        floor = _family_floor(reader, chain, budget)
        grow, needs = [], []
        for d in range(reached):
            if reader.full[d] or chain[d + 1] < floor:
                continue
            need = floor - chain[d] - _slack(floor, chain[d])
            if reader.known_above[d] >= need:
                grow.append(d)
                needs.append(need)
        if 0 in grow and reached >= 2 and reader.lp[0][-1] > chain[2]:
            reader.read([0], reader.cap[0])  # depth 1 outscores depth 2: row 0 needs ~budget ranks
            continue
        if more_rows and chain[reached] >= floor:
            reader.read(list(range(reached, depth_limit)), deep)  # a chain this deep usually goes on
            continue
        if not grow:
            return chain, floor
        if floor != _NEG_INF:
            reader.read_down_to(grow, needs)
            continue
        for width in sorted({len(reader.lp[d]) for d in grow}):
            rows = [d for d in grow if len(reader.lp[d]) == width]
            reader.read(rows, width * 4)
    return _greedy_chain(reader), _NEG_INF


# Up to this budget the reference heap loop over the read rows costs less than the floor and
# the enumeration (measured on the benchmark shapes, docs/core.md).
HEAP_LOOP_MAX_BUDGET = 64


def build_enumerated_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. The exact tree (see above)."""
    depth_limit, _ = logits.shape
    if budget == 0 or depth_limit == 0:
        return root_only_tree()
    reader = _RowReader(logits, budget)
    likely_deep = depth_limit > 2 and _probably_deep(reader)
    if budget <= HEAP_LOOP_MAX_BUDGET and likely_deep and not reader.source.wide_reads_are_cheap:
        # Every row will be read to K and popped by the heap loop: that is the reference's own
        # work, so run it without the reader's bookkeeping.
        return build_heap_tree(logits, budget)
    chain, floor = _read_until_complete(reader, budget, likely_deep)
    if floor == _NEG_INF or budget <= HEAP_LOOP_MAX_BUDGET:
        # no bound (a small tree) or few pops: the reference loop over the read rows (rows it
        # needs further are read whole on first use)
        tree = best_first(_HeapView(reader, floor), depth_limit, budget)
    else:
        tree = _depth_one_tree(reader, budget)
        if tree is None:
            tree = _enumerate(reader, len(chain) - 1, budget, floor - _slack(floor))
        if tree is None:  # the reference loop over the rows as read: exact, only slower
            tree = best_first(_HeapView(reader, floor), depth_limit, budget)
    reader.check_unread_rows()  # NaN / +inf anywhere is an error, as in the reference
    return tree


def _depth_one_tree(reader: _RowReader, budget: int) -> DraftTree | None:
    """The tree when it is row 0's first `budget` ranks alone (flat rows), else None.

    The heap pops row 0's ranks in order (each is pushed only when the previous one is
    popped), so it pops exactly those `budget` nodes iff every depth-2 candidate scores
    strictly below each of them (a tie would pop the depth-2 path first: it is
    lexicographically smaller). A child's score is its parent's plus row 1's top log-prob,
    and float rounding is monotone, so the best child is max(scores) + lp[1][0]."""
    row = reader.lp.get(0, [])
    if len(row) < budget:
        return None
    scores = [row[0]]
    score = row[0]
    for rank in range(1, budget):  # the reference's sibling chain
        score = score - row[rank - 1] + row[rank]
        scores.append(score)
    next_row = reader.lp.get(1) if reader.depth_limit > 1 and reader.dead_from > 1 else []
    if next_row is None:
        return None  # row 1 not read: nothing is known about depth 2
    if next_row and not max(scores) + next_row[0] < min(scores):
        return None
    return make_draft_tree(
        [-1] + [0] * budget,
        torch.tensor(reader.ids[0][:budget], dtype=torch.int64),
        torch.ones(budget, dtype=torch.int64),
        torch.tensor(scores, dtype=torch.float64),
    )


# The family floor can sit far below the true one (near-uniform rows deeper than wide): past
# this many candidates per budget node the enumeration gives way to the heap loop.
ENUMERATION_SLACK = 8


def _enumerate(reader: _RowReader, depths: int, budget: int, threshold: float) -> DraftTree | None:
    """Every path scoring >= threshold, then the budget best in pop order; None if the read
    ranks turn out short, the candidates outgrow `ENUMERATION_SLACK * budget` or the sorted
    order is not the heap's."""
    limit = ENUMERATION_SLACK * budget + 1024
    parent: list[int] = []  # candidate -> parent candidate (-1 = root)
    rank: list[int] = []
    depth: list[int] = []
    score: list[float] = []
    token: list[int] = []
    frontier_scores, frontier_ids = [0.0], [-1]  # the previous depth's candidates
    for d in range(depths):
        row, ids, full, known_above = reader.lp[d], reader.ids[d], reader.full[d], reader.known_above[d]
        n = len(row)
        level_start = len(score)
        first, first_id = row[0], ids[0]
        for base, pid in zip(frontier_scores, frontier_ids):
            s = base + first  # the reference's own chain: child, then sibling after sibling
            if s < threshold:
                continue
            if n > 1:
                after = s - first + row[1]
                if after < threshold:  # one child only: the common case on drafter-like rows
                    score.append(s)
                    parent.append(pid)
                    rank.append(0)
                    token.append(first_id)
                    continue
            r = 0
            while s >= threshold:
                score.append(s)
                r += 1
                if r >= n:
                    if not full and known_above >= threshold - base:
                        return None  # an unread rank might still score >= threshold
                    break
                s = s - row[r - 1] + row[r]
            parent.extend([pid] * r)
            rank.extend(range(r))
            token.extend(ids[:r])
            if len(score) > limit:
                return None
        depth.extend([d + 1] * (len(score) - level_start))
        frontier_scores, frontier_ids = score[level_start:], range(level_start, len(score))
        if not frontier_scores:
            break
    count = len(score)
    # stable: ties keep gid order (a tensor sort beats `sorted` from ~100 candidates on)
    order = torch.sort(torch.tensor(score, dtype=torch.float64), descending=True, stable=True).indices.tolist()
    head = [score[i] for i in order[: budget + 1]]
    if len(set(head)) < len(head):  # exact score ties: order them by rank path
        start = 0
        while start < len(head):
            stop = start + 1
            while stop < len(head) and head[stop] == head[start]:
                stop += 1
            if stop - start > 1:  # the whole run of this score, which may continue past the head
                while stop < count and score[order[stop]] == head[start]:
                    stop += 1
                order[start:stop] = sorted(order[start:stop], key=lambda i: _rank_path(i, parent, rank))
            start = stop
    chosen = order[:budget]
    position = [count] * count  # gid -> pop position (count: not chosen)
    for pos, gid in enumerate(chosen):
        position[gid] = pos
    parents = [-1]
    for pos, gid in enumerate(chosen):
        above = parent[gid]
        generator = gid - 1 if rank[gid] else above
        if generator >= 0 and position[generator] >= pos:
            return None  # float rounding let a node outscore its generator: the heap decides
        parents.append(position[above] + 1 if above >= 0 else 0)
    return make_draft_tree(
        parents,
        torch.tensor([token[i] for i in chosen], dtype=torch.int64),
        torch.tensor([depth[i] for i in chosen], dtype=torch.int64),
        torch.tensor([score[i] for i in chosen], dtype=torch.float64),
    )


def _rank_path(gid: int, parent: list[int], rank: list[int]) -> tuple[int, ...]:
    path = []
    while gid >= 0:
        path.append(rank[gid])
        gid = parent[gid]
    return tuple(reversed(path))
