"""`ddtree-ops smoke`: push the release, run the staged smoke tests on every selected host in
parallel (one runner process per host, on the connection the push used), keep every record
as it arrives under `runs/<run-id>/<host>/`, and end with the report.

Exit codes: 0 every host passed · 4 no host reachable · 5 a stage failed · 6 partial (some
hosts passed, others failed or died mid-run; their results are kept) · 130 Ctrl-C (the remote
runners are stopped, what arrived is kept) · 2 bad options · 3 bad inventory.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ddtree_ops.cli.console import live_display_possible, say, without_host
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
from ddtree_ops.release import RUNNER_RELPATH

if TYPE_CHECKING:  # pragma: no cover
    from ddtree_ops.inventory import Host

DEFAULT_STAGE_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0


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


def check_stages_in_bundle(stages: list[str], relpaths: set[str]) -> None:
    from ddtree_ops.errors import UsageError

    from ddtree_ops.release import STAGES_DIR

    available = sorted(p[len(STAGES_DIR) + 1:-3].replace("_", "-") for p in relpaths
                       if p.startswith(STAGES_DIR + "/") and p.endswith(".py")
                       and not p.rsplit("/", 1)[1].startswith("_"))
    unknown = [s for s in stages if s not in available]  # `parse_stages` spelled them; `__init__` is no stage
    if unknown:
        raise UsageError(f"--stages: unknown stage(s) {', '.join(unknown)} "
                         f"(this release has: {', '.join(available)})")


def host_entry(host: "Host") -> dict[str, Any]:
    """The inventory entry as plain data (what run.json keeps and stages see)."""
    entry = {
        "name": host.name, "transport": host.transport.value, "hostname": host.hostname,
        "user": host.user, "port": host.port, "python": host.python, "workdir": host.workdir,
        "groups": list(host.groups), "connect_timeout": host.connect_timeout,
        "command_timeout": host.command_timeout, "inventory": host.source,
    }
    if host.models is not None:
        entry["models"] = host.models.model_dump()
    return entry


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


class SmokeView:
    """Per host and stage while the run goes: a Rich live table on a terminal (stderr), else
    one stderr line per finished stage. Host threads only record (under a short lock); the
    table is drawn at a fixed rate from a snapshot, never while a host thread waits, and past
    the terminal's height it shows the hosts under way and counts the rest."""

    def __init__(self, title: str, hosts: list[str], quiet: bool = False,
                 clock: Any = time.monotonic):
        from ddtree_ops.cli.console import stderr_console

        self.title, self.quiet, self.clock = title, quiet, clock
        self.hosts = {h: HostView(started=clock()) for h in hosts}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.console = stderr_console()
        self.live: Any = None

    def __enter__(self) -> "SmokeView":
        if live_display_possible(self.console) and not self.quiet:
            from rich.live import Live

            self.live = Live(get_renderable=lambda: self.render(self.console.height), console=self.console,
                             refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def phase(self, host: str, phase: str, detail: str = "") -> None:
        with self.lock:
            view = self.hosts[host]
            if phase == "running" and not view.stages:
                phase, view.heard = STARTING, self.clock()
            view.phase, view.detail = phase, shorten(without_host(host, detail, phase))
        if self.live is None and not self.quiet and phase in _SAID:
            self._line(f"{host}: {phase}: {without_host(host, detail, phase)}")

    def heard(self, host: str) -> None:
        """Any line from the host's runner, a blank keepalive included."""
        with self.lock:
            self.hosts[host].heard = self.clock()

    def record(self, host: str, record: dict[str, Any]) -> None:
        kind, stage = record.get("event"), record.get("stage")
        with self.lock:
            view = self.hosts[host]
            view.heard = self.clock()
            if kind == "run_start":
                view.phase = "running"
                for name in record.get("stages") or []:
                    view.stages.setdefault(name, "queued")
                    if name not in self.order:
                        self.order.append(name)
            elif kind == "stage_start" and stage:
                view.stages[stage], view.current, view.detail = "running", stage, ""
            elif kind == "stage_end" and stage:
                view.stages[stage], view.current = str(record.get("status")), None
            elif kind == "log" and stage:
                view.detail = shorten(str(record.get("message", "")))
        if self.live is None and not self.quiet and kind == "stage_end":
            reason = record.get("reason") or ""
            self._line(f"{host}: {stage}: {record.get('status')} "
                       f"({float(record.get('duration_s') or 0):.1f}s)"
                       + (f": {reason}" if reason and record.get("status") != "pass" else ""))

    def _line(self, text: str) -> None:
        say(f"{self.title}: {text}")

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

@dataclass
class SmokePlan:
    run_id: str
    stages: list[str]
    options: dict[str, Any]
    keep_going: bool
    stage_timeout_s: float
    release_id: Optional[str]  # what was pushed (None with --no-push)


def runner_control_argv(host: "Host", workdir: str, run_id: str, subcommand: str) -> list[str]:
    """argv of `runner.py SUBCOMMAND` for one run (`stop`, `files`; `run` adds its options)."""
    return [host.python, f"{workdir.rstrip('/')}/current/{RUNNER_RELPATH}", subcommand,
            "--run-id", run_id, "--workdir", workdir]


def runner_argv(host: "Host", workdir: str, plan: SmokePlan, subcommand: str = "run") -> list[str]:
    argv = runner_control_argv(host, workdir, plan.run_id, subcommand)
    if subcommand != "run":
        return argv
    argv += ["--host", host.name, "--options", json.dumps(plan.options, separators=(",", ":")),
             "--host-entry", json.dumps(host_entry(host), separators=(",", ":")),
             "--stage-timeout", f"{plan.stage_timeout_s:g}"]
    if plan.release_id:
        argv += ["--expected-release", plan.release_id]
    if plan.stages:
        argv += ["--stages", ",".join(plan.stages)]
    if plan.keep_going:
        argv.append("--keep-going")
    return argv


def run_timeout(plan: SmokePlan, host: "Host") -> float:
    """The runner enforces per-stage timeouts; this only bounds the whole run."""
    stages = max(len(plan.stages), 9)
    return max(host.command_timeout, stages * (plan.stage_timeout_s + 10) + 60)


# The runner sends a heartbeat every 5 s (hostside/runner.py HEARTBEAT_S), even while it imports
# torch: a host silent this long froze (or its network did), and is lost, not waited for.
SILENCE_LIMIT_S = 60.0


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
) -> int:
    from ddtree_ops.cli.console import emit_json, stdout_console
    from ddtree_ops.cli.options import select_hosts
    from ddtree_ops.cli.report import render_report
    from ddtree_ops.errors import ExitCode, RemoteStepError
    from ddtree_ops.fanout import HostState, run_fanout
    from ddtree_ops.rollout import RolloutPolicy, run_rollout
    from ddtree_ops.report.model import build_report
    from ddtree_ops.results import RUNS_DIR_ENV, RunStore, new_run_id, runs_root

    from ddtree_ops.transport.factory import check_connection_config

    from ddtree_ops.local_dirs import ensure_output_dir

    _, selected = select_hosts(inventory, hosts)
    check_connection_config(selected)  # before a run folder exists: exit 3, nothing recorded
    ensure_output_dir(runs_root(runs_dir), "--runs-dir" if runs_dir else f"runs folder (${RUNS_DIR_ENV} or ./runs)")
    bundle = None
    if push:
        from ddtree_ops.release import build_bundle

        bundle = build_bundle(source)
        check_stages_in_bundle(stages, {f.relpath for f in bundle.files})
    plan = SmokePlan(run_id=run_id or new_run_id(), stages=stages, options=options,
                     keep_going=keep_going, stage_timeout_s=stage_timeout_s,
                     release_id=bundle.release_id if bundle else None)
    store = RunStore(runs_root(runs_dir))
    started = time.time()
    store.create_run(plan.run_id, {
        "command": command, "argv": sys.argv[1:], "hosts": [h.name for h in selected],
        "stages": stages, "options": options, "keep_going": keep_going,
        "release": plan.release_id, "pushed": push, "started": started,
        "source": bundle.source_root if bundle else None,
        "release_git": bundle.git.to_dict() if bundle and bundle.git else None,
    })
    if not json_out:
        release = f"release {bundle.described}" if bundle else "no push (--no-push)"
        say(f"{command} run {plan.run_id}: {len(selected)} host(s), {release}, "
            f"results in {store.run_dir(plan.run_id)}")
    recorders: dict[str, Any] = {}
    runner_started: dict[str, str] = {}  # host -> workdir, once its runner is launched
    view = SmokeView(command, [h.name for h in selected], quiet=False)

    stopping = threading.Event()  # set on Ctrl-C: runners ending without a result are expected

    def task(ctx: Any) -> int:
        host = ctx.host
        recorder = store.host_recorder(plan.run_id, host.name, {
            "inventory": host_entry(host), "release": plan.release_id, "started": time.time()})
        recorders[host.name] = recorder
        workdir = host.workdir
        if bundle is not None:
            from ddtree_ops.remote_layout import ensure_release

            view.phase(host.name, "pushing", f"release {bundle.release_id}")
            pushed = ensure_release(ctx.transport, host, bundle)
            workdir = pushed.workdir
            recorder.note(push=pushed.to_dict(), workdir=workdir)
        else:
            recorder.note(workdir=workdir)
        view.phase(host.name, "running")
        runner_started[host.name] = workdir
        recorder.note(runner_started=time.time())

        def on_line(line: str) -> None:
            record = recorder.feed_line(line)
            if record is not None:
                view.record(host.name, record)
            else:
                view.heard(host.name)

        try:
            result = ctx.transport.run(runner_argv(host, workdir, plan), on_stdout_line=on_line,
                                       timeout=run_timeout(plan, host), idle_timeout=SILENCE_LIMIT_S)
        except BaseException:
            recorder.connection_ended()  # when it was lost, not when the other hosts finished
            raise
        recorder.note(runner_exit_status=result.exit_status, finished=time.time())
        if result.stderr.strip():
            (recorder.host_dir / "runner.stderr").write_text(result.stderr, encoding="utf-8")
        if result.exit_status == 127:
            from ddtree_ops.remote_layout import python_not_found

            raise python_not_found(ctx.transport, host)
        if result.exit_status == 126:
            raise RemoteStepError(f"{host.name}: cannot run {host.python!r}: {result.tail()}")
        if recorder.record_error is not None:  # the host sent a record we could not read as its kind
            raise RemoteStepError(f"{host.name}: {recorder.record_error}")
        if recorder.run_end is None:
            if stopping.is_set():  # Ctrl-C: the runner was stopped; settle_hosts records it
                return result.exit_status
            if bundle is None and RUNNER_RELPATH in result.stderr and "No such file" in result.stderr:
                raise RemoteStepError(f"{host.name}: no release is active in {workdir} "
                                      "(run `ddtree-ops push`, or drop --no-push)")
            why = result.stderr.strip()[-400:].replace("\n", " | ") or "no output on stderr"
            raise RemoteStepError(f"{host.name}: the runner ended without a result "
                                  f"({result.status_text}): {why}")
        view.phase(host.name, "done")
        return result.exit_status

    def on_progress(name: str, state: Any, detail: str) -> None:
        if state is HostState.CONNECTING:
            view.phase(name, "connecting", detail)
        elif state.terminal and state is not HostState.OK:
            view.phase(name, state.value, detail)  # unreachable / timed out / failed, as the JSON says

    interrupted = False
    fanout = batches = None
    with view:
        try:
            batches = run_rollout(selected, rollout or RolloutPolicy(), lambda batch: run_fanout(
                batch, task, parallel=parallel, on_progress=on_progress, accept_new_host_keys=accept_new_host_keys),
                failed=lambda outcome: not outcome.ok or outcome.value != 0)  # the runner's exit: a stage failed
            fanout = batches.result
        except KeyboardInterrupt:
            stopping.set()
            interrupted = True
    if interrupted:
        say("interrupted: stopping the remote runners, keeping what arrived")
        for recorder in recorders.values():
            recorder.close()  # from here on the host's own files are the record
        stop_runners([h for h in selected if h.name in runner_started], runner_started, plan,
                     accept_new_host_keys, store.run_dir(plan.run_id))
    settle_hosts(selected, recorders, fanout, runner_started, interrupted, store, plan)
    store.update_run(plan.run_id, finished=time.time(), duration_s=round(time.time() - started, 3),
                     interrupted=interrupted)
    report = build_report(store.load(plan.run_id))
    code = ExitCode.INTERRUPTED if interrupted else report.exit_code
    refused = [r.run_end.get("error") for r in recorders.values()
               if r.run_end is not None and r.run_end.get("status") == "error"]
    if refused and not interrupted:
        say(f"the runner refused the plan: {refused[0]}")  # the report's exit code is 2
    if json_out:
        document = report.to_dict()
        document["exit_code"] = int(code)
        document["command"] = command
        if batches is not None and batches.planned > 1:
            document["rollout"] = batches.to_dict()
        emit_json(document)
    else:
        render_report(report, stdout_console())
        if batches is not None and batches.stopped:
            say(f"{command}: rollout stopped after {batches.stopped}; not started: {', '.join(batches.not_started)}")
        say(f"{command} run {plan.run_id}: exit {int(code)} "
            f"({time.time() - started:.1f}s; `ddtree-ops report {plan.run_id}` to see it again)")
    store.update_run(plan.run_id, exit_code=int(code))
    return int(code)


