"""The reference's row logsumexp, to the bit, for the fast builders: torch's own call, the
same recipe from row maxima the builder already has, and either of them split by rows between
the building thread and one worker thread.

Why the split: the pass is the builder's largest cost (15 rows of 151936 logits: ~2.5 ms of
`exp` on two threads here), and the builder's Python work around it (the block maxima, the
depth guess, the block reads) ran on one thread while the second core idled. The worker takes
a share of the rows, started as soon as the build knows it will need them, and the building
thread does its own work meanwhile, then the other rows (benchmarks/RESULTS.md).

Why the bits hold: each row's float32 sum is reduced serially inside one intra-op thread, in a
one-row call as in a fifteen-row one, so every split gives `torch.logsumexp`'s bits on the
whole [D, V] input. That holds for torch's CPU kernels as built; `split_replica_holds` (and
`logsumexp_replica_holds` for the recipe from known maxima) check it once per process, and
the builders keep torch's own call where a check fails.

The worker is one daemon thread, started on first use (a forked child starts its own), on one
intra-op thread. A build waits for every job it started before it returns, so no work
outlives the build.
"""
from __future__ import annotations

import atexit
import functools
import math
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch

# Below this many rows a split saves less than handing work to the worker costs.
MIN_SPLIT_ROWS = 4
_NEG_INF = float("-inf")


class _Worker:
    """One daemon thread running jobs in order, on one intra-op thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        ready = threading.Event()
        threads = torch.get_num_threads()
        threading.Thread(target=self._serve, args=(ready,), name="ddtree-logsumexp", daemon=True).start()
        ready.wait()
        # torch seeds a new thread's count from the last one set anywhere: set this thread's
        # again, so that threads started later do not inherit the worker's one
        torch.set_num_threads(threads)

    def submit(self, function: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, function, args))
        return future

    def _serve(self, ready: threading.Event) -> None:
        # Under OpenMP the count is per thread, but torch seeds a thread's count from the last
        # one set anywhere on the thread's first parallel op: take that first, then set one
        torch.get_num_threads()
        torch.set_num_threads(1)
        ready.set()
        while True:
            future, function, args = self._jobs.get()
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the building thread, which raises it
                future.set_exception(error)


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _the_worker() -> _Worker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
        return _worker


def _forget_worker() -> None:
    global _worker
    _worker = None  # its thread does not exist in a forked child


def _finish_jobs() -> None:
    """At exit, let a job under way finish (a build interrupted while it waited, e.g. by
    Ctrl-C): a daemon thread stopped inside a torch op aborts the process."""
    if _worker is not None:
        _worker.submit(lambda: None).result()


os.register_at_fork(after_in_child=_forget_worker)
atexit.register(_finish_jobs)


def logsumexp_given_max(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(x, dim=-1)` for x [c, V] float32 whose row maxima are already known
    (row_max [c], equal to `x.amax(dim=-1)`), without its own pass for them: the same ops on
    the same shapes as torch's CPU implementation (max, shift, exp, sum, log, add back; an
    infinite max shifts by 0), so the same bits, checked once per process
    (`logsumexp_replica_holds`)."""
    shift = row_max.unsqueeze(1).clone()  # [c, 1]
    shift.masked_fill_(shift.abs() == math.inf, 0)
    return (x - shift).exp_().sum(dim=-1).log_().add_(shift.squeeze(1))


@functools.cache
def logsumexp_replica_holds() -> bool:
    """Whether `logsumexp_given_max` gives `torch.logsumexp`'s bits in this torch build, on
    contiguous rows shaped as the builders' (two sizes, -inf logits and a row of them). A torch that computes logsumexp otherwise fails this (a different
    summation order changes the low bits of nearly every row) and keeps its own call."""
    generator = torch.Generator().manual_seed(20260)
    for rows, vocab in ((2, 70001), (4, 151936)):  # ~1 M logits: tens of ms, once
        x = torch.randn(rows, vocab, generator=generator) * 4.0  # [rows, V] float32
        x[0, ::7] = _NEG_INF
        x[-1] = _NEG_INF  # a row with no finite logit
        if not torch.equal(torch.logsumexp(x, dim=-1), logsumexp_given_max(x, x.amax(dim=-1))):
            return False
    return True


def rows_log_z(rows: torch.Tensor, row_max: torch.Tensor | None) -> torch.Tensor:
    """[c] float32 `torch.logsumexp(rows, -1)` of [c, V] rows (any float dtype, row-contiguous),
    from their known maxima when given (`logsumexp_given_max`)."""
    rows = rows.float()
    return torch.logsumexp(rows, dim=-1) if row_max is None else logsumexp_given_max(rows, row_max)


class PendingRows(NamedTuple):
    """The worker's logsumexp of rows [start, stop) of a build's logits, under way."""

    start: int
    stop: int
    log_z: Future  # -> [stop - start] float32 host tensor
    extendable: bool = False  # a head start: the build may queue the next rows behind it (`extend_rows`)

    def result(self) -> list[float]:
        return self.log_z.result().tolist()


def start_rows(logits: torch.Tensor, start: int, stop: int, row_max: torch.Tensor | None = None) -> PendingRows:
    """Hand rows [start, stop) of [D, V] host logits to the worker; `row_max` [stop - start]
    their maxima where known."""
    return PendingRows(start, stop, _the_worker().submit(rows_log_z, logits[start:stop], row_max))


def extend_rows(logits: torch.Tensor, pending: PendingRows, stop: int) -> PendingRows:
    """Rows [pending.stop, stop) of [D, V] host `logits` queued on the worker behind `pending`,
    one PendingRows for both: the worker runs its jobs in order, so `pending` is done by then."""

    def both() -> torch.Tensor:
        return torch.cat((pending.log_z.result(), rows_log_z(logits[pending.stop : stop], None)))

    return PendingRows(pending.start, stop, _the_worker().submit(both))


@functools.cache
def split_replica_holds() -> bool:
    """Whether a split pass gives `torch.logsumexp`'s bits in this torch build (see the module
    docstring), on rows shaped as the builders' and split every way a build may split them,
    both recipes, against `torch.logsumexp` on the calling thread's intra-op threads."""
    generator = torch.Generator().manual_seed(20261)
    x = torch.randn(6, 151936, generator=generator) * 4.0  # ~1 M logits: tens of ms, once
    x[0, ::7] = _NEG_INF
    x[-1] = _NEG_INF  # a row with no finite logit
    expected = torch.logsumexp(x, dim=-1).tolist()
    row_max = x.amax(dim=-1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as inside a build: one intra-op thread on each side
    try:
        for split in range(1, x.shape[0]):
            for known in (None, row_max):
                head = start_rows(x, 0, split, None if known is None else known[:split])
                tail = rows_log_z(x[split:], None if known is None else known[split:]).tolist()
                if head.result() + tail != expected:
                    return False
    finally:
        torch.set_num_threads(threads)
    return True
