"""Long work speaks: where stderr is no terminal (a pipe, a CI log), a line about each host at
least every `DDTREE_OPS_PROGRESS_EVERY_S` seconds (default 30) while it works, naming the
command, the host, the phase and how long it has been in it, and the last thing it said:

    ddtree-ops: smoke: h1: sglang-e2e: still running (2m30s; last: "Uvicorn running on ...")

The one place for this rule: the smoke view (smoke, bench) and the per-host table of the other
verbs (push, deploy, rollback, collect, hosts check) hand it what their hosts are doing; a line
of their own about a host (a stage that ended, a streamed log line) restarts that host's
interval. On a terminal the live table shows the same, and no line is written.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

PROGRESS_ENV = "DDTREE_OPS_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0
LAST_CHARS = 80


@dataclass(frozen=True)
class Activity:
    """What one host is doing now."""

    host: str
    phase: str  # a stage, "pushing", "deploying", "connecting to ...": what the line names
    since: float  # the clock's time when that phase began
    last: str = ""  # the last thing the host said ("" when nothing)


def progress_every_s() -> float:
    """The interval: $DDTREE_OPS_PROGRESS_EVERY_S (seconds > 0), else 30; a bad value is a
    usage error naming the variable."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return DEFAULT_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        from ddtree_ops.errors import UsageError

        raise UsageError(f"${PROGRESS_ENV}: expected seconds > 0, got {raw!r}")
    return value


def elapsed_text(seconds: float) -> str:
    """`45s`, `2m30s`, `1h05m`: whole seconds, as a log reader reads them."""
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def still_running_line(activity: Activity, now: float) -> str:
    from ddtree_ops.cli.console import inert

    last = " ".join(activity.last.split())
    if len(last) > LAST_CHARS:
        last = last[:LAST_CHARS - 1] + "…"
    said = f'; last: "{inert(last, one_line=True)}"' if last else ""
    return f"{activity.host}: {activity.phase}: still running ({elapsed_text(now - activity.since)}{said})"


class StillRunning:
    """Says `still_running_line` for every host that has worked `every_s` since the last line
    about it. `due()` is the rule (a fake clock tests it); `start()` runs it on a thread that
    wakes often enough to be on time, `stop()` ends it before the command's last lines."""

    def __init__(self, title: str, activities: Callable[[], list[Activity]], *,
                 every_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 say: Optional[Callable[[str], None]] = None):
        from ddtree_ops.cli.console import say as say_line

        self.title, self.activities, self.clock = title, activities, clock
        self.every_s = progress_every_s() if every_s is None else every_s
        self.say = say or say_line
        self.lock = threading.Lock()
        self.last_line: dict[str, float] = {}  # host -> when a line last named it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def spoke(self, host: str) -> None:
        """A line about `host` was just written: its interval starts again."""
        with self.lock:
            self.last_line[host] = self.clock()

    def due(self) -> list[str]:
        """The lines to write now (each host's interval restarts with its line). A host first
        seen at work counts from the start of its phase."""
        now = self.clock()
        lines = []
        for activity in self.activities():
            with self.lock:
                last = self.last_line.setdefault(activity.host, activity.since)
                if now - last < self.every_s:
                    continue
                self.last_line[activity.host] = now
            lines.append(f"{self.title}: {still_running_line(activity, now)}")
        return lines

    def tick(self) -> None:
        for line in self.due():
            self.say(line)

    def start(self) -> "StillRunning":
        wake_s = min(1.0, self.every_s / 4)
        self._thread = threading.Thread(target=self._run, args=(wake_s,), name="still-running", daemon=True)
        self._thread.start()
        return self

    def _run(self, wake_s: float) -> None:
        while not self._stop.wait(wake_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "StillRunning":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
