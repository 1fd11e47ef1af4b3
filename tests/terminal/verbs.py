"""Every verb that acts on hosts, typed at a terminal: with Rich's live table (a real size,
TERM=xterm-256color), at a dumb terminal (lines instead), piped for contrast, and Ctrl-C.

The test functions here are collected by test_verbs_local.py (the `local` host) and
test_verbs_fleet.py (real sshd on 127.0.0.1), which give the fixtures: `operator` (an
OperatorShell whose hosts have a drifted sglang 0.5.23, so `sglang qualify` has something to
qualify on CPU), `hosts` (their names) and `slow_operator` (the same folder, with hosts whose
`python:` sleeps).

Every test starts with its verb on a live terminal, so each fails if drawing the live table
deadlocks again (issue #47). Quick stages only (`--stages env,import`, one-point sweeps).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fixtures.checkout import copy_release_files
from terminal.operator_shell import HANG_STAGE, OperatorShell, final_line, kill_recorded, run_id_of
from terminal.pty_run import HIDE_CURSOR, PtyResult, Screen, plain

LIVE, DUMB, PIPE = Screen.LIVE, Screen.DUMB, Screen.PIPE
QUICK_STAGES = ("--stages", "env,import")
ONE_POINT_SWEEP = ("--budgets", "16", "--batch-sizes", "1", "--repeat", "1")


def check_fanout(result: PtyResult, screen: Screen, verb: str, hosts: list[str], state: str = "ok") -> None:
    """One line per finished host where there is no live table (the table shows them), and
    the verb's closing count."""
    for host in hosts:
        line = f"ddtree-ops: {verb}: {host}: {state} ("
        if screen is LIVE:
            assert line not in result.text, f"{line!r} printed under the live table:\n{result.text[-2000:]}"
        else:
            assert line in result.text, f"no {line!r}:\n{result.text[-2000:]}"
    count = f"ddtree-ops: {verb}: {len(hosts)}/{len(hosts)} host(s) ok in "
    assert final_line(result).startswith(count) and final_line(result).endswith("(exit 0)"), result.text[-2000:]


def check_stage_lines(result: PtyResult, screen: Screen, title: str, hosts: list[str], stages: list[str]) -> None:
    for host in hosts:
        for stage in stages:
            line = f"ddtree-ops: {title}: {host}: {stage}: pass ("
            assert (line in result.text) == (screen is not LIVE), (line, screen, result.text[-2000:])
    if screen is LIVE:
        assert f"{title} (live)" in result.text, result.text[-2000:]


def rows_with(result: PtyResult, *words: str) -> list[str]:
    return [line for line in result.lines if all(word in line for word in words)]


def test_hosts_check(operator: OperatorShell, hosts):
    for screen in (LIVE, DUMB, PIPE):
        result = operator.expect(screen, "hosts", "check")
        check_fanout(result, screen, "hosts check", hosts)


def test_status_and_its_watch(operator: OperatorShell, hosts):
    """`status` (no SGLang server runs here: said per host, exit 0); `--watch` redraws until
    Ctrl-C."""
    for screen in (LIVE, DUMB, PIPE):
        result = operator.expect(screen, "status")
        check_fanout(result, screen, "status", hosts)
        for host in hosts:
            assert rows_with(result, host, ":30000 not"), result.text[-2000:]  # the rest may wrap
    result = operator.expect(LIVE, "status", "--watch", code=130,  # Ctrl-C at its second poll
                             interrupt_when=lambda out: ", poll 2 (" in plain(out))
    assert final_line(result).removeprefix("^C") == "ddtree-ops: interrupted (SIGINT)", result.text[-2000:]


def test_push_shows_the_release_whole_on_every_screen(operator: OperatorShell, hosts):
    for screen in (LIVE, DUMB, PIPE):
        result = operator.expect(screen, "push")
        check_fanout(result, screen, "push", hosts)
        release = re.search(r"release ([0-9a-f]{16})\b", result.lines[0]).group(1)
        for host in hosts:  # a release id cut across lines (an 80-column dumb terminal) is no id
            assert rows_with(result, host, release), f"{host}'s row lacks {release}:\n{result.text}"


def test_smoke(operator: OperatorShell, hosts):
    for screen in (LIVE, DUMB, PIPE):
        result = operator.expect(screen, "smoke", *QUICK_STAGES)
        check_stage_lines(result, screen, "smoke", hosts, ["env", "import"])
        assert final_line(result).startswith(f"ddtree-ops: smoke run {run_id_of(result)}: exit 0 ("), result.text


@pytest.fixture(scope="module")
def smoke_run(operator: OperatorShell) -> str:
    return run_id_of(operator.expect(PIPE, "smoke", *QUICK_STAGES))


def test_collect_then_report(operator: OperatorShell, hosts, smoke_run):
    for screen in (LIVE, DUMB, PIPE):
        collected = operator.expect(screen, "collect", smoke_run)
        check_fanout(collected, screen, "collect", hosts)
        report = operator.expect(screen, "report", smoke_run, live_table=False)
        assert f"smoke run {smoke_run}" in report.text
        for host in hosts:
            assert rows_with(report, host, "pass"), report.text


