"""Judging a run against a baseline of named metrics, and telling the two kinds of baseline apart.

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

import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConfigError, quoted
from ddtree_ops.noise import Noise, cell_noise
from ddtree_ops.report.model import TIMINGS_TABLE, as_number, on_host, shown_value
from ddtree_ops.results import RunRecord


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
class MetricComparison:
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
        return (f"{self.check.metric}{on_host(self.host)}: expected {shown_value(self.check.expected)}"
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
    DECODE = "decode"  # `ddtree-ops baseline import|paper` output (ddtree_ops.report.baselines)


NOT_A_BASELINE = ("not a baseline: expected a metrics baseline (a mapping with a `metrics:` list) or a decode "
                  "baseline written by `ddtree-ops baseline import|paper` (\"format\": \"ddtree-ops-baseline/1\")")


def read_baseline_document(path: Path) -> Any:
    """The parsed JSON/YAML of a baseline file (read by the bounded readers: a regular file of
    bounded size, depth and aliases); a torch.save file gets a hint, not a parse error."""
    from ddtree.bounded_files import FileRefused, NotJson, decode_text, parse_json, read_bytes

    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: cannot read baseline: no such file") from None
    except FileRefused as err:
        raise ConfigError(f"{path}: cannot read baseline: {err.why}") from None
    if raw.startswith(b"PK\x03\x04") or raw.startswith(b"\x80"):  # torch.save zip / raw pickle
        raise ConfigError(f"{path}: {NOT_A_BASELINE}; this is a torch.save file (a reference run?): turn "
                          f"it into a baseline with `ddtree-ops baseline import {path.name} -o baseline.json`")
    try:
        text = decode_text(raw, path)
    except FileRefused:
        raise ConfigError(f"{path}: {NOT_A_BASELINE} (the file is not UTF-8 text)") from None
    syntax = document_syntax(path, text)
    if syntax == "CSV":  # one of the paper's tables: a decode baseline of its own cells
        from ddtree_ops.report.baselines import csv_baseline  # lazy: pulls in torch via ddtree

        return csv_baseline(path).to_dict()
    if syntax == "YAML":
        from ddtree_ops.yaml_files import parse_yaml

        return parse_yaml(text, path)  # bounded depth and aliases; ConfigError naming the line
    try:
        return parse_json(text, path)
    except NotJson as err:
        raise ConfigError(f"{path}: not valid {syntax}: {err.detail}") from None
    except FileRefused as err:
        raise ConfigError(f"{path}: {err.why}") from None


def document_syntax(path: Path, text: str) -> str:
    """YAML (.yaml/.yml), CSV (.csv, unless the text starts like JSON), else JSON: the parser a
    file gets, so an error names the syntax that was really tried."""
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "YAML"
    if suffix == ".csv" and text.lstrip()[:1] not in ("{", "["):
        return "CSV"
    return "JSON"


def baseline_kind(data: Any) -> BaselineKind | None:
    """Which baseline a parsed document is, by its keys; None when it is neither."""
    if isinstance(data, dict) and "format" in data:
        return BaselineKind.DECODE
    if isinstance(data, dict) and "metrics" in data:
        return BaselineKind.METRICS
    return None


def load_any_baseline(path: Path) -> tuple[BaselineKind, Any]:
    """(METRICS, [MetricCheck]) or (DECODE, ddtree_ops.report.baselines.Baseline); ConfigError (exit 3)
    naming the file for anything else."""
    data = read_baseline_document(path)
    kind = baseline_kind(data)
    if kind is BaselineKind.METRICS:
        return kind, parse_metric_checks(data, path)
    if kind is BaselineKind.DECODE:
        from ddtree_ops.report.baselines import Baseline  # lazy: pulls in torch via ddtree

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
            raise ConfigError(f"{where}: expected a mapping, got {quoted(entry)}")
        unknown = sorted(set(entry) - _CHECK_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {quoted(unknown)}")
        metric = entry.get("metric")
        if not isinstance(metric, str) or "." not in metric:
            raise ConfigError(f"{where}.metric: expected '<stage>.<name>', got {quoted(metric)}")
        if "expected" not in entry:
            raise ConfigError(f"{where}: missing `expected`")
        if _is_non_finite(entry["expected"]):  # inf would pass every `lower` check, nan fail all
            raise ConfigError(f"{where}.expected: expected a finite value, got {quoted(entry['expected'])}")
        try:
            better = Better(entry.get("better", "equal"))
        except ValueError:
            raise ConfigError(f"{where}.better: expected lower, higher or equal, got "
                              f"{quoted(entry.get('better'))}") from None
        tolerances = {}
        for key in ("tolerance", "abs_tolerance"):
            value = entry.get(key, 0.0)
            # NaN would fail every check and inf pass every one: neither is a tolerance
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"{where}.{key}: expected a finite number >= 0, got {quoted(value)}")
            tolerances[key] = float(value)
        hosts = entry.get("hosts", [])
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"{where}.hosts: expected a list of host names, got {quoted(hosts)}")
        checks.append(MetricCheck(metric=metric, expected=entry["expected"], better=better,
                                  hosts=tuple(hosts), **tolerances))
    return checks


def _is_non_finite(value: Any) -> bool:
    """A float infinity or NaN, or its string form ("inf", "-inf", "nan": how the runner writes
    non-finite values, hostside/protocol.py jsonable)."""
    number = as_number(value)
    return number is not None and not math.isfinite(number)




def judge(check: MetricCheck, measured: Any) -> tuple[bool, str]:
    if measured is None:
        return False, "not measured"
    expected = as_number(check.expected)
    got = as_number(measured)
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


def compare_metrics(run: RunRecord, checks: list[MetricCheck]) -> list[MetricComparison]:
    results = []
    for check in checks:
        hosts = check.hosts or tuple(run.hosts)
        for host in hosts:
            record = run.hosts.get(host)
            if record is None:  # not selected for this run: nothing to judge (an unreachable host is judged)
                results.append(MetricComparison(check, host, None, False, "host not in this run: not checked", checked=False))
                continue
            measured = record.metric(check.stage, check.name)
            noise = _metric_noise(record.stages.get(check.stage), check.name)
            if noise is not None and noise.noisy:  # a verdict on noise would be a guess
                results.append(MetricComparison(check, host, measured, False, f"not judged: noisy, {noise.why}",
                                          checked=False, noisy=True))
                continue
            ok, why = judge(check, measured)
            results.append(MetricComparison(check, host, measured, ok, why))
    return results


def _metric_noise(record: Any, name: str) -> Noise | None:
    """The noise verdict on a stage's metric when it is a timed value (its `timings` has it)."""
    if record is None:
        return None
    for row in record.tables.get(TIMINGS_TABLE, []):
        if row.get("cell") == name:
            return cell_noise(row, record.load)
    return None
