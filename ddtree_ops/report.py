"""The report of a smoke run: a host x stage status model, failures, the budget sweep, a
comparison with a baseline of named metrics, and PNG charts. No rendering library here:
the CLI draws the model with Rich; `to_dict()` is the `--json` document.

Baseline file (JSON or YAML), each check names `<stage>.<metric>` (`<stage>.status` for the
stage's outcome):

    metrics:
      - metric: tree-bench.build_ms.auto.bs1.b256
        expected: 1.5
        tolerance: 0.25        # relative to expected (default 0); abs_tolerance: absolute
        better: lower          # lower | higher | equal (default: equal, both ways)
        hosts: [gpu-a]         # default: every host of the run
      - metric: golden.status
        expected: pass

A check is a regression when the measured value is worse than expected beyond the
tolerance, is not a finite number (the runner writes inf/nan as "inf", "-inf", "nan"), or when
a host did not measure it at all. A non-finite `expected` is refused when the file is read.

The other kind of baseline is a decode baseline (`"format": "ddtree-ops-baseline/1"`, written
by `ddtree-ops baseline import|paper`): `compare_decode` checks every host's decode-bench
`methods` rows against it (tau within an absolute tolerance, token identity with AR at T=0).
`load_any_baseline` tells the two apart by content, not by file name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.noise import GPU_BUSY_LIMIT_PCT, LOAD_PER_CPU_LIMIT, SPREAD_LIMIT, Noise, cell_noise, load_problem
from ddtree_ops.tolerances import DEFAULT_TAU_TOLERANCE
from ddtree_ops.results import HostOutcome, RunRecord, StageStatus, hosts_exit_code

SWEEP_STAGE = "tree-bench"
SWEEP_TABLE = "sweep"
DECODE_STAGE = "decode-bench"
DECODE_TABLE = "methods"  # one row per method: method, budget, tau, speedup, ... (runsummary)
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
    meta: dict[str, Any] = field(default_factory=dict)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> timed stage -> load
    timings: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # host -> "stage.cell" -> row
    histories: dict[str, dict[str, Any]] = field(default_factory=dict)  # lost hosts: HostRecord.history

    @property
    def exit_code(self) -> int:
        return int(hosts_exit_code(self.outcomes.values()))

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
                          "stages": {s: {"status": self.statuses[h].get(s),
                                         "duration_s": self.durations[h].get(s),
                                         "reason": self.reasons[h].get(s),
                                         **self._load_dict(h, s)}
                                     for s in self.stages if s in self.statuses[h]}}
                      for h in self.hosts},
            "noise_rule": {"spread_limit": SPREAD_LIMIT, "load_per_cpu_limit": LOAD_PER_CPU_LIMIT,
                           "gpu_busy_limit_pct": GPU_BUSY_LIMIT_PCT},
            "failures": [f.to_dict() for f in self.failures],
            "sweep": self.sweep,
            "decode": self.decode,
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


def _on_host(host: Any) -> str:
    return "" if host in (None, "", "-") else f" on {host}"


def _last_line(text: str | None) -> str | None:
    if not text:
        return None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


def build_report(run: RunRecord) -> Report:
    stages = run.stage_names()
    statuses: dict[str, dict[str, str]] = {}
    durations: dict[str, dict[str, float]] = {}
    reasons: dict[str, dict[str, str]] = {}
    failures: list[Failure] = []
    sweep: list[dict[str, Any]] = []
    decode: list[dict[str, Any]] = []
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
            if record.status is StageStatus.FAIL:
                detail = _last_line(record.traceback) or _last_line(record.output_tail)
                failures.append(Failure(name, stage, record.reason, detail))
        for stage, record in host.stages.items():
            if record.load is not None:
                loads.setdefault(name, {})[stage] = record.load
            for row in record.tables.get(TIMINGS_TABLE, []):
                if isinstance(row.get("cell"), str):
                    timings.setdefault(name, {})[f"{stage}.{row['cell']}"] = row
        bench = host.stages.get(SWEEP_STAGE)
        if bench is not None:
            sweep += [{"host": name, **row} for row in bench.tables.get(SWEEP_TABLE, [])]
        decoded = host.stages.get(DECODE_STAGE)
        if decoded is not None:
            decode += [{"host": name, **row} for row in decoded.tables.get(DECODE_TABLE, [])]
    report = Report(run_id=run.run_id, stages=stages, hosts=list(run.hosts),
                    outcomes={h: r.outcome for h, r in run.hosts.items()}, statuses=statuses,
                    durations=durations, reasons=reasons, failures=failures, sweep=sweep,
                    decode=decode, meta=run.meta, loads=loads, timings=timings, histories=histories)
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


# ----------------------------------------------------------------------------- baselines

class Better(str, Enum):
    LOWER = "lower"
    HIGHER = "higher"
    EQUAL = "equal"


@dataclass(frozen=True)
class MetricCheck:
    metric: str  # "<stage>.<metric>"
    expected: Any
    tolerance: float = 0.0  # relative
    abs_tolerance: float = 0.0
    better: Better = Better.EQUAL
    hosts: tuple[str, ...] = ()  # empty: every host of the run

    @property
    def stage(self) -> str:
        return self.metric.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.metric.split(".", 1)[1]


@dataclass(frozen=True)
class Comparison:
    check: MetricCheck
    host: str
    measured: Any
    ok: bool
    why: str
    # False for a check of a host this run did not select (`-H` a subset of a fleet baseline),
    # or of a timed value too noisy to judge (`noisy`): neither passed nor a regression
    checked: bool = True
    noisy: bool = False

    @property
    def verdict(self) -> str:
        if self.noisy:
            return "not judged"
        if not self.checked:
            return "not checked"
        return "ok" if self.ok else "regression"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.check.metric, "host": self.host,
                "expected": self.check.expected, "measured": self.measured,
                "tolerance": self.check.tolerance, "abs_tolerance": self.check.abs_tolerance,
                "better": self.check.better.value, "ok": self.ok, "why": self.why, "checked": self.checked,
                "noisy": self.noisy, "verdict": self.verdict}

    def line(self) -> str:
        return (f"{self.check.metric}{_on_host(self.host)}: expected {shown_value(self.check.expected)}"
                f"{self._bound()}, measured {shown_value(self.measured)} ({self.why})")

    def _bound(self) -> str:
        if not isinstance(self.check.expected, (int, float)) or isinstance(self.check.expected, bool):
            return ""
        parts = []
        if self.check.tolerance:
            parts.append(f"{self.check.tolerance:.0%}")
        if self.check.abs_tolerance:
            parts.append(f"{self.check.abs_tolerance:g}")
        return f" ± {' + '.join(parts)}" if parts else ""


_CHECK_KEYS = {"metric", "expected", "tolerance", "abs_tolerance", "better", "hosts"}


class BaselineKind(str, Enum):
    METRICS = "metrics"  # a `metrics:` list of named checks (this module)
    DECODE = "decode"  # `ddtree-ops baseline import|paper` output (ddtree_ops.baselines)


NOT_A_BASELINE = ("not a baseline: expected a metrics baseline (a mapping with a `metrics:` list) or a decode "
                  "baseline written by `ddtree-ops baseline import|paper` (\"format\": \"ddtree-ops-baseline/1\")")


def read_baseline_document(path: Path) -> Any:
    """The parsed JSON/YAML of a baseline file; a torch.save file gets a hint, not a parse error."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read baseline: {err.strerror or err}") from err
    if raw.startswith(b"PK\x03\x04") or raw.startswith(b"\x80"):  # torch.save zip / raw pickle
        raise ConfigError(f"{path}: {NOT_A_BASELINE}; this is a torch.save file (a reference run?): turn "
                          f"it into a baseline with `ddtree-ops baseline import {path.name} -o baseline.json`")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: {NOT_A_BASELINE} (the file is not UTF-8 text)") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as err:  # noqa: BLE001 - yaml and json errors alike
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: "
                          f"{str(err).splitlines()[0]}") from err


