"""`ddtree-ops smoke`: parse the options, run the staged smoke tests on every selected host in
parallel (`ddtree_ops.smoke` does the run) with a live view, and end with the report.

Exit codes: 0 every host passed · 4 no host reachable · 5 a stage failed · 6 partial (some
hosts passed, others failed or died mid-run; their results are kept) · 130 Ctrl-C (the remote
runners are stopped, what arrived is kept) · 2 bad options · 3 bad inventory.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ddtree_ops.cli.console import live_display_possible, say, without_host
from ddtree_ops.cli.interrupts import signals_deferred
from ddtree_ops.cli.options import (
    DEFAULT_PARALLEL,
    AcceptNewHostKeysOpt,
    HostsOpt,
    InventoryOpt,
    JsonOpt,
    MaxFailOpt,
    ParallelOpt,
    SerialOpt,
    rollout_policy,
)
from ddtree_ops.cli.report import RunsDirOpt
from ddtree_ops.smoke import DEFAULT_STAGE_TIMEOUT_S

if TYPE_CHECKING:  # pragma: no cover
    from ddtree_ops.inventory import Host



# ----------------------------------------------------------------------------- options

def parse_int_list(flag: str, text: Optional[str], minimum: int) -> Optional[list[int]]:
    from ddtree_ops.errors import UsageError

    if text is None:
        return None
    values = []
    for word in (w.strip() for w in text.split(",")):
        try:
            value = int(word)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise UsageError(f"{flag}: expected comma-separated integers >= {minimum}, "
                             f"got {word!r} in {text!r}")
        values.append(value)
    return values


def parse_stages(text: Optional[str]) -> list[str]:
    """Stage names as the runner spells them (`tree_bench` is `tree-bench`), each once; []
    when --stages is not given (the default order). Given but empty is refused: it never means all."""
    from ddtree_ops.errors import UsageError

    if text is None:
        return []
    stages: list[str] = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if not word.replace("-", "").replace("_", "").isalnum():
            raise UsageError(f"--stages: not a stage name: {word!r}")
        name = word if word.startswith("_") else word.replace("_", "-")  # `__init__` stays unknown
        if name not in stages:
            stages.append(name)
    if not stages:
        raise UsageError(f"--stages: empty stage list {text!r} (omit --stages for the default order)")
    return stages


# ----------------------------------------------------------------------------- live view

# A host silent this long gets a "last heard" cell (`silent 27s`), well before SILENCE_LIMIT_S.
SILENT_AFTER_S = 10.0
DETAIL_CHARS = 80
STARTING = "starting: importing torch"  # the runner is up but has not sent its run_start yet
_SETTLED = ("done", "failed", "unreachable", "host key refused", "timed out", "interrupted")
_SAID = ("failed", "unreachable", "host key refused", "timed out")  # a line each without a live table


def shorten(text: str, limit: int = DETAIL_CHARS) -> str:
    """One line of at most `limit` characters, cut between words (never inside a number)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return (text[:cut] if cut > 0 else text[:limit]) + " …"


@dataclass
class HostView:
    phase: str = "queued"  # queued, connecting, pushing, starting: ..., running, done, failed
    stages: dict[str, str] = field(default_factory=dict)  # stage -> status or "running"
    current: Optional[str] = None
    detail: str = ""
    started: float = field(default_factory=time.monotonic)
    heard: Optional[float] = None  # when the runner last sent anything (keepalives included)
    since: float = field(default_factory=time.monotonic)  # when the phase (or the stage) began


