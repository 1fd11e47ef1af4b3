"""Reading a row's largest log-probs without sorting, or for large vocabularies even scanning,
the whole row more than once.

Two sources answer the same two questions ("the top k of each row", "everything >= a cut in
each row") and return log-probs exactly as the reference computes them (float32 logit minus
the float32 logsumexp):
- `FullRows`: one full-row `torch.topk` per read (small vocabularies: it is cheap there).
- `BlockMaxima`: the rows are cut into blocks of `BLOCK` tokens and each block's maximum is
  taken once (a vectorised `amax`, far cheaper than a top-k or a logsumexp pass). A block is
  a run of `BLOCK` neighbouring tokens (block j: tokens BLOCK * j .. BLOCK * j + BLOCK - 1; a
  shorter tail block ends the row). Blocks of strided tokens (j, j + V // BLOCK, ...) made the
  maxima one element-wise max of `BLOCK` slices, faster on rows already in the cache (0.21
  against 0.51 ms for [15, 151936] on a 2-core AMD EPYC), but 32 streams at once read rows
  from memory at 0.8-1.7 ms against 0.6-0.8 ms, and builds found them there: with neighbours
  builds took 0.73-1.09x the time, median 0.96x (14 families x 4 budgets, interleaved). Every logit
  >= a cut lies in a block whose maximum is >= that cut, so gathering only those blocks finds
  exactly the logits a full-row comparison would; sorting that handful is cheap. The k-th
  largest block maximum is a valid cut for a top-k read: the k blocks at or above it hold k
  logits >= it, so the row's top k all lie at or above it.

Ties between exactly equal logits may come out in a different order than `torch.topk` over the
full row gives them; the values (and so the tree's scores) are the same.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

try:
    import numpy
except ImportError:  # a host Python without numpy: the torch paths serve
    numpy = None

from ddtree.inputs import raise_bad_row
from ddtree.op_threads import build_callers_threads, callers_threads
from ddtree.row_logsumexp import (
    MIN_SPLIT_ROWS,
    PendingRows,
    extend_rows,
    logsumexp_given_max,
    logsumexp_replica_holds,
    rows_log_z,
    split_replica_holds,
    start_rows,
)

# Tokens per block: measured fastest for 32k-152k vocabularies on a 2-core CPU (strided blocks,
# Intel); with blocks of neighbours on an AMD EPYC, 64 and 128 were 5-13 % faster on deep rows
# but 4-16 % slower on flat and wide ones at budget 1024, 48 slower throughout.
BLOCK = 32
# Below this vocabulary a full-row top-k costs less than the block machinery
# (measured with benchmarks/tree_build.py; docs/dev/tree-builders.md).
BLOCK_MIN_VOCAB = 65536
# Above this share of the rows, comparing full rows costs less than gathering blocks.
MAX_GATHERED_SHARE = 0.25
# Up to this k a top-k read gathers each row's k best blocks whole (few ops, k * BLOCK logits a
# row); wider reads select the blocks above a cut instead.
TOP_BLOCKS_MAX_K = 64
# From this many logits a top-k read takes (rows x k) on, `_top_logits_on_host` finds them:
# it costs ~0.05 ms more to start than the torch top-k over every block maximum, and less per
# logit (alone, on a 2-core AMD EPYC: 15 rows x 16 ranks 0.41-0.45 against 0.51-0.54 ms,
# 15 x 64 0.76-0.94 against 1.49-1.52; 2 x 16 0.32 against 0.19).
HOST_TOP_MIN_LOGITS = 240
# `_sorted_per_row` sorts on one int64 key (row, logit, token) while rows x vocabulary stay
# below this (the key then stays below 2^62), else on two keys
ONE_SORT_KEY_MAX = 1 << 29
# Every build through block maxima normalises rows 0 and 1, whatever its route: the worker
# starts on them before the depth guess (`start_head_rows`), ~0.6 ms sooner than the guess
# allows, and the rows a route then splits off for it are queued behind them (interleaved on
# the benchmark's 18 families at budgets 128 and 1024: 0.91-0.98x the time on deep and
# middling trees, 1.01-1.03x on the shallow few-peaks, power-1.0 and peaked@T2).
HEAD_START_ROWS = 2
# With work of its own beside a split logsumexp (a read's block gathering, ~0.5 ms), the
# building thread leaves the worker this share of the rows (`row_logsumexp`).
WORKER_SHARE_BESIDE_WORK = 0.6
_NEG_INF = float("-inf")


class Read(NamedTuple):
    """Per row: finite log-probs sorted descending (float32 values as Python floats), token ids."""

    log_probs: list[list[float]]
    ids: list[list[int]]


def row_source(logits: torch.Tensor) -> "FullRows | BlockMaxima":
    """The cheaper way to read this input's rows."""
    return BlockMaxima(logits) if logits.shape[1] >= BLOCK_MIN_VOCAB else FullRows(logits)