def baseline_kind(data: Any) -> BaselineKind | None:
    """Which baseline a parsed document is, by its keys; None when it is neither."""
    if isinstance(data, dict) and "format" in data:
        return BaselineKind.DECODE
    if isinstance(data, dict) and "metrics" in data:
        return BaselineKind.METRICS
    return None


def load_any_baseline(path: Path) -> tuple[BaselineKind, Any]:
    """(METRICS, [MetricCheck]) or (DECODE, ddtree_ops.baselines.Baseline); ConfigError (exit 3)
    naming the file for anything else."""
    data = read_baseline_document(path)
    kind = baseline_kind(data)
    if kind is BaselineKind.METRICS:
        return kind, parse_metric_checks(data, path)
    if kind is BaselineKind.DECODE:
        from ddtree_ops.baselines import Baseline  # lazy: pulls in torch via ddtree

        return kind, Baseline.from_dict(data, str(path))
    raise ConfigError(f"{path}: {NOT_A_BASELINE}")


def load_baseline(path: Path) -> list[MetricCheck]:
    """A metrics baseline; every error names the file and the entry."""
    data = read_baseline_document(path)
    if baseline_kind(data) is not BaselineKind.METRICS:
        raise ConfigError(f"{path}: {NOT_A_BASELINE}")
    return parse_metric_checks(data, path)


