"""Terminal output shared by host commands: a live per-host table while a fan-out runs (stderr),
a summary table at the end (stdout), or one JSON document on stdout with `--json`.

Command modules call `run_on_hosts(...)`:

    code = run_on_hosts(
        "push", hosts, task, options,
        columns=["action", "release"],            # extra summary columns
        row=lambda outcome: [outcome.value.action.value, outcome.value.release_id],
        to_json=lambda value: value.to_dict(),     # per-host "result" in --json
        extra_json={"release": bundle.release_id},
    )
    return code

Text from outside this program (host replies, records, tracebacks, inventory and baseline
fields) reaches the operator only through this module, and is made inert here: the consoles
never read Rich markup or emoji codes, and every string they draw, like every `say()` line,
has its control characters shown as escapes (`inert`). Styled words are `styled(...)` Text.
`--json` documents carry the exact text (JSON escapes control characters itself).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import re
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from ddtree_ops.cli.interrupts import signals_deferred
from ddtree_ops.cli.options import FanoutOptions

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

# Rich is imported inside the functions that draw: a fan-out starts its hosts first and imports
# Rich (~20 ms) while they connect, instead of before.

_STATE_STYLE = {
    "queued": "dim",
    "connecting": "cyan",
    "running": "yellow",
    "ok": "green",
    "failed": "red",
    "unreachable": "red",
    "host key refused": "red",
    "timed out": "red",
    "skipped": "dim",
    "interrupted": "magenta",
}


_FINAL_STATES = {"ok", "failed", "unreachable", "host key refused", "timed out", "skipped", "interrupted"}


# Anything a terminal may act on: C0 controls but tab and newline (ESC starts CSI/OSC
# sequences: colours, cursor moves, title changes, OSC 52 clipboard writes), DEL, C1 controls
# (0x9b is a one-byte CSI), and, past ASCII, format characters (bidi overrides that reorder a
# line), line/paragraph separators and lone surrogates.
_SUSPECT = re.compile(r"[^\x20-\x7e\t\n]")
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _visible(char: str) -> str:
    code = ord(char)
    if char == "\r":
        return "\\r"
    if code < 0x20 or 0x7F <= code <= 0x9F or unicodedata.category(char) in _UNSAFE_CATEGORIES:
        return f"\\x{code:02x}" if code < 0x100 else (f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return char


def inert(text: str, *, one_line: bool = False) -> str:
    """`text` with every character a terminal could act on written as a visible escape
    (`\\x1b`, `\\r`, `\\u202e`); newlines kept unless `one_line` (then `\\n`)."""
    text = _SUSPECT.sub(lambda m: _visible(m.group()), text)
    return text.replace("\n", "\\n") if one_line else text


def styled(text: Any, style: str = "") -> "Any":
    """A Rich Text of `text` (inert) in `style`: how a coloured word reaches a table or line."""
    from rich.text import Text

    return Text(inert(str(text)), style=style)


@functools.cache
def _inert_console_class() -> type:
    from rich.console import Console

    class InertConsole(Console):
        """Draws the control characters of every string it is given as escapes (Rich's own
        styling and cursor codes are not strings, so they still work)."""

        def render_str(self, text: str, **kwargs: Any):  # noqa: ANN201 - rich.text.Text
            return super().render_str(inert(text), **kwargs)

    return InertConsole


def inert_console(**options: Any) -> Console:
    """A console that never reads markup or emoji codes in strings, and keeps them inert."""
    return _inert_console_class()(markup=False, emoji=False, highlight=False, **options)


def stderr_console() -> Console:
    probe = inert_console(stderr=True)
    if probe.is_dumb_terminal:
        return inert_console(stderr=True, **_dumb_terminal_size(sys.stderr))
    return probe if probe.is_terminal or _columns_given() else inert_console(stderr=True, width=200)


def stdout_console() -> Console:
    probe = inert_console()
    if probe.is_dumb_terminal:
        return inert_console(**_dumb_terminal_size(sys.stdout))
    # Not a terminal (pipes, CI logs, tests): wide enough that rows never wrap mid-message,
    # unless COLUMNS says how wide (Rich reads it).
    if probe.is_terminal or _columns_given():
        return probe
    return inert_console(width=200, soft_wrap=False)


def _columns_given() -> bool:
    return os.environ.get("COLUMNS", "").strip().isdigit()


def _dumb_terminal_size(stream: Any) -> dict[str, int]:
    """A dumb terminal's real size (COLUMNS, else the terminal's own): Rich takes every dumb
    terminal for 80x25 unless given both, and a summary squeezed into 80 columns cut release
    ids across lines."""
    try:
        columns, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        columns, lines = 80, 25
    if _columns_given():
        columns = int(os.environ["COLUMNS"])
    return {"width": columns or 80, "height": lines or 25}


def live_display_possible(console: Console) -> bool:
    """A redrawn live table needs a real terminal: a dumb one (TERM=dumb) gets lines instead."""
    return console.is_terminal and not console.is_dumb_terminal


def without_host(host: str, text: str, state: str = "") -> str:
    """An error shown next to its host (and its state), without the `<host>: ` (and the
    `<state>: `) it starts with: `h1: unreachable: cannot resolve`, never `unreachable: unreachable:`."""
    for prefix in (f"{host}: ", f"{state}: " if state else None):
        while prefix and text.startswith(prefix):
            text = text[len(prefix):]
    return text


_documents_emitted = 0  # how many JSON documents this process began to write on stdout


def emit_json(document: Any, *, one_line: bool = False) -> None:
    """Write the command's one JSON document on stdout (the CLI boundary writes one for an
    error only when none was begun here, so a script never reads two). `one_line`: a document
    of a stream (`status --watch --json`), one per line."""
    global _documents_emitted
    _documents_emitted += 1  # counted first: a document cut short by a closed pipe still counts
    sys.stdout.write(json.dumps(document, indent=None if one_line else 2, default=str) + "\n")
    sys.stdout.flush()


def documents_emitted() -> int:
    return _documents_emitted


def say(message: str) -> None:
    """A progress/log line on stderr (never on stdout, which may carry JSON); always one
    line, inert (it often quotes a host)."""
    sys.stderr.write(f"ddtree-ops: {inert(message, one_line=True)}\n")
    sys.stderr.flush()


TABLE_CHROME_LINES = 6  # title, borders, header and caption of the live table


def fit_rows(rows: list[Any], height: Optional[int], state_of: Callable[[Any], str],
             idle: Sequence[str]) -> tuple[list[Any], Optional[str]]:
    """The rows a live table of `height` lines can show, and a caption counting every state
    when some are left out: hosts in an `idle` state (done, queued) give way first."""
    if height is None or len(rows) <= max(height - TABLE_CHROME_LINES, 1):
        return rows, None
    room = max(height - TABLE_CHROME_LINES - 1, 1)
    counts: dict[str, int] = {}
    for row in rows:
        counts[state_of(row)] = counts.get(state_of(row), 0) + 1
    shown = [row for row in rows if state_of(row) not in idle][:room]
    caption = (f"{len(rows)} hosts: " + ", ".join(f"{n} {state}" for state, n in counts.items())
               + (f"; {len(rows) - len(shown)} not shown" if len(shown) < len(rows) else ""))
    return shown, caption


class LiveHostTable:
    """Per-host state while a fan-out runs. On a terminal: a Rich live table on stderr.
    Otherwise: one stderr line per finished host, and a `still running` line about each host at
    work at least every 30 s (cli/still_running.py). Safe to call from worker threads.

    Rows are kept from the first call; the display begins at `start()`, which the fan-out
    calls once its hosts are under way (what finished before is shown then)."""

    def __init__(self, title: str, host_names: Sequence[str]):
        self.title = title
        self.rows: dict[str, tuple[str, str, float]] = {n: ("queued", "", time.monotonic()) for n in host_names}
        self.started: dict[str, float] = {}
        self.lock = threading.Lock()
        self.showing = False
        self.closed = False  # the command is past its fan-out (done or interrupted)
        self.live: Optional[Live] = None
        self.live_wanted = False  # set under the lock before the live table exists: no lines then
        self.height: Optional[int] = None
        self.still_running: Any = None  # without a live table: the lines while hosts work
        from ddtree_ops.cli.still_running import progress_every_s

        self.progress_every_s = progress_every_s()  # a bad $DDTREE_OPS_PROGRESS_EVERY_S: refused before any host

    def __enter__(self) -> "LiveHostTable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.start()  # a fan-out that never started its display still reports its hosts
        with self.lock:
            # An interrupted fan-out leaves its workers to finish on their own: what they
            # report now would land after the command's final line ("interrupted").
            self.closed = True
        if self.still_running is not None:
            self.still_running.stop()
        if self.live is not None:
            with signals_deferred():
                self.live.__exit__(*exc)

    def start(self) -> None:
        if self.showing:
            return
        # Rich is loaded before taking the lock: the hosts' threads report through it meanwhile.
        # Loaded whole: Ctrl-C inside a module's import leaves it half made (a class body cut
        # off reads as a RuntimeError, not an interrupt), and it comes now, as the hosts start.
        with signals_deferred():
            console = stderr_console()
            for module in ("rich.live", "rich.text", "rich.table"):  # what `_render` imports
                importlib.import_module(module)
        from rich.live import Live

        with self.lock:
            if self.showing:
                return
            self.showing = True
            live_wanted = self.live_wanted = live_display_possible(console)
            if live_wanted:
                self.height = console.height
            done = [(host, row) for host, row in self.rows.items() if row[0] in _FINAL_STATES]
        if live_wanted:
            # Made and started outside the lock: Rich (15 and later) draws a first frame while
            # constructing and starting, and `_frame` takes the lock; holding it here was a
            # self-deadlock on every terminal (issue #47). Drawn per frame, not per event: a
            # frame costs O(hosts), whatever the fleet does.
            live = Live(get_renderable=self._frame, console=console, refresh_per_second=8,
                        transient=True)
            with signals_deferred():  # started whole or not at all: see `signals_deferred`
                live.__enter__()
                with self.lock:
                    self.live = live  # an orphaned Live would redraw below the final line
            return
        for host, (state_text, detail, changed) in done:
            self._say_finished(host, state_text, detail, changed)
        from ddtree_ops.cli.still_running import StillRunning

        self.still_running = StillRunning(self.title, self.activities, every_s=self.progress_every_s).start()

    def activities(self) -> list[Any]:
        """What each host under way is doing (for the `still running` lines): the step its task
        reported (`deploying`, `release <id>`), or whom it is connecting to."""
        from ddtree_ops.cli.still_running import Activity

        with self.lock:
            rows = list(self.rows.items())
        found = []
        for host, (state, detail, changed) in rows:
            if state == "connecting":
                found.append(Activity(host, f"connecting to {detail}" if detail else state, changed))
            elif state == "running":
                found.append(Activity(host, detail or state, changed))
        return found

    def on_progress(self, host: str, state: Any, detail: str) -> None:
        state_text = getattr(state, "value", str(state))
        now = time.monotonic()
        with self.lock:
            if state_text == "connecting":
                self.started[host] = now
            self.rows[host] = (state_text, detail, now)
            line_now = self.showing and not self.live_wanted and not self.closed
        if line_now and getattr(state, "terminal", False):
            self._say_finished(host, state_text, detail, now)

    def _say_finished(self, host: str, state_text: str, detail: str, changed: float) -> None:
        elapsed = changed - self.started.get(host, changed)
        tail = f": {without_host(host, detail, state_text)}" if detail and state_text != "ok" else ""
        say(f"{self.title}: {host}: {state_text} ({elapsed:.1f}s){tail}")
        if self.still_running is not None:
            self.still_running.spoke(host)

    def _frame(self) -> Table:
        return self._render(self.height)

    def _render(self, height: Optional[int] = None) -> Table:
        """The table; past `height` lines only the hosts under way or failed are rows, and a
        caption counts every state (a 64-host fleet in a 40-line terminal stays readable).
        The state is copied under the lock and drawn outside it: Rich may call back into us
        (or into a host thread's report) while it renders."""
        from rich.table import Table

        with self.lock:
            snapshot, started = list(self.rows.items()), dict(self.started)
        rows, caption = fit_rows(snapshot, height, lambda row: row[1][0],
                                 ("ok", "queued", "skipped"))
        table = Table(title=self.title, title_justify="left", expand=False, caption=caption,
                      caption_justify="left")
        table.add_column("host")
        table.add_column("state")
        table.add_column("time", justify="right")
        table.add_column("detail", overflow="fold", max_width=80)  # folded: a value is never cut
        now = time.monotonic()
        for host, (state, detail, changed) in rows:
            begun = started.get(host)
            finished = state in _FINAL_STATES
            elapsed = ((changed if finished else now) - begun) if begun is not None else 0.0
            table.add_row(host, styled(state, _STATE_STYLE.get(state, "")), f"{elapsed:.1f}s", detail)
        return table


def outcome_json(outcome: Any, to_json: Optional[Callable[[Any], Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "state": outcome.state.value,
        "ok": outcome.ok,
        "duration_s": round(outcome.duration_s, 3),
    }
    if outcome.ok:
        doc["result"] = to_json(outcome.value) if to_json else outcome.value
    else:
        doc["error"] = outcome.message()
        details = getattr(outcome.error, "details", None)
        if details is not None:
            doc["result"] = details
    return doc


def fanout_document(command: str, result: Any, started: float, to_json: Optional[Callable[[Any], Any]] = None,
                    extra_json: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A fan-out's `--json` document: the command, its exit code and time, each host's outcome."""
    return {
        "command": command,
        "exit_code": int(result.exit_code()),
        "duration_s": round(time.monotonic() - started, 3),
        **(extra_json or {}),
        "hosts": {name: outcome_json(o, to_json) for name, o in result.items()},
    }


def summary_table(
    title: str,
    result: Any,
    columns: Sequence[str],
    row: Callable[[Any], Sequence[str]],
) -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    # fold, never elide: a cut host name, release id or version could read as another one
    table.add_column("host", overflow="fold")
    table.add_column("state")
    for column in columns:
        table.add_column(column, overflow="fold")
    table.add_column("time", justify="right")
    table.add_column("error", overflow="fold")
    for name, outcome in result.items():
        has_facts = outcome.ok or getattr(outcome.error, "details", None) is not None
        cells = [str(c) for c in row(outcome)] if has_facts else [""] * len(columns)
        table.add_row(
            name,
            styled(outcome.state.value, _STATE_STYLE.get(outcome.state.value, "")),
            *cells,
            f"{outcome.duration_s:.2f}s",
            "" if outcome.ok else without_host(name, outcome.message(), outcome.state.value),
        )
    return table


def run_on_hosts(
    command: str,
    hosts: Sequence[Any],
    task: Callable[[Any], Any],
    options: FanoutOptions,
    *,
    columns: Sequence[str] = (),
    row: Callable[[Any], Sequence[str]] = lambda outcome: [],
    to_json: Optional[Callable[[Any], Any]] = None,
    extra_json: Optional[dict[str, Any]] = None,
    deadline_s: Optional[float] = None,
    while_running: Optional[Callable[[], Any]] = None,
    changed: Optional[Callable[[Any], bool]] = None,
    rollback_command: Optional[Callable[[list[str]], str]] = None,
    restores: Optional[Callable[[Any], Optional[str]]] = None,
) -> int:
    """Fan `task(ctx)` out over hosts with live progress; print the summary or the JSON
    document; return the exit code (0/4/5/6) for the command to return.

    `row(outcome)` gives the extra summary cells of a host that succeeded (or whose error has
    `.details`, like a failed check that still gathered facts). `while_running()` is called
    once the hosts are connecting (work the hosts need only later, e.g. the release archive).
    With `options.rollout` the hosts go in batches (see ddtree_ops.rollout); `changed(outcome)`
    says whether a host was changed, and `rollback_command(hosts)` undoes exactly those;
    `restores(outcome)`: the release that rollback puts back on the host (None: it removes all)."""
    from ddtree_ops.fanout import HostState, run_fanout
    from ddtree_ops.rollout import RolloutPolicy, run_rollout

    started = time.monotonic()
    with LiveHostTable(command, [h.name for h in hosts]) as live:

        def launched() -> None:
            live.start()
            if while_running is not None:
                while_running()

        def one_batch(batch: list[Any]) -> Any:
            return run_fanout(
                batch,
                task,
                parallel=options.parallel,
                fail_fast=options.fail_fast,
                accept_new_host_keys=options.accept_new_host_keys,
                deadline_s=deadline_s,
                on_progress=live.on_progress,
                on_launched=launched,
            )

        rollout = run_rollout(hosts, options.rollout or RolloutPolicy(), one_batch)
        for name in rollout.not_started:
            live.on_progress(name, HostState.SKIPPED, rollout.result[name].detail)
    result = rollout.result
    code = result.exit_code()
    batched = options.rollout is not None and options.rollout.batched
    changes = _changes(rollout, changed, rollback_command, restores) if batched else {}
    if options.json:
        document = fanout_document(command, result, started, to_json, extra_json)
        if batched:
            document["rollout"] = {**rollout.to_dict(), **changes}
        emit_json(document)
    else:
        stdout_console().print(summary_table(command, result, columns, row))
        if batched and (rollout.stopped or result.failed):
            _say_changes(command, rollout, changes)
        ok, total = len(result.succeeded), len(result)
        say(f"{command}: {ok}/{total} host(s) ok in {time.monotonic() - started:.1f}s (exit {int(code)})")
    return int(code)


def _changes(rollout: Any, changed: Optional[Callable[[Any], bool]],
             rollback_command: Optional[Callable[[list[str]], str]],
             restores: Optional[Callable[[Any], Optional[str]]] = None) -> dict[str, Any]:
    """Which hosts this rollout changed, which it did not, the command that undoes exactly the
    changed, and what that command leaves on each of them."""
    if changed is None:
        return {}
    hosts = [name for name, outcome in rollout.result.items() if changed(outcome)]
    found = {"changed": hosts, "unchanged": [name for name in rollout.result if name not in hosts],
             "rollback_command": rollback_command(hosts) if rollback_command is not None and hosts else None}
    if restores is not None:
        found["rollback_restores"] = {name: restores(rollout.result[name]) for name in hosts}
    return found


def _say_changes(command: str, rollout: Any, changes: dict[str, Any]) -> None:
    if rollout.stopped:
        say(f"{command}: rollout stopped after {rollout.stopped}")
    if rollout.not_started:
        say(f"{command}: not started (untouched): {', '.join(rollout.not_started)}")
    if "changed" in changes:
        say(f"{command}: changed: {', '.join(changes['changed']) or 'none'}")
        say(f"{command}: not changed: {', '.join(changes['unchanged']) or 'none'}")
    if changes.get("rollback_command"):
        say(f"{command}: to roll back exactly the changed hosts: {changes['rollback_command']}")
        for name, release in (changes.get("rollback_restores") or {}).items():
            say(f"{command}:   {name}: " + (f"back to release {release}" if release else "the plugin removed"))