class FullRows:
    """Reads by full-row `torch.topk` (and one comparison pass for counts)."""

    wide_reads_are_cheap = False  # a top-k's cost grows with k

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # [D, V] any float dtype, any device

    def top_log_prob_guesses(self, rows: list[int]) -> tuple[list[float], list[float]]:
        """(upper bounds, estimates) of the rows' top log-probs, from every `BLOCK`-th logit
        and the row's maximum: their logsumexp is at most the row's (the bound); plus
        log(BLOCK) it stands for the whole row's (the estimate)."""
        x = self.logits[rows[0] : rows[-1] + 1]  # [c, V] (rows are a contiguous run)
        with callers_threads():
            tops = x.amax(dim=-1, keepdim=True).float()  # [c, 1]
            # sum over the sample of exp(logit - top): the top plus the sample then log-sum to
            # top + log1p(sum). (Strided, the sample costs less shifted into a fresh tensor
            # first than run through logsumexp.) NaN for a row without a finite maximum: "no guess".
            sums = (x[:, ::BLOCK].float() - tops).exp_().sum(dim=-1).tolist()
        bounds = [-math.log1p(total) if total == total else math.nan for total in sums]
        estimates = [-math.log1p(BLOCK * total) if total == total else math.nan for total in sums]
        return bounds, estimates

    def _chunk(self, rows: list[int]) -> torch.Tensor:
        start, stop = rows[0], rows[-1] + 1
        if stop - start == len(rows):
            return self.logits[start:stop].float()  # [c, V]
        return self.logits[torch.tensor(rows, device=self.logits.device)].float()  # only these rows

    def top(self, rows: list[int], ks: list[int], log_z: torch.Tensor) -> Read:
        """Each row's top ks[i] finite log-probs (fewer where the row runs out).
        log_z: [c] float32 host, the rows' logsumexp."""
        with callers_threads():
            return _top_of(self._chunk(rows), ks, log_z)

    def at_least(self, rows: list[int], cuts: torch.Tensor, limits: list[int], log_z: torch.Tensor) -> tuple[Read, list[int]]:
        """Each row's finite logits >= cuts[i] ([c] float32, logit scale) as log-probs, the
        largest limits[i] of them, and how many there are in all."""
        with callers_threads():
            x = self._chunk(rows)
            counts = (x >= cuts.to(x.device).unsqueeze(1)).sum(dim=1).tolist()
            return _top_of(x, [min(c, limit) for c, limit in zip(counts, limits)], log_z), counts


def _top_of(x: torch.Tensor, ks: list[int], log_z: torch.Tensor) -> Read:
    width = max(ks)  # x: [c, V] float32
    if width == 0:
        return Read([[] for _ in ks], [[] for _ in ks])
    values, ids = torch.topk(x, width, dim=-1)
    return _read_of_top(values, ids, ks, log_z)


def read_of_top_logits(values: torch.Tensor, ids: torch.Tensor, ks: list[int], log_z: torch.Tensor) -> Read:
    """`BlockMaxima.top_logits`' result for rows whose logsumexp is `log_z` ([c] float32 host)
    -> the read `top` gives (each row's first ks[i] finite log-probs)."""
    return _read_of_top(values, ids, ks, log_z)


def _read_of_top(values: torch.Tensor, ids: torch.Tensor, ks: list[int], log_z: torch.Tensor) -> Read:
    """[c, width] top logits (descending) and their ids -> each row's first ks[i] as a Read."""
    log_probs = (values.cpu() - log_z.unsqueeze(1)).tolist()  # the reference's own subtraction
    lp_rows, id_rows = [], []
    for lp_row, id_row, k in zip(log_probs, ids.tolist(), ks):
        n = k
        while n and not math.isfinite(lp_row[n - 1]):  # zero-probability tokens are never placed
            n -= 1
        lp_rows.append(lp_row[:n])
        id_rows.append(id_row[:n])
    return Read(lp_rows, id_rows)


