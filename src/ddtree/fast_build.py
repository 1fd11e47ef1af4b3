"""The default fast exact builder (`BuildMethod.FAST`): rows read only as far as the tree
needs them, then the tree enumerated in plain Python.

Why it is exact. The best-first set is the `budget` best rank paths by (score desc, rank path
lex asc). Any `budget` valid paths give a lower bound `floor` on the budget-th best score; a
path scoring below it can never be placed, so a row only needs the ranks whose log-prob can
still lift the best prefix of its depth (the greedy chain) to `floor`.

1. Read rows: one batched logsumexp per chunk of rows (rows 0-1, then every further row the
   greedy chain reaches; all rows at once when the block maxima predict a deep chain), a few
   ranks per row at first. Large vocabularies read ranks through block maxima
   (`ddtree.row_select`): only the blocks that can hold them are touched.
2. Floor: the budget-th best of a family of valid paths whose scores need no extra reads:
   "greedy to depth d, rank r at depth d+1, greedy again to depth e" scores
   chain[e] - lp[d][0] + lp[d][r]. With block maxima at large budgets, the same family
   counted from the maxima (`_block_maxima_floor`: each is an exact token's logit, so they
   count a row's tokens from below) gives a far tighter floor before any deep read. Every
   row then needs exactly the ranks with lp >= floor - chain[d]; rows whose read ranks stop
   above that are read down to it.
3. Estimate the budget-th best score over the read rows (whole levels of plain float64 sums,
   a few tensor ops per depth) and enumerate above it; should fewer than `budget` paths clear
   the estimate, enumerate above the floor instead. Enumerate, in plain Python over float
   lists, every path scoring >= that threshold with the
   reference's own float64 chains (child: logw + lp[0]; sibling: logw - lp[r] + lp[r+1]),
   sort by (score desc, rank path asc), keep `budget`. The generator check (previous
   sibling or parent placed before) proves the sorted order is the heap's pop order.
Anything unexpected (no finite floor, a path that runs past the read ranks, a failed check,
a floor so loose that the candidates explode) hands the rows as read to the heap loop.

Trees that likely reach every row (block reads) skip the floor up front: every row is read 16
ranks deep and the heap loop runs over them, working out the floor and reading down to it
only if it pops past a row's 16th rank (`_lazy_heap_through_blocks`).
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from typing import NamedTuple

import torch

from ddtree.bounded_heap import bounded_best_first
from ddtree.heap_build import TieOrderChanged, build_heap_tree, heap_loop_for
from ddtree.host_tensors import double_tensor, long_tensor
from ddtree.inputs import check_rows_finite, raise_bad_row
from ddtree.op_threads import callers_threads, small_ops_on_one_thread
from ddtree.path_enumeration import enumerate_tree
from ddtree.row_logsumexp import PendingRows, logsumexp_given_max
from ddtree.row_select import (
    BlockMaxima,
    Read,
    float_slack,
    give_the_worker_one_more_row,
    normalise_rows,
    read_of_top_logits,
    row_source,
    settle_rows,
    start_head_rows,
    start_rows_early,
)
from ddtree.tree import DraftTree, make_draft_tree, root_only_tree

_NEG_INF = float("-inf")

# A read down to a floor takes at most this many times the ranks a row already has (measured
# on drafter-like rows at V = 151936, budget 1024: 4x costs more rounds than it saves, 32x
# over-reads); a full-row top-k grows with k, so those reads grow by 4x.
READ_GROWTH = 8
FULL_ROW_READ_GROWTH = 4

# Rows are first read `PROBE_RANKS` ranks at a time: a cheap read whose tree gives a much
# better floor; the few rows that then need more are read again exactly.
PROBE_RANKS = 32


def build_fast_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. The exact tree, rows read lazily
    (`build_enumerated_tree`)."""
    return build_enumerated_tree(logits, budget)


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
        # rows from here on hold no path scoring >= the floor (never read, never needed)
        self.unreachable_from = depth_limit
        self.read_once = False  # rows read by `_read_through_maxima`
        self.family_best = _NEG_INF  # `_family_floor`'s last budget-th best score (no margin)
        # `_block_maxima_floor`'s, or one taken in advance (`_histogram_in_advance`)
        self.maxima_histogram: tuple[tuple[int, float], torch.Tensor] | None = None
        self.top_bounds: tuple[torch.Tensor, list[float]] | None = None  # `_top_log_prob_bounds`'s
        self.pending_rows: PendingRows | None = None  # rows the worker thread is normalising (`normalise_rows`)

    def _normalise(self, rows: list[int], meanwhile=None):
        """Normalise the rows not normalised yet; `meanwhile()`'s result (`normalise_rows`)."""
        return normalise_rows(self, [d for d in rows if d not in self.log_z], meanwhile)

    def check_unread_rows(self) -> None:
        """Raise for NaN / +inf in rows never normalised (a normalised row was checked then)."""
        unread = [d for d in range(self.depth_limit) if d not in self.log_z]
        if not unread:
            return
        if self.top_bounds is not None:
            # a row's largest block maximum is NaN or +inf iff the row holds one (amax
            # propagates NaN): read from the maxima the bounds took, not from them again
            tops = self.top_bounds[0].tolist()  # [D]
            for d in unread:
                if tops[d] != tops[d] or tops[d] == math.inf:
                    raise_bad_row(d, self.logits[d])
            return
        if isinstance(self.source, BlockMaxima) and self.source.has_maxima(unread):
            # a block's maximum is NaN or +inf iff the block holds one (amax propagates NaN)
            maxima = self.source.maxima(unread)  # [u, NB]
            for i in (maxima.isnan() | maxima.isposinf()).any(dim=1).nonzero().flatten().tolist():
                raise_bad_row(unread[i], self.logits[unread[i]])
            return
        with callers_threads():
            check_rows_finite(self.logits[unread[0] : unread[-1] + 1], first_row=unread[0])

    def read(self, rows: list[int], k: int, first_row_k: int | None = None, on_gathered=None) -> None:
        """Read the top min(k, cap) ranks of each of `rows` (ascending); row 0, if among them,
        `first_row_k` ranks when given. `on_gathered(values)`: called with the [c, k] logits a
        block read gathers before the rows' logsumexp (not called where none is gathered)."""
        wanted = [min(first_row_k if d == 0 and first_row_k else k, self.cap[d]) for d in rows]
        asked, asked_ks = [d for d, w in zip(rows, wanted) if w], [w for w in wanted if w]
        gather = None
        if asked and isinstance(self.source, BlockMaxima):
            # the blocks' logits need no logsumexp: gathered beside the pass where it is split

            def gather():
                gathered = self.source.top_logits(asked, asked_ks)
                if gathered is not None and on_gathered is not None:
                    on_gathered(gathered[0])
                return gathered

        gathered = self._normalise(rows, meanwhile=gather)
        for d in [d for d, w in zip(rows, wanted) if w == 0 and d < self.dead_from]:
            self.lp[d], self.ids[d], self.full[d], self.known_above[d] = [], [], True, _NEG_INF
        alive = sum(d < self.dead_from for d in asked)  # dead rows are a suffix of the ascending rows
        rows, wanted = asked[:alive], asked_ks[:alive]
        if not rows:
            return
        if gathered is not None:
            values, ids = gathered
            read = read_of_top_logits(values[:alive], ids[:alive], wanted, self._log_z(rows))
        else:
            read = self.source.top(rows, wanted, self._log_z(rows))
        self._store(rows, read, wanted, None)

    def read_down_to(self, rows: list[int], needs: list[float], tight: bool = False) -> None:
        """Read, for each of `rows` (ascending, already normalised), every rank whose log-prob
        is >= its `needs` entry; `tight`: the needs come from a floor close to the final one,
        so reads are not limited to a few times what a row has."""
        margins = [2 * float_slack(need) for need in needs]  # over-reading a few ranks is harmless
        cuts = torch.tensor([n - m + self.log_z[d] for d, n, m in zip(rows, needs, margins)], dtype=torch.float64)
        # A loose floor can ask for far more ranks than the tree will use (a first floor from
        # 32-rank probes sits 1.5-4 nats low on drafter-like rows at budget 1024, and a row
        # read to 1024 ranks then used 200): read at most `READ_GROWTH` x what the row has,
        # then let the floor rise with what was read.
        growth = READ_GROWTH if self.source.wide_reads_are_cheap else FULL_ROW_READ_GROWTH
        limits = [self.cap[d] if tight else min(self.cap[d], growth * max(len(self.lp[d]), 8)) for d in rows]
        read, counts = self.source.at_least(rows, cuts.to(torch.float32), limits, self._log_z(rows))
        wanted = [min(count, limit) for count, limit in zip(counts, limits)]
        # every rank >= the need is read when the count is below the limit (a count at or
        # above it may be a lower bound, `BlockMaxima.at_least`) or the row is read to its cap
        exact = [count < limit or w == self.cap[d] for d, w, count, limit in zip(rows, wanted, counts, limits)]
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
    """`best_first`'s `log_probs[d]` over a `_RowReader` (its `token_ids` are `reader.ids`).
    With a finite floor the rows as read suffice (ranks below the floor are never popped
    within the budget); without one, or for a row not read yet, the row is read whole (up to
    its cap) on first use."""

    def __init__(self, reader: _RowReader, floor: float):
        self.reader = reader
        self.cut_rows_suffice = floor != _NEG_INF

    def __getitem__(self, d: int) -> list[float]:
        reader = self.reader
        if d >= reader.dead_from or (self.cut_rows_suffice and d >= reader.unreachable_from):
            return []
        if d not in reader.lp or not (reader.full[d] or self.cut_rows_suffice):
            reader.read([d], reader.cap[d])
        return reader.lp[d] if d < reader.dead_from else []