def parse_metric_checks(data: dict[str, Any], path: Path) -> list[MetricCheck]:
    if not isinstance(data.get("metrics"), list):
        raise ConfigError(f"{path}: metrics: expected a list of checks, got {type(data.get('metrics')).__name__}")
    checks = []
    for index, entry in enumerate(data["metrics"]):
        where = f"{path}: metrics[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping, got {entry!r}")
        unknown = sorted(set(entry) - _CHECK_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}")
        metric = entry.get("metric")
        if not isinstance(metric, str) or "." not in metric:
            raise ConfigError(f"{where}.metric: expected '<stage>.<name>', got {metric!r}")
        if "expected" not in entry:
            raise ConfigError(f"{where}: missing `expected`")
        if _is_non_finite(entry["expected"]):  # inf would pass every `lower` check, nan fail all
            raise ConfigError(f"{where}.expected: expected a finite value, got {entry['expected']!r}")
        try:
            better = Better(entry.get("better", "equal"))
        except ValueError:
            raise ConfigError(f"{where}.better: expected lower, higher or equal, got "
                              f"{entry.get('better')!r}") from None
        tolerances = {}
        for key in ("tolerance", "abs_tolerance"):
            value = entry.get(key, 0.0)
            # NaN would fail every check and inf pass every one: neither is a tolerance
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
            tolerances[key] = float(value)
        hosts = entry.get("hosts", [])
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"{where}.hosts: expected a list of host names, got {hosts!r}")
        checks.append(MetricCheck(metric=metric, expected=entry["expected"], better=better,
                                  hosts=tuple(hosts), **tolerances))
    return checks


def _is_non_finite(value: Any) -> bool:
    """A float infinity or NaN, or its string form ("inf", "-inf", "nan": how the runner writes
    non-finite values, hostside/protocol.py jsonable)."""
    number = _as_number(value)
    return number is not None and not math.isfinite(number)


def _as_number(value: Any) -> float | None:
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


def judge(check: MetricCheck, measured: Any) -> tuple[bool, str]:
    if measured is None:
        return False, "not measured"
    expected = _as_number(check.expected)
    got = _as_number(measured)
    if expected is None or isinstance(check.expected, bool):
        same = measured == check.expected and type(measured) is type(check.expected)
        return same, "equal" if same else "differs"
    if not math.isfinite(expected):  # refused when a baseline is loaded; never a pass
        return False, "expected value is not a finite number"
    if got is None or not math.isfinite(got):  # "inf" / "-inf" / "nan" as the runner writes them
        return False, "not a number"
    slack = abs(expected) * check.tolerance + check.abs_tolerance
    if check.better is Better.LOWER:
        ok = got <= expected + slack
        return ok, "within tolerance" if ok else f"{got / expected:.2f}x expected" \
            if expected else "above expected"
    if check.better is Better.HIGHER:
        ok = got >= expected - slack
        return ok, "within tolerance" if ok else "below expected"
    ok = abs(got - expected) <= slack
    return ok, "within tolerance" if ok else "outside tolerance"