class BlockMaxima:
    """Block maxima of [D, V] logits, taken once, and reads through them."""

    wide_reads_are_cheap = True  # a selection costs what it returns, not what it skips

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # [D, V] any float dtype, any device
        depth_limit, vocab = logits.shape
        self.vocab = vocab
        self.whole = vocab // BLOCK  # block j < whole holds tokens BLOCK * j + i, i = 0..BLOCK-1
        self.block_count = self.whole + (1 if vocab % BLOCK else 0)  # the tail: one more, shorter block
        self._maxima = torch.empty(depth_limit, self.block_count, device=logits.device)  # [D, NB] float32
        self._blocks = _block_view(logits)  # [D, BLOCK, NB'] a view: block j is [:, :, j]
        self._host_blocks = _host_block_view(logits)  # numpy [D, NB, BLOCK], where `_select_on_host` serves
        self._ready = [False] * depth_limit  # rows whose maxima are taken (rows the tree reaches)

    def maxima(self, rows: list[int]) -> torch.Tensor:
        """[c, NB] float32: the block maxima of `rows` (ascending), taken on first use."""
        missing = [d for d in rows if not self._ready[d]]
        if missing:
            start, stop = missing[0], missing[-1] + 1  # one pass over the span
            source = self.logits[start:stop]
            # A pass over whole rows, yet on the build's one thread (`ddtree.op_threads`): a max
            # is exact in any order, a second thread gains little (on a 2-core AMD EPYC,
            # [15, 151936]: 0.51 / 0.76 ms on one thread from the cache / from memory, 0.49 /
            # 0.59 ms on two) and waking the OpenMP team for it cost ~0.15 ms more (builds 3-7 %
            # faster on deep rows, 16-27 % on flat ones)
            if source.dtype != torch.float32:
                source = source.float()  # CPU amax on half types is slow
            if self.whole:
                torch.amax(_block_view(source), dim=1, out=self._maxima[start:stop, : self.whole])
            if self.whole < self.block_count:
                self._maxima[start:stop, self.whole] = source[:, self.whole * BLOCK :].amax(dim=-1)
            self._ready[start:stop] = [True] * (stop - start)
        if rows and rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run (ascending rows): a view, no copy
            return self._maxima[rows[0] : rows[-1] + 1]
        return self._maxima[rows]

    def has_maxima(self, rows: list[int]) -> bool:
        """Whether every one of `rows` has its maxima taken already."""
        return all(self._ready[d] for d in rows)

    def top_log_prob_guesses(self, rows: list[int]) -> tuple[list[float], list[float]]:
        """(upper bounds, estimates) of the rows' top log-probs, from the maxima alone: the
        block maxima are some of a row's logits, so their logsumexp is at most the row's. The
        bound serves as the estimate too (measured to steer the reads well at 65k-152k)."""
        maxima = self.maxima(rows)  # [c, NB]
        bounds = (maxima.amax(dim=-1) - torch.logsumexp(maxima, dim=-1)).tolist()
        return bounds, bounds

    def top(self, rows: list[int], ks: list[int], log_z: torch.Tensor) -> Read:
        """As `FullRows.top`."""
        if max(ks) >= self.block_count:  # as many ranks as blocks: no block can be skipped
            return FullRows(self.logits).top(rows, ks, log_z)
        small = [i for i, k in enumerate(ks) if k <= TOP_BLOCKS_MAX_K] if self.whole == self.block_count else []
        if len(small) == len(rows):
            return self._top_in_top_blocks(rows, ks, log_z)
        if small:
            # a wide read of one row (row 0 read to the budget) beside narrow ones: the narrow
            # rows from their best blocks, not cut at the wide row's k-th block maximum (which
            # gathered some thousand logits of each to keep a few dozen)
            wide = [i for i in range(len(rows)) if ks[i] > TOP_BLOCKS_MAX_K]
            narrow_read = self._top_in_top_blocks([rows[i] for i in small], [ks[i] for i in small], log_z[small])
            wide_read = self.top([rows[i] for i in wide], [ks[i] for i in wide], log_z[wide])
            by_row = dict(zip(small, zip(*narrow_read))) | dict(zip(wide, zip(*wide_read)))
            return Read([by_row[i][0] for i in range(len(rows))], [by_row[i][1] for i in range(len(rows))])
        read = self._select(rows, self._kth_largest_block_max(rows, ks), log_z)
        return Read([lp[:k] for lp, k in zip(read.log_probs, ks)], [i[:k] for i, k in zip(read.ids, ks)])

    def at_least(self, rows: list[int], cuts: torch.Tensor, limits: list[int], log_z: torch.Tensor) -> tuple[Read, list[int]]:
        """As `FullRows.at_least`, except that a count at or above its limit is only a lower
        bound: a row whose cut clears far more blocks than `limits[i]` ranks need (a flat row
        under a low cut) is read down to its k-th largest block maximum instead, which still
        holds its top `limits[i]` and keeps the read the size of what it returns (or, when it
        wants as many ranks as there are blocks, by a full-row top-k)."""
        cuts = cuts.to(self.logits.device, torch.float32).clone()
        hit = None
        hits = self._hits_on_host(rows, cuts)
        if hits is not None:
            cleared = numpy.bincount(hits[0], minlength=len(rows)).tolist()
        else:
            hit = self.maxima(rows) >= cuts.unsqueeze(1)  # [c, NB] blocks that may hold a logit >= the cut
            cleared = hit.sum(dim=1).tolist()
        # each cleared block holds at least one logit >= the cut: a row is "wide" when it
        # clears more blocks than the ranks it may keep. Only then can the limit-th largest
        # block maximum lie above the cut (otherwise raising the cut to it changes nothing)
        wide = [i for i, (count, limit) in enumerate(zip(cleared, limits)) if count > limit]
        if any(limits[i] >= self.block_count for i in wide):
            # as many ranks wanted as there are blocks: a full-row top-k bounds the work instead
            return FullRows(self.logits).at_least(rows, cuts, limits, log_z)
        if wide:
            raised = self._kth_largest_block_max([rows[i] for i in wide], [limits[i] for i in wide])
            cuts[wide] = torch.maximum(cuts[wide], raised)
            hit, cleared, hits = None, None, None  # the raised cuts clear fewer blocks
        read = self._select(rows, cuts, log_z, hit, cleared, hits)
        counts = [len(lp) for lp in read.log_probs]
        return Read([lp[:n] for lp, n in zip(read.log_probs, limits)], [i[:n] for i, n in zip(read.ids, limits)]), counts

    def top_logits(self, rows: list[int], ks: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The work of `top(rows, ks, log_z)` that needs no logsumexp, for reads `top` makes
        from each row's best blocks (every k small, no short tail block): ([c, max k] logits
        sorted descending, their ids), which `read_of_top_logits` turns into the read. None
        for other reads."""
        if max(ks) > TOP_BLOCKS_MAX_K or max(ks) >= self.block_count or self.whole != self.block_count:
            return None
        return self._top_logits_in_top_blocks(rows, max(ks))

    def _top_in_top_blocks(self, rows: list[int], ks: list[int], log_z: torch.Tensor) -> Read:
        """`top` for small k, in a handful of ops: a row's k largest logits all lie in its k
        blocks with the largest maxima (a logit outside them has k block maxima, k other
        logits, at or above it), so the top k of those k blocks are the row's top k."""
        return _read_of_top(*self._top_logits_in_top_blocks(rows, max(ks)), ks, log_z)

    def _top_logits_in_top_blocks(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        on_host = self._top_logits_on_host(rows, width)
        if on_host is not None:
            return on_host
        blocks = torch.topk(self.maxima(rows), width, dim=-1).indices  # [c, width]
        source_rows = torch.tensor(rows, device=blocks.device).unsqueeze(1)  # [c, 1]
        candidates = self._blocks[source_rows, :, blocks].float().reshape(len(rows), width * BLOCK)  # [c, width, BLOCK] flat
        values, where = torch.topk(candidates, width, dim=-1)  # [c, width] sorted descending
        return values, blocks.gather(1, where // BLOCK) * BLOCK + where % BLOCK

    def _top_logits_on_host(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`_top_logits_in_top_blocks` in numpy, through groups of `BLOCK` blocks, for host rows
        of whole blocks; None where a row's cut is not finite (the torch path serves).

        Each of a row's `width` best groups of `BLOCK` blocks holds a block, and that block a
        logit, equal to the group's maximum, so the width-th largest group maximum is a cut
        with at least `width` logits at or above it: every logit a top-`width` read returns.
        The blocks above it are found and sorted as `_select_on_host` does, ties by token. (A
        top-k over the [15, 4748] maxima took 0.22 ms alone here; over the [15, 148] groups
        0.02.)"""
        if self._host_blocks is None or len(rows) * width < HOST_TOP_MIN_LOGITS or self.block_count // BLOCK < width:
            return None
        # the groups leave a shorter tail group out: its blocks are still compared with the cut
        cut = torch.topk(_group_maxima(self.maxima(rows)), width, dim=-1).values[:, -1]  # [c]
        cut_values = cut.numpy()
        if not numpy.isfinite(cut_values).all():  # -inf: rows with few finite logits; NaN rows
            return None
        row_of, values, token = self._logits_at_least_on_host(rows, cut_values, *self._hits_on_host(rows, cut))
        counts = numpy.bincount(row_of, minlength=len(rows))
        if counts.min() < width:  # a NaN block maximum left a row short of its cut
            return None
        starts = numpy.cumsum(counts) - counts
        picked = _row_value_order(len(rows), row_of, values, token, self.vocab)[starts[:, None] + numpy.arange(width)]  # [c, width]
        return torch.from_numpy(values[picked]), torch.from_numpy(token[picked])

    def _kth_largest_block_max(self, rows: list[int], ks: list[int]) -> torch.Tensor:
        """[c] float32: per row, a cut under which that row's top ks[i] logits all lie: the
        ks[i]-th largest block maximum, or a lower one (1 <= ks[i] < blocks)."""
        maxima = self.maxima(rows)  # [c, NB]
        width = max(ks)
        if width <= 256:  # a top-k this small beats a selection (measured)
            top = torch.topk(maxima, width, dim=-1).values  # [c, width]
            return top.gather(1, torch.tensor(ks, device=top.device).sub(1).unsqueeze(1)).squeeze(1)
        # one batched selection at the widest k: a lower cut is still a valid one
        return torch.kthvalue(maxima, self.block_count - width + 1, dim=-1).values

    def _select(self, rows: list[int], cuts: torch.Tensor, log_z: torch.Tensor,
                hit: torch.Tensor | None = None, cleared: list[int] | None = None, hits=None) -> Read:
        """Every finite logit >= cuts[i] of each row rows[i] (ascending), as sorted log-probs.
        `hit` / `cleared`: `maxima >= cuts` and its row sums, or `hits` (`_hits_on_host`), when
        the caller has them."""
        if hits is None and hit is None:
            hits = self._hits_on_host(rows, cuts)
        if hits is not None:
            if len(hits[0]) * BLOCK > MAX_GATHERED_SHARE * len(rows) * self.vocab:
                return self._whole_rows(rows, cuts, log_z, unbounded=False)
            return self._select_on_host(rows, cuts, log_z, *hits)
        cut = cuts.unsqueeze(1)  # [c, 1]
        unbounded = bool(cuts.isneginf().any())  # only then can -inf blocks and logits clear a cut
        if hit is None:
            hit = self.maxima(rows) >= cut  # [c, NB] blocks that may hold a logit >= cut
            cleared = None
        if unbounded:
            hit = hit & (self.maxima(rows) > _NEG_INF)
        hit_count = sum(cleared) if cleared is not None and not unbounded else int(hit.sum())
        if hit_count * BLOCK > MAX_GATHERED_SHARE * len(rows) * self.vocab:
            return self._whole_rows(rows, cuts, log_z, unbounded)
        row_of, block = hit.nonzero(as_tuple=True)  # [P] each
        if rows and rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run (ascending rows)
            source_row = row_of + rows[0] if rows[0] else row_of  # [P] rows of the logits
        else:
            source_row = torch.tensor(rows, device=block.device)[row_of]
        has_tail = self.whole < self.block_count
        main = block < self.whole if has_tail else None  # every block but a short tail one
        if main is None or bool(main.all()):
            values = self._blocks[source_row, :, block].float()  # [P, BLOCK]: whole blocks
        else:
            values = torch.full((block.numel(), BLOCK), _NEG_INF, device=block.device)
            values[main] = self._blocks[source_row[main], :, block[main]].float()
            tail = self.logits[source_row[~main], self.whole * BLOCK :].float()  # [T, V % BLOCK]
            values[~main, : tail.shape[1]] = tail
        keep = values >= cut[row_of]  # [P, BLOCK]
        if unbounded:
            keep &= values > _NEG_INF
        hit_index, offset = keep.nonzero(as_tuple=True)
        block = block[hit_index]
        token = block * BLOCK + offset  # the tail block too: it is the row's last, shorter run
        return _sorted_per_row(len(rows), row_of[hit_index], values[hit_index, offset], token, log_z, self.vocab)

    def _whole_rows(self, rows: list[int], cuts: torch.Tensor, log_z: torch.Tensor, unbounded: bool) -> Read:
        """`_select` by comparing whole rows: cheaper than gathering most of their blocks."""
        cut = cuts.unsqueeze(1)  # [c, 1]
        with callers_threads():
            x = self.logits[rows].float()  # [c, V]
            keep = (x >= cut) & (x > _NEG_INF) if unbounded else x >= cut
            row_of, token = keep.nonzero(as_tuple=True)
            return _sorted_per_row(len(rows), row_of, x[keep], token, log_z, self.vocab)

    def _hits_on_host(self, rows: list[int], cuts: torch.Tensor):
        """(row_of, block): numpy [P] each, row-major (blocks ascend per row), the blocks whose
        maximum is >= their row's cut, for host rows of whole blocks and cuts with no -inf;
        None elsewhere (the torch path serves). On [15, 4748] maxima numpy's compare and flat
        nonzero took 0.04 ms against torch's 0.15 (its broadcast compare alone 0.07), and a
        2-D `numpy.nonzero` 0.28."""
        if self._host_blocks is None or not rows:
            return None
        cut = cuts.numpy()  # [c] float32
        if (cut == _NEG_INF).any():
            return None
        if not self.has_maxima(rows):
            self.maxima(rows)
        table = self._maxima.numpy()  # [D, NB] a view; rows apart gathered by numpy, not torch (~0.05 ms less)
        maxima = table[rows[0] : rows[-1] + 1] if rows[-1] - rows[0] + 1 == len(rows) else table[rows]  # [c, NB]
        return numpy.divmod(numpy.flatnonzero(maxima >= cut[:, None]), maxima.shape[1])

    def _select_on_host(self, rows: list[int], cuts: torch.Tensor, log_z: torch.Tensor, row_of, block) -> Read:
        """`_select`'s gather in numpy, for float32 host rows of whole blocks and finite cuts,
        over the blocks `_hits_on_host` found: the same blocks, the same logits, sorted by
        `_sorted_on_host`. A few hundred blocks take a handful of ops, each a fraction of a
        torch op's dispatch (builds that read down to a floor: 0.93-0.99x the time, flat rows
        at 512 0.86x; benchmarks/RESULTS.md)."""
        return _sorted_on_host(len(rows), *self._logits_at_least_on_host(rows, cuts.numpy(), row_of, block), log_z.numpy(), self.vocab)

    def _logits_at_least_on_host(self, rows: list[int], cut, row_of, block):
        """numpy (row_of, logit, token) [M] each: the logits >= their row's `cut` ([c] float32)
        in the hit blocks (`_hits_on_host`), row-major, tokens ascending per row."""
        values = self._host_blocks[_host_source_rows(rows, row_of), block]  # [P, BLOCK]
        hit_index, offset = numpy.divmod(numpy.flatnonzero(values >= cut[row_of, None]), BLOCK)
        return row_of[hit_index], values[hit_index, offset], block[hit_index] * BLOCK + offset


def _host_block_view(logits: torch.Tensor):
    """numpy [D, NB, BLOCK] view of contiguous float32 host logits whose vocabulary is whole
    blocks (no copy), or None: other dtypes, devices or layouts, a short tail block, no numpy."""
    if numpy is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[1] % BLOCK or not logits.is_contiguous():
        return None
    try:
        return logits.numpy().reshape(logits.shape[0], logits.shape[1] // BLOCK, BLOCK)  # contiguous: a view
    except RuntimeError:  # no numpy bridge, or a tensor that requires grad
        return None


def _block_view(rows: torch.Tensor) -> torch.Tensor:
    """[c, BLOCK, V // BLOCK] view of [c, V] rows' first BLOCK * (V // BLOCK) tokens: block j
    (the last index) holds tokens BLOCK * j .. BLOCK * j + BLOCK - 1 (a view: no copy)."""
    count, vocab = rows.shape
    return rows[:, : vocab // BLOCK * BLOCK].unflatten(1, (vocab // BLOCK, BLOCK)).transpose(1, 2)


def _sorted_per_row(count: int, row_of: torch.Tensor, values: torch.Tensor, token: torch.Tensor, log_z: torch.Tensor, vocab: int) -> Read:
    """Flat (row, logit, token) triples -> per-row log-probs sorted descending, and their ids;
    exactly equal logits by token id. One integer sort where the key fits 63 bits: the row,
    then the float32 logit's order-preserving integer image (negated, for descending), then
    the token. Host triples are sorted in numpy (`_sorted_on_host`); a device's there."""
    if values.device.type == "cpu":
        host = _numpy_views(row_of, values, token, log_z)
        if host is not None:
            return _sorted_on_host(count, *host, vocab)
    bits = values.view(torch.int32).long()  # [M]
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # same order as the floats
    by_value = row_of * (1 << 33) - ordered  # >= -2^31 + 1 and < count * 2^33
    if count * vocab < ONE_SORT_KEY_MAX:
        order = torch.sort((by_value + (1 << 31)) * vocab + token).indices  # distinct keys: no ties
    else:  # too wide for one key: by token, then stably by (row, logit)
        by_token = torch.sort(token).indices
        order = by_token[torch.sort(by_value[by_token], stable=True).indices]
    row_of, token = row_of[order].cpu(), token[order].cpu()
    log_probs = (values[order].cpu() - log_z[row_of]).tolist()  # the reference's own subtraction
    return _split_rows(log_probs, token.tolist(), torch.bincount(row_of, minlength=count).tolist())


def _sorted_on_host(count: int, row_of, values, token, log_z, vocab: int) -> Read:
    """`_sorted_per_row` on numpy views of host tensors: the same keys, the same float32
    subtraction, so the same read. A few hundred triples take a dozen ops, each a fraction of
    a torch op's dispatch (builds that read down to a floor at budget 1024: 0.96-0.98x the
    time, benchmarks/RESULTS.md)."""
    order = _row_value_order(count, row_of, values, token, vocab)
    row_of = row_of[order]
    log_probs = (values[order] - log_z[row_of]).tolist()  # float32 minus float32, as in torch
    return _split_rows(log_probs, token[order].tolist(), numpy.bincount(row_of, minlength=count).tolist())


def _row_value_order(count: int, row_of, values, token, vocab: int):
    """numpy: the order of (row ascending, logit descending, token ascending) over [M] host
    triples, as `_sorted_per_row` sorts them."""
    bits = values.view(numpy.int32).astype(numpy.int64)  # [M]
    ordered = numpy.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # same order as the floats
    by_value = row_of * (1 << 33) - ordered
    if count * vocab < ONE_SORT_KEY_MAX:
        return numpy.argsort((by_value + (1 << 31)) * vocab + token)  # distinct keys: no ties
    by_token = numpy.argsort(token, kind="stable")
    return by_token[numpy.argsort(by_value[by_token], kind="stable")]


def _group_maxima(maxima: torch.Tensor) -> torch.Tensor:
    """[c, NB // BLOCK]: the maxima of [c, NB] block maxima taken `BLOCK` blocks at a time (a
    shorter tail group left out)."""
    whole = maxima.shape[1] // BLOCK
    return maxima[:, : whole * BLOCK].unflatten(1, (whole, BLOCK)).amax(dim=-1)


def _host_source_rows(rows: list[int], row_of):
    """numpy [P]: the logits' row of each entry of `row_of` (indices into ascending `rows`)."""
    if rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run: no lookup
        return row_of + rows[0]
    return numpy.asarray(rows, dtype=numpy.int64)[row_of]


def _numpy_views(*tensors: torch.Tensor) -> tuple | None:
    """numpy views of host tensors (no copies), or None where torch runs without numpy."""
    if numpy is None:
        return None
    try:
        return tuple(tensor.numpy() for tensor in tensors)
    except RuntimeError:  # torch built or run without its numpy bridge
        return None


def _split_rows(log_probs: list[float], ids: list[int], sizes: list[int]) -> Read:
    """Flat lists in row order -> one list per row (`sizes[i]` entries for row i)."""
    lp_rows, id_rows, start = [], [], 0
    for size in sizes:
        lp_rows.append(log_probs[start : start + size])
        id_rows.append(ids[start : start + size])
        start += size
    return Read(lp_rows, id_rows)


# --------------------------------------------------------------- shared by the fast builders


def float_slack(*values: float) -> float:
    """Absolute margin for approximate (non-chain) score comparisons: over-reading is harmless."""
    return 1e-5 * (1.0 + sum(abs(v) for v in values if math.isfinite(v)))


def normalise_rows(owner: Any, missing: list[int], meanwhile: Callable[[], Any] | None = None) -> Any:
    """Fill `owner.log_z` for the rows `missing` (ascending, not yet normalised) with one
    logsumexp over the span they cover, widened to >= 2 rows so the float32 sums are bit-equal
    to the reference's full [D, V] call: torch reduces a lone row with a thread-split sum but
    each row of a multi-row call serially, as the reference does. Raises on NaN / +inf rows;
    lowers `owner.dead_from` at a row with no finite logit. `owner`: the builders' row readers
    (`logits`, `depth_limit`, `log_z: dict[int, float]`, `dead_from`; optionally `source`,
    `top_bounds`, whose first item holds the row maxima, and `pending_rows`, rows the worker
    thread is normalising already, `start_rows_early`).

    Inside a build with two threads the pass is split with the worker thread
    (`row_logsumexp`) and `meanwhile`, the caller's own work, runs beside it (elsewhere after
    it); its result is returned."""
    run = meanwhile or (lambda: None)
    if not missing:
        return run()
    start, stop = missing[0], missing[-1] + 1
    if owner.logits.stride(-1) != 1:
        # rows not laid out token after token (a transposed view): torch then reduces across
        # rows, and a row's sum depends on which rows share the call; only the full call is
        # the reference's
        start, stop = 0, owner.depth_limit
    elif stop - start == 1 and owner.depth_limit > 1:
        start, stop = (start, stop + 1) if stop < owner.depth_limit else (start - 1, stop)
    source = getattr(owner, "source", None)
    # the maxima are read anyway (block reads; taken on the build's one thread): their row
    # maxima spare logsumexp its own (host rows only: the replica check runs on the host's kernels)
    use_maxima = isinstance(source, BlockMaxima) and owner.logits.device.type == "cpu" and owner.logits.stride(-1) == 1
    known = getattr(owner, "top_bounds", None)  # (row maxima, ...) when the builder took them already
    if not use_maxima:
        row_max = None
    elif known is not None:
        row_max = known[0][start:stop]  # [c]
    else:
        row_max = source.maxima(list(range(start, stop))).amax(dim=1)  # [c]
    if row_max is not None and not (owner.logits[start:stop].is_contiguous() and logsumexp_replica_holds()):
        row_max = None  # torch.logsumexp itself
    early = getattr(owner, "pending_rows", None)
    if early is not None and early.extendable and early.start <= start <= early.stop and stop - early.stop >= MIN_SPLIT_ROWS:
        # a head start, and enough rows past it to split: the worker's share queued behind it
        split = early.stop + _worker_rows(stop - early.stop, meanwhile)
        early = owner.pending_rows = extend_rows(owner.logits, early, split)
    pending = early
    if pending is None and row_max is not None and _splits(owner.logits, stop - start):
        split = start + _worker_rows(stop - start, meanwhile)
        pending = start_rows(owner.logits, start, split, row_max[: split - start])
    if pending is not None and pending.start <= start:
        latest = (lambda: owner.pending_rows) if early is not None else None  # on the owner, where `meanwhile` may extend it
        log_z, result = _beside(owner.logits, pending, start, stop, row_max, run, latest)
        if early is not None:
            owner.pending_rows = None
    else:
        with callers_threads():  # the pass over whole rows, with the threads the reference has
            log_z = dict(enumerate(rows_log_z(owner.logits[start:stop], row_max).tolist(), start))
        result = run()
    for row in sorted(log_z):
        value = log_z[row]
        if math.isnan(value) or value == math.inf:
            raise_bad_row(row, owner.logits[row])
        if value == _NEG_INF:
            owner.dead_from = min(owner.dead_from, row)
        owner.log_z.setdefault(row, value)
    return result


def _beside(logits: torch.Tensor, pending: PendingRows, start: int, stop: int, row_max: torch.Tensor | None, run: Callable[[], Any], latest: Callable[[], PendingRows] | None = None) -> tuple[dict[int, float], Any]:
    """Rows [start, stop) normalised while the worker has `pending` (which starts at or before
    `start`) under way: `run()` first, then the rows past the worker's on this thread. Returns
    ({row: log_z} for both shares, run's result). `latest()`: the worker's rows as `run()` may
    have extended them (`give_the_worker_one_more_row`)."""
    try:
        result = run()
        if latest is not None:
            pending = latest() or pending
        own = max(start, pending.stop)
        if stop - own == 1 and own > 0:
            own -= 1  # >= 2 rows: the same bits on any thread count
        mine = rows_log_z(logits[own:stop], None if row_max is None else row_max[own - start :]).tolist() if own < stop else []
    finally:
        theirs = pending.result()  # waited for even on an error: the worker reads the logits
    log_z = dict(enumerate(theirs, pending.start))
    log_z.update(enumerate(mine, own))
    return log_z, result


def start_rows_early(owner: Any, rows: int) -> None:
    """Start the worker thread on the logsumexp of rows [0, rows) of `owner.logits` (a
    builder's row reader, as `normalise_rows` takes it) where the pass would be split anyway:
    `normalise_rows` picks the result up, `settle_rows` waits for it if nothing did."""
    logits = owner.logits
    pending = owner.pending_rows
    if pending is not None and pending.extendable and pending.stop < rows <= logits.shape[0]:
        owner.pending_rows = extend_rows(logits, pending, rows)  # behind the head start
    elif pending is None and MIN_SPLIT_ROWS <= rows <= logits.shape[0] and _splits(logits, rows):
        owner.pending_rows = start_rows(logits, 0, rows)


def give_the_worker_one_more_row(owner: Any) -> None:
    """Queue the row past the worker's share behind it (`extend_rows`), where this thread keeps
    at least two rows of its own: for a `meanwhile` of `normalise_rows` that turned out to take
    longer than the share allowed for (`normalise_rows` splits the rest as it then stands)."""
    pending = owner.pending_rows
    if pending is not None and pending.stop + 2 <= owner.depth_limit:
        owner.pending_rows = extend_rows(owner.logits, pending, pending.stop + 1)


def start_head_rows(owner: Any) -> None:
    """Start the worker thread on rows [0, HEAD_START_ROWS) of `owner.logits` (a builder's
    row reader, as `normalise_rows` takes it) where a build's pass over its rows would be
    split: a head start that `start_rows_early` and `normalise_rows` extend with the rows they
    give the worker. Only where such a split is made (`normalise_rows` splits rows whose maxima
    it knows, and so only where the recipe from known maxima gives torch's bits)."""
    logits = owner.logits
    if owner.pending_rows is None and logits.shape[0] > HEAD_START_ROWS and _splits(logits, MIN_SPLIT_ROWS) and logsumexp_replica_holds():
        owner.pending_rows = start_rows(logits, 0, HEAD_START_ROWS)._replace(extendable=True)


def settle_rows(owner: Any) -> None:
    """Wait for rows the worker was given and nothing picked up (a build waits for its jobs)."""
    pending, owner.pending_rows = owner.pending_rows, None
    if pending is not None:
        pending.log_z.exception()  # waits; the build already has its outcome


def _splits(logits: torch.Tensor, rows: int) -> bool:
    """Whether a build's pass over `rows` rows of host `logits` is split with the worker thread
    (`row_logsumexp`): enough contiguous rows, a caller with exactly two intra-op threads
    (the case measured; one thread is the caller's choice, more run the plain pass as before),
    and a torch whose split gives the plain pass's bits."""
    if rows < MIN_SPLIT_ROWS or build_callers_threads() != 2 or logits.device.type != "cpu" or not logits.is_contiguous():
        return False
    with callers_threads():  # the check compares with the pass on the caller's threads
        return split_replica_holds()


def _worker_rows(rows: int, meanwhile: Callable[[], Any] | None) -> int:
    """The worker's share of a split pass: half the rows, or WORKER_SHARE_BESIDE_WORK of them
    when this thread has work of its own to do meanwhile."""
    share = 0.5 if meanwhile is None else WORKER_SHARE_BESIDE_WORK
    return min(rows - 1, max(1, round(rows * share)))