def _first_reads(budget: int, wide_reads_are_cheap: bool) -> tuple[int, int]:
    """Ranks first read from rows 0-1 and from the deeper rows. Small budgets read whole
    (capped) rows at once, as the reference does: a top-k that small costs about what a probe
    does (through block maxima: a few ops on the k best blocks), and a whole row needs no
    floor. Larger budgets probe `PROBE_RANKS`; with full-row reads deeper rows are probed
    wider (a drafter-like row at budget 1024 needs ~100 ranks) so that one top-k, not two,
    usually suffices."""
    if budget <= 2 * PROBE_RANKS:
        return budget, budget
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
        ends = double_tensor(chain[1:])  # [E] chain[e] for e = 1..E
        scores = [ends]
        if flat:
            count_t = long_tensor(counts)
            delta = double_tensor(flat) - double_tensor(firsts).repeat_interleave(count_t)
            row_of = torch.arange(depths).repeat_interleave(count_t)  # [M] the row each deviation is in
            grid = ends.unsqueeze(1) + delta.unsqueeze(0)  # [E, M] depth e+1 paths deviating at row_of
            scores.append(grid[row_of.unsqueeze(0) <= torch.arange(depths).unsqueeze(1)])
        scores = torch.cat(scores)
        floor = float(torch.kthvalue(scores, scores.numel() - budget + 1).values)  # the budget-th best
    reader.family_best = max(reader.family_best, floor)
    return floor - float_slack(floor) * 1e-4


def _negated(value: float) -> float:
    return -value


# `_block_maxima_floor` looks for the floor on a grid of this many steps from the chain's best
# node down to `BLOCK_FLOOR_SPAN` nats below its deepest one. It costs ~0.25 ms and pays for
# itself from this budget on, where a loose floor reads hundreds of ranks too many (measured
# on drafter-like rows at V = 151936 when it was first added: 11 % faster at 1024, even at
# 512, 10 % slower at 256).
BLOCK_FLOOR_STEPS = 512
BLOCK_FLOOR_SPAN = 24.0
BLOCK_FLOOR_MIN_BUDGET = 512
# A likely deep tree on that path probes rows this many ranks deep, not `PROBE_RANKS`: the
# maxima floor sets the reads (measured at budget 1024: 5 % faster at V = 151936, 12 % at
# 32000; 1 rank was 14 % slower, as every row then had to be read again)
BLOCK_FLOOR_PROBE_RANKS = 4