def compare_with_baseline(run: RunRecord, checks: list[MetricCheck]) -> list[Comparison]:
    results = []
    for check in checks:
        hosts = check.hosts or tuple(run.hosts)
        for host in hosts:
            record = run.hosts.get(host)
            if record is None:  # not selected for this run: nothing to judge (an unreachable host is judged)
                results.append(Comparison(check, host, None, False, "host not in this run: not checked", checked=False))
                continue
            measured = record.metric(check.stage, check.name)
            noise = _metric_noise(record.stages.get(check.stage), check.name)
            if noise is not None and noise.noisy:  # a verdict on noise would be a guess
                results.append(Comparison(check, host, measured, False, f"not judged: noisy, {noise.why}",
                                          checked=False, noisy=True))
                continue
            ok, why = judge(check, measured)
            results.append(Comparison(check, host, measured, ok, why))
    return results


def _metric_noise(record: Any, name: str) -> Noise | None:
    """The noise verdict on a stage's metric when it is a timed value (its `timings` has it)."""
    if record is None:
        return None
    for row in record.tables.get(TIMINGS_TABLE, []):
        if row.get("cell") == name:
            return cell_noise(row, record.load)
    return None


# ----------------------------------------------------------------------------- decode baselines



@dataclass(frozen=True)
class DecodeCheck:
    """One judged value of a host's decode-bench against a decode baseline."""

    metric: str  # "decode-bench.tau.ddtree_tb64", "decode-bench.identical_to_ar.dflash", ...
    host: str
    expected: Any
    measured: Any
    tolerance: float | None  # absolute, for tau
    ok: bool
    why: str

    @property
    def verdict(self) -> str:
        """ok, regression, or outside tolerance: a value above the baseline beyond a two-sided
        tolerance (tau far above it: a different setup, still exit 5, but not a loss)."""
        if self.ok:
            return "ok"
        above = _as_number(self.measured) is not None and _as_number(self.expected) is not None \
            and self.tolerance is not None and _as_number(self.measured) > _as_number(self.expected)
        return "outside tolerance" if above else "regression"

    def line(self) -> str:
        bound = f" ± {self.tolerance:g}" if self.tolerance is not None else ""
        return (f"{self.metric}{_on_host(self.host)}: expected {shown_value(self.expected)}{bound}, "
                f"measured {shown_value(self.measured)} ({self.why})")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "host": self.host, "expected": self.expected,
                "measured": self.measured, "tolerance": self.tolerance, "ok": self.ok,
                "verdict": self.verdict, "why": self.why}


@dataclass
class DecodeComparison:
    tau_tolerance: float
    checks: list[DecodeCheck]
    rows: list[dict[str, Any]]  # one per (host, method): run and baseline side by side
    notes: list[str]  # hosts and baseline methods not compared, and why
    # baseline methods of a cell a host measured that its run has no row for:
    # {host, method, baseline_cell, regression, why}
    not_compared: list[dict[str, Any]] = field(default_factory=list)

    @property
    def regressions(self) -> list[DecodeCheck]:
        return [c for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"tau_tolerance": self.tau_tolerance, "comparisons": [c.to_dict() for c in self.checks],
                "rows": self.rows, "notes": self.notes, "not_compared": self.not_compared,
                "regressions": len(self.regressions)}


def _cell_name(key: tuple[Any, ...]) -> str:
    return f"{key[0]} · {key[1]} · T={key[2]:g}"


def _run_summaries(report: Report, host: str) -> list[Any]:
    from ddtree_ops.baselines import summaries_from_rows

    rows = [{k: v for k, v in row.items() if k != "host" and k not in DECODE_NOISE_KEYS}
            for row in report.decode if row["host"] == host]
    return summaries_from_rows(rows, f"run {report.run_id}: {host}: {DECODE_STAGE} {DECODE_TABLE}")


def _aliases(summaries: list[Any], dataset: str | None, model: str | None) -> tuple[dict, dict]:
    datasets = {s.dataset: dataset for s in summaries} if dataset else {}
    models = {s.model: model for s in summaries} if model else {}
    return datasets, models


def _row_verdict(row: Any) -> str | None:
    """A comparison row's word: None (nothing to judge), ok, regression, or outside tolerance
    (tau above the baseline's beyond the tolerance, tokens fine)."""
    if row.tau_ok is None and row.lossless_ok is None:
        return None
    if row.ok:
        return "ok"
    if row.lossless_ok is not False and row.tau > row.baseline_tau:
        return "outside tolerance"
    return "regression"


