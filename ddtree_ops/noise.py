"""When a timed figure cannot be trusted: the one rule behind every `noisy` mark (tables,
`--json`, plots) and behind `report --baseline` declining to judge a value.

A timed stage (tree-bench, decode-bench, sglang-e2e; `bench` runs them) records, per cell,
the min / median / max of its samples (its `timings` table) and the host's load before and
after the stage (1-minute load average, CPU count, GPU utilisation where there is a GPU).
A cell is noisy when any of these says its median may be far from what an idle host measures:

- samples: fewer than MIN_SAMPLES timed calls (a time budget cut the cell short): one or two
  calls cannot show a spread, so a disturbed call would pass for a steady figure;
- spread: (max - min) / median above SPREAD_LIMIT (the slowest sample is more than half the
  median slower than the fastest: something else ran in between);
- host load: the 1-minute load average per CPU above LOAD_PER_CPU_LIMIT before or after the
  stage (the stage alone keeps at most about one task per CPU busy: more means other work
  competed for the CPUs), or the GPU more than GPU_BUSY_LIMIT_PCT busy before the stage
  started (another job on it).

Values that do not depend on time (tau, token identity, statuses) are never noisy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

SPREAD_LIMIT = 0.5
MIN_SAMPLES = 3  # the stages' default `repeat`: a full cell is judged, a cut-short one is not
LOAD_PER_CPU_LIMIT = 1.25
GPU_BUSY_LIMIT_PCT = 50.0


@dataclass(frozen=True)
class Noise:
    """The verdict on one cell: `why` is empty when it can be trusted."""

    spread: Optional[float]  # (max - min) / median; None without samples
    why: str = ""

    @property
    def noisy(self) -> bool:
        return bool(self.why)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def spread_of(low: Any, median: Any, high: Any) -> Optional[float]:
    """(high - low) / median, or None when the three are not finite numbers with median > 0."""
    values = [_number(v) for v in (low, median, high)]
    if any(v is None for v in values) or values[1] <= 0:  # type: ignore[operator]
        return None
    return (values[2] - values[0]) / values[1]  # type: ignore[operator]


def load_problem(load: Optional[Mapping[str, Any]]) -> str:
    """Why the host's load makes a timed stage's figures unreliable, or ""."""
    if not isinstance(load, Mapping):
        return ""
    for when in ("before", "after"):
        sample = load.get(when)
        if not isinstance(sample, Mapping):
            continue
        average, cpus = _number(sample.get("loadavg_1m")), _number(sample.get("cpus"))
        if average is not None and cpus and average / cpus > LOAD_PER_CPU_LIMIT:
            return (f"host load {average:.2f} on {cpus:.0f} CPUs {when} the stage "
                    f"({average / cpus:.2f} per CPU > {LOAD_PER_CPU_LIMIT:g})")
    before = load.get("before")
    gpu = _number(before.get("gpu_util_pct")) if isinstance(before, Mapping) else None
    if gpu is not None and gpu > GPU_BUSY_LIMIT_PCT:
        return f"GPU {gpu:.0f}% busy before the stage (> {GPU_BUSY_LIMIT_PCT:g}%)"
    return ""


def cell_noise(timing: Optional[Mapping[str, Any]], load: Optional[Mapping[str, Any]]) -> Noise:
    """The verdict on one timed cell from its `timings` row (min, median, max) and its stage's
    host load; a cell without a timings row is judged on the load alone, one without a sample
    count on its spread and load."""
    spread = spread_of(timing.get("min"), timing.get("median"), timing.get("max")) if timing else None
    samples = _number(timing.get("samples")) if timing else None
    if samples is not None and samples < MIN_SAMPLES:
        return Noise(spread, f"{samples:.0f} sample(s) < {MIN_SAMPLES}: too few to judge")
    if spread is not None and spread > SPREAD_LIMIT:
        return Noise(spread, f"spread {spread:.0%} of the median > {SPREAD_LIMIT:.0%}")
    return Noise(spread, load_problem(load))


def describe_load(load: Optional[Mapping[str, Any]]) -> str:
    """`load 0.42 -> 3.10 on 2 CPUs, GPU 3% -> 97%` for a stage's before/after samples."""
    if not isinstance(load, Mapping):
        return ""
    before, after = load.get("before") or {}, load.get("after") or {}

    def figure(sample: Mapping[str, Any], key: str, form: str) -> str:
        value = _number(sample.get(key)) if isinstance(sample, Mapping) else None
        return "?" if value is None else form.format(value)

    cpus = _number((after or before).get("cpus")) if isinstance(after or before, Mapping) else None
    text = (f"load {figure(before, 'loadavg_1m', '{:.2f}')} -> {figure(after, 'loadavg_1m', '{:.2f}')}"
            + (f" on {cpus:.0f} CPUs" if cpus else ""))
    if any(isinstance(s, Mapping) and "gpu_util_pct" in s for s in (before, after)):
        text += f", GPU {figure(before, 'gpu_util_pct', '{:.0f}%')} -> {figure(after, 'gpu_util_pct', '{:.0f}%')}"
    return text
