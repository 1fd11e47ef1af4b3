"""Every path scoring >= a threshold over rows read down to it, then the `budget` best in the
reference's pop order: the fast builders' alternative to the best-first loop.

The scores are the reference's own float64 chains (a child is its parent's score plus the
row's best log-prob, each sibling the previous one's less that rank's log-prob plus the
next). Sorting them (exact ties by rank path, as the heap pops them) gives the heap's pop
order as long as every node's generator (its elder sibling, or its parent for a first child)
pops first: where float rounding let a node outscore its generator, the enumeration gives
None and the caller lets the heap decide.

The paths are generated in Python (most parents on drafter-like rows have one child above a
tight threshold: a few float operations each, where a numpy call costs ~1.5 us); the sort,
the tie order, the checks and the output arrays take a fixed number of numpy calls, where
Python spent a step per node (benchmarks/RESULTS.md). Without numpy, Python does it all.
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple, Protocol

import torch

from ddtree.host_tensors import double_tensor
from ddtree.tree import DraftTree, make_draft_tree

try:
    import numpy
except ImportError:  # a host Python without numpy: Python finishes the enumeration
    numpy = None


class RowsRead(Protocol):
    """The read rows, as `fast_build._RowReader` holds them, by depth index."""

    lp: dict[int, list[float]]
    ids: dict[int, list[int]]
    full: dict[int, bool]
    known_above: dict[int, float]


# Up to this many paths in runs of tied scores are put in rank-path order in Python (a walk up
# per path); more take numpy's walk, a few calls per level (measured: 4 paths 0.06 ms in
# numpy; 755 paths 0.3 ms in numpy, ~4x that in Python).
PYTHON_TIE_MEMBERS = 64


def enumerate_tree(rows: RowsRead, depths: int, budget: int, threshold: float, limit: int, at_least_budget: bool = False) -> DraftTree | None:
    """The tree of the budget best paths over rows 0..depths-1, from every path scoring >=
    threshold; None if a path through an unread rank may still reach it, the paths outnumber
    `limit`, the sorted order is not the heap's (see above) or (`at_least_budget`: the
    threshold is no proven floor) fewer than `budget` paths reach it."""
    paths = _paths_above(rows, depths, threshold, limit)
    if paths is None or (at_least_budget and len(paths.score) < budget):
        return None
    finish = _finish_in_python if numpy is None else _finish_in_numpy
    return finish(paths, depths, budget)


class _Paths(NamedTuple):
    """Every path scoring >= the threshold by gid: level by level, and within a level by
    parent, then rank (so gid order is rank-path order within a level, and siblings are
    contiguous)."""

    parent: list[int]  # gid of the parent (-1: the root)
    rank: list[int]
    depth: list[int]
    score: list[float]
    token: list[int]
    # no path outscores its generator (float rounding could make a sibling outscore the one
    # before it): then the sorted order puts every generator first, unchecked
    in_order: list[bool]


def _paths_above(rows: RowsRead, depths: int, threshold: float, limit: int) -> _Paths | None:
    paths = _Paths([], [], [], [], [], [True])
    parent, rank, depth, score, token, in_order = paths
    frontier_scores, frontier_ids = [0.0], [-1]  # the previous depth's paths
    for d in range(depths):
        row, ids, full, known_above = rows.lp[d], rows.ids[d], rows.full[d], rows.known_above[d]
        n = len(row)
        level_start = len(score)
        first, first_id = row[0], ids[0]
        if first > 0.0:
            in_order[0] = False  # not a log-prob: a child would outscore its parent
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
                elder, s = s, s - row[r - 1] + row[r]
                if s > elder:
                    in_order[0] = False
            parent.extend([pid] * r)
            rank.extend(range(r))
            token.extend(ids[:r])
            if len(score) > limit:
                return None
        depth.extend([d + 1] * (len(score) - level_start))
        frontier_scores, frontier_ids = score[level_start:], range(level_start, len(score))
        if not frontier_scores:
            break
    return paths


def _finish_in_python(paths: _Paths, depths: int, budget: int) -> DraftTree | None:
    parent, rank, depth, score, token, _ = paths
    # stable: ties keep gid order (a tensor sort beats `sorted` from ~100 candidates on)
    values, order_t = torch.sort(double_tensor(score), descending=True, stable=True)
    order = order_t.tolist()
    head = min(budget + 1, len(score))
    tied = (values[1:head] == values[: head - 1]).nonzero().flatten().tolist()  # values[i] == values[i+1]
    if tied:  # exact score ties: order each run by rank path, as the heap does
        _order_tied_runs(order, score, tied, parent, rank)
    chosen = order[:budget]
    position = [-1] * len(score)  # gid -> pop position, once popped
    parents = [-1]
    for pos, gid in enumerate(chosen):
        above = parent[gid]
        generator = gid - 1 if rank[gid] else above
        if generator >= 0 and position[generator] < 0:
            return None  # float rounding let a node outscore its generator: the heap decides
        position[gid] = pos
        parents.append(position[above] + 1 if above >= 0 else 0)
    # tie runs only reorder equal scores, so the sorted values are the chosen nodes' scores
    tokens, node_depths = list(map(token.__getitem__, chosen)), list(map(depth.__getitem__, chosen))
    return make_draft_tree(parents, tokens, node_depths, values[: len(chosen)])


def _order_tied_runs(order: list[int], score: list[float], tied: list[int], parent: list[int], rank: list[int]) -> None:
    """Sort, in place and by rank path, each run of exactly equal scores in `order` that starts
    at a `tied` position (the run may continue past the positions checked)."""
    done = -1
    for start in tied:
        if start < done:
            continue
        value, stop = score[order[start]], start + 1
        while stop < len(order) and score[order[stop]] == value:
            stop += 1
        order[start:stop] = sorted(order[start:stop], key=lambda i: _rank_path(i, parent, rank))
        done = stop


def _rank_path(gid: int, parent: list[int], rank: list[int]) -> tuple[int, ...]:
    path = []
    while gid >= 0:
        path.append(rank[gid])
        gid = parent[gid]
    return tuple(reversed(path))


def _finish_in_numpy(paths: _Paths, depths: int, budget: int) -> DraftTree | None:
    if not paths.in_order[0]:
        return None  # float rounding let a path outscore its generator: the heap decides
    score = numpy.array(paths.score, dtype=numpy.float64)
    chosen = _pop_order(score, paths, depths, budget)[:budget]
    position = numpy.full(score.size + 1, -1, dtype=numpy.int64)  # gid -> pop position; [-1]: the root
    position[chosen] = numpy.arange(chosen.size)
    pick = _picker(chosen.tolist())
    above = numpy.array(pick(paths.parent), dtype=numpy.int64)
    return make_draft_tree([-1] + (position[above] + 1).tolist(), pick(paths.token), pick(paths.depth), torch.from_numpy(score[chosen]))


def _picker(gids: list[int]):
    """A function giving the list of a column's values at `gids` (one C call per column: half
    the time of a `map` over 1024 gids)."""
    if len(gids) == 1:
        return lambda column: [column[gids[0]]]  # itemgetter of one item gives no tuple
    get = itemgetter(*gids) if gids else (lambda column: ())
    return lambda column: list(get(column))


def _pop_order(score, paths: _Paths, depths: int, budget: int):
    """gids by score, descending; exact ties by rank path, as the heap pops them (a stable sort
    keeps gid order, which is rank-path order only within a level)."""
    order = numpy.argsort(-score, kind="stable")
    head = min(budget + 1, score.size)
    ranked = score[order]
    tied = numpy.flatnonzero(ranked[1:head] == ranked[: head - 1])
    if not tied.size:
        return order
    # every position in a run of equal scores that starts within the budget, the run whole
    in_run = numpy.zeros(score.size, dtype=bool)
    in_run[tied] = True
    in_run[tied + 1] = True
    last = int(tied[-1]) + 1
    while last + 1 < score.size and ranked[last + 1] == ranked[last]:
        last += 1
        in_run[last] = True
    places = numpy.flatnonzero(in_run)
    members = order[places]
    if members.size <= PYTHON_TIE_MEMBERS:
        key = lambda gid: (-paths.score[gid], _rank_path(gid, paths.parent, paths.rank))  # noqa: E731
        order[places] = sorted(members.tolist(), key=key)
        return order
    parent, rank, depth = (numpy.array(column, dtype=numpy.int64) for column in (paths.parent, paths.rank, paths.depth))
    walked = _rank_paths(members, parent, rank, depth, depths)
    # lexsort's last key is the primary one: score, then the path from the root down
    resorted = numpy.lexsort(tuple(walked[:, column] for column in reversed(range(depths))) + (-score[members],))
    order[places] = members[resorted]
    return order


def _rank_paths(members, parent, rank, depth, depths: int):
    """[m, depths] rank paths of the gids `members`, padded with -1 (a prefix sorts first)."""
    paths = numpy.full((members.size, depths), -1, dtype=numpy.int64)
    node, at = members, numpy.arange(members.size)
    while node.size:
        paths[at, depth[node] - 1] = rank[node]
        up = parent[node]
        keep = up >= 0
        node, at = up[keep], at[keep]
    return paths
