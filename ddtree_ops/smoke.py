"""A smoke run on the operator side: push the release, start one runner per host (on the
connection the push used), keep every record as it arrives under `runs/<run-id>/<host>/`,
settle each host's outcome, and stop the runners on Ctrl-C keeping what arrived. The CLI
(`ddtree-ops smoke`, `bench`, `deploy --gate-stages`) parses options and renders around it."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ddtree_ops.errors import interrupt_signal_name

if TYPE_CHECKING:  # pragma: no cover
    from ddtree_ops.inventory import Host
    from ddtree_ops.results import RunStore

DEFAULT_STAGE_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0


def check_stages_in_bundle(stages: list[str], relpaths: set[str]) -> None:
    from ddtree_ops.errors import UsageError
    from ddtree_ops.hostside.protocol import stage_names
    from ddtree_ops.release import STAGES_DIR

    available = stage_names(p[len(STAGES_DIR) + 1:-3] for p in relpaths
                            if p.startswith(STAGES_DIR + "/") and p.endswith(".py") and "/" not in p[len(STAGES_DIR) + 1:])
    unknown = [s for s in stages if s not in available]  # `parse_stages` spelled them; `__init__` is no stage
    if unknown:
        raise UsageError(f"--stages: unknown stage(s) {', '.join(unknown)} "
                         f"(this release has: {', '.join(available)})")


def default_stages(relpaths: set[str]) -> list[str]:
    """The stages a runner of this bundle runs when none are named (= hostside/runner.py
    available_stages, read from the bundle's file list instead of the host's disk)."""
    from ddtree_ops.hostside.protocol import STAGE_ORDER, stage_module_name
    from ddtree_ops.release import STAGES_DIR

    return [s for s in STAGE_ORDER if f"{STAGES_DIR}/{stage_module_name(s)}.py" in relpaths]


def host_entry(host: "Host") -> dict[str, Any]:
    """The inventory entry as plain data (what run.json keeps and stages see)."""
    entry = {
        "name": host.name, "transport": host.transport.value, "hostname": host.hostname,
        "user": host.user, "port": host.port, "python": host.python, "workdir": host.workdir,
        "groups": list(host.groups), "connect_timeout": host.connect_timeout,
        "command_timeout": host.command_timeout, "inventory": host.source,
    }
    if host.models is not None:
        entry["models"] = host.models.to_dict()
    return entry


@dataclass
class SmokePlan:
    run_id: str
    stages: list[str]
    options: dict[str, Any]
    keep_going: bool
    stage_timeout_s: float
    release_id: Optional[str]  # what was pushed (None with --no-push)
    stream_output: bool = False  # `-v`: the runner streams what each stage writes


def runner_control_argv(host: "Host", workdir: str, run_id: str, subcommand: str) -> list[str]:
    """argv of `runner.py SUBCOMMAND` for one run (`stop`, `files`; `run` adds its options)."""
    from ddtree_ops.release import RUNNER_RELPATH  # the CLI imports this module to register its options

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
    if plan.stream_output:
        argv.append("--stream-output")
    return argv


def run_timeout(plan: SmokePlan, host: "Host") -> float:
    """The runner enforces per-stage timeouts; this only bounds the whole run."""
    stages = max(len(plan.stages), 9)
    return max(host.command_timeout, stages * (plan.stage_timeout_s + 10) + 60)


# The runner sends a heartbeat every 5 s (hostside/runner.py HEARTBEAT_S), even while it imports
# torch: a host silent this long froze (or its network did), and is lost, not waited for.
SILENCE_LIMIT_S = 60.0


class SmokeObserver(Protocol):
    """What watches a run live (the CLI's table): entered around the fan-out, called from the
    host threads."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def phase(self, host: str, phase: str, detail: str = "") -> None: ...

    def record(self, host: str, record: dict[str, Any]) -> None: ...

    def heard(self, host: str) -> None: ...


@dataclass
class SmokeRun:
    """A finished (or interrupted) run: its plan, where it is kept, and how it went."""

    plan: SmokePlan
    store: "RunStore"
    started: float  # time.time()
    interrupted: bool
    refused: list[str]  # the runners' refusals of the plan (a usage error on the host)
    batches: Any  # the rollout's batches (None when interrupted before the first ended)


def execute_smoke(
    selected: list["Host"],
    *,
    stages: list[str],
    options: dict[str, Any],
    keep_going: bool,
    push: bool,
    source: Optional[Path],
    stage_timeout_s: float,
    runs_dir: Optional[Path],
    parallel: int,
    accept_new_host_keys: bool,
    observer: SmokeObserver,
    notify: Callable[[str], None],
    announce: bool = True,
    command: str = "smoke",
    run_id: Optional[str] = None,
    rollout: Any = None,
    stream_output: bool = False,
) -> SmokeRun:
    """Push (unless `push` is False), run the runner on every selected host, keep every record
    under the run folder as it arrives, settle each host's outcome; stop the runners and keep
    what arrived on Ctrl-C. `observer` sees phases and records live; `notify` gets the lines
    an operator should read."""
    from ddtree_ops.errors import RemoteStepError
    from ddtree_ops.fanout import HostState, run_fanout
    from ddtree_ops.local_dirs import ensure_output_dir
    from ddtree_ops.outcome import exit_code_for, judge_finished_host
    from ddtree_ops.results import RUNS_DIR_ENV, RunStore, new_run_id, runs_root
    from ddtree_ops.rollout import RolloutPolicy, run_rollout
    from ddtree_ops.transport.factory import check_connection_config

    check_connection_config(selected)  # before a run folder exists: exit 3, nothing recorded
    ensure_output_dir(runs_root(runs_dir), "--runs-dir" if runs_dir else f"runs folder (${RUNS_DIR_ENV} or ./runs)")
    bundle = None
    if push:
        from ddtree_ops.release import build_bundle

        bundle = build_bundle(source)
        relpaths = {f.relpath for f in bundle.files}
        check_stages_in_bundle(stages, relpaths)
        # The default plan, spelled out here: the outcome is judged from what we asked for, so
        # a host that leaves a stage out of its run_start cannot drop it from the verdict.
        stages = stages or default_stages(relpaths)
    plan = SmokePlan(run_id=run_id or new_run_id(), stages=stages, options=options,
                     keep_going=keep_going, stage_timeout_s=stage_timeout_s,
                     release_id=bundle.release_id if bundle else None, stream_output=stream_output)
    store = RunStore(runs_root(runs_dir))
    started = time.time()
    store.create_run(plan.run_id, {
        "command": command, "argv": sys.argv[1:], "hosts": [h.name for h in selected],
        "stages": stages, "options": options, "keep_going": keep_going,
        "release": plan.release_id, "pushed": push, "started": started,
        "source": bundle.source_root if bundle else None,
        "release_git": bundle.git.to_dict() if bundle and bundle.git else None,
    })
    if announce:
        release = f"release {bundle.described}" if bundle else "no push (--no-push)"
        notify(f"{command} run {plan.run_id}: {len(selected)} host(s), {release}, "
               f"results in {store.run_dir(plan.run_id)}")
    recorders: dict[str, Any] = {}
    runner_started: dict[str, str] = {}  # host -> workdir, once its runner is launched

    stopping = threading.Event()  # set on Ctrl-C: runners ending without a result are expected

    def task(ctx: Any) -> int:
        host = ctx.host
        recorder = store.host_recorder(plan.run_id, host.name, {
            "inventory": host_entry(host), "release": plan.release_id, "started": time.time()})
        recorders[host.name] = recorder
        workdir = host.workdir
        if bundle is not None:
            from ddtree_ops.remote_layout import ensure_release

            observer.phase(host.name, "pushing", f"release {bundle.release_id}")
            pushed = ensure_release(ctx.transport, host, bundle)
            workdir = pushed.workdir
            recorder.note(push=pushed.to_dict(), workdir=workdir)
        else:
            recorder.note(workdir=workdir)
        observer.phase(host.name, "running")
        runner_started[host.name] = workdir
        recorder.note(runner_started=time.time())

        def on_line(line: str) -> None:
            record = recorder.feed_line(line)
            if record is not None:
                observer.record(host.name, record)
            else:
                observer.heard(host.name)

        try:
            result = ctx.transport.run(runner_argv(host, workdir, plan), on_stdout_line=on_line,
                                       timeout=run_timeout(plan, host), idle_timeout=SILENCE_LIMIT_S)
        except BaseException:
            recorder.connection_ended()  # when it was lost, not when the other hosts finished
            raise
        recorder.note(runner_exit_status=result.exit_status, finished=time.time())
        if result.stderr.strip():
            recorder.write_text("runner.stderr", result.stderr)
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
            from ddtree_ops.release import RUNNER_RELPATH

            if bundle is None and RUNNER_RELPATH in result.stderr and "No such file" in result.stderr:
                raise RemoteStepError(f"{host.name}: no release is active in {workdir} "
                                      "(run `ddtree-ops push`, or drop --no-push)")
            why = result.stderr.strip()[-400:].replace("\n", " | ") or "no output on stderr"
            raise RemoteStepError(f"{host.name}: the runner ended without a result "
                                  f"({result.status_text}): {why}")
        observer.phase(host.name, "done")
        # the rollout goes on by our verdict on the stage records, not by the runner's exit status
        verdict = judge_finished_host(plan.stages, recorder.planned, {
            s: v for s, v in recorder.stage_states.items() if v != "running"}, recorder.run_end.get("status"))
        return int(exit_code_for([verdict.outcome]))

    def on_progress(name: str, state: Any, detail: str) -> None:
        if state is HostState.CONNECTING:
            observer.phase(name, "connecting", detail)
        elif state.terminal and state is not HostState.OK:
            observer.phase(name, state.value, detail)  # unreachable / timed out / failed, as the JSON says

    interrupted, signal_name = False, "SIGINT"
    fanout = batches = None
    with observer:
        try:
            batches = run_rollout(selected, rollout or RolloutPolicy(), lambda batch: run_fanout(
                batch, task, parallel=parallel, on_progress=on_progress, accept_new_host_keys=accept_new_host_keys),
                failed=lambda outcome: not outcome.ok or outcome.value != 0)  # the runner's exit: a stage failed
            fanout = batches.result
        except KeyboardInterrupt as err:
            stopping.set()
            interrupted, signal_name = True, interrupt_signal_name(err)
    if interrupted:
        notify(f"interrupted ({signal_name}): stopping the remote runners, keeping what arrived")
        for recorder in recorders.values():
            recorder.close()  # from here on the host's own files are the record
        stop_runners([h for h in selected if h.name in runner_started], runner_started, plan,
                     accept_new_host_keys, store.run_dir(plan.run_id), notify, signal_name)
    settle_hosts(selected, recorders, fanout, runner_started, interrupted, store, plan)
    store.update_run(plan.run_id, finished=time.time(), duration_s=round(time.time() - started, 3),
                     interrupted=interrupted)
    refused = [r.run_end.get("error") for r in recorders.values()
               if r.run_end is not None and r.run_end.get("status") == "error"]
    return SmokeRun(plan=plan, store=store, started=started, interrupted=interrupted,
                    refused=refused, batches=batches)


def settle_hosts(selected: list["Host"], recorders: dict[str, Any], fanout: Any,
                 runner_started: dict[str, str], interrupted: bool, store: Any,
                 plan: SmokePlan) -> None:
    """Record each host's operator-side outcome next to what it streamed: interrupted,
    unreachable (never connected), failed before its runner started, or lost mid-run. A host
    whose folder cannot be written (a link planted there) is left as its result says; the
    others are still recorded."""
    from ddtree_ops.errors import ConfigError

    for host in selected:
        try:
            _settle_host(host, recorders, fanout, runner_started, interrupted, store, plan)
        except ConfigError:
            continue


def _settle_host(host: "Host", recorders: dict[str, Any], fanout: Any, runner_started: dict[str, str],
                 interrupted: bool, store: Any, plan: SmokePlan) -> None:
    from ddtree_ops.fanout import HostState
    from ddtree_ops.outcome import HostOutcome

    recorder = recorders.get(host.name)
    if recorder is None:
        recorder = store.host_recorder(plan.run_id, host.name, {
            "inventory": host_entry(host), "release": plan.release_id})
        recorders[host.name] = recorder
    try:
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
    finally:
        recorder.close()


def stop_runners(hosts: list["Host"], workdirs: dict[str, str], plan: SmokePlan,
                 accept_new_host_keys: bool, run_dir: Path, notify: Callable[[str], None],
                 signal_name: str = "SIGTERM") -> None:
    """Ask each host's runner to stop (`runner.py stop --signal`, the signal the operator sent,
    which waits until the runner has written its last records), then fetch the run's files as
    `collect` does, so the local store ends with the host's complete record. In parallel,
    bounded."""
    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.run_fetch import collect_host_files
    from ddtree_ops.transport.factory import open_transport

    def stop(host: "Host") -> None:
        workdir = workdirs[host.name].rstrip("/")
        try:
            with open_transport(host, accept_new_host_keys=accept_new_host_keys) as transport:
                argv = runner_argv(host, workdir, plan, "stop")
                done = transport.run([*argv, "--signal", signal_name], timeout=STOP_TIMEOUT_S)
                if done.exit_status == 2 and "--signal" in done.stderr:  # a release from before it
                    transport.run(argv, timeout=STOP_TIMEOUT_S)
                collect_host_files(transport, host, workdir, plan.run_id, run_dir / host.name,
                                   STOP_TIMEOUT_S)
        except DdtreeOpsError as err:
            notify(f"{host.name}: could not stop the runner: {err}")

    threads = [threading.Thread(target=stop, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * STOP_TIMEOUT_S)