def _block_maxima_floor(reader: _RowReader, chain: list[float], budget: int, grid: tuple[int, float] | None = None) -> float:
    """A floor from the block maxima alone, far tighter than `_family_floor` before rows are
    read deep (whose family only holds the ranks read so far); -inf when it finds none.

    Each block's maximum is one token's exact logit, so row d holds at least as many tokens
    within r nats of its best as it has blocks whose maximum is. The path "greedy to depth d,
    such a token at d+1, greedy to depth e" scores chain[e] - r, so the family of those paths
    has at least sum over d < e of (blocks of row d within chain[e] - F nats of its best, less
    the best itself) members scoring >= F, plus the chain's own nodes. The largest F on a grid
    where that count reaches `budget` is a floor; blocks are counted conservatively (binned
    down, with a margin for float rounding), so it can only come out lower.

    `grid`: (steps, step) to search on instead, F_j = chain[1] - j * step; the histogram of a
    grid is kept on the reader for the next call on it (over the rows of that first call)."""
    depths = len(chain) - 1
    if depths == 0 or not isinstance(reader.source, BlockMaxima):
        return _NEG_INF
    top = chain[1]
    if grid is None:
        steps = BLOCK_FLOOR_STEPS
        step = (top - (chain[depths] - BLOCK_FLOOR_SPAN)) / steps  # candidate floors F_j = top - j * step
    else:
        steps, step = grid
    lowest = top - steps * step
    kept = reader.maxima_histogram
    below = kept[1] if grid is not None and kept is not None and kept[0] == grid else None
    if below is None or below.shape[0] < depths:
        below = _maxima_histogram(reader.source.maxima(list(range(depths))), steps, step)
        if grid is not None:
            reader.maxima_histogram = (grid, below)
    rows = _host_rows(below)
    # a token r nats below row d's best places its path to depth e iff r <= chain[e] - F_j,
    # i.e. (less a margin for float rounding, rounded down: it can only count fewer) iff it
    # lies less than j + shift[e] steps below
    margin = 2 * float_slack(top, lowest)
    shift = [math.floor((chain[e] - top - margin) / step) for e in range(1, depths + 1)]

    def paths_at_least(j: int) -> int:
        floor_j = top - j * step
        count = 0
        for e in range(1, depths + 1):
            k = j + shift[e - 1]
            if k >= 1:  # the greedy tokens are in bin 0 of every row: one per row less
                count += rows[e - 1][min(k - 1, steps)] - e
            count += chain[e] >= floor_j  # the chain's own node at depth e
        return count

    if paths_at_least(steps) < budget:
        return _NEG_INF
    lo, hi = 0, steps  # the smallest j whose count reaches the budget (counts grow with j)
    while lo < hi:
        mid = (lo + hi) // 2
        if paths_at_least(mid) >= budget:
            hi = mid
        else:
            lo = mid + 1
    floor = top - lo * step
    return floor - float_slack(floor)


def _host_rows(table: torch.Tensor):
    """A host int64 table for element reads from Python: a numpy view (no copy; a full
    `tolist()` of the [15, 769] histogram cost more than the search that reads ~150 of it),
    or lists where torch runs without numpy."""
    try:
        return table.numpy()
    except RuntimeError:  # torch installed without numpy
        return table.tolist()


def _maxima_histogram(maxima: torch.Tensor, steps: int, step: float) -> torch.Tensor:
    """[E, steps + 1] int64 on the host: below[d, k] counts the blocks of rows 0..d whose
    maximum lies less than k + 1 steps below their row's best (one bincount over every row,
    then running sums over bins and over rows). maxima: [E, NB] float32."""
    rows = maxima.shape[0]
    distance = maxima.amax(dim=1, keepdim=True) - maxima  # [E, NB] >= 0 (+inf: -inf blocks)
    bins = distance.mul_(1 / step).clamp_(max=steps).long()  # floor: values are >= 0
    bins += torch.arange(rows, device=bins.device).unsqueeze(1) * (steps + 1)  # row d's bins after row d-1's
    within = torch.bincount(bins.flatten(), minlength=rows * (steps + 1)).view(rows, steps + 1)
    return within.cumsum_(1).cumsum_(0).cpu()


# A greedy two-token path more likely than this (log-prob) predicts a deep tree. Only the
# chunking of the reads depends on it, never the result.
DEEP_GUESS_LOG_PROB = -2.0
# A greedy two-token path more likely than this reads rows once through the block maxima
# (`_read_through_maxima`, as `_reads_through` decides) though the tree is not likely deep:
# probing row by row cost more there (dflash-tiny at 1024, estimate -2.5, a tree 7-8 deep:
# 0.66-0.81x the time; at 512 within the noise). At -5, rows of two or three levels (few-peaks,
# peaked@T2, estimates -3.8) took 1.06-1.3x the time.
READ_THROUGH_GUESS_LOG_PROB = -3.0
# Below BLOCK_FLOOR_MIN_BUDGET (down to READ_THROUGH_MIN_BUDGET) rows are read once through
# the block maxima too, unless the greedy chain through every row is bounded above
# EVERY_ROW_GUESS_LOG_PROB: a tree that likely reaches every row gains nothing from
# normalising fewer rows and pays the floors (budgets 16-64: 1.1-1.2x the time on such rows
# read through), while one that stops short skips the last rows' logsumexp (budgets 16-256:
# 0.6-0.9x the time on trees 5-12 deep; the bounds cost the other rows ~0.15 ms). Measured
# bound sums: -5.1 to 0 on rows whose trees reach all 15 rows at 128-256, -6.7 and below on
# the others.
READ_THROUGH_MIN_BUDGET = 16
EVERY_ROW_GUESS_LOG_PROB = -6.0


class DepthGuess(NamedTuple):
    """Guesses from rows 0-1 before any read (only the chunking of reads depends on them)."""

    may_be_deep: bool  # the greedy two-token path may beat DEEP_GUESS_LOG_PROB (an upper bound says so)
    likely_deep: bool  # ...and a best estimate says it does
    estimate: float = -math.inf  # that estimate (the path's log-prob; NaN for a NaN row)

    @property
    def reads_through(self) -> bool:
        """The estimate beats READ_THROUGH_GUESS_LOG_PROB (see there)."""
        return self.estimate >= READ_THROUGH_GUESS_LOG_PROB


