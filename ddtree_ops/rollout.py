"""A change goes out in batches (Ansible's `serial`) under a failure budget (Ansible's
`max_fail_percentage`, counted over every host so far): the first batch is the canary.

`--serial 1,10%,100%` on 64 hosts makes batches of 1, 6 and the remaining 57: a count is hosts,
a percentage is of the whole selection (rounded down, at least 1), and the last size repeats
until every host has a batch. After each batch, when more than `--max-fail-percent` of the
hosts started so far failed, no further batch starts; those hosts are reported as not started
and are never touched. This module runs nothing itself: `run_rollout` calls one fan-out per
batch and merges their per-host results.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, TypeVar

from ddtree_ops.errors import UsageError
from ddtree_ops.fanout import FanoutResult, HostResult, HostState

T = TypeVar("T")
NO_BUDGET = 100.0  # "more than 100 % failed" never happens: every batch runs

_SIZE = re.compile(r"(\d+)(%?)")


class BatchSize(NamedTuple):
    value: int
    percent: bool  # value is a percentage of the whole selection

    def hosts(self, total: int) -> int:
        if not self.percent:
            return self.value
        return max(1, total * self.value // 100)  # Ansible: int(pct / 100 * total) or 1

    def __str__(self) -> str:
        return f"{self.value}{'%' if self.percent else ''}"


def parse_serial(text: Optional[str]) -> tuple[BatchSize, ...]:
    """`1,10%,100%` -> batch sizes; () when not given (one batch: every host at once)."""
    if text is None:
        return ()
    sizes = []
    for word in (w.strip() for w in text.split(",")):
        match = _SIZE.fullmatch(word)
        if match is None:
            raise UsageError(f"--serial: expected comma-separated host counts or percentages "
                             f"(e.g. 1,10%,100%), got {word!r} in {text!r}")
        size = BatchSize(int(match.group(1)), bool(match.group(2)))
        if size.percent and not 1 <= size.value <= 100:
            raise UsageError(f"--serial: a percentage must be 1-100, got {word!r} in {text!r}")
        if not size.percent and size.value < 1:
            raise UsageError(f"--serial: a batch needs at least 1 host, got {word!r} in {text!r} "
                             "(100% is every host)")
        sizes.append(size)
    return tuple(sizes)


def parse_fail_percent(text: Optional[str], default: float) -> float:
    """`--max-fail-percent P`: 0-100 (a number, with or without `%`)."""
    if text is None:
        return default
    raw = text.strip().removesuffix("%")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 100:  # NaN fails both
        raise UsageError(f"--max-fail-percent: expected a percentage 0-100, got {text!r}")
    return value


def plan_batches(items: Sequence[T], serial: Sequence[BatchSize]) -> list[list[T]]:
    """Split items (in order) into batches as Ansible's `serial` does."""
    if not serial:
        return [list(items)] if items else []
    batches: list[list[T]] = []
    rest, total = list(items), len(items)
    while rest:
        size = serial[min(len(batches), len(serial) - 1)].hosts(total)
        batches.append(rest[:size])
        rest = rest[size:]
    return batches


@dataclass(frozen=True)
class RolloutPolicy:
    serial: tuple[BatchSize, ...] = ()
    max_fail_percent: float = NO_BUDGET

    @property
    def batched(self) -> bool:
        return bool(self.serial)


@dataclass
class BatchReport:
    number: int  # from 1
    hosts: list[str]
    failed: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.number, "hosts": self.hosts, "failed": self.failed,
                "ok": [h for h in self.hosts if h not in self.failed]}


@dataclass
class RolloutResult:
    result: FanoutResult  # every selected host, in order; those never started are SKIPPED
    batches: list[BatchReport] = field(default_factory=list)
    planned: int = 0  # batches planned
    stopped: Optional[str] = None  # why no further batch started, None when all ran

    @property
    def not_started(self) -> list[str]:
        started = {h for b in self.batches for h in b.hosts}
        return [h for h in self.result if h not in started]

    def to_dict(self) -> dict[str, Any]:
        return {"batches": [b.to_dict() for b in self.batches], "batches_planned": self.planned,
                "stopped": self.stopped, "not_started": self.not_started}


def not_started_detail(batch: int) -> str:
    return f"not started: the rollout stopped after batch {batch}"


def run_rollout(hosts: Sequence[Any], policy: RolloutPolicy, run_batch: Callable[[list[Any]], FanoutResult],
                failed: Callable[[HostResult], bool] = lambda outcome: not outcome.ok) -> RolloutResult:
    """Run `run_batch` on each batch in turn (hosts have `.name`); stop once the hosts so far
    that `failed` (default: their task did not succeed) exceed the budget. A KeyboardInterrupt
    propagates (no further batch starts)."""
    batches = plan_batches(hosts, policy.serial)
    merged = FanoutResult((h.name, HostResult(h.name)) for h in hosts)
    rollout = RolloutResult(merged, planned=len(batches))
    started = failures = 0
    for number, batch in enumerate(batches, start=1):
        result = run_batch(batch)
        merged.update(result)
        failing = [name for name, outcome in result.items() if failed(outcome)]
        rollout.batches.append(BatchReport(number, [h.name for h in batch], failing))
        started += len(batch)
        failures += len(failing)
        if number < len(batches) and failures * 100 > policy.max_fail_percent * started:
            rollout.stopped = (f"batch {number} of {len(batches)}: {failures} of {started} host(s) so far failed "
                               f"({100 * failures / started:.0f}% > --max-fail-percent {policy.max_fail_percent:g})")
            for host in (h for later in batches[number:] for h in later):
                merged[host.name] = HostResult(host.name, HostState.SKIPPED, detail=not_started_detail(number))
            break
    return rollout