def compare_decode(report: Report, baseline: Any, tau_tolerance: float = DEFAULT_TAU_TOLERANCE,
                   dataset: str | None = None, model: str | None = None) -> DecodeComparison:
    """Every host's decode-bench rows against a decode baseline (`ddtree_ops.baselines.Baseline`).

    Per method: tau within `tau_tolerance` of the baseline cell (same dataset, model,
    temperature and method; `dataset` / `model` name the baseline's cell when the run's names
    differ, e.g. our prompt set standing in for math500) and, at T=0, every request
    token-identical to AR (an unmeasured identity is a regression too). A host whose
    decode-bench failed, did not run, or passed without rows, or whose rows match no baseline
    cell, is a regression (nothing could be checked); only a host that skipped it (no models)
    is noted. Baseline methods of a matched cell that the host lacks: a budget the run did not
    sweep is noted; `dflash`, AR (`baseline`) or `ddtree_best`, which decode-bench always
    measures, is a `not measured` regression.
    """
    from ddtree.runsummary import AUTOREGRESSIVE_KEY
    from ddtree_ops.baselines import compare_with_baseline

    if tau_tolerance < 0:
        raise ConfigError(f"--tau-tolerance: expected a number >= 0, got {tau_tolerance}")
    checks: list[DecodeCheck] = []
    table: list[dict[str, Any]] = []
    notes: list[str] = []
    compared_hosts = 0
    not_compared: list[dict[str, Any]] = []
    for host in report.hosts:
        status = report.statuses[host].get(DECODE_STAGE)
        reason = report.reasons[host].get(DECODE_STAGE, "")
        summaries = _run_summaries(report, host)
        if not summaries:
            if status == StageStatus.SKIP.value:
                notes.append(f"{host}: not compared (decode-bench skip: {reason})")
            elif status is None and DECODE_STAGE not in report.stages:
                notes.append(f"{host}: not compared (no decode-bench in this run)")
            else:
                if status == StageStatus.PASS.value:
                    what = f"decode-bench pass without {DECODE_TABLE} rows: {reason}"
                elif status is None:
                    what = f"no decode-bench result (host {report.outcomes[host].value})"
                else:
                    what = f"decode-bench {status}: {reason}"
                checks.append(DecodeCheck(f"{DECODE_STAGE}.{DECODE_TABLE}", host, "decode-bench results", None,
                                          None, False, f"not measured: {what}"))
            continue
        compared_hosts += 1
        datasets, models = _aliases(summaries, dataset, model)
        result = compare_with_baseline(summaries, baseline, tau_tolerance, datasets, models)
        matched = 0
        for row in result.rows:
            method = row.key[3]
            cell = _cell_name(row.baseline_key)
            table.append({"host": host, "method": method, "budget": row.budget, "tau": row.tau,
                          "baseline_tau": row.baseline_tau, "speedup": row.speedup,
                          "baseline_speedup": row.baseline_speedup, "identical_to_ar": row.identical_to_ar,
                          "baseline_cell": cell if row.tau_ok is not None else None,
                          "ok": row.ok if (row.tau_ok is not None or row.lossless_ok is not None) else None,
                          "verdict": _row_verdict(row)})
            if method == AUTOREGRESSIVE_KEY:
                continue  # the reference itself: tau 1 and identical by construction
            if row.tau_ok is not None:
                matched += 1
                delta = row.tau - row.baseline_tau
                why = f"{delta:+.3f}, {'within' if row.tau_ok else 'outside'} tolerance"
                if method == "ddtree_best":
                    why += f", fastest budget {row.budget}"
                checks.append(DecodeCheck(f"{DECODE_STAGE}.tau.{method}", host, row.baseline_tau,
                                          round(row.tau, 4), tau_tolerance, bool(row.tau_ok),
                                          f"{why}; baseline {cell}"))
            if row.lossless_ok is not None:
                if row.identical_to_ar is None:
                    why = "not measured: no identical_to_ar at T=0"
                elif row.lossless_ok:
                    why = "token-identical to AR at T=0"
                else:
                    why = f"tokens differ from AR at T=0 on {1.0 - row.identical_to_ar:.0%} of requests"
                checks.append(DecodeCheck(f"{DECODE_STAGE}.identical_to_ar.{method}", host, 1.0,
                                          row.identical_to_ar, None, bool(row.lossless_ok), why))
        for entry in result.not_compared:
            cell = _cell_name(entry.key)
            if entry.budget is not None:  # the operator's budget sweep: a choice, not a loss
                why = f"the run measured no budget {entry.budget}"
                notes.append(f"{host}: {entry.method} of baseline {cell} not compared ({why})")
            else:
                why = f"not measured: the run has no {entry.method} row for baseline {cell}"
                checks.append(DecodeCheck(f"{DECODE_STAGE}.tau.{entry.method}", host, entry.tau, None,
                                          tau_tolerance, False, why))
            not_compared.append({"host": host, "method": entry.method, "baseline_cell": cell,
                                 "regression": entry.budget is None, "why": why})
        if not matched:
            run_cells = sorted({_cell_name(s.key) for s in summaries})
            offered = sorted({e.dataset for e in baseline.entries})
            offered_models = sorted({e.model for e in baseline.entries})
            checks.append(DecodeCheck(
                f"{DECODE_STAGE}.tau", host, "a baseline cell", ", ".join(run_cells), None, False,
                f"no such cell in the baseline, which has datasets {', '.join(offered)} and models "
                f"{', '.join(offered_models)}: name one with --baseline-dataset / --baseline-model"))
    if not compared_hosts and not checks:
        checks.append(DecodeCheck(f"{DECODE_STAGE}.{DECODE_TABLE}", "-", "decode-bench results", None, None,
                                  False, f"no host of run {report.run_id} measured decode-bench"))
    return DecodeComparison(tau_tolerance=tau_tolerance, checks=checks, rows=table, notes=notes,
                            not_compared=not_compared)