def _guess_depth(reader: _RowReader) -> DepthGuess:
    bounds, estimates = reader.source.top_log_prob_guesses([0, 1])
    # NaN (a NaN row) compares False: read as usual, the read reports it
    return DepthGuess(sum(bounds) >= DEEP_GUESS_LOG_PROB, sum(estimates) >= DEEP_GUESS_LOG_PROB, sum(estimates))


def _rows_the_chain_may_reach(chain: list[float], floor: float) -> int:
    """How many more rows the greedy chain will likely still reach `floor` in, if each costs
    it what the rows so far cost on average (a chunking guess: a row it then needs after all
    is read in a later round)."""
    reached = len(chain) - 1
    per_row = chain[-1] / reached  # <= 0
    if floor == _NEG_INF or per_row == 0.0:
        return 1 << 30
    return 1 + int((floor - chain[-1]) / per_row)


def _read_through_maxima(reader: _RowReader, budget: int) -> tuple[list[float], float] | None:
    """Rows read once, each down to what the tree can use, from the block maxima alone; None
    when the maxima give no floor (the caller then probes as usual).

    1. The block maxima of every row (one `amax` pass). Each row's best logit is its largest
       block maximum, so the greedy chain needs no read: lp[d][0] is that logit minus the
       row's logsumexp, the same float32 subtraction as a read's.
    2. Only the rows the tree can reach get their logsumexp (the one full-row pass that
       costs): the maxima's own logsumexp is at most the row's, so max - logsumexp(maxima)
       bounds lp[d][0] from above, and a row whose best path cannot reach the
       block-maxima floor even so is never needed. Rows are normalised in a few batched
       calls: first those a guess (the bounds as the chain) reaches, then any the exact chain
       still may.
    3. Every reached row read once, down to floor - chain[d]: exactly the ranks the tree can
       use (no probe, no second read)."""
    depth_limit = reader.depth_limit
    tops, bounds = _top_log_prob_bounds(reader)

    def reach(chain: list[float], floor: float) -> int:
        """Rows [0, n) may hold a path >= floor, the chain exact over its rows and bounded past them."""
        best, n = chain[-1], len(chain) - 1
        while n < depth_limit:
            best += bounds[n]
            if best < floor - float_slack(floor, best):
                break
            n += 1
        return n

    guess = _chain_of_bounds(reader)
    grid = _grid_of_bounds(guess)
    guessed_floor = _block_maxima_floor(reader, guess, budget, grid)
    stop = max(min(2, depth_limit), reach([0.0], guessed_floor) if guessed_floor != _NEG_INF else depth_limit)
    for _ in range(depth_limit + 1):
        reader._normalise(list(range(stop)))
        alive = min(stop, reader.dead_from)
        log_z = reader._log_z(list(range(alive)))
        firsts = (tops[:alive].cpu() - log_z).tolist()  # [alive] lp[d][0], as a read gives it (on the host)
        chain = [0.0]
        for first in firsts:
            chain.append(chain[-1] + first)
        floor = _block_maxima_floor(reader, chain, budget, grid)
        if floor == _NEG_INF:
            return None
        more = reach(chain, floor) if alive == stop else alive
        if more <= stop:
            break
        stop = more
    rows = [d for d in range(alive) if chain[d + 1] >= floor - float_slack(floor, chain[d + 1])]
    reader.unreachable_from = len(rows)  # the chain is the best path of each depth
    reader.read_once = True
    reader.read([d for d in rows if not reader.cap[d]], 0)  # no rank usable: read as empty
    rows = [d for d in rows if reader.cap[d]]
    if rows:
        needs = [floor - chain[d] - float_slack(floor, chain[d]) for d in rows]
        reader.read_down_to(rows, needs, tight=True)
    return _greedy_chain(reader), floor


def _grid_of_bounds(guess: list[float]) -> tuple[int, float] | None:
    """One grid for every block-maxima floor of a build, so the maxima's histogram is taken
    once: the span of `guess`, the chain as the bounds give it (it falls more slowly than the
    exact one), widened by half."""
    if len(guess) < 2:
        return None
    return BLOCK_FLOOR_STEPS * 3 // 2, (guess[1] - guess[-1] + BLOCK_FLOOR_SPAN) / BLOCK_FLOOR_STEPS


def _chain_of_bounds(reader: _RowReader) -> list[float]:
    """The greedy chain as the rows' top log-prob bounds give it, up to a row they say nothing of."""
    guess = [0.0]
    for bound in _top_log_prob_bounds(reader)[1]:
        if bound == math.inf:
            break
        guess.append(guess[-1] + min(bound, 0.0))
    return guess


def _top_log_prob_bounds(reader: _RowReader) -> tuple[torch.Tensor, list[float]]:
    """(tops [D], bounds): each row's largest logit and an upper bound on its top log-prob,
    from the block maxima of every row (taken here if not yet), worked out once per reader.
    The maxima are some of a row's logits, so their logsumexp is at most the row's. NaN (a NaN
    row, or a row with no finite logit) gives no bound (+inf); such a row is normalised,
    which raises or marks it dead."""
    if reader.top_bounds is None:
        maxima = reader.source.maxima(list(range(reader.depth_limit)))  # [D, NB] float32 (a view)
        tops = maxima.amax(dim=1)  # [D]
        log_z_lower = logsumexp_given_max(maxima, tops)  # [D] torch.logsumexp's value, without its own max pass
        bounds = [b if b == b else math.inf for b in (tops - log_z_lower).tolist()]
        reader.top_bounds = (tops, bounds)
    return reader.top_bounds


def _reads_through(reader: _RowReader, budget: int, guess: DepthGuess) -> bool:
    """Whether rows are read once through the block maxima (`_read_through_maxima`): for a
    tree guessed deep (or of middling depth, `guess.reads_through`) from budget
    BLOCK_FLOOR_MIN_BUDGET on; from READ_THROUGH_MIN_BUDGET on only when the greedy chain
    through every row is bounded below EVERY_ROW_GUESS_LOG_PROB, i.e. when the tree likely
    stops short of the last rows, which are then never normalised."""
    if not (guess.likely_deep or guess.reads_through) or not isinstance(reader.source, BlockMaxima):
        return False
    if budget >= BLOCK_FLOOR_MIN_BUDGET:
        return True
    if budget < READ_THROUGH_MIN_BUDGET:
        return False
    return _chain_bound_through_every_row(reader) < EVERY_ROW_GUESS_LOG_PROB