class SmokeView:
    """Per host and stage while the run goes: a Rich live table on a terminal (stderr), else
    one stderr line per finished stage and, while a host works, a `still running` line at
    least every 30 s (cli/still_running.py). Host threads only record (under a short lock); the
    table is drawn at a fixed rate from a snapshot, never while a host thread waits, and past
    the terminal's height it shows the hosts under way and counts the rest. `verbose`: each
    host's stage output, as the runner streams it, one stderr line per line."""

    def __init__(self, title: str, hosts: list[str], quiet: bool = False,
                 clock: Any = time.monotonic, verbose: bool = False):
        from ddtree_ops.cli.console import stderr_console

        self.title, self.quiet, self.clock, self.verbose = title, quiet, clock, verbose
        self.hosts = {h: HostView(started=clock(), since=clock()) for h in hosts}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.console = stderr_console()
        self.live: Any = None
        self.still_running: Any = None
        from ddtree_ops.cli.still_running import progress_every_s

        self.progress_every_s = progress_every_s()  # a bad $DDTREE_OPS_PROGRESS_EVERY_S: refused before any host

    def __enter__(self) -> "SmokeView":
        if live_display_possible(self.console) and not self.quiet:
            from rich.live import Live

            live = Live(get_renderable=lambda: self.render(self.console.height), console=self.console,
                        refresh_per_second=4, transient=True)
            with signals_deferred():  # started whole or not at all (a Ctrl-C right at the start)
                live.__enter__()
                self.live = live
        elif not self.quiet:
            from ddtree_ops.cli.still_running import StillRunning

            self.still_running = StillRunning(self.title, self.activities, every_s=self.progress_every_s,
                                              clock=self.clock).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.still_running is not None:
            self.still_running.stop()
        if self.live is not None:
            with signals_deferred():
                self.live.__exit__(*exc)

    def activities(self) -> list[Any]:
        """What each host under way is doing (for the `still running` lines)."""
        from ddtree_ops.cli.still_running import Activity

        with self.lock:
            return [Activity(name, view.current or view.phase, view.since, view.detail)
                    for name, view in self.hosts.items() if view.phase not in (*_SETTLED, "queued")]

    def phase(self, host: str, phase: str, detail: str = "") -> None:
        with self.lock:
            view = self.hosts[host]
            if phase == "running" and not view.stages:
                phase, view.heard = STARTING, self.clock()
            if phase != view.phase:
                view.since = self.clock()
            view.phase, view.detail = phase, shorten(without_host(host, detail, phase))
        if self.live is None and not self.quiet and phase in _SAID:
            self._line(f"{host}: {phase}: {without_host(host, detail, phase)}", host)

    def heard(self, host: str) -> None:
        """Any line from the host's runner, a blank keepalive included."""
        with self.lock:
            self.hosts[host].heard = self.clock()

    def record(self, host: str, record: dict[str, Any]) -> None:
        kind, stage = record.get("event"), record.get("stage")
        if kind == "output":
            self._output(host, record)
            return
        with self.lock:
            view = self.hosts[host]
            view.heard = self.clock()
            if kind == "run_start":
                view.phase, view.since = "running", self.clock()
                for name in record.get("stages") or []:
                    view.stages.setdefault(name, "queued")
                    if name not in self.order:
                        self.order.append(name)
            elif kind == "stage_start" and stage:
                view.stages[stage], view.current, view.detail = "running", stage, ""
                view.since = self.clock()
            elif kind == "stage_end" and stage:
                view.stages[stage], view.current, view.since = str(record.get("status")), None, self.clock()
            elif kind == "log" and stage:
                view.detail = shorten(str(record.get("message", "")))
            elif kind == "heartbeat" and record.get("last_output"):  # the stage's (or its server's) last line
                view.detail = shorten(str(record["last_output"]))
        if self.live is None and not self.quiet and kind == "stage_end":
            reason = record.get("reason") or ""
            self._line(f"{host}: {stage}: {record.get('status')} "
                       f"({float(record.get('duration_s') or 0):.1f}s)"
                       + (f": {reason}" if reason and record.get("status") != "pass" else ""), host)

    def _output(self, host: str, record: dict[str, Any]) -> None:
        """`-v`: the lines a host's stage wrote (its log, or a log it keeps beside, e.g. a
        server's), as `<host>: <stage>[/<file>] | <line>`; inert, like every host string."""
        with self.lock:
            self.hosts[host].heard = self.clock()
        if not self.verbose:
            return
        where = str(record.get("stage"))
        if record.get("file"):
            where += f"/{record['file']}"
        for line in record.get("lines") or []:
            say(f"{host}: {where} | {line}")
        if self.still_running is not None:
            self.still_running.spoke(host)

    def _line(self, text: str, host: Optional[str] = None) -> None:
        say(f"{self.title}: {text}")
        if host is not None and self.still_running is not None:
            self.still_running.spoke(host)

    def render(self, height: Optional[int] = None) -> Any:
        """The table from a snapshot taken under the lock (copies only); past `height` lines
        the hosts under way come first and a caption counts every phase."""
        from rich.table import Table

        from ddtree_ops.cli.console import fit_rows
        from ddtree_ops.cli.report import _STATUS_STYLE, _styled

        with self.lock:
            order = list(self.order)
            rows = [(name, view.phase, dict(view.stages), view.detail, view.started, view.heard)
                    for name, view in self.hosts.items()]
        now = self.clock()
        rows, caption = fit_rows(rows, height, lambda row: row[1], ("queued", "done"))
        silences = {row[0]: now - row[5] for row in rows
                    if row[5] is not None and row[1] not in _SETTLED and now - row[5] >= SILENT_AFTER_S}
        table = Table(title=f"{self.title} (live)", title_justify="left", caption=caption,
                      caption_justify="left")
        table.add_column("host")
        table.add_column("phase")
        for stage in order:
            table.add_column(stage)
        table.add_column("time", justify="right")
        if silences:
            table.add_column("last heard", justify="right")
        table.add_column("detail", overflow="fold", max_width=DETAIL_CHARS)  # folded, never cut
        for name, phase, stages, detail, started, _ in rows:
            cells = [_styled(stages.get(s, ""), _STATUS_STYLE) for s in order]
            silent = [f"silent {silences[name]:.0f}s" if name in silences else ""] if silences else []
            table.add_row(name, phase, *cells, f"{now - started:.0f}s", *silent, detail)
        return table


