"""SIGTERM interrupts a command the way Ctrl-C does.

A CI job cancel (and `kill`) sends SIGTERM, whose default action ends the process at once:
no remote runner stopped, no record finished, nothing on stdout. While a command runs, the
first SIGINT or SIGTERM raises KeyboardInterrupt instead, so every Ctrl-C path applies
(`smoke` stops its runners and keeps what arrived; the CLI boundary exits 130 with one line,
and one JSON document under `--json`).

A repeated SIGTERM during that cleanup is only noted: the cleanup is bounded and finishes
the records. A repeated Ctrl-C is an operator who will not wait: it raises again, and the
boundary still ends quietly. Handlers are installed only in the main thread and restored on
exit, so `main()` called in-process (tests) leaves the caller's handlers as they were.

A handler runs wherever the main thread happens to be, and Python swallows an exception
raised inside a weakref callback or `__del__` (an import's module-lock callback is one):
it only reports it to `sys.unraisablehook`. The interrupt would then be lost and the command
would go on as if no signal came. So while the handlers are in place, that hook re-sends
the same signal to the main thread, until the KeyboardInterrupt lands somewhere it can
propagate.
"""
from __future__ import annotations

import _thread
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


def _resend_to_main_thread(signum: int, hook_left: threading.Event) -> None:
    """Sent from its own thread: sent from the main thread, the handler would run at once,
    inside the hook, and be swallowed again. A real signal (not `interrupt_main`) also wakes
    a main thread that is blocked in a system call, unless it lands just before the call
    starts: the command's waits are short polls (fanout: 0.1 s), so the next one sees it."""
    hook_left.wait()
    main = threading.main_thread().ident
    if hasattr(signal, "pthread_kill") and main is not None:
        signal.pthread_kill(main, signum)
    else:
        _thread.interrupt_main(signum)


@contextmanager
def signals_interrupt() -> Iterator[Callable[[], None]]:
    """Within the block, SIGINT/SIGTERM raise KeyboardInterrupt (see the module doc). Yields
    `settle()`: call it once the command is over, so that a late signal cannot cut the final
    report (one line, one JSON document) short."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None  # signal handlers can only be set from the main thread
        return
    interrupted = False
    # Each KeyboardInterrupt a handler raised, by id, with its signal; held, so no id is reused.
    raised: dict[int, tuple[KeyboardInterrupt, int]] = {}

    def interrupt(signum: int) -> KeyboardInterrupt:
        nonlocal interrupted
        interrupted = True
        error = KeyboardInterrupt()
        raised[id(error)] = (error, signum)
        return error

    def on_sigint(signum: int, frame: Any) -> None:
        raise interrupt(signum)

    def on_sigterm(signum: int, frame: Any) -> None:
        if interrupted:
            sys.stderr.write("ddtree-ops: terminated again: still stopping (Ctrl-C to stop at once)\n")
            return
        raise interrupt(signum)

    previous_hook = sys.unraisablehook

    def redeliver_swallowed(unraisable: Any) -> None:
        nonlocal interrupted
        error, signum = raised.pop(id(unraisable.exc_value), (None, None))
        if error is not unraisable.exc_value or signum is None:
            previous_hook(unraisable)
            return
        interrupted = False  # this one never arrived: the re-sent signal is a first one
        hook_left = threading.Event()
        threading.Thread(target=_resend_to_main_thread, args=(signum, hook_left), daemon=True,
                         name="ddtree-ops-resend-interrupt").start()
        hook_left.set()  # the last step here: the signal must not land in this hook too

    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    # An inherited SIG_IGN (a background job, `nohup`) stays ignored; SIGINT is taken over only
    # from Python's own handler, so an embedding program's handler is left alone.
    if previous[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    if previous[signal.SIGTERM] is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, on_sigterm)
    sys.unraisablehook = redeliver_swallowed

    def settle() -> None:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    try:
        yield settle
    finally:
        sys.unraisablehook = previous_hook
        if _keep_settled:
            settle()
        else:
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, cannot be restored from here
                    signal.signal(sig, handler)