def _chain_bound_through_every_row(reader: _RowReader) -> float:
    """An upper bound on the greedy chain's score through every row (rows without a bound add 0)."""
    return sum(min(bound, 0.0) for bound in _top_log_prob_bounds(reader)[1])


# Rows through block maxima whose tree likely reaches every row (see `_reaches_every_row`) go
# to the reference's heap loop over rows read `LAZY_FIRST_RANKS` deep
# (`_lazy_heap_through_blocks`): such trees use few ranks of most rows (2-16 on the benchmark's
# trees 15 deep at budget 1024, a hundred or two on two or three rows of `peaked`), so one
# batched read of 16 ranks, and a floor only when the loop pops past one, cost less than the
# floors and reads down to them up front.
LAZY_FIRST_RANKS = 16
LAZY_READ_GROWTH = 16
# ...when the greedy chain through every row is bounded at this or above: -6.7 to 0 on the
# benchmark's families whose trees are 14-15 deep at budget 1024. Power-2.0 (-7.5, 13-14 deep)
# gained nothing from it (1.0-1.15x the time at 16-1024: its trees at small budgets stop short
# of the last rows, which the lazy heap normalises all the same), the others sit at -13.7 and
# below.
LAZY_HEAP_CHAIN_LOG_PROB = -7.0


def _reaches_every_row(reader: _RowReader, budget: int, guess: DepthGuess) -> bool:
    """Block reads, from READ_THROUGH_MIN_BUDGET on, of a tree guessed likely deep whose greedy
    chain through every row is bounded at LAZY_HEAP_CHAIN_LOG_PROB or above."""
    if not (guess.likely_deep and isinstance(reader.source, BlockMaxima)) or budget < READ_THROUGH_MIN_BUDGET:
        return False
    return _chain_bound_through_every_row(reader) >= LAZY_HEAP_CHAIN_LOG_PROB


def _lazy_heap_through_blocks(reader: _RowReader, budget: int) -> DraftTree | None:
    """The reference's heap loop over every row normalised at once and read LAZY_FIRST_RANKS
    deep through the block maxima; None if a wider read ordered exactly tied logits
    differently from the narrower one (the caller then builds the tree another way).

    The first time the loop pops past a row's read ranks (before any pop, where the first
    reads have a flat tail: `_has_a_flat_tail`), the block-maxima floor is worked out from the
    exact greedy chain and every row read down to it in one batched read, as
    `_read_through_maxima` does: then the rows hold every rank the tree can use. (Re-reading
    only the row popped past, a few times wider, cost ~0.3 ms a row: more than the floor.)
    The loop stops there and the tree is enumerated above the floor (`path_enumeration`),
    which costs about half the pops still to come (peaked rows at 1024, the floor 0.1 nats
    under the last score: 0.94x the build's time); where a greedy step's log-prob is exactly
    0.0, every node ties with its greedy child and the loop, which sorts only the ties it
    meets, goes on over the complete rows instead. Without a floor the row is read
    LAZY_READ_GROWTH x wider, up to its cap."""
    depth_limit = reader.depth_limit
    grid = None  # the grid of a histogram taken in advance (`_histogram_in_advance`)

    def histogram_if_flat(values: torch.Tensor) -> None:
        # after the first reads' gathering, before this thread's own rows' logsumexp
        nonlocal grid
        if budget >= BLOCK_FLOOR_MIN_BUDGET and _has_a_flat_tail(values):
            # this thread takes the histogram before its own rows: the worker, one more of them
            # (peaked rows at 512-1024, on and at T = 0.5: 0.96-0.97x the time)
            give_the_worker_one_more_row(reader)
            grid = _histogram_in_advance(reader)

    reader.read(list(range(depth_limit)), LAZY_FIRST_RANKS, on_gathered=histogram_if_flat)  # raises for NaN / +inf rows
    alive = min(depth_limit, reader.dead_from)
    rows = [reader.lp[d] if d < alive else [] for d in range(depth_limit)]
    ids = [reader.ids[d] if d < alive else [] for d in range(depth_limit)]
    complete = [d >= alive or reader.full[d] for d in range(depth_limit)]
    floor_tried = False
    pop_floor = _NEG_INF  # the loop's `floor`, once `read_to_floor` has one

    def extend(d: int) -> None:
        """Row d as the reader now holds it, appended in place (the loop holds the lists)."""
        done = len(rows[d])
        if reader.ids[d][:done] != ids[d][:done]:
            raise TieOrderChanged(d)
        rows[d].extend(reader.lp[d][done:])
        ids[d].extend(reader.ids[d][done:])

    def read_to_floor() -> bool:
        # over the rows read so far (none re-read yet), up to the first empty one: a row
        # whose cap is 0 (d >= budget) ends every path
        nonlocal pop_floor
        chain = _greedy_chain(reader)
        floor = _block_maxima_floor(reader, chain, budget, grid) if grid is not None else _NEG_INF
        if floor == _NEG_INF:
            floor = _block_maxima_floor(reader, chain, budget)
        if floor == _NEG_INF:
            return False
        pop_floor = _pop_floor(floor)
        grow, needs = [], []
        for d in range(len(chain) - 1):
            need = floor - chain[d] - float_slack(floor, chain[d])
            if not complete[d] and chain[d + 1] >= floor - float_slack(floor, chain[d + 1]) and reader.known_above[d] >= need:
                grow.append(d)
                needs.append(need)
        if grow:
            reader.read_down_to(grow, needs, tight=True)
            for d in grow:
                extend(d)
        complete[:] = [True] * depth_limit  # no path through an unread rank reaches the floor
        return True

    def more(d: int) -> bool:
        """Extend row d in place; whether it gained ranks."""
        nonlocal floor_tried
        if complete[d]:
            return False
        done = len(rows[d])
        if not floor_tried:
            floor_tried = True
            if read_to_floor():
                raise _RowsComplete
        want = min(reader.cap[d], done * LAZY_READ_GROWTH)
        reader.read([d], want)
        extend(d)
        complete[d] = reader.full[d]
        return len(rows[d]) > done

    try:
        if grid is not None:
            # flat tails (the histogram is taken): the loop would soon pop past a row's first
            # reads and drop its pops (peaked rows at 512-1024: ~0.3 ms of them), so the floor
            # comes first (builds 0.95-0.98x the time on two threads, 0.97-0.99x on one)
            floor_tried = True
            if read_to_floor():
                raise _RowsComplete
        return heap_loop_for(rows)(rows, ids, depth_limit, budget, more, lambda: pop_floor)
    except TieOrderChanged:
        return None
    except _RowsComplete:
        pass
    tree = None
    if all(row[0] != 0.0 for row in rows if row):
        tree = _enumerate(reader, len(_greedy_chain(reader)) - 1, budget, pop_floor)
    if tree is None:
        tree = heap_loop_for(rows)(rows, ids, depth_limit, budget, floor=pop_floor)
    return tree


