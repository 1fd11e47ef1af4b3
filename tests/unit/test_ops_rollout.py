"""Batches (Ansible's `serial`) and the failure budget: planning, parsing, stopping. The fan-out
under them is a fake here (the layer under test is the rollout, not the pool)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddtree_ops.errors import ExitCode, UsageError
from ddtree_ops.fanout import FanoutResult, HostResult, HostState
from ddtree_ops.rollout import BatchSize, RolloutPolicy, parse_fail_percent, parse_serial, plan_batches, run_rollout


def sizes(batches):
    return [len(b) for b in batches]


def test_serial_follows_ansible_percentages_of_the_whole_selection_and_repeats_the_last_size():
    assert sizes(plan_batches(range(64), parse_serial("1,10%,100%"))) == [1, 6, 57]
    assert sizes(plan_batches(range(10), parse_serial("1,10%,100%"))) == [1, 1, 8]
    assert sizes(plan_batches(range(7), parse_serial("2"))) == [2, 2, 2, 1]
    assert sizes(plan_batches(range(5), parse_serial("1%"))) == [1] * 5  # rounds down, at least 1
    assert sizes(plan_batches(range(5), parse_serial("3,30"))) == [3, 2]
    assert sizes(plan_batches(range(4), ())) == [4]
    assert plan_batches(list("abcde"), parse_serial("1,2")) == [["a"], ["b", "c"], ["d", "e"]]


@pytest.mark.parametrize("text", ["", "1,,2", "x", "10%%", "-1", "0", "101%", "1.5", "0%", "1, 2x"])
def test_a_serial_that_does_not_parse_is_a_usage_error_naming_the_value(text):
    with pytest.raises(UsageError) as err:
        parse_serial(text)
    assert err.value.exit_code is ExitCode.USAGE and "--serial" in str(err.value) and repr(text) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["-1", "100.5", "x", "nan", "101%", ""])
def test_a_fail_percentage_outside_0_to_100_is_refused(text):
    with pytest.raises(UsageError, match="--max-fail-percent"):
        parse_fail_percent(text, 0)


def test_fail_percentage_accepts_a_percent_sign_and_defaults():
    assert parse_fail_percent("25%", 0) == 25 and parse_fail_percent(None, 7) == 7 and parse_fail_percent("0", 100) == 0
    assert BatchSize(10, True).hosts(64) == 6 and str(BatchSize(10, True)) == "10%"


def fake_hosts(n):
    return [SimpleNamespace(name=f"h{i}") for i in range(n)]


def batch_runner(failing):
    calls = []

    def run(batch):
        calls.append([h.name for h in batch])
        return FanoutResult((h.name, HostResult(h.name, HostState.FAILED if h.name in failing else HostState.OK))
                            for h in batch)

    run.calls = calls
    return run


def test_a_failing_canary_stops_the_rollout_and_starts_no_other_host():
    run = batch_runner({"h0"})
    rollout = run_rollout(fake_hosts(4), RolloutPolicy(parse_serial("1,100%"), 0), run)
    assert run.calls == [["h0"]]
    assert rollout.not_started == ["h1", "h2", "h3"]
    assert [o.state for o in rollout.result.values()] == [HostState.FAILED] + [HostState.SKIPPED] * 3
    assert "batch 1 of 2: 1 of 1 host(s) so far failed" in rollout.stopped
    assert rollout.result.exit_code() is ExitCode.REMOTE
    assert rollout.to_dict()["batches"] == [{"batch": 1, "hosts": ["h0"], "failed": ["h0"], "ok": []}]


def test_the_budget_counts_every_host_so_far_and_the_last_batch_never_stops_anything():
    # 1 failure in 5 hosts so far = 20 %: within 25, beyond 19
    within = batch_runner({"h3"})
    rollout = run_rollout(fake_hosts(8), RolloutPolicy(parse_serial("1,4,100%"), 25), within)
    assert within.calls == [["h0"], ["h1", "h2", "h3", "h4"], ["h5", "h6", "h7"]] and rollout.stopped is None
    assert rollout.result.exit_code() is ExitCode.PARTIAL
    beyond = batch_runner({"h3"})
    rollout = run_rollout(fake_hosts(8), RolloutPolicy(parse_serial("1,4,100%"), 19), beyond)
    assert beyond.calls == [["h0"], ["h1", "h2", "h3", "h4"]] and rollout.not_started == ["h5", "h6", "h7"]
    last = batch_runner({"h1"})
    assert run_rollout(fake_hosts(2), RolloutPolicy(parse_serial("1"), 0), last).stopped is None


def test_without_serial_one_batch_runs_every_host():
    run = batch_runner({"h1"})
    rollout = run_rollout(fake_hosts(3), RolloutPolicy(), run)
    assert run.calls == [["h0", "h1", "h2"]] and rollout.stopped is None and rollout.planned == 1
