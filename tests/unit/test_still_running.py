"""Long work speaks (issue #47): the `still running` rule with a fake clock, and what the smoke
view and the per-host table hand it. A real piped run: tests/cli/test_smoke_cli.py."""
from __future__ import annotations

import pytest

from ddtree_ops.cli.still_running import Activity, StillRunning, elapsed_text, progress_every_s


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def rule(activities, clock, every_s=30.0):
    said: list[str] = []
    return StillRunning("smoke", lambda: list(activities), every_s=every_s, clock=clock, say=said.append), said


def test_a_line_at_least_every_interval_naming_host_phase_elapsed_and_last_words():
    clock = Clock()
    work = [Activity("h1", "sglang-e2e", since=clock.now, last="server listening")]
    still, said = rule(work, clock)
    clock.now += 29.9
    still.tick()
    assert said == []  # not yet
    clock.now += 0.1
    still.tick()
    assert said == ['smoke: h1: sglang-e2e: still running (30s; last: "server listening")']
    clock.now += 29
    still.tick()
    assert len(said) == 1  # 29 s since the last line
    clock.now += 1 + 60  # late ticks (a busy machine) still give one line, not a burst
    still.tick()
    assert said[1:] == ['smoke: h1: sglang-e2e: still running (2m00s; last: "server listening")']


def test_a_line_of_its_own_about_a_host_restarts_its_interval_and_hosts_are_apart():
    clock = Clock()
    work = [Activity("h1", "tree-bench", since=clock.now), Activity("h2", "pushing", since=clock.now - 20)]
    still, said = rule(work, clock)
    clock.now += 10
    still.tick()
    assert said == ["smoke: h2: pushing: still running (30s)"]  # h2 began 20 s earlier; no last words
    still.spoke("h1")  # e.g. a stage of h1 ended and was said
    clock.now += 25
    still.tick()
    assert said[1:] == []  # h1: 25 s since its line; h2: 25 s since its line
    clock.now += 5
    still.tick()
    assert said[1:] == ["smoke: h1: tree-bench: still running (40s)", "smoke: h2: pushing: still running (1m00s)"]


def test_the_last_words_are_one_short_inert_line():
    clock = Clock()
    work = [Activity("h1", "env", since=clock.now, last="evil \x1b]52;c;aGk=\x07 title\nnext " + "x" * 200)]
    still, said = rule(work, clock, every_s=1)
    clock.now += 1
    still.tick()
    (line,) = said
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line
    assert '(1s; last: "evil \\x1b]52;c;aGk=\\x07 title next xxx' in line and line.endswith('…")')


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (150, "2m30s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (7500, "2h05m")])
def test_elapsed_reads_as_a_person_reads_it(seconds, text):
    assert elapsed_text(seconds) == text


def test_the_interval_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    from ddtree_ops.errors import UsageError

    monkeypatch.delenv("DDTREE_OPS_PROGRESS_EVERY_S", raising=False)
    assert progress_every_s() == 30.0
    monkeypatch.setenv("DDTREE_OPS_PROGRESS_EVERY_S", "2.5")
    assert progress_every_s() == 2.5
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv("DDTREE_OPS_PROGRESS_EVERY_S", bad)
        with pytest.raises(UsageError, match=rf"^\$DDTREE_OPS_PROGRESS_EVERY_S: expected seconds > 0, got '{bad}'$"):
            progress_every_s()


def test_the_smoke_view_says_what_each_host_is_doing(monkeypatch):
    from ddtree_ops.cli.smoke import STARTING, SmokeView

    clock = Clock()
    view = SmokeView("smoke", ["h1", "h2", "h3"], clock=clock)
    view.phase("h1", "pushing", "release abc")
    clock.now += 5
    view.phase("h1", "running")  # the runner is up, importing torch
    view.phase("h2", "connecting", "h2.example:22")
    assert [(a.host, a.phase, a.since) for a in view.activities()] == [
        ("h1", STARTING, 1005.0), ("h2", "connecting", 1005.0)]  # h3 is queued
    view.record("h1", {"event": "run_start", "stages": ["env", "sglang-e2e"]})
    clock.now += 1
    view.record("h1", {"event": "stage_start", "stage": "sglang-e2e"})
    view.record("h1", {"event": "log", "stage": "sglang-e2e", "message": "ddtree-b16: python -m sglang..."})
    view.record("h1", {"event": "heartbeat", "stage": "sglang-e2e", "elapsed_s": 5.0,
                       "last_output": "Uvicorn running on http://127.0.0.1:31002"})
    view.phase("h2", "failed", "h2: cannot connect")
    (h1,) = view.activities()
    assert (h1.phase, h1.since, h1.last) == ("sglang-e2e", 1006.0, "Uvicorn running on http://127.0.0.1:31002")


def test_the_host_table_says_each_step_its_hosts_report():
    from ddtree_ops.cli.console import LiveHostTable
    from ddtree_ops.fanout import HostState

    table = LiveHostTable("deploy", ["a", "b", "c"])
    table.on_progress("a", HostState.CONNECTING, "root@a:22")
    table.on_progress("b", HostState.CONNECTING, "root@b:22")
    table.on_progress("b", HostState.RUNNING, "deploying")
    table.on_progress("c", HostState.CONNECTING, "root@c:22")
    table.on_progress("c", HostState.OK, "")
    assert [(a.host, a.phase) for a in table.activities()] == [("a", "connecting to root@a:22"), ("b", "deploying")]


def test_verbose_lines_are_host_prefixed_and_inert(capsys):
    """`-v`: a host's output reaches the terminal as one inert line per line, and only with -v."""
    from ddtree_ops.cli.smoke import SmokeView

    record = {"event": "output", "stage": "sglang-e2e", "file": "server-b8.log",
              "lines": ["Uvicorn running", "\x1b]0;pwned\x07\x1b[2J cleared"]}
    SmokeView("smoke", ["h1"], quiet=True).record("h1", record)
    assert capsys.readouterr().err == ""
    SmokeView("smoke", ["h1"], quiet=True, verbose=True).record("h1", record)
    assert capsys.readouterr().err.splitlines() == [
        "ddtree-ops: h1: sglang-e2e/server-b8.log | Uvicorn running",
        "ddtree-ops: h1: sglang-e2e/server-b8.log | \\x1b]0;pwned\\x07\\x1b[2J cleared"]
    SmokeView("smoke", ["h1"], quiet=True, verbose=True).record("h1", {**record, "file": None, "lines": ["x"]})
    assert capsys.readouterr().err == "ddtree-ops: h1: sglang-e2e | x\n"
