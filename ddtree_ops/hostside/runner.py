"""The host-side smoke runner: `python <workdir>/current/ddtree_ops/hostside/runner.py run ...`.

One Python start per host per run. The parent process (this script) imports torch and the
release's `ddtree` once (unless every selected stage declares `NEEDS_TORCH = False`), then
forks a worker that runs the selected stages in order and sends each event back over a pipe.
The parent never runs stage code, so a stage that hangs (per-stage timeout) or kills the
interpreter (abort, segfault) is reported as failed with its last output; the parent then
reports the rest as not run, or (`--keep-going`) forks a fresh worker for them.
Events go to stdout (one JSON line each) and to `<workdir>/runs/<run-id>/` on the host, so a
run whose SSH channel dropped keeps going and its results can be fetched later (`collect`).

Subcommands: `run` (the above), `stop` (SIGTERM the runner of a run and wait until it has
written its last records: Ctrl-C on the operator side), `files` (list a run's files with sizes
and sha256, for `collect`).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.machinery
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any



class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Loads the release's modules from their sources, which the manifest covers: bytecode
    in a `__pycache__` of the release is neither read (a planted .pyc would otherwise run as
    verified code) nor written. SourceLoader.get_code skips the cache when path_stats fails."""

    def path_stats(self, path: str) -> Any:
        raise OSError("the release's bytecode caches are not used")


def _compile_release_from_source(release_root: str) -> None:
    """A path hook for the folders inside the release (sys.path entries and packages'
    __path__); every other folder keeps Python's own finder (and its bytecode caches)."""
    root = os.path.realpath(release_root)
    finder_for = importlib.machinery.FileFinder.path_hook(
        (_SourceOnlyLoader, importlib.machinery.SOURCE_SUFFIXES))

    def release_hook(entry: str) -> Any:
        real = os.path.realpath(entry or ".")
        if real != root and not real.startswith(root + os.sep):
            raise ImportError("not a folder of the release")
        return finder_for(entry)

    sys.path_hooks.insert(0, release_hook)
    sys.path_importer_cache.clear()


if __package__ in (None, ""):
    # Run as a script: import `ddtree_ops.hostside` and `ddtree` from the release this file
    # belongs to, ahead of anything else on the host's sys.path (the script's own folder is
    # dropped so `hostside/*.py` never shadows a top-level module), compiled from their sources. The path is
    # resolved once, here: `current` may be switched by a push during the run, and every stage
    # must still come from the release the run started with.
    _script_dir = os.path.dirname(os.path.realpath(__file__))
    _release_root = os.path.dirname(os.path.dirname(_script_dir))  # <release>/ddtree_ops/hostside
    _own_dirs = {_script_dir, os.path.dirname(os.path.abspath(__file__))}
    sys.path[:] = [p for p in sys.path
                   if os.path.abspath(p or ".") not in _own_dirs and os.path.realpath(p or ".") not in _own_dirs]
    sys.path[:0] = [_release_root, os.path.join(_release_root, "src")]
    _compile_release_from_source(_release_root)

from ddtree_ops.hostside.protocol import (  # noqa: E402
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STAGE_FAILED,
    EXIT_USAGE,
    STAGE_ORDER,
    EventKind,
    RunStatus,
    SmokeOptions,
    StageContext,
    StageResult,
    Status,
    encode_event,
    jsonable,
    make_event,
    stage_module_name,
    stage_names,
    stages_dir,
)
from ddtree_ops.hostside.safe_write import WriteRefused, make_folders, open_append, write_file  # noqa: E402
from ddtree_ops.hostside.signals import Redelivery  # noqa: E402
from ddtree_ops.hostside.stage_output import StageOutput  # noqa: E402

# The release this runner belongs to, `current` resolved as the run starts (a push may switch
# `current` while the run goes on).
OWN_RELEASE_ROOT = Path(os.path.realpath(__file__)).parents[2]  # <release>/ddtree_ops/hostside/runner.py

