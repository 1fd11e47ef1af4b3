"""The report of a smoke run: a host x stage status model, its failures, the budget sweep,
and the timing noise of each cell. No rendering library here: the CLI draws the model with
Rich; `to_dict()` is the `--json` document. Baselines are judged in `metric_checks` (named
metrics) and `decode_checks` (decode baselines); charts are drawn in `plots`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ddtree_ops.errors import quoted
from ddtree_ops.noise import GPU_BUSY_LIMIT_PCT, LOAD_PER_CPU_LIMIT, MIN_SAMPLES, SPREAD_LIMIT, Noise, cell_noise, load_problem
from ddtree_ops.outcome import HostOutcome, exit_code_for
from ddtree_ops.results import RunRecord, StageStatus

SWEEP_STAGE = "tree-bench"
SWEEP_TABLE = "sweep"
DECODE_STAGE = "decode-bench"
DECODE_TABLE = "methods"  # one row per method: method, budget, tau, speedup, ... (runsummary)
SERVER_STAGE = "sglang-e2e"
SERVER_TABLE = "sglang_e2e"  # one row per server variant: acceptance, offline acceptance, tokens/s, ...
SERVER_LOAD_TABLE = "sglang_load"  # one row per variant and concurrency level
LOST_STAGE = "lost"  # a stage's report status when the host was lost during it
TIMINGS_TABLE = "timings"  # a timed stage's min / median / max per cell (hostside/protocol.py)
# What the report adds to a decode-bench row (its timing spread and noise verdict): not part
# of the row the host wrote, so taken off again before the row is read as a method summary.
DECODE_NOISE_KEYS = ("tpot_min_ms", "tpot_median_ms", "tpot_max_ms", "spread", "noisy", "noisy_why")


# ----------------------------------------------------------------------------- the model

@dataclass
class Failure:
    host: str
    stage: str
    reason: str
    detail: str | None  # last traceback line or output line, when the stage left one

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "stage": self.stage, "reason": self.reason,
                "detail": self.detail}


@dataclass
class Report:
    run_id: str
    stages: list[str]
    hosts: list[str]
    outcomes: dict[str, HostOutcome]
    statuses: dict[str, dict[str, str]]  # host -> stage -> status value
    durations: dict[str, dict[str, float]]  # host -> stage -> seconds
    reasons: dict[str, dict[str, str]]  # host -> stage -> reason
    failures: list[Failure]
    sweep: list[dict[str, Any]]  # tree-bench rows, each with its `host`
    decode: list[dict[str, Any]] = field(default_factory=list)  # decode-bench rows + `host`
    server: list[dict[str, Any]] = field(default_factory=list)  # sglang-e2e variant rows + `host`
    server_load: list[dict[str, Any]] = field(default_factory=list)  # sglang-e2e load rows + `host`
    meta: dict[str, Any] = field(default_factory=dict)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> timed stage -> load
    timings: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # host -> "stage.cell" -> row
    histories: dict[str, dict[str, Any]] = field(default_factory=dict)  # lost hosts: HostRecord.history
    disagreements: dict[str, list[str]] = field(default_factory=dict)  # host -> its records that contradicted the verdict

    @property
    def exit_code(self) -> int:
        return int(exit_code_for(self.outcomes.values()))

    def noise(self, host: str, stage: str, cell: str) -> Noise | None:
        """The noise verdict on a timed value (`stage`'s `timings` has `cell`), else None: a
        value that does not depend on time (tau, a status) is judged as it is."""
        timing = self.timings.get(host, {}).get(f"{stage}.{cell}")
        if timing is None:
            return None
        return cell_noise(timing, self.loads.get(host, {}).get(stage))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_command": self.meta.get("command"),  # smoke or bench
            "duration_s": self.meta.get("duration_s"),  # the run's wall time
            "release": self.meta.get("release"),
            "stages": self.stages,
            "hosts": {h: {"outcome": self.outcomes[h].value, "history": self.histories.get(h),
                          "disagreements": self.disagreements.get(h, []),
                          "stages": {s: {"status": self.statuses[h].get(s),
                                         "duration_s": self.durations[h].get(s),
                                         "reason": self.reasons[h].get(s),
                                         **self._load_dict(h, s)}
                                     for s in self.stages if s in self.statuses[h]}}
                      for h in self.hosts},
            "noise_rule": {"min_samples": MIN_SAMPLES, "spread_limit": SPREAD_LIMIT, "load_per_cpu_limit": LOAD_PER_CPU_LIMIT,
                           "gpu_busy_limit_pct": GPU_BUSY_LIMIT_PCT},
            "failures": [f.to_dict() for f in self.failures],
            "sweep": self.sweep,
            "decode": self.decode,
            "server": self.server,
            "server_load": self.server_load,
            "run_exit_code": self.exit_code,  # the run's verdict; `exit_code` is the command's
            "original_exit_code": self.meta.get("exit_code"),  # what the run's command exited with
        }

    def _load_dict(self, host: str, stage: str) -> dict[str, Any]:
        """A timed stage's host load and timing cells, with the noise verdict on each."""
        load = self.loads.get(host, {}).get(stage)
        prefix = f"{stage}."
        cells = {name[len(prefix):]: row for name, row in self.timings.get(host, {}).items()
                 if name.startswith(prefix)}
        if load is None and not cells:
            return {}
        judged = {cell: {**row, "noisy": cell_noise(row, load).noisy,
                         "noisy_why": cell_noise(row, load).why or None} for cell, row in cells.items()}
        return {"load": load, "load_problem": load_problem(load) or None, "timings": judged}


def shown_value(value: Any) -> str:
    """A value in a one-line verdict, as an operator reads it (no Python reprs, no `None`)."""
    if value is None:
        return "nothing"
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)


