"""The local run store: `runs/<run-id>/<host>/` with the raw event log, one JSON per stage and
a `run.json`, written as events arrive so that whatever reached us survives a dying host, a
dropped connection or Ctrl-C.

Layout (the root is `--runs-dir`, else `$DDTREE_OPS_RUNS_DIR`, else `./runs`):

    runs/<run-id>/run.json                 the run: hosts, stages, options, release, timings
    runs/<run-id>/<host>/events.jsonl      every smoke record the host streamed, verbatim
    runs/<run-id>/<host>/stages/<stage>.json   the stage_end record of each finished stage
    runs/<run-id>/<host>/run.json          inventory entry, release id, versions, timings,
                                           and the operator-side outcome (e.g. lost, error)
    runs/<run-id>/<host>/remote/...        files fetched by `ddtree-ops collect`

The record format is the one in `ddtree_ops/hostside/protocol.py` (this module reads it by field name, so
the operator side does not need the host-side package on its path).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ddtree.bounded_files import FileRefused, open_regular, parse_json, read_bytes
from ddtree.bounded_files import read_json as bounded_read_json

from ddtree_ops.errors import ConfigError, UsageError, quoted
from ddtree_ops.hostside.protocol import Status as StageStatus  # the runner's own enum, read back
from ddtree_ops.hostside.safe_write import WriteRefused, open_append, write_file
from ddtree_ops.ids import is_safe_id
from ddtree_ops.outcome import STOPPED_RUN_ENDS, HostOutcome, judge_finished_host

RUNS_DIR_ENV = "DDTREE_OPS_RUNS_DIR"
DEFAULT_RUNS_DIR = "runs"
_STAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # used with fullmatch: "$" would let "x\n" through


def runs_root(override: str | os.PathLike[str] | None = None) -> Path:
    return Path(override or os.environ.get(RUNS_DIR_ENV) or DEFAULT_RUNS_DIR)


def new_run_id(now: float | None = None) -> str:
    """Sortable by time, unique enough for concurrent operators: `20261130-172400-3f9a1c`."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(3)}"


def check_run_id(run_id: str) -> str:
    """A run id given on the command line (or by a caller): UsageError unless safe."""
    from ddtree_ops.ids import IdKind, check_cli_id

    return check_cli_id(IdKind.RUN, run_id)


def check_host_dir_name(path: Path, name: Any) -> str:
    """A host name read back from a run record becomes a folder name: the inventory's rule
    (ddtree_ops.ids.folder_name_problem)."""
    from ddtree_ops.ids import folder_name_problem, shown

    unfit = folder_name_problem(name)
    if unfit is not None:
        raise ConfigError(f"{path}: hosts: unsafe host name {shown(name)} ({unfit}; it names a folder of the run)")
    return name


STORE_FILE = ".ddtree-ops-store.json"  # {"id": this run store's id, "last": the last run's sequence number}
STORE_LOCK = ".ddtree-ops-store.lock"
FUTURE_SLACK_S = 86400.0  # a run named up to a day ahead of this clock is clock skew, not the future
_SMALL_JSON_MAX = 1 << 20


def run_id_time(run_id: str) -> float | None:
    """When a run id made by new_run_id says it was made (UTC), or None for another name."""
    import calendar

    try:
        return float(calendar.timegm(time.strptime(run_id[:15], "%Y%m%d-%H%M%S")))
    except ValueError:
        return None


def _small_json(path: Path) -> Any:
    """A small JSON file's value, or None for anything else (absent, large, not a plain file,
    not UTF-8 JSON, nested too deep): for ordering runs, where one bad file costs only itself."""
    from ddtree.bounded_files import read_json as read_bounded

    try:
        return read_bounded(path, max_bytes=_SMALL_JSON_MAX)
    except (OSError, ValueError):
        return None


