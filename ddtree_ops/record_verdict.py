"""A host's verdict from its smoke runner's output lines, by the operator-side rule, for
whatever ran the runner without ddtree-ops' own fan-out: the Ansible play
(docs/ansible/smoke.yml, through docs/ansible/filter_plugins/ddtree.py).

The rule is ddtree_ops.outcome.judge_finished_host, fed as `smoke` and `report` feed it: the
stages asked for, as the host's stage_end records report them; the host's run_end may only
make the outcome worse. Records are read as the run store reads them (ddtree_ops.results): a
record of another run or host, or one that is not what its kind says, fails the host.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddtree_ops.outcome import PASSING_STAGE_STATUSES, HostOutcome, judge_finished_host
from ddtree_ops.results import parse_record, record_field_error, record_owner_error


def verdict_from_lines(lines: Iterable[str], asked: list[str], run_id: str, host: str) -> dict[str, Any]:
    """{"outcome", "passed", "stages": {stage: status}, "reason"} for one host's runner output."""
    planned: list[str] = []
    ended: dict[str, str] = {}
    run_end = None
    for number, line in enumerate(lines, 1):
        record = parse_record(line)
        if record is None:
            continue  # keepalive lines, stray output
        why = record_owner_error(record, run_id, host) or record_field_error(record)
        if why is not None:
            return _verdict(HostOutcome.FAIL, {}, f"output line {number}: {why}")
        kind = record.get("event")
        if kind == "run_start":
            planned = [str(s) for s in record.get("stages") or []]
        elif kind == "stage_end":
            ended[str(record.get("stage"))] = str(record.get("status"))
        elif kind == "run_end":
            run_end = record
    stages = {stage: ended.get(stage, "missing") for stage in asked or planned}
    if run_end is None:
        return _verdict(HostOutcome.FAIL, stages, "the runner ended without a result (no run_end record)")
    verdict = judge_finished_host(asked, planned, ended, run_end.get("status"))
    bad = [f"{stage} {status}" for stage, status in stages.items() if status not in PASSING_STAGE_STATUSES]
    return _verdict(verdict.outcome, stages, "; ".join(bad + list(verdict.disagreements)))


def _verdict(outcome: HostOutcome, stages: dict[str, str], reason: str) -> dict[str, Any]:
    return {"outcome": outcome.value, "passed": outcome is HostOutcome.PASS, "stages": stages, "reason": reason}