def decode_baseline_overlay(report: Report, baseline: Any, dataset: str | None = None,
                            model: str | None = None) -> list[dict[str, Any]]:
    """The baseline's points for `plot_run(..., decode_baseline=...)`: for each (dataset,
    model, temperature) of the run, the baseline's DDTree budget sweep and its DFlash level."""
    from ddtree_ops.baselines import budget_series

    series = budget_series(baseline.entries)
    index = baseline.index()
    points: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for host in report.hosts:
        summaries = _run_summaries(report, host)
        datasets, models = _aliases(summaries, dataset, model)
        for summary in summaries:
            ds, name, temperature, _ = summary.key
            cell = (datasets.get(ds, ds), models.get(name, name), temperature)
            if cell in seen:
                continue
            seen.add(cell)
            label = f"baseline {_cell_name(cell)}"
            points += [{"budget": b, "tau": t, "speedup": sp, "label": f"{label} · DDTree"}
                       for b, t, sp in series.get(cell, [])]
            flat = index.get((*cell, "dflash"))
            if flat is not None:
                points.append({"budget": None, "method": "dflash", "tau": flat.tau, "speedup": flat.speedup,
                               "label": f"{label} · DFlash"})
    return points


# ----------------------------------------------------------------------------- plots

def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        from ddtree_ops.errors import UsageError

        raise UsageError("--plot needs matplotlib (pip install matplotlib, or the project's "
                         "`test` extra)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(report: Report, out_dir: Path,
             decode_baseline: list[dict[str, Any]] | None = None) -> list[Path]:
    """Every chart the run has data for: tree-build time vs budget (tree-bench) and, with
    decode-bench results, acceptance length and speedup vs budget."""
    return plot_sweep(report, out_dir) + plot_decode(report, out_dir, decode_baseline)


