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
tolerance, or when a host did not measure it at all.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.results import HostOutcome, RunRecord, StageStatus, hosts_exit_code

SWEEP_STAGE = "tree-bench"
SWEEP_TABLE = "sweep"
DECODE_STAGE = "decode-bench"
DECODE_TABLE = "methods"  # one row per method: method, budget, tau, speedup, ... (runsummary)


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

    @property
    def exit_code(self) -> int:
        return int(hosts_exit_code(self.outcomes.values()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "release": self.meta.get("release"),
            "stages": self.stages,
            "hosts": {h: {"outcome": self.outcomes[h].value,
                          "stages": {s: {"status": self.statuses[h].get(s),
                                         "duration_s": self.durations[h].get(s),
                                         "reason": self.reasons[h].get(s)}
                                     for s in self.stages if s in self.statuses[h]}}
                      for h in self.hosts},
            "failures": [f.to_dict() for f in self.failures],
            "sweep": self.sweep,
            "decode": self.decode,
            "exit_code": self.exit_code,
        }


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
    for name, host in run.hosts.items():
        statuses[name] = {s: r.status.value for s, r in host.stages.items()}
        durations[name] = {s: r.duration_s for s, r in host.stages.items()}
        reasons[name] = {s: r.reason for s, r in host.stages.items()}
        if host.error and host.outcome is not HostOutcome.PASS:
            failures.append(Failure(name, "-", host.error, None))
        for stage, record in host.stages.items():
            if record.status is StageStatus.FAIL:
                detail = _last_line(record.traceback) or _last_line(record.output_tail)
                failures.append(Failure(name, stage, record.reason, detail))
        bench = host.stages.get(SWEEP_STAGE)
        if bench is not None:
            sweep += [{"host": name, **row} for row in bench.tables.get(SWEEP_TABLE, [])]
        decoded = host.stages.get(DECODE_STAGE)
        if decoded is not None:
            decode += [{"host": name, **row} for row in decoded.tables.get(DECODE_TABLE, [])]
    return Report(run_id=run.run_id, stages=stages, hosts=list(run.hosts),
                  outcomes={h: r.outcome for h, r in run.hosts.items()}, statuses=statuses,
                  durations=durations, reasons=reasons, failures=failures, sweep=sweep,
                  decode=decode, meta=run.meta)


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

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.check.metric, "host": self.host,
                "expected": self.check.expected, "measured": self.measured,
                "tolerance": self.check.tolerance, "abs_tolerance": self.check.abs_tolerance,
                "better": self.check.better.value, "ok": self.ok, "why": self.why}

    def line(self) -> str:
        return (f"{self.check.metric} on {self.host}: expected {self.check.expected!r}"
                f"{self._bound()}, measured {self.measured!r} ({self.why})")

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


def load_baseline(path: Path) -> list[MetricCheck]:
    """Parse a baseline file; every error names the file and the entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read baseline: {err.strerror or err}") from err
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # noqa: BLE001 - yaml and json errors alike
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: "
                          f"{str(err).splitlines()[0]}") from err
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), list):
        raise ConfigError(f"{path}: expected a mapping with a `metrics:` list")
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
        try:
            better = Better(entry.get("better", "equal"))
        except ValueError:
            raise ConfigError(f"{where}.better: expected lower, higher or equal, got "
                              f"{entry.get('better')!r}") from None
        tolerances = {}
        for key in ("tolerance", "abs_tolerance"):
            value = entry.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{where}.{key}: expected a number >= 0, got {value!r}")
            tolerances[key] = float(value)
        hosts = entry.get("hosts", [])
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"{where}.hosts: expected a list of host names, got {hosts!r}")
        checks.append(MetricCheck(metric=metric, expected=entry["expected"], better=better,
                                  hosts=tuple(hosts), **tolerances))
    return checks


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
    if got is None or math.isnan(got):
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
            measured = record.metric(check.stage, check.name) if record else None
            ok, why = judge(check, measured)
            if record is None:
                why = "host not in this run"
            results.append(Comparison(check, host, measured, ok, why))
    return results


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
        for host in sorted({r["host"] for r in rows}):
            points = sorted((r["budget"], r[key]) for r in rows
                            if r["host"] == host and _as_number(r.get(key)) is not None)
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                          label=f"{host} · DDTree")
            for flat in report.decode:
                if flat["host"] == host and flat.get("method") == "dflash" and \
                        _as_number(flat.get(key)) is not None:
                    axis.axhline(flat[key], linestyle="--", alpha=0.6, label=f"{host} · DFlash")
        for row in baseline or []:
            if _as_number(row.get(key)) is not None and _as_number(row.get("budget")) is not None:
                axis.scatter([row["budget"]], [row[key]], marker="x", color="black",
                             label=row.get("label", "baseline"))
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
        for host in sorted({r["host"] for r in rows}):
            for builder in sorted({r["builder"] for r in rows if r["host"] == host}):
                points = sorted((r["budget"], r["per_request_ms"]) for r in rows
                                if r["host"] == host and r["builder"] == builder
                                and _as_number(r.get("per_request_ms")) is not None)
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                              label=f"{host} · {builder}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel("tree build time per request (ms)")
        axis.set_title(f"DDTree tree build vs budget · batch {batch_size} · run {report.run_id}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"tree-build-vs-budget-bs{batch_size}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
