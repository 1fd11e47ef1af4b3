"""A host judged from its runner's output lines (what the Ansible play hands over) by the
operator-side rule: the stages asked for, as the stage records report them, never run_end."""
from __future__ import annotations

from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event
from ddtree_ops.record_verdict import verdict_from_lines


def lines(*records: tuple, run_id: str = "r1", host: str = "h0") -> list[str]:
    out = ["", "   "]  # keepalive lines are skipped
    for kind, fields in records:
        out.append(encode_event(make_event(kind, run_id, host, **fields)).strip())
    return out


def stage(name: str, status: str) -> tuple:
    return EventKind.STAGE_END, {"stage": name, "index": 0, "status": status, "reason": "", "duration_s": 0.1,
                                 "metrics": {}, "tables": {}, "traceback": None, "output_tail": None, "load": None}


START = (EventKind.RUN_START, {"stages": ["env", "import"]})


def test_every_stage_asked_for_passed():
    got = verdict_from_lines(lines(START, stage("env", "pass"), stage("import", "skip"),
                                   (EventKind.RUN_END, {"status": "pass"})), ["env", "import"], "r1", "h0")
    assert got == {"outcome": "pass", "passed": True, "stages": {"env": "pass", "import": "skip"}, "reason": ""}


def test_a_run_end_saying_pass_over_a_failed_stage_fails_the_host():
    got = verdict_from_lines(lines(START, stage("env", "fail"), stage("import", "pass"),
                                   (EventKind.RUN_END, {"status": "pass"})), ["env", "import"], "r1", "h0")
    assert (got["outcome"], got["passed"]) == ("fail", False)
    assert got["reason"] == "env fail; run_end says pass, but env is fail"


def test_a_stage_left_out_is_missing_and_no_run_end_is_no_result():
    left_out = lines((EventKind.RUN_START, {"stages": ["env"]}), stage("env", "pass"),
                     (EventKind.RUN_END, {"status": "pass"}))
    got = verdict_from_lines(left_out, ["env", "import"], "r1", "h0")
    assert (got["passed"], got["stages"]) == (False, {"env": "pass", "import": "missing"})
    cut = verdict_from_lines(lines(START, stage("env", "pass")), ["env", "import"], "r1", "h0")
    assert (cut["passed"], cut["reason"]) == (False, "the runner ended without a result (no run_end record)")


def test_a_record_of_another_host_fails_the_host():
    mixed = lines(START, stage("env", "pass"), stage("import", "pass"), (EventKind.RUN_END, {"status": "pass"}),
                  host="h9")
    got = verdict_from_lines(mixed, ["env", "import"], "r1", "h0")
    assert not got["passed"] and got["reason"].startswith("output line 3: host 'h9' is not this host's 'h0'")