def plot_decode(report: Report, out_dir: Path,
                baseline: list[dict[str, Any]] | None = None) -> list[Path]:
    """tau and speedup against the DDTree budget, a line per host (DFlash as a dashed level);
    `baseline` rows (`budget`, `tau`, `speedup`, optional `label`) are overlaid."""
    rows = [r for r in report.decode if _as_number(r.get("budget")) is not None]
    if not rows:
        return []
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, key, label in ((axes[0], "tau", "acceptance length tau"),
                             (axes[1], "speedup", "speedup over autoregressive")):
        hosts = sorted({r["host"] for r in rows})
        for number, host in enumerate(hosts):
            points = sorted((r["budget"], r[key], None, None, bool(r.get("noisy")) and key == "speedup")
                            for r in rows if r["host"] == host and _as_number(r.get(key)) is not None)
            if points:
                _plot_series(axis, points, f"{host} · DDTree", series_style(0, number))
            for flat in report.decode:
                if flat["host"] == host and flat.get("method") == "dflash" and \
                        _as_number(flat.get(key)) is not None:
                    axis.axhline(flat[key], alpha=0.6, label=f"{host} · DFlash",
                                 **series_style(1, number))  # DFlash's colour, the host's line style
        _overlay_baseline(axis, baseline or [], key)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        handles, labels = axis.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        axis.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(f"DDTree decode vs budget · run {report.run_id}")
    fig.tight_layout()
    path = out_dir / "decode-vs-budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_sweep(report: Report, out_dir: Path) -> list[Path]:
    """One PNG per batch size: per-request tree-build time against budget, a line per host
    and builder (log-log, like the paper's budget trade-off figure)."""
    if not report.sweep:
        return []
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for batch_size in sorted({r.get("batch_size") for r in report.sweep}):
        rows = [r for r in report.sweep if r.get("batch_size") == batch_size]
        fig, axis = plt.subplots(figsize=(7, 4.5))
        hosts = sorted({r["host"] for r in report.sweep})
        builders = sorted({r["builder"] for r in report.sweep})
        for host in hosts:
            for builder in builders:
                points = sorted((r["budget"], r["per_request_ms"], r.get("min_ms"), r.get("max_ms"),
                                 bool(r.get("noisy"))) for r in rows
                                if r["host"] == host and r["builder"] == builder
                                and _as_number(r.get("per_request_ms")) is not None)
                if points:
                    _plot_series(axis, points, f"{host} · {builder}", series_style(builders.index(builder),
                                                                                 hosts.index(host)))
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel("tree build time per request (ms)")
        axis.set_title(f"DDTree tree build vs budget · batch {batch_size} · run {report.run_id}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, title=NOISY_LEGEND, title_fontsize=7)
        fig.tight_layout()
        path = out_dir / f"tree-build-vs-budget-bs{batch_size}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


NOISY_LEGEND = "hollow marker: noisy; band: min-max"
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (5, 5)))


def series_style(series: int, host: int) -> dict[str, Any]:
    """One colour per builder (or method) and one line style per host, so that no two
    series of a chart look alike until the styles run out (20 colours x 8 styles)."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    return {"color": colours[(2 * series) % 20 + (series // 10) % 2],
            "linestyle": LINE_STYLES[host % len(LINE_STYLES)]}


def _plot_series(axis: Any, points: list[tuple], label: str, style: dict[str, Any]) -> None:
    """(x, median, min, max, noisy) points: a line, a min-max band where both were recorded,
    and hollow markers on noisy points."""
    xs = [p[0] for p in points]
    axis.plot(xs, [p[1] for p in points], marker="o", label=label, markersize=4, **style)
    banded = [p for p in points if _as_number(p[2]) is not None and _as_number(p[3]) is not None]
    if banded:
        axis.fill_between([p[0] for p in banded], [p[2] for p in banded], [p[3] for p in banded],
                          color=style["color"], alpha=0.15, linewidth=0)
    noisy = [p for p in points if p[4]]
    if noisy:
        axis.plot([p[0] for p in noisy], [p[1] for p in noisy], linestyle="none", marker="o", markersize=8,
                  markerfacecolor="white", markeredgecolor=style["color"])


def _overlay_baseline(axis: Any, rows: list[dict[str, Any]], key: str) -> None:
    """Baseline sweep points joined per label (black, dashed, x) and flat DFlash levels (dotted)."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        value = _as_number(row.get(key))
        if value is None:
            continue
        label = str(row.get("label", "baseline"))
        budget = _as_number(row.get("budget"))
        if budget is None:
            if row.get("method") == "dflash":
                axis.axhline(value, color="black", linestyle=":", alpha=0.7, label=label)
            continue
        by_label.setdefault(label, []).append((budget, value))
    for label, points in by_label.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], color="black", linestyle="--",
                  marker="x", alpha=0.8, label=label)
