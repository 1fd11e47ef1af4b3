"""A stop signal that raises in the main thread still arrives where Python swallows it.

A signal handler runs wherever the main thread happens to be. If that is a weakref callback
or a `__del__` (an import's module-lock callback is one), Python does not propagate what the
handler raises: it reports it to `sys.unraisablehook` and carries on, and the stop is lost
(a runner or a command runs on as if no signal came). While a `Redelivery` is installed, that
hook sends the same signal to the main thread again until the exception lands where it can
propagate.

Stdlib only: the smoke runner on a GPU host and the operator's CLI both use it.
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional


class Redelivery:
    """Handlers raise `redelivery.raising(error, signum)`; between `install()` and `remove()`
    (or as a context manager) a swallowed one is sent again. `on_swallowed(signum)` runs
    first, e.g. to forget that the signal was seen (the re-sent one is a first one)."""

    def __init__(self, on_swallowed: Optional[Callable[[int], None]] = None):
        self._on_swallowed = on_swallowed
        # each exception a handler raised, by id, with its signal; held, so no id is reused
        self._raised: dict[int, tuple[BaseException, int]] = {}
        self._previous_hook: Optional[Callable[[Any], Any]] = None

    def raising(self, error: BaseException, signum: int) -> BaseException:
        """`error`, remembered as raised by the handler of `signum`."""
        self._raised[id(error)] = (error, signum)
        return error

    def install(self) -> None:
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._hook

    def remove(self) -> None:
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook
            self._previous_hook = None

    def __enter__(self) -> "Redelivery":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _hook(self, unraisable: Any) -> None:
        error, signum = self._raised.pop(id(unraisable.exc_value), (None, None))
        if error is not unraisable.exc_value or signum is None:
            (self._previous_hook or sys.__unraisablehook__)(unraisable)
            return
        if self._on_swallowed is not None:
            self._on_swallowed(signum)
        hook_left = threading.Event()
        threading.Thread(target=_resend_to_main_thread, args=(signum, hook_left), daemon=True,
                         name="resend-signal").start()
        hook_left.set()  # the last step here: the signal must not land in this hook too


def _resend_to_main_thread(signum: int, hook_left: threading.Event) -> None:
    """Sent from its own thread: sent from the main thread, the handler would run at once,
    inside the hook, and be swallowed again. A real signal (not `interrupt_main`) also wakes
    a main thread that is blocked in a system call, unless it lands just before the call
    starts: the waits of the CLI and the runner are short polls, so the next one sees it."""
    hook_left.wait()
    main = threading.main_thread().ident
    if hasattr(signal, "pthread_kill") and main is not None:
        signal.pthread_kill(main, signum)
    else:
        _thread.interrupt_main(signum)
