"""Judging a run's decode-bench rows against a decode baseline (`ddtree-ops baseline import|paper`
output, `ddtree_ops.report.baselines.Baseline`): tau within an absolute tolerance, token
identity with AR at T=0, per host and method; and the baseline's points for the charts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.report.model import (
    DECODE_NOISE_KEYS,
    DECODE_STAGE,
    DECODE_TABLE,
    Report,
    as_number,
    on_host,
    shown_value,
)
from ddtree_ops.results import StageStatus
from ddtree_ops.tolerances import DEFAULT_TAU_TOLERANCE


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
        above = as_number(self.measured) is not None and as_number(self.expected) is not None \
            and self.tolerance is not None and as_number(self.measured) > as_number(self.expected)
        return "outside tolerance" if above else "regression"

    def line(self) -> str:
        bound = f" ± {self.tolerance:g}" if self.tolerance is not None else ""
        return (f"{self.metric}{on_host(self.host)}: expected {shown_value(self.expected)}{bound}, "
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
    from ddtree_ops.report.baselines import summaries_from_rows

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
    """Every host's decode-bench rows against a decode baseline (`ddtree_ops.report.baselines.Baseline`).

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
    from ddtree_ops.report.baselines import compare_summaries

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
        result = compare_summaries(summaries, baseline, tau_tolerance, datasets, models)
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
    if not compared_hosts and not checks and not any(row.get("method") for row in report.server):
        checks.append(DecodeCheck(f"{DECODE_STAGE}.{DECODE_TABLE}", "-", "decode-bench results", None, None,
                                  False, f"no host of run {report.run_id} measured decode-bench"))
    return DecodeComparison(tau_tolerance=tau_tolerance, checks=checks, rows=table, notes=notes,
                            not_compared=not_compared)


def decode_baseline_overlay(report: Report, baseline: Any, dataset: str | None = None,
                            model: str | None = None) -> list[dict[str, Any]]:
    """The baseline's points for `plot_run(..., decode_baseline=...)`: for each (dataset,
    model, temperature) of the run, the baseline's DDTree budget sweep and its DFlash level."""
    from ddtree_ops.report.baselines import budget_series

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