# ----------------------------------------------------------------------------- the run

def run_smoke(
    *,
    inventory: Optional[Path],
    hosts: Optional[list[str]],
    stages: list[str],
    options: dict[str, Any],
    keep_going: bool,
    json_out: bool,
    push: bool,
    source: Optional[Path],
    stage_timeout_s: float,
    runs_dir: Optional[Path],
    parallel: int,
    accept_new_host_keys: bool,
    command: str = "smoke",
    run_id: Optional[str] = None,
    rollout: Any = None,
    plot: Optional[Path] = None,
    verbose: bool = False,
) -> int:
    """`smoke` and `bench`: the run (ddtree_ops.smoke) with a live view, then the report (and
    its charts in `plot`), then the final line: nothing is left to do once it is printed."""
    from ddtree_ops.cli.console import emit_json, stdout_console
    from ddtree_ops.cli.options import select_hosts
    from ddtree_ops.cli.report import render_report
    from ddtree_ops.errors import ExitCode
    from ddtree_ops.report.model import build_report
    from ddtree_ops.smoke import execute_smoke

    _, selected = select_hosts(inventory, hosts)
    run = execute_smoke(
        selected, stages=stages, options=options, keep_going=keep_going, push=push, source=source,
        stage_timeout_s=stage_timeout_s, runs_dir=runs_dir, parallel=parallel,
        accept_new_host_keys=accept_new_host_keys,
        observer=SmokeView(command, [h.name for h in selected], verbose=verbose),
        notify=say, announce=not json_out, command=command, run_id=run_id, rollout=rollout, stream_output=verbose)
    plan, store, batches, started, interrupted = run.plan, run.store, run.batches, run.started, run.interrupted
    refused = run.refused
    report = build_report(store.load(plan.run_id))
    code = ExitCode.INTERRUPTED if interrupted else report.exit_code
    store.update_run(plan.run_id, exit_code=int(code))
    if refused and not interrupted:
        say(f"the runner refused the plan: {refused[0]}")  # the report's exit code is 2
    plots: list[str] = []
    if plot is not None:  # drawn before the final line (matplotlib's first start takes a while)
        from ddtree_ops.report.plots import plot_run

        plots = [str(p) for p in plot_run(report, plot)]
    if json_out:
        document = report.to_dict()
        document["exit_code"] = int(code)
        document["command"] = command
        if batches is not None and batches.planned > 1:
            document["rollout"] = batches.to_dict()
        if plot is not None:
            document["plots"] = plots
        emit_json(document)
    else:
        render_report(report, stdout_console())
        if batches is not None and batches.stopped:
            say(f"{command}: rollout stopped after {batches.stopped}; not started: {', '.join(batches.not_started)}")
        for path in plots:
            say(f"wrote {path}")
        if plot is not None and not plots:
            say("no tree-bench or decode-bench results in this run: nothing to plot")
        say(f"{command} run {plan.run_id}: exit {int(code)} "
            f"({time.time() - started:.1f}s; `ddtree-ops report {plan.run_id}` to see it again)")
    return int(code)




# ----------------------------------------------------------------------------- the command

def stages_help() -> str:
    """--stages' help, naming the stages this checkout ships (the stage modules and STAGE_ORDER:
    a stage added there shows here)."""
    from ddtree_ops.hostside.protocol import STAGE_ORDER, stage_names, stages_dir

    names = stage_names(p.stem for p in stages_dir().glob("*.py"))
    default = [s for s in names if s in STAGE_ORDER]
    others = [s for s in names if s not in STAGE_ORDER]
    return ("Comma-separated stages, run in the order given. Default: " + ", ".join(default)
            + (f". Only when named: {', '.join(others)}." if others else "."))


StagesOpt = Annotated[Optional[str], typer.Option("--stages", help=stages_help(), show_default=False)]
BudgetsOpt = Annotated[Optional[str], typer.Option(
    "--budgets", help="Tree budgets for the sweeps (default: 16,32,64,128,256,512,1024).",
    show_default=False)]