# The lazy heap takes the histogram in advance only where some row's 2nd and 16th read logits
# lie within this many nats: siblings that fall that slowly make the loop pop past the first
# reads (peaked rows: ~1 nat, at T = 0.5 ~2). Taken for every tree, it cost the sharp power
# laws, whose trees fit in the first reads (2.14 x their exponent, >= 3.2 nats), 1.05-1.08x the
# time. Such trees also take their floor before any pop (the sharp power laws, floor first:
# 1.19-1.63x the time).
FLAT_TAIL_NATS = 2.5


def _has_a_flat_tail(values: torch.Tensor) -> bool:
    """Whether some row of [c, k] read logits (sorted descending) has its 2nd and last within
    FLAT_TAIL_NATS."""
    if values.shape[1] < 2:
        return False
    return bool(((values[:, 1] - values[:, -1]) < FLAT_TAIL_NATS).any())


def _histogram_in_advance(reader: _RowReader) -> tuple[int, float] | None:
    """Take the block maxima's histogram (`_block_maxima_floor`'s) now, on the grid the bounds
    give, and keep it on the reader for the floor; its grid (None: no grid, nothing taken).

    Why now: the first reads' gathering is done and this thread's own rows' logsumexp comes
    next, while the worker has 10 of 15 rows, one more once the tail is found flat; queued
    behind that share on the worker instead (peaked rows at 512-1024), the histogram delayed
    the floor: builds took 1.03-1.04x the time (OMP_WAIT_POLICY=PASSIVE; with 9 worker rows
    and spinning OpenMP threads the worker had been 0.94x the time)."""
    guess = _chain_of_bounds(reader)
    grid = _grid_of_bounds(guess)
    if grid is None:
        return None
    maxima = reader.source.maxima(list(range(len(guess) - 1)))  # taken already, for the bounds
    reader.maxima_histogram = (grid, _maxima_histogram(maxima, *grid))
    return grid


class _RowsComplete(Exception):
    """`_lazy_heap_through_blocks`: every row holds every rank the tree can use; the loop's pops
    so far are dropped."""


def _read_until_complete(reader: _RowReader, budget: int, guess: DepthGuess) -> tuple[list[float], float]:
    """Read rows until every path scoring >= floor lies within the read ranks.
    Returns (greedy chain, floor); floor -inf means no bound was found (rows read whole)."""
    depth_limit = reader.depth_limit
    likely_deep = guess.likely_deep
    first, deep = _first_reads(budget, reader.source.wide_reads_are_cheap)
    if _reads_through(reader, budget, guess):
        read = _read_through_maxima(reader, budget)
        if read is not None:
            return read
        # the block-maxima floor, not a probe's family, will set how far rows are read
        first = deep = BLOCK_FLOOR_PROBE_RANKS
    rows = list(range(min(2, depth_limit)))
    if likely_deep and first == deep:
        rows = list(range(depth_limit))  # one batched read instead of two
    # A shallow tree at a large budget takes most of its nodes from row 0: read it to K now
    # when a read costs what it returns, rather than probe it first.
    wide_row_0 = not likely_deep and budget > 2 * PROBE_RANKS and reader.source.wide_reads_are_cheap
    reader.read(rows, first, first_row_k=reader.cap[0] if wide_row_0 else None)
    maxima_floors: dict[int, float] = {}  # `_block_maxima_floor` by chain length, each worked out once

    def maxima_floor_of(chain: list[float]) -> float:
        if len(chain) not in maxima_floors:
            maxima_floors[len(chain)] = _block_maxima_floor(reader, chain, budget)
        return maxima_floors[len(chain)]

    family_floor = _NEG_INF
    for _ in range(64):
        chain = _greedy_chain(reader)
        reached = len(chain) - 1  # rows chained so far
        more_rows = reached < min(depth_limit, reader.dead_from) and reached not in reader.lp
        if not more_rows and all(reader.full[d] for d in range(reached)) and budget <= HEAP_LOOP_MAX_BUDGET:
            return chain, _NEG_INF  # every row read whole: the heap loop needs no floor
        if budget >= BLOCK_FLOOR_MIN_BUDGET:
            # at a large budget the maxima floor first (block reads; -inf otherwise): rows will
            # be read further, and the family's floor as well cost more than it saved (every
            # tree, not only deep ones: power-1.0 at 512-1024 0.89-0.95x the time, the others
            # within the noise)
            maxima_floor_of(chain)
        maxima_floor = maxima_floors.get(len(chain), _NEG_INF)
        if maxima_floor != _NEG_INF:
            # the maxima floor is known for this chain: the family's, over the ranks read so
            # far, would rise little above it and cost more than that saves (measured)
            floor = max(maxima_floor, family_floor)
        else:
            family_floor = floor = _family_floor(reader, chain, budget)
        grow, needs = _rows_to_grow(reader, chain, floor)
        if grow and budget >= BLOCK_FLOOR_MIN_BUDGET and floor != _NEG_INF:
            # rows would be read further: a tighter floor first (both are floors, so the higher
            # one is); it saves reading ranks the tree never uses
            maxima_floor = maxima_floor_of(chain)
            if maxima_floor > floor:
                floor = maxima_floor
                grow, needs = _rows_to_grow(reader, chain, floor)
        if 0 in grow and reached >= 2 and reader.lp[0][-1] > chain[2]:
            reader.read([0], reader.cap[0])  # depth 1 outscores depth 2: row 0 needs ~budget ranks
            continue
        if floor == _NEG_INF and not likely_deep and not reader.full.get(0, True) and budget > 2 * PROBE_RANKS:
            # too few paths for a floor yet: row 0 holds the most candidates of any row, and
            # with it read to K the family has `budget` paths, so the next rows are read to a floor
            reader.read([0], reader.cap[0])
            continue
        if more_rows and chain[reached] >= floor:
            stop = min(depth_limit, reached + _rows_the_chain_may_reach(chain, floor))
            reader.read(list(range(reached, stop)), deep)  # one batched read for them all
            continue
        if not grow:
            return chain, floor
        if floor != _NEG_INF:
            reader.read_down_to(grow, needs, tight=floor == maxima_floor)
            continue
        for width in sorted({len(reader.lp[d]) for d in grow}):
            rows = [d for d in grow if len(reader.lp[d]) == width]
            reader.read(rows, width * 4)
    return _greedy_chain(reader), _NEG_INF