DEFAULT_STAGE_TIMEOUT_S = 600.0
HEARTBEAT_S = 5.0
STREAM_POLL_S = 0.5  # with --stream-output: how soon a line a stage wrote is sent
# With --stream-output, at most this much output per run is sent: the operator's transport
# stops a command past 256 MiB of stdout (transport/base.py MAX_OUTPUT_BYTES), and the logs
# stay on the host either way (`collect` fetches them).
STREAM_LIMIT_BYTES = 64 << 20
OUTPUT_TAIL_CHARS = 4000
PID_FILE = "runner.pid"


class Interrupted(BaseException):
    """SIGTERM/SIGINT reached the runner: stop the worker, keep what is recorded. A
    BaseException, so no `except Exception` on the way (torch's import) can swallow it."""


class _Terminated(BaseException):
    """SIGTERM reached a worker (a timeout or a stop): unwinds the stage, running its
    `finally` blocks (a stage's servers are stopped there), then the worker exits."""


# A stopped worker gets this long to unwind its stage before SIGKILL.
STOP_GRACE_S = 10.0


# ----------------------------------------------------------------------------- stage catalogue

def available_stages() -> list[str]:
    """Stages in STAGE_ORDER whose module exists in this release."""
    folder = stages_dir()
    return [s for s in STAGE_ORDER if (folder / f"{stage_module_name(s)}.py").is_file()]


def resolve_stages(requested: list[str] | None) -> list[str]:
    """The run plan: the requested names in the given order (any stage whose module is in
    this release), or by default every available stage of STAGE_ORDER."""
    if not requested:
        return available_stages()
    folder = stages_dir()
    unknown = [s for s in requested
               if not s or s.startswith("_") or not (folder / f"{stage_module_name(s)}.py").is_file()]
    if unknown:
        every = stage_names(p.stem for p in folder.glob("*.py"))
        raise ValueError(f"unknown stage(s) {', '.join(map(repr, unknown))}; this release has: {', '.join(every)}")
    seen: set[str] = set()
    return [s for s in requested if not (s in seen or seen.add(s))]


# A stage module whose code never touches torch says so on a line of its own; a run of only
# such stages then starts without importing torch (about a second of CPU). Read, not imported:
# importing a stage runs its code, and stage code runs only in the worker.
_NO_TORCH_LINE = re.compile(r"^NEEDS_TORCH\s*=\s*False\s*(#.*)?$", re.MULTILINE)


def stage_needs_torch(name: str) -> bool:
    try:
        text = (stages_dir() / f"{stage_module_name(name)}.py").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return True  # the worker reports what is wrong with it
    return _NO_TORCH_LINE.search(text) is None


def load_stage(name: str) -> Any:
    module = importlib.import_module(f"ddtree_ops.hostside.stages.{stage_module_name(name)}")
    for attr in ("NAME", "DESCRIPTION", "run"):
        if not hasattr(module, attr):
            raise AttributeError(f"stage module {module.__name__} has no {attr}")
    if module.NAME != name:
        raise ValueError(f"stage module {module.__name__} declares NAME={module.NAME!r}, "
                         f"expected {name!r}")
    return module


# ----------------------------------------------------------------------------- the worker

