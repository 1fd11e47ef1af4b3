"""The per-depth tensor frontier builder: a second exact builder, held to the heap by tests.

Why it is exact. The best-first set is the `budget` best rank paths by (score desc, rank path
lex asc). Any `budget` valid paths give a lower bound `floor` on the budget-th best score; a
path scoring below it can never be placed, so a row only needs the ranks whose log-prob can
still lift the best prefix of its depth (the greedy chain) to `floor`.

`build_frontier_tree` reads rows with `_Rows` / `_read_rows_and_estimate_floor` (row 0 in full,
later rows `PROBE_RANKS` at a time) and runs a per-depth tensor frontier: candidate scores are
the reference's incremental float64 chains (child: logw + lp[0]; next sibling:
logw - lp[r] + lp[r+1]), computed for a whole frontier by one sequential `cumsum`; the tree is
the budget best of what is kept, ordered by (score, rank path). The result is checked: every
placed node's generator (previous sibling, or parent for rank 0) must be placed before it.
That holds whenever scores never rise along a generator edge, which is what makes the
reference's pop order equal to the sorted order; if float rounding ever breaks it, the heap
builds the tree instead. The default fast path is `ddtree.fast_build`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ddtree.heap_build import build_heap_tree
from ddtree.inputs import check_rows_finite
from ddtree.row_select import float_slack, normalise_rows
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree

_NEG_INF = float("-inf")


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
        normalise_rows(self, [d for d in range(start, stop) if d not in self.log_z])

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
            cut_lp = (floor - best) - float_slack(floor, best)
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
            k = min(k, int((row >= threshold - float_slack(threshold)).sum()))
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
            if rows.complete_above[d] > result.floor - best - float_slack(result.floor, best)
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
            floor -= float_slack(floor) * 1e-4  # plain sums here, chains in the tree: stay below
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
        floor -= float_slack(floor) * 1e-4
    for d in [d for d in range(1, len(chain)) if d in rows.log_probs]:  # rows the chain reaches
        if floor == _NEG_INF:  # no bound (fewer paths than the budget): read them whole
            if rows.complete_above[d] != _NEG_INF:
                rows.fetch(d, d + 1, _NEG_INF, 0.0)
        elif rows.complete_above[d] > floor - chain[d] - float_slack(floor, chain[d]):
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
            reach = floor - frontier_score - float_slack(floor)
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
