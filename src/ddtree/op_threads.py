"""Intra-op threads for the fast CPU builder: its few full-row passes use the caller's threads,
the many small ops between them one.

Why: a small op (a [15, 4748] comparison, a bincount, a gather of a few hundred blocks) is
still above ATen's grain size, so it wakes the OpenMP team, and waking sleeping threads
(`OMP_WAIT_POLICY=PASSIVE`, or any thread the scheduler has parked on a busy host) costs more
than the op. A build makes dozens of them and only a handful of passes over whole rows (a
logsumexp, a full-row top-k) gain from a second thread. The block maxima, a pass over whole
rows too, stay on one: a max is exact in any order and that pass gained less from a second
thread than the wake-up cost (`row_select.BlockMaxima.maxima`).

Every op here gives the same bits on one thread as on several (element-wise arithmetic,
comparisons, maxima, integer counts, sorts); the full-row reductions whose float sums could
depend on the split run with the caller's threads, exactly as before (`callers_threads`),
except the logsumexp of a caller with two threads, which `row_logsumexp` splits by rows
between this thread and a worker thread, one intra-op thread each (`build_callers_threads`).

Under OpenMP (torch's CPU build) the count is per calling thread: other threads keep theirs
while a build runs, except a thread whose very first torch op falls inside the build, which
starts with one (torch seeds a new thread's count from the last value set).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# None: no build running in this context; n > 0: a build's small ops run on one thread and its
# caller had n; 0: inside one of its full-row passes (nested passes change nothing)
_callers: ContextVar[int | None] = ContextVar("ddtree_callers_threads", default=None)


@contextmanager
def small_ops_on_one_thread(logits: torch.Tensor) -> Iterator[None]:
    """Run the block with one intra-op thread when `logits` live on the host and the caller
    has more; `callers_threads` inside it restores the caller's count for a full-row pass."""
    threads = torch.get_num_threads()
    if threads == 1 or logits.device.type != "cpu" or _callers.get() is not None:
        yield
        return
    token = _callers.set(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _callers.reset(token)


@contextmanager
def callers_threads() -> Iterator[None]:
    """Inside `small_ops_on_one_thread`: the caller's thread count for this block (a pass over
    whole rows). Elsewhere: nothing changes."""
    threads = _callers.get()
    if not threads:
        yield
        return
    token = _callers.set(0)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
        _callers.reset(token)


def build_callers_threads() -> int | None:
    """Inside `small_ops_on_one_thread` and outside its full-row passes: the caller's thread
    count (the build's share of the CPU). Elsewhere None."""
    return _callers.get() or None