def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL when the runner dies. (Its children are stopped by
    `Supervisor.stop_worker`: SIGTERM first, then SIGKILL to the worker's process group.)"""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _redirect_output(log_path: Path) -> None:
    """Point fds 1 and 2 (Python, C extensions and faulthandler alike) at the stage's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)  # never through a link
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _pick_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken torch (missing CUDA library...): the env stage reports it
        return "none"


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated()


class _Sender:
    """The worker's end of the pipe, shared by a stage's threads (`ctx.log` from a thread
    pool): one message at a time, or the pickled frames interleave."""

    def __init__(self, conn: Any):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)


def _checked_result(stage: str, result: Any) -> tuple[Status, str, dict[str, Any], dict[str, Any]]:
    """(status, reason, metrics, tables) as plain JSON, or an error naming what is wrong: a
    malformed result fails its stage, never the runner."""
    if not isinstance(result, StageResult):
        raise TypeError(f"stage {stage} returned {type(result).__name__}, not StageResult")
    status = Status(result.status)
    if status in (Status.NOT_RUN, Status.MISSING):
        raise ValueError(f"stage {stage} returned {status.name} (reserved for the runner and the operator)")
    reason = "" if result.reason is None else str(result.reason)  # an exception or a Path reads fine
    if not isinstance(result.metrics, dict):
        raise TypeError(f"stage {stage} metrics: expected a dict, got {type(result.metrics).__name__}")
    tables = result.tables
    if not isinstance(tables, dict) or not all(
            isinstance(rows, (list, tuple)) and all(isinstance(row, dict) for row in rows) for rows in tables.values()):
        raise TypeError(f"stage {stage} tables: expected {{name: [row dicts]}}, got {tables!r:.80}")
    return status, reason, jsonable(result.metrics, f"stage {stage} metrics"), jsonable(tables, f"stage {stage} tables")


def worker_main(conn: Any, plan: dict[str, Any], stages: list[str]) -> None:
    """Run `stages` in order in this (forked) process; every event goes to `conn`. Stopped by
    the runner (SIGTERM), it unwinds the stage and exits quietly: the runner records why."""
    try:
        _run_stages(conn, plan, stages)
    except _Terminated:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)  # no traceback into the stage's output tail


def _run_stages(conn: Any, plan: dict[str, Any], stages: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt stops
    signal.signal(signal.SIGTERM, _raise_terminated)
    os.setpgid(0, 0)  # the stage's children share this group, which a stop kills last
    _die_with_parent()
    conn = _Sender(conn)
    import faulthandler

    run_dir = Path(plan["run_dir"])
    logs = run_dir / "logs"
    _redirect_output(logs / "worker.log")
    faulthandler.enable(file=sys.stderr, all_threads=True)
    options = SmokeOptions.from_dict(plan["options"])
    device = _pick_device() if plan["needs_torch"] else "cpu"  # no stage here uses torch
    for stage in stages:
        _redirect_output(logs / f"{stage}.log")
        conn.send(("event", EventKind.STAGE_START, {"stage": stage}))
        metrics: dict[str, Any] = {}

        def log(message: str, _stage: str = stage) -> None:
            print(f"[{_stage}] {message}", file=sys.stderr, flush=True)
            conn.send(("event", EventKind.LOG, {"stage": _stage, "message": str(message)}))

        def emit_metric(name: str, value: Any, _stage: str = stage,
                        _metrics: dict[str, Any] = metrics) -> None:
            value = jsonable(value, f"metric {_stage}.{name}")
            _metrics[name] = value
            conn.send(("event", EventKind.METRIC, {"stage": _stage, "name": name, "value": value}))

        ctx = StageContext(
            stage=stage, device=device, options=options, host=plan["host_entry"],
            run_dir=run_dir, release_root=Path(plan["release_root"]),
            expected_release=plan.get("expected_release"), log=log, emit_metric=emit_metric,
        )
        started = time.monotonic()
        trace = None
        load: dict[str, Any] = {}
        try:
            module = load_stage(stage)
            if getattr(module, "TIMED", False):  # its figures are read against the host's load
                load["before"] = host_load()
            status, reason, result_metrics, tables = _checked_result(stage, module.run(ctx))
            metrics.update(result_metrics)
        except _Terminated:
            raise  # stopped by the runner: its `finally` blocks ran; nothing more to report
        except BaseException as err:  # noqa: BLE001 - a stage's exception is its failure
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            status, reason, tables = Status.FAIL, f"{type(err).__name__}: {err}", {}
        duration = time.monotonic() - started
        if load:
            load["after"] = host_load()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("end", stage, {
            "status": status.value, "reason": reason, "duration_s": round(duration, 6),
            "metrics": metrics, "tables": tables, "traceback": trace, "load": load or None,
        }))
        if status is Status.FAIL and not plan["keep_going"]:
            break
    conn.send(("done", None, None))


# ----------------------------------------------------------------------------- host load

GPU_QUERY_TIMEOUT_S = 10.0


def host_load() -> dict[str, Any]:
    """What else the host was doing, sampled before and after a timed stage: the 1-minute
    load average (system-wide, so against the system's CPU count) and, where `nvidia-smi`
    exists, the utilisation of the GPU the stage uses (CUDA_VISIBLE_DEVICES' first, else 0)."""
    sample: dict[str, Any] = {"time": round(time.time(), 3), "cpus": os.cpu_count()}
    try:
        sample["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:  # not offered by this system
        sample["loadavg_1m"] = None
    gpu = _gpu_utilisation_pct()
    if gpu is not None:
        sample["gpu_util_pct"] = gpu
    return sample


def _gpu_utilisation_pct() -> float | None:
    import shutil
    import subprocess

    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    argv = [tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    if first.isdigit():
        argv.insert(1, f"--id={first}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S)
        return float(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.split() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # a wedged or odd nvidia-smi: no figure rather than no stage


# ----------------------------------------------------------------------------- the parent

class EventSink:
    """Writes each event to stdout and to the run folder; a closed stdout (dropped SSH
    channel) is noted and the run goes on writing files only."""

    def __init__(self, workdir: Path, run_id: str, host: str):
        """Writes WORKDIR/runs/RUN_ID/..., following no link below the workdir (safe_write)."""
        self.workdir, self.run_id, self.host = workdir, run_id, host
        self.run_dir = workdir / "runs" / run_id
        self.stdout_alive = True
        make_folders(workdir, self.parts("stages"))
        make_folders(workdir, self.parts("logs"))
        self._events = open_append(workdir, self.parts("events.jsonl"))

    def parts(self, *names: str) -> list[str]:
        """The path of a file of this run, below the workdir."""
        return ["runs", self.run_id, *names]

    def write_json(self, parts: list[str], data: Any) -> None:
        """A JSON file of the run folder (strict JSON), written whole, never through a link."""
        write_file(self.workdir, parts, json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")

    def emit(self, kind: EventKind, **fields: Any) -> dict[str, Any]:
        record = make_event(kind, self.run_id, self.host, **fields)
        line = encode_event(record)
        if kind is not EventKind.OUTPUT:  # streamed only: the log files it quotes are the record
            self._events.write(line + "\n")
            self._events.flush()
        if kind is EventKind.STAGE_END:
            self.write_json(self.parts("stages", f"{record['stage']}.json"), record)
        if self.stdout_alive:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, OSError):
                self.stdout_alive = False
        return record

    def close(self) -> None:
        self._events.close()


def _output_tail(log_path: Path) -> str:
    try:
        with open(log_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - OUTPUT_TAIL_CHARS))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _mp_context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    # fork: the worker inherits the parent's torch import (no second import, no new Python).
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class _Keepalive:
    """A blank stdout line every HEARTBEAT_S while the runner has no event to send (importing
    torch can take a minute on a GPU host): the operator side treats a silent host as frozen.
    Blank lines are not records; nothing else writes stdout meanwhile."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except (BrokenPipeError, OSError):
                return

    def __enter__(self) -> "_Keepalive":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()


def _preload() -> dict[str, Any]:
    """Import torch and ddtree once in the parent, so forked workers share them."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    # Should anything ask torch about CUDA in this (pre-fork) process, let it ask NVML rather
    # than initialise the driver: a driver initialised before fork() is unusable in the worker.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # torch's OpenMP threads wait for work by spinning: on a host whose cores are busy with
    # other processes each parallel op then waits for a descheduled spinner (tree-bench, 2
    # cores at load ~13: 113 s spinning, 49 s passive). OpenMP reads it once, as torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # No garbage collection while they load: torch creates about a million objects, and every
    # full collection meanwhile walks all of them again (about an eighth of the import's CPU).
    # Frozen afterwards, so that the forked worker's collections skip them too (and leave the
    # memory pages it shares with this process unwritten, so uncopied).
    gc.disable()
    try:
        try:
            import torch

            info["torch"] = torch.__version__
        except Exception as err:  # noqa: BLE001 - the env stage reports a broken torch
            info["torch_error"] = f"{type(err).__name__}: {err}"
        try:
            import ddtree  # noqa: F401
        except Exception as err:  # noqa: BLE001 - the import stage reports it
            info["ddtree_error"] = f"{type(err).__name__}: {err}"
    finally:
        gc.freeze()
        gc.enable()
    return info


def release_problem(release_root: Path, workdir: Path, default_root: bool) -> str | None:
    """Why this release must not run, or None. A pushed release (one with a manifest) is
    checked before anything of it beyond `ddtree_ops.hostside` is imported: a tampered file must never run
    as if verified. A folder without a manifest (a checkout given as --release-root) runs,
    and the `import` stage says it is not a pushed release."""
    from ddtree_ops.hostside.release_check import check_release, has_manifest, summary

    if default_root:  # the runner's own release, reached through `current`
        releases = os.path.realpath(workdir / "releases")
        if os.path.dirname(os.path.realpath(release_root)) != releases:
            return f"{workdir / 'current'} leads to {release_root}, not to a release in {releases}"
    if not has_manifest(release_root):
        return None
    release_id, problems = check_release(release_root)
    return f"release {release_id} at {release_root} is not intact: {summary(problems)}" if problems else None


def _raise_interrupted(signum: int, _frame: Any) -> None:
    global _stop_signal
    _stop_signal = signal.Signals(signum).name
    raise _REDELIVERY.raising(Interrupted(_stop_signal), signum)


def _raise_if_stopped() -> None:
    """Raise the stop again if one came and was lost on the way: an `except BaseException`
    in the code it interrupted (a release's import, a library's) or C code that cleared it."""
    if _stop_signal is not None:
        raise Interrupted(_stop_signal)


_stop_signal: str | None = None  # the stop signal's name, once one has come


_REDELIVERY = Redelivery()  # a stop swallowed where it landed (an import's lock callback) is sent again


class Supervisor:
    """Runs the plan's stages through forked workers and turns every outcome into records."""

    def __init__(self, plan: dict[str, Any], stages: list[str], sink: EventSink):
        self.plan, self.sink = plan, sink
        self.timeout_s = float(plan["stage_timeout_s"])
        self.keep_going = bool(plan["keep_going"])
        self.pending = list(stages)
        self.index_of = {s: i for i, s in enumerate(stages)}
        self.counts = {s.value: 0 for s in Status if s is not Status.MISSING}
        self.status = RunStatus.PASS
        self.worker: Any = None
        self.current: str | None = None  # the stage the worker is in
        self.stage_started = time.monotonic()
        self.stream_output = bool(plan.get("stream_output"))
        self.output: StageOutput | None = None  # the current stage's output, followed
        self.streamed_bytes = 0

    def relay_output(self, final: bool = False) -> None:
        """The current stage's new output lines: sent as `output` events with --stream-output
        (up to STREAM_LIMIT_BYTES a run); read either way, so a heartbeat can name the last one."""
        if self.output is None:
            return
        for file, lines in self.output.read(final):
            if not self.stream_output or self.streamed_bytes > STREAM_LIMIT_BYTES:
                continue
            self.streamed_bytes += sum(len(line) + 1 for line in lines)
            if self.streamed_bytes > STREAM_LIMIT_BYTES:
                lines = [*lines, f"... streaming stopped after {STREAM_LIMIT_BYTES >> 20} MiB of output; "
                                 f"the logs are in {self.plan['run_dir']} (`ddtree-ops collect` fetches them)"]
            self.sink.emit(EventKind.OUTPUT, stage=self.current, file=file, lines=lines)
        if final:
            self.output = None

    def finish(self, stage: str, **fields: Any) -> None:
        fields.setdefault("output_tail", None)
        self.sink.emit(EventKind.STAGE_END, stage=stage, index=self.index_of[stage], **fields)
        self.counts[fields["status"]] += 1
        if fields["status"] == Status.FAIL.value:
            self.status = RunStatus.FAIL
        self.pending.remove(stage)

    def fail_current(self, reason: str) -> None:
        stage = self.current or (self.pending[0] if self.pending else None)
        if stage is None:
            return
        elapsed = time.monotonic() - self.stage_started if self.current else 0.0
        self.relay_output(final=True)
        log_path = Path(self.plan["run_dir"]) / "logs" / f"{stage}.log"
        self.finish(stage, status=Status.FAIL.value, reason=reason, duration_s=round(elapsed, 6),
                    metrics={}, tables={}, traceback=None, output_tail=_output_tail(log_path))
        self.current = None

    def not_run(self, reason: str) -> None:
        for stage in list(self.pending):
            self.finish(stage, status=Status.NOT_RUN.value, reason=reason, duration_s=0.0,
                        metrics={}, tables={}, traceback=None)

    def stop_worker(self) -> None:
        """SIGTERM, so the stage unwinds and stops what it started (servers); SIGKILL after
        `STOP_GRACE_S`; then SIGKILL to the worker's process group, for any child left."""
        worker = self.worker
        if worker is None:
            return
        if worker.is_alive():
            worker.terminate()
            worker.join(STOP_GRACE_S)
        if worker.is_alive():
            worker.kill()
        worker.join(5.0)
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass  # no process left in the group (or it was never made)

    def run(self) -> RunStatus:
        try:
            while self.pending:
                _raise_if_stopped()
                before = len(self.pending)
                lost = self._one_worker()
                if lost:
                    self.fail_current(lost)
                elif len(self.pending) == before:  # never expected: guard against a loop
                    self.not_run("not run: the worker finished without running it")
                if self.status is RunStatus.FAIL and not self.keep_going:
                    self.not_run("not run: an earlier stage failed (use --keep-going to run it)")
        except Interrupted as why:
            self.stop_worker()
            if self.current is not None:
                self.fail_current(f"interrupted ({why})")
            self.not_run(f"not run: interrupted ({why})")
            return RunStatus.INTERRUPTED
        return self.status

    def _one_worker(self) -> str:
        """Fork a worker over the pending stages and relay its events until it finishes,
        fails (without --keep-going), hangs or dies. Returns why it was lost, or ""."""
        mp = _mp_context()
        receiver, sender = mp.Pipe(duplex=False)
        self.worker = mp.Process(target=worker_main, args=(sender, self.plan, list(self.pending)),
                                 daemon=True)
        self.worker.start()
        sender.close()
        self.current, last_event = None, time.monotonic()
        try:
            while True:
                _raise_if_stopped()
                wait = STREAM_POLL_S if self.stream_output and self.output is not None else HEARTBEAT_S
                if self.current is not None:
                    left = self.stage_started + self.timeout_s - time.monotonic()
                    if left <= 0:
                        return f"timed out after {self.timeout_s:g}s"
                    wait = min(wait, left)
                if not receiver.poll(wait):
                    if self.stream_output:
                        self.relay_output()
                    if time.monotonic() - last_event >= HEARTBEAT_S:
                        if not self.stream_output:
                            self.relay_output()  # read for its last line only
                        elapsed = time.monotonic() - self.stage_started if self.current else 0.0
                        last = self.output.last_line if self.output is not None else ""
                        self.sink.emit(EventKind.HEARTBEAT, stage=self.current,
                                       elapsed_s=round(elapsed, 3), last_output=last or None)
                        last_event = time.monotonic()
                    continue
                try:
                    kind, what, fields = receiver.recv()
                except (EOFError, OSError):
                    self.worker.join(2.0)
                    return f"worker {_describe_exit(self.worker.exitcode)}"
                last_event = time.monotonic()
                if kind == "done":
                    return ""
                if kind == "end":
                    self.relay_output(final=True)  # the stage's last lines before its end
                    self.current = None
                    self.finish(what, **fields)
                    if fields["status"] == Status.FAIL.value and not self.keep_going:
                        return ""
                elif what is EventKind.STAGE_START:
                    self.current, self.stage_started = fields["stage"], time.monotonic()
                    self.output = StageOutput(Path(self.plan["run_dir"]), self.current)
                    self.sink.emit(what, stage=self.current, index=self.index_of[self.current])
                else:
                    self.sink.emit(what, **fields)
                    if self.stream_output:
                        self.relay_output()
        except BaseException:
            self.stop_worker()  # interrupted: nothing more worth waiting for
            raise
        finally:
            if self.current is None:
                self.worker.join(5.0)  # it said done (or failed): let it exit on its own
            self.stop_worker()  # a hung or silent worker is killed
            receiver.close()


def command_run(args: argparse.Namespace) -> int:
    workdir = Path(os.path.expanduser(args.workdir))
    run_dir = workdir / "runs" / args.run_id
    release_root = Path(os.path.expanduser(args.release_root)) if args.release_root \
        else OWN_RELEASE_ROOT
    try:
        sink = EventSink(workdir, args.run_id, args.host)
    except WriteRefused as err:  # e.g. a link planted at runs/<run-id>: nothing is written through it
        print(f"runner: {err}", file=sys.stderr)
        return EXIT_USAGE
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)
    _REDELIVERY.install()
    started = time.monotonic()
    try:
        try:
            options = SmokeOptions.from_dict(json.loads(args.options or "{}"))
            host_entry = json.loads(args.host_entry or "{}")
            stages = resolve_stages(args.stages.split(",") if args.stages else None)
        except ValueError as err:
            sink.emit(EventKind.RUN_START, stages=[], options={}, error=str(err),
                      release_root=str(release_root), expected_release=args.expected_release,
                      python=sys.version.split()[0], pid=os.getpid(),
                      keep_going=args.keep_going, stage_timeout_s=args.stage_timeout)
            sink.emit(EventKind.RUN_END, status=RunStatus.ERROR.value, counts={},
                      duration_s=0.0, exit_code=EXIT_USAGE, error=str(err))
            print(f"runner: {err}", file=sys.stderr)
            return EXIT_USAGE
        refusal, interrupted = None, None
        needs_torch = any(stage_needs_torch(stage) for stage in stages)
        try:
            # `stop` finds the runner by this file: written only once a stop is handled
            write_file(workdir, sink.parts(PID_FILE), f"{os.getpid()}\n")
            try:
                refusal = release_problem(release_root, workdir, default_root=not args.release_root)
            except Exception as err:  # noqa: BLE001 - a release we cannot even check is not run
                refusal = f"release at {release_root} could not be checked: {type(err).__name__}: {err}"
            if refusal is not None:
                preload = {"python": sys.version.split()[0], "error": refusal}
                print(f"runner: {refusal}", file=sys.stderr)
            elif needs_torch:
                with _Keepalive():
                    preload = _preload()
            else:  # no `torch` key: it was not imported
                preload = {"python": sys.version.split()[0], "executable": sys.executable}
            _raise_if_stopped()
        except Interrupted as why:  # stopped while the release was checked or torch imported
            refusal, interrupted = None, str(why)
            preload = {"python": sys.version.split()[0], "interrupted": interrupted}
        plan = {
            "run_dir": str(run_dir), "release_root": str(release_root),
            "expected_release": args.expected_release, "options": options.to_dict(),
            "host_entry": host_entry, "keep_going": args.keep_going,
            "stage_timeout_s": args.stage_timeout,
            "needs_torch": needs_torch, "stream_output": args.stream_output,
        }
        meta = dict(stages=stages, options=options.to_dict(), release_root=str(release_root),
                    expected_release=args.expected_release, pid=os.getpid(),
                    keep_going=args.keep_going, stage_timeout_s=args.stage_timeout, **preload)
        sink.emit(EventKind.RUN_START, **meta)
        sink.write_json(sink.parts("run.json"), {"run_id": args.run_id, "host": args.host,
                                                  **jsonable(meta, "run.json")})
        supervisor = Supervisor(plan, stages, sink)
        if refusal is not None:
            supervisor.not_run(f"not run: {refusal}")
            status = RunStatus.FAIL
        elif interrupted is None:
            status = supervisor.run()
        else:
            supervisor.not_run(f"not run: interrupted ({interrupted})")
            status = RunStatus.INTERRUPTED
        counts = supervisor.counts
        code = {RunStatus.PASS: EXIT_OK, RunStatus.FAIL: EXIT_STAGE_FAILED,
                RunStatus.INTERRUPTED: EXIT_INTERRUPTED}[status]
        duration = round(time.monotonic() - started, 6)
        sink.emit(EventKind.RUN_END, status=status.value, counts=counts, duration_s=duration,
                  exit_code=code)
        summary = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        summary.update(status=status.value, counts=counts, duration_s=duration, exit_code=code)
        sink.write_json(sink.parts("run.json"), summary)
        return code
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _REDELIVERY.remove()
        sink.close()
        try:
            (run_dir / PID_FILE).unlink()
        except OSError:
            pass


STOP_SIGNALS = ("SIGTERM", "SIGINT")  # the runner handles both alike; only the records differ


def command_stop(args: argparse.Namespace) -> int:
    """Signal the runner of RUN_ID (`--signal`, SIGTERM by default): it stops its worker and
    records the rest as not run, naming the signal."""
    pid_file = Path(os.path.expanduser(args.workdir)) / "runs" / args.run_id / PID_FILE
    try:
        pid = int(pid_file.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        print(json.dumps({"stopped": False, "reason": "no runner for this run"}))
        return EXIT_OK
    try:
        os.kill(pid, signal.Signals[args.signal])
    except ProcessLookupError:
        print(json.dumps({"stopped": False, "reason": f"runner pid {pid} already gone"}))
        return EXIT_OK
    # Wait (bounded) until it has recorded the stop, so the caller can fetch a complete run.
    deadline = time.monotonic() + args.wait
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"stopped": True, "pid": pid, "finished": not pid_file.exists()}))
    return EXIT_OK


def command_files(args: argparse.Namespace) -> int:
    """One JSON line per file of the run: path (relative), size, sha256."""
    run_dir = Path(os.path.expanduser(args.workdir)) / "runs" / args.run_id
    if not run_dir.is_dir():
        print(f"runner: no run {args.run_id} under {run_dir.parent}", file=sys.stderr)
        return EXIT_USAGE
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        if path.name.startswith(".") or path.name == PID_FILE:
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(json.dumps({"path": path.relative_to(run_dir).as_posix(),
                          "size": path.stat().st_size, "sha256": digest}))
    return EXIT_OK


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="runner.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the smoke stages")
    run.add_argument("--run-id", required=True)
    run.add_argument("--workdir", required=True)
    run.add_argument("--host", default="local", help="the inventory name, for the records")
    run.add_argument("--release-root", default=None, help="default: <workdir>/current")
    run.add_argument("--expected-release", default=None, help="release id the operator pushed")
    run.add_argument("--stages", default="", help="comma-separated; default: all available")
    run.add_argument("--options", default="{}", help="SmokeOptions as JSON")
    run.add_argument("--host-entry", default="{}", help="the inventory entry as JSON")
    run.add_argument("--keep-going", action="store_true")
    run.add_argument("--stage-timeout", type=float, default=DEFAULT_STAGE_TIMEOUT_S)
    run.add_argument("--stream-output", action="store_true",
                     help="also send each line a stage writes (its log, its artifacts' *.log) as an output event")
    for name in ("stop", "files"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--run-id", required=True)
        cmd.add_argument("--workdir", required=True)
        if name == "stop":
            cmd.add_argument("--wait", type=float, default=10.0,
                             help="seconds to wait for the runner to finish its records")
            # the operator's own signal (Ctrl-C: SIGINT), so the records say what stopped the run
            cmd.add_argument("--signal", choices=STOP_SIGNALS, default="SIGTERM")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return {"run": command_run, "stop": command_stop, "files": command_files}[args.command](args)


if __name__ == "__main__":
    exit_code = main()
    # torch leaves about a million objects behind, and the interpreter's last garbage collection
    # walks them all: ~0.6 s of CPU per run. Frozen objects are not walked; the rest of the
    # shutdown (atexit, flushing, closing) is unchanged.
    gc.freeze()
    sys.exit(exit_code)