def test_bench(operator: OperatorShell, hosts):
    for screen in (LIVE, DUMB):
        result = operator.expect(screen, "bench", *ONE_POINT_SWEEP)
        check_stage_lines(result, screen, "bench", hosts, ["tree-bench"])
        assert final_line(result).startswith(f"ddtree-ops: bench run {run_id_of(result)}: exit 0 ("), result.text


@pytest.fixture(scope="module")
def qualified(operator: OperatorShell, hosts) -> dict[Screen, PtyResult]:
    """`sglang qualify` of the hosts' drifted sglang, live and dumb (its record, next to the
    inventory, is what `deploy` then needs): run once for both tests below."""
    return {screen: operator.expect(screen, "sglang", "qualify", "--stages", "plugin") for screen in (LIVE, DUMB)}


def test_sglang_qualify(qualified, hosts):
    for screen, result in qualified.items():
        for host in hosts:
            assert f"qualify: {host}: sglang 0.5.23 qualified by run " in result.text, (screen, result.text[-2000:])


def test_deploy_then_rollback(operator: OperatorShell, hosts, qualified):
    for screen in (LIVE, DUMB):
        check_fanout(operator.expect(screen, "deploy"), screen, "deploy", hosts)
        check_fanout(operator.expect(screen, "rollback"), screen, "rollback", hosts)
    rolled = operator.expect(PIPE, "rollback")  # nothing left to undo: said so, per host
    check_fanout(rolled, PIPE, "rollback", hosts)
    assert all(rows_with(rolled, host, "nothing-deployed") for host in hosts), rolled.text


# Ctrl-C: a host whose `python:` sleeps holds each verb in its remote step.
STEP_VERBS = [("hosts", "check", "--deep"), ("push",), ("deploy",), ("rollback",), ("collect", "RUN"),
              ("bench", *ONE_POINT_SWEEP), ("sglang", "qualify", "--stages", "plugin"), ("status",)]


@pytest.mark.parametrize("verb", STEP_VERBS, ids=lambda verb: " ".join(verb[:2]))
def test_ctrl_c_in_a_remote_step(slow_operator, smoke_run, verb):
    """Ctrl-C once a host is inside the step (and the live table is up): exit 130 and the signal
    named. `push` also on a dumb terminal and piped (Ctrl-C at the shell of `... | tee log`)."""
    shell, pids = slow_operator
    args = [smoke_run if word == "RUN" else word for word in verb]
    for screen in (LIVE, DUMB, PIPE) if verb == ("push",) else (LIVE,):
        try:
            result = shell.expect(screen, *args, code=130, interrupt_when=lambda out: pids.exists() and (
                screen is not LIVE or HIDE_CURSOR in out))
        finally:
            kill_recorded(pids)
        if verb[0] == "bench":  # a smoke run: it stops the hosts' runners and reports the run
            assert "ddtree-ops: interrupted (SIGINT): stopping the remote runners" in result.text, result.text[-2000:]
            assert f"ddtree-ops: bench run {run_id_of(result)}: exit 130 (" in final_line(result), result.text[-2000:]
        else:  # (a terminal echoes the ^C) then the command's last word
            assert final_line(result).removeprefix("^C") == "ddtree-ops: interrupted (SIGINT)", result.text[-2000:]


@pytest.fixture(scope="module")
def hang_checkout(tmp_path_factory) -> Path:
    return copy_release_files(tmp_path_factory.mktemp("checkout"), {"hang": HANG_STAGE})


def test_ctrl_c_stops_a_smoke_run_and_its_runners(operator: OperatorShell, hosts, hang_checkout):
    """Ctrl-C while every host is inside a stage: the runners are stopped with the operator's
    signal and record it, what arrived is kept, exit 130."""
    for screen in (LIVE, DUMB):
        before = set((operator.cwd / "runs").glob("*"))

        def all_hanging(_: str) -> bool:
            runs = [run for run in (operator.cwd / "runs").glob("*") if run not in before]
            return len(runs) == 1 and all(
                '"stage":"hang"' in _read(runs[0] / host / "events.jsonl") for host in hosts)

        result = operator.expect(screen, "smoke", "--source", str(hang_checkout), "--stages", "env,hang",
                                 code=130, interrupt_when=all_hanging)
        run_id = run_id_of(result)
        assert "ddtree-ops: interrupted (SIGINT): stopping the remote runners, keeping what arrived" in result.text
        assert final_line(result).startswith(f"ddtree-ops: smoke run {run_id}: exit 130 ("), result.text
        for host in hosts:
            record = json.loads((operator.cwd / "runs" / run_id / host / "stages" / "hang.json").read_text())
            assert (record["status"], record["reason"]) == ("fail", "interrupted (SIGINT)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