def on_host(host: Any) -> str:
    """' on <host>' for a verdict line, or nothing when there is no host to name."""
    return "" if host in (None, "", "-") else f" on {host}"


def as_number(value: Any) -> float | None:
    """A number given as a number or as its string form (the runner writes inf/nan as text), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _last_line(text: str | None) -> str | None:
    if not text:
        return None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


# The fields a table's rows are grouped and sorted by, and what each must be.
_INTEGER, _INTEGER_OR_NONE, _TEXT = "an integer", "an integer or null", "a string"
_TEXT_OR_NONE = "a string or null"
_ROW_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    SWEEP_TABLE: (("builder", _TEXT), ("batch_size", _INTEGER), ("budget", _INTEGER)),
    DECODE_TABLE: (("budget", _INTEGER_OR_NONE),),
    SERVER_TABLE: (("variant", _TEXT), ("method", _TEXT_OR_NONE), ("budget", _INTEGER_OR_NONE),
                   ("block_size", _INTEGER_OR_NONE)),
    SERVER_LOAD_TABLE: (("variant", _TEXT), ("concurrency", _INTEGER), ("budget", _INTEGER_OR_NONE))}


def _fits(value: Any, kind: str) -> bool:
    if kind == _TEXT:
        return isinstance(value, str)
    if kind == _TEXT_OR_NONE:
        return value is None or isinstance(value, str)
    return (kind == _INTEGER_OR_NONE and value is None) or (isinstance(value, int) and not isinstance(value, bool))


def _keyed_rows(host: str, record: Any, table: str, failures: list[Failure]) -> list[dict[str, Any]]:
    """The table's rows of a stage record, each with its `host`; a row whose key field is not
    what it must be (a host's record may hold anything) is left out and named as that host's
    failure, so that grouping and sorting meet only comparable values."""
    if record is None:
        return []
    kept = []
    for index, row in enumerate(record.tables.get(table, [])):
        bad = next(((key, kind) for key, kind in _ROW_KEYS[table] if not _fits(row.get(key), kind)), None)
        if bad is None:
            kept.append({"host": host, **row})
        else:
            failures.append(Failure(host, record.stage, f"{table}[{index}].{bad[0]}: expected {bad[1]}, got "
                                                        f"{quoted(row.get(bad[0]))} (the row is left out)", None))
    return kept


def build_report(run: RunRecord) -> Report:
    stages = run.stage_names()
    statuses: dict[str, dict[str, str]] = {}
    durations: dict[str, dict[str, float]] = {}
    reasons: dict[str, dict[str, str]] = {}
    failures: list[Failure] = []
    sweep: list[dict[str, Any]] = []
    decode: list[dict[str, Any]] = []
    server: list[dict[str, Any]] = []
    server_load: list[dict[str, Any]] = []
    loads: dict[str, dict[str, Any]] = {}
    timings: dict[str, dict[str, dict[str, Any]]] = {}
    histories: dict[str, dict[str, Any]] = {}
    for name, host in run.hosts.items():
        # "lost": under way when the host was lost (its duration: how long it had run)
        statuses[name] = {s: LOST_STAGE if r.lost else r.status.value for s, r in host.stages.items()}
        if host.history is not None:
            histories[name] = host.history
        durations[name] = {s: r.duration_s for s, r in host.stages.items()}
        reasons[name] = {s: r.reason for s, r in host.stages.items()}
        if host.error and host.outcome is not HostOutcome.PASS:
            failures.append(Failure(name, "-", host.error, None))
        for stage, record in host.stages.items():
            if record.status in (StageStatus.FAIL, StageStatus.MISSING):
                detail = _last_line(record.traceback) or _last_line(record.output_tail)
                failures.append(Failure(name, stage, record.reason, detail))
        for stage, record in host.stages.items():
            if record.load is not None:
                loads.setdefault(name, {})[stage] = record.load
            for row in record.tables.get(TIMINGS_TABLE, []):
                if isinstance(row.get("cell"), str):
                    timings.setdefault(name, {})[f"{stage}.{row['cell']}"] = row
        sweep += _keyed_rows(name, host.stages.get(SWEEP_STAGE), SWEEP_TABLE, failures)
        decode += _keyed_rows(name, host.stages.get(DECODE_STAGE), DECODE_TABLE, failures)
        server += _keyed_rows(name, host.stages.get(SERVER_STAGE), SERVER_TABLE, failures)
        server_load += _keyed_rows(name, host.stages.get(SERVER_STAGE), SERVER_LOAD_TABLE, failures)
    report = Report(run_id=run.run_id, stages=stages, hosts=list(run.hosts),
                    outcomes={h: r.outcome for h, r in run.hosts.items()}, statuses=statuses,
                    durations=durations, reasons=reasons, failures=failures, sweep=sweep,
                    decode=decode, server=server, server_load=server_load, meta=run.meta, loads=loads, timings=timings, histories=histories,
                    disagreements={h: r.disagreements for h, r in run.hosts.items() if r.disagreements})
    for row in sweep:
        cell = f"build_ms.{row.get('builder')}.bs{row.get('batch_size')}.b{row.get('budget')}"
        _mark_noise(row, report.timings.get(row["host"], {}).get(f"{SWEEP_STAGE}.{cell}"),
                    report.noise(row["host"], SWEEP_STAGE, cell), "ms")
    for row in decode:
        cell = f"tpot_ms.{row.get('method')}"
        _mark_noise(row, report.timings.get(row["host"], {}).get(f"{DECODE_STAGE}.{cell}"),
                    report.noise(row["host"], DECODE_STAGE, cell), "tpot_ms", prefix="tpot_")
    return report


def _mark_noise(row: dict[str, Any], timing: dict[str, Any] | None, noise: Noise | None, unit: str,
                prefix: str = "") -> None:
    """A table row gains its cell's min / median / max, spread and noise verdict."""
    if timing is not None:
        if prefix:
            row.update({f"{prefix}min_ms": timing.get("min"), f"{prefix}median_ms": timing.get("median"),
                        f"{prefix}max_ms": timing.get("max")})
        else:
            row.update({f"min_{unit}": timing.get("min"), f"max_{unit}": timing.get("max")})
    row["spread"] = None if noise is None or noise.spread is None else round(noise.spread, 4)
    row["noisy"] = None if noise is None else noise.noisy
    row["noisy_why"] = None if noise is None else (noise.why or None)


def sweep_pivot(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Rows keyed by (host, batch_size, budget) with one per-request-ms column per builder."""
    builders: list[str] = []
    table: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        builder = str(row.get("builder"))
        if builder not in builders:
            builders.append(builder)
        key = (row.get("host"), row.get("batch_size"), row.get("budget"))
        entry = table.setdefault(key, {"host": key[0], "batch_size": key[1], "budget": key[2]})
        entry[builder] = row.get("per_request_ms")
        if row.get("noisy"):
            entry.setdefault("noisy_builders", []).append(builder)
        if row.get("nodes") is not None:
            entry["nodes"] = row["nodes"]
    ordered = sorted(table.values(), key=lambda r: (str(r["host"]), r["batch_size"] or 0,
                                                    r["budget"] or 0))
    return builders, ordered
