"""The cause of issue #47 held directly: Rich draws a frame while the live table is made and
started, so the table must not hold its lock then (every verb at a terminal: verbs.py)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_rich_draws_a_frame_while_constructing_the_live_table():
    """The deadlock's cause, held directly: Rich may call `get_renderable` from inside `Live()`
    and `Live.start()` (rich 15 does); the table must not hold its own lock then."""
    from rich.live import Live

    from ddtree_ops.cli import console as console_module

    calls = []
    real_init = Live.__init__

    def spying_init(self, *args, **kwargs):
        getter = kwargs.get("get_renderable")
        if getter is not None:
            calls.append(getter())  # what rich 15 does: a frame at construction
        real_init(self, *args, **kwargs)

    table = console_module.LiveHostTable("t", ["a", "b"])
    terminal = console_module.inert_console(stderr=True, force_terminal=True, width=100)
    Live.__init__ = spying_init
    original = console_module.stderr_console
    console_module.stderr_console = lambda: terminal
    try:
        import threading

        done = threading.Event()
        worker = threading.Thread(target=lambda: (table.start(), done.set()), daemon=True)
        worker.start()
        assert done.wait(30), "LiveHostTable.start() deadlocked with a frame drawn at construction"
        table.on_progress("a", "ok", "")
        table.__exit__(None, None, None)
    finally:
        Live.__init__ = real_init
        console_module.stderr_console = original
    assert calls, "Live was never given our renderable"