def _rows_to_grow(reader: _RowReader, chain: list[float], floor: float) -> tuple[list[int], list[float]]:
    """The chained rows that may hold unread ranks scoring >= floor, and the log-prob each
    must be read down to."""
    grow, needs = [], []
    for d in range(len(chain) - 1):
        if reader.full[d] or chain[d + 1] < floor:
            continue
        need = floor - chain[d] - float_slack(floor, chain[d])
        if reader.known_above[d] >= need:
            grow.append(d)
            needs.append(need)
    return grow, needs


# Below `row_select.BLOCK_MIN_VOCAB` rows are read by full-row top-k, except for a likely deep
# tree at a large budget: there the block-maxima floor saves more than the block machinery
# costs (drafter-like rows, V = 32000, twelve requests: 8 % faster at budget 1024, even at
# 768; V = 16384: 2-13 % slower at 768-1024).
DEEP_BLOCK_MIN_BUDGET = 1024
DEEP_BLOCK_MIN_VOCAB = 24576

# Up to this budget the reference heap loop over the read rows costs less than the floor and
# the enumeration (measured with benchmarks/tree_build.py; docs/dev/tree-builders.md).
HEAP_LOOP_MAX_BUDGET = 64
# Rows read by full-row top-k that may hold a deep tree go to the lazy heap at every budget
# unless block maxima take over (DEEP_BLOCK_*): at budgets 1024-2048, V = 16384-50257, it took
# 0.5-1.0x the time of the probes, floors and enumeration (most 0.7-0.8x) on trees of two to
# fifteen levels (`build.choose_method` sends budgets below 1024 there directly). Flat rows
# (no deep guess) keep the enumeration: depth-one trees cost it least. Tests switch this off
# to reach the enumeration on small vocabularies.
LAZY_HEAP_ON_FULL_ROWS = True


def build_enumerated_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    """logits: [D, V] (checked by the caller); budget >= 0. The exact tree (see above); its
    small ops on one thread (`ddtree.op_threads`)."""
    if budget == 0 or logits.shape[0] == 0:
        return root_only_tree()
    with small_ops_on_one_thread(logits):
        return _build_enumerated_tree(logits, budget)


# A tree guessed likely deep through block maxima normalises most rows, whichever way it is
# then read: the worker thread, which has rows 0-1 under way already (`start_head_rows`), is
# given the rows up to this share of them (with their own max pass) right after the guess,
# while this thread takes the other rows' block maxima, the bounds, the first reads'
# gathering and then the other rows' logsumexp (`row_logsumexp`). With the head start, 10 of
# 15 rows took 0.94-0.97x the time of 9 on power-1.5/2.0/2.5-sharp and dflash-tiny@T0.5 at
# budgets 128 and 1024 (power-1.0-sharp 1.00x), peaked 0.96-1.0x, peaked@T0.5 0.95-1.01x;
# 11 took up to 1.08x the time of 10 (power-1.5-sharp@T0.5; interleaved,
# OMP_WAIT_POLICY=PASSIVE). Flat tails give the worker one more row later.
EARLY_ROWS_SHARE = 2 / 3
# ...unless the depth guess's estimate is below FAR_READ_ESTIMATE: such trees are read through
# the block maxima (`_read_through_maxima`) rather than by the lazy heap, and this thread has
# less work of its own before its rows (no first reads to gather), so the worker starts on
# FAR_EARLY_ROWS_SHARE of them (FAR_EARLY_ROWS_SHARE_AT_FLOORS from BLOCK_FLOOR_MIN_BUDGET on,
# where this thread works out a floor first). Interleaved on the benchmark's families guessed
# below it (power-1.0-sharp, power-1.5, power-1.5-sharp@T2, dflash-tiny): 0.82-0.93x the time at
# budgets 64-256, 0.94-0.98x at 1024. The lazy heap's trees (estimates -0.6 to 0: peaked,
# the sharp power laws, dflash-tiny@T0.5 at -1.0) took 1.10-1.13x the time with the smaller share.
FAR_READ_ESTIMATE = -1.02
FAR_EARLY_ROWS_SHARE = 0.47
FAR_EARLY_ROWS_SHARE_AT_FLOORS = 0.53


def _early_rows_share(guess: DepthGuess, budget: int) -> float:
    """The share of rows the worker starts on right after the depth guess (see above)."""
    if guess.estimate >= FAR_READ_ESTIMATE:
        return EARLY_ROWS_SHARE
    return FAR_EARLY_ROWS_SHARE_AT_FLOORS if budget >= BLOCK_FLOOR_MIN_BUDGET else FAR_EARLY_ROWS_SHARE


def _build_enumerated_tree(logits: torch.Tensor, budget: int) -> DraftTree:
    reader = _RowReader(logits, budget)
    try:
        return _build_from(reader, budget)
    finally:
        settle_rows(reader)  # the worker's rows, if no read picked them up