def write_json_atomic(root: Path, relpath: list[str], data: Any) -> Path:
    """root/relpath holds `data` as JSON, whole or not at all, written following no link below
    the runs root (hostside.safe_write.write_file); ConfigError naming the path otherwise."""
    return write_under(root, relpath, json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_under(root: Path, relpath: list[str], text: str) -> Path:
    try:
        return write_file(root, relpath, text)
    except WriteRefused as err:
        raise ConfigError(str(err)) from None


def append_under(root: Path, relpath: list[str]) -> Any:
    """root/relpath opened to append text (no link followed below root); ConfigError otherwise."""
    try:
        return open_append(root, relpath)
    except WriteRefused as err:
        raise ConfigError(str(err)) from None


def read_json(path: Path) -> dict[str, Any]:
    """A run record (run.json, a stage copy) through the bounded reader: a regular file, of
    bounded size, UTF-8 JSON nested at most MAX_DEPTH deep; {} when absent. Anything else is a
    ConfigError naming the file, which costs only the record's host (`_load_or_fail`)."""
    try:
        data = bounded_read_json(path)
    except FileNotFoundError:
        return {}
    except FileRefused as err:
        raise ConfigError(f"{path}: unreadable run record: {err.why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_record(line: str) -> dict[str, Any] | None:
    """One smoke record from one line, or None for anything else (stray output)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = parse_json(line, "a record")
    except FileRefused:  # not JSON, a 5000-digit number, nested past MAX_DEPTH
        return None
    if isinstance(record, dict) and "event" in record and "v" in record:
        return record
    return None


MAX_RECORDS_PER_STAGE = 10_000  # a runner sends a few dozen; past this a host is flooding


def _finite_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def record_field_error(record: dict[str, Any]) -> str | None:
    """Why a record of this run and host cannot be read as its kind says (`kind.field: expected
    ..., got ...`), or None. Checked as each record arrives and again when a run is read, so a
    host's wrong value fails that host, never the command."""
    kind = record.get("event")
    if not isinstance(kind, str):
        return f"event: expected a record kind, got {quoted(kind)}"
    if not isinstance(record.get("stage"), (str, type(None))):
        return f"{kind}.stage: expected a stage name, got {quoted(record.get('stage'))}"
    if kind == "run_start":
        stages = record.get("stages")
        if stages is not None and not (isinstance(stages, list) and all(isinstance(s, str) for s in stages)):
            return f"run_start.stages: expected a list of stage names, got {quoted(stages)}"
    elif kind == "stage_end":
        try:
            StageRecord.from_record(record)
        except ValueError as err:
            return str(err)
    elif kind == "log" and not isinstance(record.get("message"), (str, type(None))):
        return f"log.message: expected a string, got {quoted(record.get('message'))}"
    elif kind == "heartbeat" and not isinstance(record.get("last_output"), (str, type(None))):
        return f"heartbeat.last_output: expected a string, got {quoted(record.get('last_output'))}"
    elif kind == "output":
        lines, file = record.get("lines"), record.get("file")
        if not (isinstance(lines, list) and all(isinstance(line, str) for line in lines)):
            return f"output.lines: expected a list of strings, got {quoted(lines)}"
        if not isinstance(file, (str, type(None))):
            return f"output.file: expected a file name, got {quoted(file)}"
    elif kind == "run_end":
        for name, ok, expected in (
                ("status", lambda v: isinstance(v, (str, type(None))), "a string"),
                ("counts", lambda v: isinstance(v, (dict, type(None))), "an object"),
                ("duration_s", lambda v: v is None or _finite_seconds(v), "a finite number >= 0"),
                ("exit_code", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer")):
            if not ok(record.get(name)):
                return f"run_end.{name}: expected {expected}, got {quoted(record.get(name))}"
    return None


def record_owner_error(record: dict[str, Any], run_id: str, host: str) -> str | None:
    """Why a record is not this run's and host's, or None. Every record carries `run_id` and
    `host` (hostside/protocol.py make_event): another run's log copied into this folder must
    never be read as this run's result."""
    from ddtree_ops.ids import shown

    for name, expected, owner in (("run_id", run_id, "run"), ("host", host, "host")):
        if name not in record:
            return f"no {name} (expected {shown(expected)}): not a record of this {owner}"
        if record[name] != expected:
            return f"{name} {shown(record[name])} is not this {owner}'s {shown(expected)}: a record of another {owner}"
    return None


def check_record_owner(record: dict[str, Any], run_id: str, host: str, where: str) -> None:
    """ConfigError naming `where` (file and line) for a record of another run or host."""
    why = record_owner_error(record, run_id, host)
    if why is not None:
        raise ConfigError(f"{where}: {why}")


# ----------------------------------------------------------------------------- writing

class HostRecorder:
    """Writes one host's records as they arrive (thread-confined: one per host thread)."""

    def __init__(self, root: Path, run_id: str, host: str, meta: dict[str, Any],
                 clock: Callable[[], float] = time.time):
        """Writes runs `root`/run_id/host/..., following no link below `root`."""
        self.root, self.host, self.run_id, self.clock = root, host, run_id, clock
        self.host_dir = root / run_id / host
        self._events = append_under(root, [run_id, host, "events.jsonl"])
        self.meta: dict[str, Any] = {"host": host, **meta}
        self.stage_states: dict[str, str] = {}  # stage -> "running" or its final status
        self.record_error: str | None = None  # the first record refused (wrong field, a flood): the host fails
        self.records_per_stage: dict[str | None, int] = {}
        self.planned: list[str] = []
        self.run_end: dict[str, Any] | None = None
        self.last_heard = clock()  # any line counts, the runner's blank keepalives included
        self.stage_began: dict[str, float] = {}  # stage -> when its stage_start arrived (our clock)
        self.lost_facts: dict[str, Any] | None = None  # set when the stream ended early
        self._save_meta()

    def feed_line(self, line: str) -> dict[str, Any] | None:
        """Record one stdout line of the runner; returns the parsed record (None if stray)."""
        self.last_heard = self.clock()
        record = parse_record(line)
        if self._events.closed:  # a line after the run was settled (Ctrl-C): the host has it
            return record
        if record is not None and record_owner_error(record, self.run_id, self.host) is not None:
            record = None  # another run's or host's record: kept as stray output, never as ours
        if record is not None:
            # `-v`'s output records are shown, not kept (the host's log files are the record;
            # `collect` fetches them), so they do not count against the stage's records
            refused = record_field_error(record) or (
                None if record.get("event") == "output" else self._past_stage_budget(record))
            if refused is not None:
                if self.record_error is None:
                    self.record_error = f"a record was refused: {refused}"
                    self.note(record_error=self.record_error)
                record = None  # kept as stray output for a look, never read as a result
        if record is None:
            if line.strip():
                with append_under(self.root, self._parts("output.log")) as out:
                    out.write(line.rstrip("\n") + "\n")
            return None
        kind = record.get("event")
        if kind == "output":
            return record
        self._events.write(line.strip() + "\n")  # verbatim: the raw event log
        self._events.flush()
        stage = record.get("stage")
        if kind == "run_start":
            self.planned = list(record.get("stages") or [])
            for key in ("python", "torch", "executable", "release_root", "expected_release",
                        "options", "stages", "keep_going", "stage_timeout_s", "error",
                        "torch_error", "ddtree_error", "interrupted"):  # why a host's stages failed
                if key in record:
                    self.meta[key] = record[key]
            self.meta["remote_started"] = record.get("time")
            self._save_meta()
        elif kind == "stage_start" and isinstance(stage, str):
            self.stage_states[stage] = "running"
            self.stage_began[stage] = self.last_heard
        elif kind == "stage_end" and isinstance(stage, str) and _STAGE_RE.fullmatch(stage):
            self.stage_states[stage] = str(record.get("status"))
            write_json_atomic(self.root, self._parts("stages", f"{stage}.json"), record)
        elif kind == "run_end":
            self.run_end = record
            self.meta.update(remote_status=record.get("status"), counts=record.get("counts"),
                             remote_duration_s=record.get("duration_s"),
                             remote_exit_code=record.get("exit_code"))
            self._save_meta()
        return record

    def _past_stage_budget(self, record: dict[str, Any]) -> str | None:
        stage = record.get("stage")
        count = self.records_per_stage[stage] = self.records_per_stage.get(stage, 0) + 1
        if count > MAX_RECORDS_PER_STAGE:
            return f"stage {quoted(stage)}: more than {MAX_RECORDS_PER_STAGE} records"
        return None

    def connection_ended(self) -> None:
        """The runner's stream ended without its run_end (the connection dropped or the host
        went silent): the facts of the loss, taken now, for `note_lost` to keep."""
        now = self.clock()
        running = [s for s, state_ in self.stage_states.items() if state_ == "running"]
        began = self.meta.get("runner_started")
        self.lost_facts = {
            "at": round(now, 3), "silent_s": round(now - self.last_heard, 3),
            "ran_s": round(now - began, 3) if isinstance(began, (int, float)) else None,
            "stage": running[-1] if running else None,
            "stage_ran_s": round(now - self.stage_began[running[-1]], 3) if running else None}

    def note_lost(self, error: str, state: str) -> None:
        """The host was lost mid-run: when (our clock), after how long a silence, how long its
        runner and its current stage had run. Kept for good: a later `collect` adds what the
        host finished meanwhile, never erases the loss."""
        if self.lost_facts is None:
            self.connection_ended()
        self.note(outcome=HostOutcome.LOST.value, error=error, state=state, lost=self.lost_facts)

    def note(self, **fields: Any) -> None:
        """Operator-side facts: outcome, error, timings, push result."""
        self.meta.update(fields)
        self._save_meta()

    def _parts(self, *names: str) -> list[str]:
        return [self.run_id, self.host, *names]

    def write_text(self, name: str, text: str) -> None:
        """A file of the host's folder (e.g. the runner's stderr), written whole."""
        write_under(self.root, self._parts(name), text)

    def _save_meta(self) -> None:
        write_json_atomic(self.root, self._parts("run.json"), self.meta)

    def close(self) -> None:
        self._events.close()


class RunStore:
    def __init__(self, root: Path):
        self.root = root

    def run_dir(self, run_id: str) -> Path:
        return self.root / check_run_id(run_id)

    def create_run(self, run_id: str, meta: dict[str, Any]) -> Path:
        write_json_atomic(self.root, [check_run_id(run_id), "run.json"],
                          {"run_id": run_id, **meta, "created": self._next_sequence()})
        return self.run_dir(run_id)

    def _next_sequence(self) -> dict[str, Any]:
        """{"store": this store's id, "seq": n}: the n-th run this store created. "Newest" is the
        order runs were created in here, which no clock set ahead and no folder name moves."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / STORE_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two operators creating runs at once each get their own number
            state = self._store_state() or {"id": secrets.token_hex(8), "last": 0}
            state["last"] += 1
            write_json_atomic(self.root, [STORE_FILE], state)
            return {"store": state["id"], "seq": state["last"]}
        finally:
            os.close(fd)

    def _store_state(self) -> dict[str, Any] | None:
        """{"id", "last"} of this store, or None when it has none (yet, or it is unreadable)."""
        state = _small_json(self.root / STORE_FILE)
        if isinstance(state, dict) and isinstance(state.get("id"), str) and type(state.get("last")) is int:
            return state
        return None

    def runs_newest_first(self) -> tuple[list[str], list[str]]:
        """(run ids, newest first; ["RUN: why it is left out"]). Runs this store created come
        first, in the order it created them; then runs it did not (an older ddtree-ops, a copy
        from elsewhere, a folder renamed by hand: its run.json names another run), newest name
        first, except one whose name is dated in the future, which is left out, named: its
        name says nothing about when it was made."""
        store = (self._store_state() or {}).get("id")
        ours: list[tuple[int, str]] = []
        others, left_out = [], []
        for run_id in self.list_runs():
            try:  # an unreadable record decides nothing, and is named (the one record reader)
                meta = read_json(self.root / run_id / "run.json")
            except ConfigError as err:
                left_out.append(str(err))
                continue
            created = meta.get("created")
            if store and isinstance(created, dict) and created.get("store") == store \
                    and type(created.get("seq")) is int and meta.get("run_id") == run_id:
                ours.append((created["seq"], run_id))
                continue
            dated = run_id_time(run_id)
            if dated is not None and dated > time.time() + FUTURE_SLACK_S:
                left_out.append(f"{run_id}: dated {time.strftime('%Y-%m-%d', time.gmtime(dated))}, in the future "
                                "(a clock set ahead, or a folder named by hand), and not created by this run store")
            else:
                others.append(run_id)
        return [r for _, r in sorted(ours, reverse=True)] + sorted(others, reverse=True), left_out

    def update_run(self, run_id: str, **fields: Any) -> None:
        data = read_json(self.run_dir(run_id) / "run.json")
        data.update(fields)
        write_json_atomic(self.root, [run_id, "run.json"], data)

    def host_recorder(self, run_id: str, host: str, meta: dict[str, Any],
                      clock: Callable[[], float] = time.time) -> HostRecorder:
        return HostRecorder(self.root, check_run_id(run_id), host, meta, clock)

    def list_runs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and (p / "run.json").is_file() and is_safe_id(p.name))

    def latest_run(self) -> str:
        """The newest run (see runs_newest_first)."""
        runs, left_out = self.runs_newest_first()
        if not runs:
            why = f" ({'; '.join(left_out[:3])})" if left_out else ""
            raise UsageError(f"no runs under {self.root}{why} (run `ddtree-ops smoke` first, or "
                             f"point --runs-dir / ${RUNS_DIR_ENV} at your runs)")
        return runs[0]

    def load(self, run_id: str | None = None) -> "RunRecord":
        run_id = self.latest_run() if run_id is None else run_id  # "" is a bad id, not "latest"
        path = self.run_dir(run_id)
        if not (path / "run.json").exists():  # there but not a file (a FIFO): read_json names it
            known = ", ".join(self.list_runs()[-5:]) or "none"
            raise UsageError(f"no run {run_id!r} under {self.root} (latest: {known})")
        meta = read_json(path / "run.json")
        hosts = meta.get("hosts") or sorted(p.name for p in path.iterdir() if p.is_dir())
        if not isinstance(hosts, list):
            raise ConfigError(f"{path / 'run.json'}: hosts: expected a list, got {type(hosts).__name__}")
        hosts = [check_host_dir_name(path / "run.json", h) for h in hosts]
        asked = meta.get("stages")
        if asked is not None and not (isinstance(asked, list) and all(isinstance(s, str) for s in asked)):
            raise ConfigError(f"{path / 'run.json'}: stages: expected a list of stage names, got {quoted(asked)}")
        asked = asked or []
        return RunRecord(run_id=run_id, path=path, meta=meta,
                         hosts={h: _load_or_fail(path / h, h, run_id, asked) for h in hosts})


# ----------------------------------------------------------------------------- reading

@dataclass
class StageRecord:
    stage: str
    index: int
    status: StageStatus
    reason: str = ""
    duration_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    traceback: str | None = None
    output_tail: str | None = None
    load: dict[str, Any] | None = None  # timed stages: host-load samples {before, after}
    lost: bool = False  # under way when the host was lost; duration_s is how long it had run

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "StageRecord":
        """A stage_end record as written by the runner; ValueError naming the field for one
        that is not (edited by hand, another version): the caller names the file."""
        try:
            status = StageStatus(record.get("status"))
        except ValueError:
            status = StageStatus.FAIL
        index, duration = record.get("index") or 0, record.get("duration_s") or 0.0
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"stage_end.index: expected an integer, got {quoted(index)}")
        if not _finite_seconds(duration):  # 1e999 parses as inf
            raise ValueError(f"stage_end.duration_s: expected a finite number >= 0, got {quoted(duration)}")
        metrics, tables = record.get("metrics") or {}, record.get("tables") or {}
        if not isinstance(metrics, dict):
            raise ValueError(f"stage_end.metrics: expected an object, got {quoted(metrics)}")
        if not isinstance(tables, dict) or not all(
                isinstance(rows, list) and all(isinstance(row, dict) for row in rows) for rows in tables.values()):
            raise ValueError(f"stage_end.tables: expected {{name: [row objects]}}, got {quoted(tables)}")
        for name in ("reason", "traceback", "output_tail"):
            if not isinstance(record.get(name), (str, type(None))):
                raise ValueError(f"stage_end.{name}: expected a string, got {quoted(record.get(name))}")
        load = record.get("load")
        if not isinstance(load, (dict, type(None))) or not all(
                isinstance(sample, dict) for sample in (load or {}).values()):
            raise ValueError(f"stage_end.load: expected {{before, after}} samples, got {quoted(load)}")
        return cls(stage=str(record.get("stage")), index=index, status=status,
                   reason=str(record.get("reason") or ""), duration_s=float(duration),
                   metrics=dict(metrics), tables=dict(tables),
                   traceback=record.get("traceback"), output_tail=record.get("output_tail"),
                   load=load)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "index": self.index, "status": self.status.value,
                "reason": self.reason, "duration_s": self.duration_s, "metrics": self.metrics,
                "tables": self.tables, "traceback": self.traceback,
                "output_tail": self.output_tail, "load": self.load}


@dataclass
class HostRecord:
    host: str
    meta: dict[str, Any]
    stages: dict[str, StageRecord]  # in plan order
    outcome: HostOutcome
    error: str | None = None
    run_end: dict[str, Any] | None = None  # the runner's last record, if it reached us
    disagreements: list[str] = field(default_factory=list)  # the host's records that contradicted its outcome

    @property
    def history(self) -> dict[str, Any] | None:
        """For a host lost during the run: when and how it was lost, and what it finished on
        its own afterwards (fetched by `collect`); None for any other host."""
        if self.outcome is not HostOutcome.LOST:
            return None
        lost = self.meta.get("lost") if isinstance(self.meta.get("lost"), dict) else {}
        end = self.run_end or {}
        return {"lost_at": lost.get("at"), "silent_s": lost.get("silent_s"), "ran_s": lost.get("ran_s"),
                "stage": lost.get("stage"), "stage_ran_s": lost.get("stage_ran_s"), "error": self.error,
                "completed_on_host": end.get("status"), "host_exit_code": end.get("exit_code"),
                "finished_on_host_at": end.get("time"), "collected_at": self.meta.get("collected")}

    def metric(self, stage: str, name: str) -> Any:
        record = self.stages.get(stage)
        if record is None:
            return None
        if name == "status":
            return record.status.value
        return record.metrics.get(name)


@dataclass
class RunRecord:
    run_id: str
    path: Path
    meta: dict[str, Any]
    hosts: dict[str, HostRecord]

    def stage_names(self) -> list[str]:
        names: list[str] = list(self.meta.get("stages") or [])
        for host in self.hosts.values():
            names += [s for s in host.stages if s not in names]
        return names


MAX_EVENT_LOG_BYTES = 256 << 20  # a run's log holds a few MB; read whole into records


def read_events(path: Path, run_id: str | None = None, host: str | None = None) -> list[dict[str, Any]]:
    """The smoke records of an event log ([] when there is none); with run_id and host,
    ConfigError naming the file and line for a record of another run or host (nothing of a
    mixed log is used). Read by the bounded reader: a regular file of at most
    MAX_EVENT_LOG_BYTES, lines of at most a transport line (MAX_LINE_BYTES)."""
    try:
        handle = open_regular(path, MAX_EVENT_LOG_BYTES)
    except FileNotFoundError:
        return []
    except FileRefused as err:
        raise ConfigError(f"{path}: unreadable event log: {err.why}") from None
    with handle:
        return parse_events(handle, path, run_id, host)


def parse_events(source: Any, path: Path, run_id: str | None = None, host: str | None = None) -> list[dict[str, Any]]:
    """`read_events` of an open binary file (or BytesIO) that holds the log of `path`."""
    from ddtree_ops.transport.base import MAX_LINE_BYTES

    records, consumed = [], 0
    for number, raw in enumerate(iter(lambda: source.readline(MAX_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise ConfigError(f"{path}: line {number}: longer than {MAX_LINE_BYTES} bytes: refused")
        consumed += len(raw)
        if consumed > MAX_EVENT_LOG_BYTES:  # it grew while read (a writer still appending)
            raise ConfigError(f"{path}: more than {MAX_EVENT_LOG_BYTES} bytes: refused")
        record = parse_record(raw.decode("utf-8", "replace"))
        if record is None:
            continue
        if run_id is not None and host is not None:
            check_record_owner(record, run_id, host, f"{path}: line {number}")
            why = record_field_error(record)
            if why is not None:
                raise ConfigError(f"{path}: line {number}: {why}")
        records.append(record)
    return records


def read_stage_copy(path: Path, run_id: str, host: str) -> dict[str, Any]:
    """A `stages/<stage>.json` copy (a stage_end record), refused if another run's or host's."""
    record = read_json(path)
    check_record_owner(record, run_id, host, str(path))
    return record


def _stage_record(record: dict[str, Any], where: Path) -> StageRecord:
    try:
        return StageRecord.from_record(record)
    except ValueError as err:
        raise ConfigError(f"{where}: stage {str(record.get('stage'))!r:.60}: {err}") from None


def _load_or_fail(host_dir: Path, host: str, run_id: str, asked: list[str]) -> HostRecord:
    """One host's results; a host whose files hold a bad record (a wrong field, another run's or
    host's record) is failed with that error, and every other host is still read."""
    try:
        return load_host(host_dir, host, run_id, asked)
    except ConfigError as err:
        return HostRecord(host=host, meta={}, stages={}, outcome=HostOutcome.FAIL, error=str(err))


def _check_host_meta(meta: dict[str, Any], path: Path) -> None:
    """The operator-side facts `load_host` reads from a host's run.json, each of its kind:
    ConfigError naming the file and field otherwise (a hand-edited or planted record)."""
    outcome = meta.get("outcome")
    if outcome is not None and (not isinstance(outcome, str) or outcome not in {o.value for o in HostOutcome}):
        allowed = ", ".join(o.value for o in HostOutcome)
        raise ConfigError(f"{path}: outcome: expected one of {allowed}, got {quoted(outcome)}")
    for name in ("error", "record_error", "state"):
        if not isinstance(meta.get(name), (str, type(None))):
            raise ConfigError(f"{path}: {name}: expected a string, got {quoted(meta.get(name))}")
    if not isinstance(meta.get("lost"), (dict, type(None))):
        raise ConfigError(f"{path}: lost: expected an object, got {quoted(meta.get('lost'))}")


def load_host(host_dir: Path, host: str, run_id: str, asked: list[str] | None = None) -> HostRecord:
    """A host's results from its folder; the event log is the truth, `collect` may have
    replaced it with the host's own (more complete) copy. A record of another run or host
    (a log copied by hand) is a ConfigError naming the file: never shown as this run's.
    `asked`: the stages the operator asked for (run.json); the outcome of a finished host is
    judged from those and the stage records (ddtree_ops.outcome), never from its run_end."""
    meta = read_json(host_dir / "run.json")
    _check_host_meta(meta, host_dir / "run.json")
    events = read_events(host_dir / "events.jsonl", run_id, host)
    asked = [str(s) for s in asked or []]
    planned: list[str] = []
    started: set[str] = set()
    ended: dict[str, StageRecord] = {}
    run_end = None
    for record in events:
        kind = record.get("event")
        if kind == "run_start":
            planned = [str(s) for s in record.get("stages") or []]
        elif kind == "stage_start":
            started.add(str(record.get("stage")))
        elif kind == "stage_end":
            stage_record = _stage_record(record, host_dir / "events.jsonl")
            ended[stage_record.stage] = stage_record
        elif kind == "run_end":
            run_end = record
    for stage_file in sorted((host_dir / "stages").glob("*.json")):  # e.g. events lost
        if stage_file.stem in ended:
            continue  # the event log has it: the copy is only a fallback
        stage_record = _stage_record(read_stage_copy(stage_file, run_id, host), stage_file)
        ended.setdefault(stage_record.stage, stage_record)
    outcome_note = meta.get("outcome")
    error = meta.get("error")
    stages: dict[str, StageRecord] = {}
    stopped = run_end is not None and run_end.get("status") in STOPPED_RUN_ENDS
    # a host that never started, or whose runner refused the plan, shows no cells, only its outcome
    shown = asked if events and not stopped else []
    wanted = shown + [s for s in planned if s not in shown]
    order = wanted + [s for s in sorted(ended, key=lambda s: ended[s].index) if s not in wanted]
    lost = meta.get("lost") if isinstance(meta.get("lost"), dict) else {}
    for index, stage in enumerate(order):
        if stage in ended:
            stages[stage] = ended[stage]
        elif run_end is not None and not stopped:  # the host says it finished, and never reported this stage
            stages[stage] = StageRecord(stage, index, StageStatus.MISSING,
                                        "missing: asked for, and the host sent no record of it")
        elif stage in started:
            why = error or "the host stopped answering"
            ran = lost.get("stage_ran_s") if lost.get("stage") == stage else None
            stages[stage] = StageRecord(stage, index, StageStatus.FAIL,
                                        f"no result: {why} during this stage",
                                        duration_s=float(ran) if isinstance(ran, (int, float)) else 0.0,
                                        lost=outcome_note == HostOutcome.LOST.value)
        else:
            stages[stage] = StageRecord(stage, index, StageStatus.NOT_RUN,
                                        "not run: the run ended early")
    disagreements: tuple[str, ...] = ()
    if isinstance(meta.get("record_error"), str):
        outcome, error = HostOutcome.FAIL, meta["record_error"]  # whatever else it sent: not trusted
    elif outcome_note == HostOutcome.LOST.value:
        outcome = HostOutcome.LOST  # whatever the host finished later: the run lost it
    elif run_end is not None:
        verdict = judge_finished_host(asked, planned, {s: r.status.value for s, r in ended.items()},
                                      run_end.get("status"))
        outcome, disagreements = verdict.outcome, verdict.disagreements
        if disagreements and error is None:
            error = f"{host_dir / 'events.jsonl'}: " + "; ".join(disagreements)
    elif outcome_note in {o.value for o in HostOutcome}:
        outcome = HostOutcome(outcome_note)
    elif events:
        outcome = HostOutcome.LOST
    else:
        outcome = HostOutcome.PENDING
    return HostRecord(host=host, meta=meta, stages=stages, outcome=outcome, error=error, run_end=run_end,
                      disagreements=list(disagreements))


# ----------------------------------------------------------------------------- collect

def sha256_file(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open_regular(path, max_bytes=None) as handle:  # never blocks on a FIFO put there meanwhile
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


def adopt_remote_records(host_dir: Path, run_id: str, host: str) -> bool:
    """Use the host's own event log when it holds more records than the streamed one.

    Everything is read and checked first: a record of another run or host in the host's log or
    stage copies (e.g. another run's files copied there) is a ConfigError naming the file, and
    the local records stay as they were. The log adopted is the very bytes that were checked;
    everything is written following no link below the runs root (`host_dir`/../..)."""
    import io

    if host_dir.name != host or host_dir.parent.name != run_id:
        raise ConfigError(f"{host_dir}: not the folder of host {host} in run {run_id}")
    root, parts = host_dir.parent.parent, [run_id, host]
    remote = host_dir / "remote"
    remote_events = remote / "events.jsonl"
    try:
        raw = read_bytes(remote_events, MAX_EVENT_LOG_BYTES)
    except FileNotFoundError:
        return False
    except FileRefused as err:
        raise ConfigError(f"{remote_events}: unreadable event log: {err.why}") from None
    theirs = parse_events(io.BytesIO(raw), remote_events, run_id, host)
    ours = read_events(host_dir / "events.jsonl")
    if len(theirs) <= len(ours):
        return False
    stage_copies = {stage_file.name: read_stage_copy(stage_file, run_id, host)
                    for stage_file in sorted((remote / "stages").glob("*.json"))
                    if _STAGE_RE.fullmatch(stage_file.stem)}
    try:
        write_file(root, [*parts, "events.jsonl"], raw)
    except WriteRefused as err:
        raise ConfigError(str(err)) from None
    for name, record in stage_copies.items():
        write_json_atomic(root, [*parts, "stages", name], record)
    meta = read_json(host_dir / "run.json")
    meta["collected"] = time.time()
    if any(r.get("event") == "run_end" for r in theirs) and meta.get("outcome") != HostOutcome.LOST.value:
        meta.pop("outcome", None)  # the host finished: its run_end decides the outcome
    # a host lost during the run stays lost: its history shows what it finished afterwards
    write_json_atomic(root, [*parts, "run.json"], meta)
    return True