BatchSizesOpt = Annotated[Optional[str], typer.Option(
    "--batch-sizes", help="Batch sizes for tree-bench (default: 1,16).", show_default=False)]
RepeatOpt = Annotated[Optional[int], typer.Option(
    "--repeat", min=1, help="Timed calls per benchmark point (default: 3; more = steadier).",
    show_default=False)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for the random logits.")]
KeepGoingOpt = Annotated[bool, typer.Option(
    "--keep-going", help="Run the remaining stages after a failure (default: report them as not run).")]
NoPushOpt = Annotated[bool, typer.Option(
    "--no-push", help="Test whatever release is active on the hosts (skip the push).")]
SourceOpt = Annotated[Optional[Path], typer.Option(
    "--source", help="Push this checkout instead of the ddtree ddtree-ops runs with.",
    show_default=False)]
StageTimeoutOpt = Annotated[float, typer.Option(
    "--stage-timeout", min=1, max=7 * 24 * 3600,
    help="Seconds a stage may run before it is stopped and failed (at most a week: every stage is bounded).")]


VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Stream what each host's stages write (their logs, a server's log) to stderr as it is "
                            "written, one line each: `<host>: <stage> | <line>`.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE",
    help="A stage knob (options.extra, see docs/smoke.md), repeatable: e.g. --set strict=true "
         "--set max_new_tokens=64; VALUE is read as JSON, else taken as a string. An unknown knob or "
         "a bad value is refused before anything runs.",
    show_default=False)]


def parse_extra(settings: Optional[list[str]]) -> dict[str, Any]:
    """`--set key=value` pairs -> options.extra (JSON values, else strings), checked against
    the stages' knob table (the one the runner checks with) before anything is allocated or
    pushed: an unknown knob or a bad value is a usage error naming it."""
    from ddtree.bounded_files import FileRefused, NotJson, parse_json

    from ddtree_ops.errors import UsageError
    from ddtree_ops.hostside.protocol import check_knobs

    extra: dict[str, Any] = {}
    for setting in settings or []:
        key, sep, raw = setting.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum():
            raise UsageError(f"--set: expected KEY=VALUE with a name of letters, digits and _, got {setting!r}")
        try:
            value = parse_json(raw, f"--set {key}")
        except NotJson:
            value = raw
        except FileRefused as err:  # nested past the depth limit
            raise UsageError(str(err)) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--set {key}: expected a finite value, got {raw!r}")
        extra[key] = value
    try:
        return check_knobs(extra)
    except ValueError as err:
        raise UsageError(str(err)) from None


def build_options(budgets: Optional[str], batch_sizes: Optional[str], repeat: Optional[int],
                  seed: int, settings: Optional[list[str]] = None) -> dict[str, Any]:
    options: dict[str, Any] = {"seed": seed}
    extra = parse_extra(settings)
    if extra:
        options["extra"] = extra
    parsed = parse_int_list("--budgets", budgets, 0)
    if parsed is not None:
        options["budgets"] = parsed
    parsed = parse_int_list("--batch-sizes", batch_sizes, 1)
    if parsed is not None:
        options["batch_sizes"] = parsed
    if repeat is not None:
        options["repeat"] = repeat
    return options


def smoke(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    stages: StagesOpt = None,
    budgets: BudgetsOpt = None,
    batch_sizes: BatchSizesOpt = None,
    repeat: RepeatOpt = None,
    seed: SeedOpt = 0,
    keep_going: KeepGoingOpt = False,
    json_out: JsonOpt = False,
    no_push: NoPushOpt = False,
    source: SourceOpt = None,
    stage_timeout: StageTimeoutOpt = DEFAULT_STAGE_TIMEOUT_S,
    runs_dir: RunsDirOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    settings: SetOpt = None,
    serial: SerialOpt = None,
    max_fail_percent: MaxFailOpt = None,
    verbose: VerboseOpt = False,
) -> int:
    """Push, run the staged smoke tests on every selected host, keep the results, report."""
    policy = rollout_policy(serial, max_fail_percent)
    return run_smoke(
        inventory=inventory, hosts=hosts, stages=parse_stages(stages),
        options=build_options(budgets, batch_sizes, repeat, seed, settings), keep_going=keep_going,
        json_out=json_out, push=not no_push, source=source, stage_timeout_s=stage_timeout,
        runs_dir=runs_dir, parallel=parallel, accept_new_host_keys=accept_new_host_keys, rollout=policy,
        verbose=verbose)


def register(app: typer.Typer) -> None:
    app.command("smoke")(smoke)