def _build_from(reader: _RowReader, budget: int) -> DraftTree:
    logits = reader.logits
    depth_limit, vocab = logits.shape
    full_rows = not reader.source.wide_reads_are_cheap
    if not full_rows:
        start_head_rows(reader)  # rows 0-1: every route through block maxima normalises them
    guess = _guess_depth(reader) if depth_limit > 2 else DepthGuess(False, False)
    if guess.likely_deep and not full_rows:
        start_rows_early(reader, round(depth_limit * _early_rows_share(guess, budget)))
    if full_rows and guess.likely_deep and budget >= DEEP_BLOCK_MIN_BUDGET and vocab >= DEEP_BLOCK_MIN_VOCAB:
        reader.source = BlockMaxima(logits)  # nothing is read yet; see DEEP_BLOCK_MIN_BUDGET
    elif full_rows and guess.may_be_deep and (budget <= HEAP_LOOP_MAX_BUDGET or LAZY_HEAP_ON_FULL_ROWS):
        # Rows past 1 will likely be read wide and popped by the heap loop: that is the
        # reference's own work, so run it without the reader's bookkeeping (see
        # LAZY_HEAP_ON_FULL_ROWS).
        with callers_threads():
            return build_heap_tree(logits, budget, lazy_rows=True)
    if _reaches_every_row(reader, budget, guess):
        tree = _lazy_heap_through_blocks(reader, budget)
        if tree is not None:
            return tree
        reader = _RowReader(logits, budget)  # a wider read reordered tied logits: start again
    chain, floor = _read_until_complete(reader, budget, guess)
    if floor == _NEG_INF or budget <= HEAP_LOOP_MAX_BUDGET:
        # no bound (a small tree) or few pops: the reference loop over the read rows (rows it
        # needs further are read whole on first use)
        tree = bounded_best_first(_HeapView(reader, floor), reader.ids, depth_limit, budget, floor=_pop_floor(floor))
    else:
        tree = _depth_one_tree(reader, budget)
        depths = len(chain) - 1
        if tree is None and reader.read_once:
            # rows read once, down to the floor: the heap loop over them costs less than the
            # estimate and the enumeration (measured at budget 1024: 2.2-2.6 ms against
            # 3.2-4.2 ms of CPU time on drafter-like rows). Where paths tie exactly and often,
            # the loop keyed by rank path (power-2.0 / -2.5 rows at 512-1024: 0.76-0.93x the
            # enumeration's time). Every row it can reach is read (plain lists: no
            # `_HeapView` call per pop)
            rows = [reader.lp[d] if d < min(reader.unreachable_from, reader.dead_from) else [] for d in range(depth_limit)]
            tree = heap_loop_for([reader.lp[d] for d in range(depths)])(rows, reader.ids, depth_limit, budget, floor=_pop_floor(floor))
        if tree is None:
            threshold = _pop_floor(floor)
            estimate = _estimated_last_score(reader, depths, budget, threshold)
            if estimate > threshold:  # enumerate above the estimate; if it was too high, above the floor
                tree = _enumerate(reader, depths, budget, estimate - float_slack(estimate), at_least_budget=True)
            if tree is None:
                tree = _enumerate(reader, depths, budget, threshold)
        if tree is None:  # the reference loop over the rows as read: exact, only slower
            tree = bounded_best_first(_HeapView(reader, floor), reader.ids, depth_limit, budget, floor=_pop_floor(floor))
    reader.check_unread_rows()  # NaN / +inf anywhere is an error, as in the reference
    return tree


def _pop_floor(floor: float) -> float:
    """A floor of this module (a bound on the budget-th best score, float slack taken off
    once) as the heap loop's `floor`: less that slack again, as `_enumerate`'s threshold."""
    return floor - float_slack(floor)


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
    return make_draft_tree([-1] + [0] * budget, reader.ids[0][:budget], [1] * budget, scores)


# The family floor can sit far below the true one (near-uniform rows deeper than wide): past
# this many candidates per budget node the enumeration gives way to the heap loop.
ENUMERATION_SLACK = 8


def _estimated_last_score(reader: _RowReader, depths: int, budget: int, threshold: float) -> float:
    """The budget-th best score of the paths over the read rows, as plain float64 sums (not
    the reference's chains, so off by rounding), or -inf if fewer than `budget` score >=
    threshold. A few tensor ops per depth, for whole levels of paths at once.

    Why: the floor the rows were read to is a bound, on heavy-tailed rows 1-3 nats below the
    tree's last score, and enumerating every path above it in Python (the exact chains) made
    3-7 times `budget` candidates. Any budget-th best is itself nearly a floor for the
    enumeration; it is checked there (at least `budget` paths found above it), not trusted."""
    chain = _greedy_chain(reader)  # chain[d]: the best depth-d score, the frontier's maximum
    frontier = torch.zeros(1, dtype=torch.float64)  # [F] the previous depth's path scores >= threshold
    levels: list[torch.Tensor] = []
    limit = ENUMERATION_SLACK * budget + 1024  # as many as the enumeration would take
    for d in range(min(depths, len(chain) - 1)):
        row = reader.lp[d]
        usable = bisect_right(row, chain[d] - threshold, key=_negated)  # ranks with lp >= threshold - best
        if frontier.numel() * usable > limit:
            break  # a loose floor on flat rows: the levels so far still give an estimate
        scores = frontier.unsqueeze(1) + double_tensor(row[:usable])  # [F, usable]
        frontier = scores[scores >= threshold]  # [F'] flattened
        if not frontier.numel():
            break
        levels.append(frontier)
    found = torch.cat(levels) if levels else frontier
    if found.numel() < budget:
        return _NEG_INF
    return float(torch.kthvalue(found, found.numel() - budget + 1).values)


def _enumerate(reader: _RowReader, depths: int, budget: int, threshold: float, at_least_budget: bool = False) -> DraftTree | None:
    """Every path scoring >= threshold, then the budget best in pop order
    (`path_enumeration`); None if the read ranks turn out short, the candidates outgrow
    `ENUMERATION_SLACK * budget` or the sorted order is not the heap's, or
    (`at_least_budget`: the threshold is no proven floor) fewer than `budget` paths score >=
    threshold."""
    return enumerate_tree(reader, depths, budget, threshold, ENUMERATION_SLACK * budget + 1024, at_least_budget)