def settle_hosts(selected: list["Host"], recorders: dict[str, Any], fanout: Any,
                 runner_started: dict[str, str], interrupted: bool, store: Any,
                 plan: SmokePlan) -> None:
    """Record each host's operator-side outcome next to what it streamed: interrupted,
    unreachable (never connected), failed before its runner started, or lost mid-run."""
    from ddtree_ops.fanout import HostState
    from ddtree_ops.results import HostOutcome

    for host in selected:
        recorder = recorders.get(host.name)
        if recorder is None:
            recorder = store.host_recorder(plan.run_id, host.name, {
                "inventory": host_entry(host), "release": plan.release_id})
            recorders[host.name] = recorder
        outcome = fanout.get(host.name) if fanout is not None else None
        if interrupted:
            recorder.note(outcome=HostOutcome.INTERRUPTED.value)
        elif outcome is not None and not outcome.ok:
            if host.name not in runner_started:
                kind = HostOutcome.FAIL
                if outcome.state is HostState.HOST_KEY_REFUSED:
                    kind = HostOutcome.HOST_KEY_REFUSED
                elif outcome.never_connected:
                    kind = HostOutcome.UNREACHABLE
                recorder.note(outcome=kind.value, error=outcome.message(), state=outcome.state.value)
            elif recorder.record_error is None and (recorder.planned or recorder.stage_states):
                # the runner was under way: partial results
                recorder.note_lost(outcome.message(), outcome.state.value)
            else:  # the runner could not start (no release, no python), or sent a bad record
                recorder.note(outcome=HostOutcome.FAIL.value, error=outcome.message(), state=outcome.state.value)
        elif outcome is not None and outcome.ok:
            recorder.note(outcome=None)
        recorder.close()


