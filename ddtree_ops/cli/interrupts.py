"""SIGTERM interrupts a command the way Ctrl-C does.

A CI job cancel (and `kill`) sends SIGTERM, whose default action ends the process at once:
no remote runner stopped, no record finished, nothing on stdout. While a command runs, the
first SIGINT or SIGTERM raises KeyboardInterrupt instead, so every Ctrl-C path applies
(`smoke` stops its runners and keeps what arrived; the CLI boundary exits 130 with one line,
and one JSON document under `--json`). What is raised is `errors.Interrupted`, a
KeyboardInterrupt that names its signal: the final line says `interrupted (SIGINT)` or
`interrupted (SIGTERM)`, and `smoke` stops the hosts' runners with the same signal, so their
records say what the operator did (a bare KeyboardInterrupt carried no signal, and every stop
was recorded as the SIGTERM that `runner.py stop` sent).

A repeated SIGTERM during that cleanup is only noted: the cleanup is bounded and finishes
the records. A repeated Ctrl-C is an operator who will not wait: it raises again, and the
boundary still ends quietly. Handlers are installed only in the main thread and restored on
exit, so `main()` called in-process (tests) leaves the caller's handlers as they were.

An interrupt that lands where Python swallows exceptions (a weakref callback, `__del__`)
is sent again (`ddtree_ops.hostside.signals`).
"""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_keep_settled = False


def keep_settled_after_command() -> None:
    """For the console script, which ends the process right after `main()`: the handlers are
    not restored once the command is over, so signals stay ignored until the process exits."""
    global _keep_settled
    _keep_settled = True


@contextmanager
def signals_interrupt() -> Iterator[Callable[[], None]]:
    """Within the block, SIGINT/SIGTERM raise `Interrupted` (see the module doc). Yields
    `settle()`: call it once the command is over, so that a late signal cannot cut the final
    report (one line, one JSON document) short."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None  # signal handlers can only be set from the main thread
        return
    from ddtree_ops.errors import Interrupted
    from ddtree_ops.hostside.signals import Redelivery

    interrupted = False

    def never_arrived(signum: int) -> None:
        nonlocal interrupted
        interrupted = False  # swallowed where it landed: the re-sent signal is a first one

    redelivery = Redelivery(on_swallowed=never_arrived)

    def interrupt(signum: int) -> BaseException:
        nonlocal interrupted
        interrupted = True
        return redelivery.raising(Interrupted(signal.Signals(signum).name), signum)

    def on_sigint(signum: int, frame: Any) -> None:
        if not _deferred(signum):
            raise interrupt(signum)

    def on_sigterm(signum: int, frame: Any) -> None:
        if _deferred(signum):
            return
        if interrupted:
            sys.stderr.write("ddtree-ops: terminated again: still stopping (Ctrl-C to stop at once)\n")
            return
        raise interrupt(signum)

    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    # An inherited SIG_IGN (a background job, `nohup`) stays ignored; SIGINT is taken over only
    # from Python's own handler, so an embedding program's handler is left alone.
    if previous[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    if previous[signal.SIGTERM] is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, on_sigterm)
    redelivery.install()

    def settle() -> None:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    try:
        yield settle
    finally:
        redelivery.remove()
        if _keep_settled:
            settle()
        else:
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, cannot be restored from here
                    signal.signal(sig, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """An interrupt that comes during the block is held back and delivered as the block ends:
    for a step that must not be cut half-way, such as starting or stopping Rich's live display
    (a Live interrupted inside `start` can be neither used nor stopped: it went on redrawing
    below the final line, and the cursor stayed hidden). Held in the handlers, not by a signal
    mask: a process-directed signal goes to any thread that does not block it."""
    global _defer_depth, _deferred_signal
    if threading.current_thread() is not threading.main_thread():
        yield  # the handlers run in the main thread only
        return
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
        if _defer_depth == 0 and _deferred_signal is not None:
            signum, _deferred_signal = _deferred_signal, None
            signal.raise_signal(signum)  # now, where it lands whole


_defer_depth = 0  # how many `signals_deferred` blocks the main thread is in
_deferred_signal: int | None = None  # the first interrupt that came during them


def _deferred(signum: int) -> bool:
    """Inside `signals_deferred`: remember the signal (the first one) instead of acting on it."""
    global _deferred_signal
    if _defer_depth == 0:
        return False
    if _deferred_signal is None:
        _deferred_signal = signum
    return True