def stop_runners(hosts: list["Host"], workdirs: dict[str, str], plan: SmokePlan,
                 accept_new_host_keys: bool, run_dir: Path) -> None:
    """Ask each host's runner to stop (SIGTERM via `runner.py stop`, which waits until the
    runner has written its last records), then fetch the run's files as `collect` does, so
    the local store ends with the host's complete record. In parallel, bounded."""
    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.run_fetch import collect_host_files
    from ddtree_ops.transport.factory import open_transport

    def stop(host: "Host") -> None:
        workdir = workdirs[host.name].rstrip("/")
        try:
            with open_transport(host, accept_new_host_keys=accept_new_host_keys) as transport:
                transport.run(runner_argv(host, workdir, plan, "stop"), timeout=STOP_TIMEOUT_S)
                collect_host_files(transport, host, workdir, plan.run_id, run_dir / host.name,
                                   STOP_TIMEOUT_S)
        except DdtreeOpsError as err:
            say(f"{host.name}: could not stop the runner: {err}")

    threads = [threading.Thread(target=stop, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * STOP_TIMEOUT_S)


# ----------------------------------------------------------------------------- the command

StagesOpt = Annotated[Optional[str], typer.Option(
    "--stages", help="Comma-separated stages, in order (default: the release's stages in the default order, all but the long lossless-full).",
    show_default=False)]
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


SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE",
    help="A stage knob (options.extra, see docs/smoke.md), repeatable: e.g. --set strict=true "
         "--set max_new_tokens=64; VALUE is read as JSON, else taken as a string.",
    show_default=False)]


def parse_extra(settings: Optional[list[str]]) -> dict[str, Any]:
    """`--set key=value` pairs -> options.extra (JSON values, else strings)."""
    from ddtree_ops.errors import UsageError

    extra: dict[str, Any] = {}
    for setting in settings or []:
        key, sep, raw = setting.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum():
            raise UsageError(f"--set: expected KEY=VALUE with a name of letters, digits and _, got {setting!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--set {key}: expected a finite value, got {raw!r}")
        extra[key] = value
    return extra


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
) -> int:
    """Push, run the staged smoke tests on every selected host, keep the results, report."""
    policy = rollout_policy(serial, max_fail_percent)
    return run_smoke(
        inventory=inventory, hosts=hosts, stages=parse_stages(stages),
        options=build_options(budgets, batch_sizes, repeat, seed, settings), keep_going=keep_going,
        json_out=json_out, push=not no_push, source=source, stage_timeout_s=stage_timeout,
        runs_dir=runs_dir, parallel=parallel, accept_new_host_keys=accept_new_host_keys, rollout=policy)


def register(app: typer.Typer) -> None:
    app.command("smoke")(smoke)
