"""The bounded fan-out: per-host results, exit codes, --fail-fast, --parallel, deadlines.
Hosts here are fakes (the layer under test is the pool, not the transport)."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from ddtree_ops.errors import ConnectionRefused, ExitCode, RemoteStepError
from ddtree_ops.fanout import HostState, run_fanout
from ddtree_ops.inventory import parse_inventory


class FakeTransport:
    def __init__(self, name):
        self.host_name = name
        self.closed = threading.Event()

    def close(self):
        self.closed.set()


def hosts(n):
    inv = parse_inventory({"hosts": {f"h{i}": {} for i in range(n)}}, source="t", base_dir=Path("."))
    return list(inv.hosts.values())


def connect_except(unreachable=()):
    opened = {}

    def connect(host):
        if host.name in unreachable:
            raise ConnectionRefused(host.name, "nothing listens")
        opened[host.name] = FakeTransport(host.name)
        return opened[host.name]

    connect.opened = opened
    return connect


def test_all_ok_values_and_progress_order():
    events = []
    result = run_fanout(hosts(3), lambda ctx: ctx.host.name.upper(), connect=connect_except(),
                        on_progress=lambda h, s, d: events.append((h, s)))
    assert {n: o.value for n, o in result.items()} == {"h0": "H0", "h1": "H1", "h2": "H2"}
    assert result.exit_code() is ExitCode.OK and not result.failed
    assert [s for h, s in events if h == "h1"] == [HostState.QUEUED, HostState.CONNECTING, HostState.RUNNING, HostState.OK]


def fail_on(*names):
    def task(ctx):
        if ctx.host.name in names:
            raise RemoteStepError(f"{ctx.host.name}: stage failed")
        return "ok"

    return task


@pytest.mark.parametrize(
    "unreachable,failing,code",
    [
        ((), (), ExitCode.OK),
        (("h0", "h1", "h2"), (), ExitCode.CONNECT),
        ((), ("h0", "h1", "h2"), ExitCode.REMOTE),
        (("h0",), ("h1", "h2"), ExitCode.REMOTE),
        (("h0",), (), ExitCode.PARTIAL),
        ((), ("h2",), ExitCode.PARTIAL),
    ],
)
def test_exit_codes(unreachable, failing, code):
    connect = connect_except(unreachable)
    result = run_fanout(hosts(3), fail_on(*failing), connect=connect)
    assert result.exit_code() is code
    assert set(result.failed) == set(unreachable) | set(failing)
    for name in unreachable:
        assert result[name].state is HostState.UNREACHABLE
        assert result[name].message() == f"{name}: connection refused: nothing listens"
    for name in failing:
        assert result[name].state is HostState.FAILED
    assert all(t.closed.is_set() for t in connect.opened.values())  # every connection closed


def test_one_failure_does_not_stop_the_others_but_fail_fast_does():
    result = run_fanout(hosts(5), fail_on("h0"), parallel=1, connect=connect_except())
    assert [o.state for o in result.values()] == [HostState.FAILED] + [HostState.OK] * 4
    result = run_fanout(hosts(5), fail_on("h0"), parallel=1, fail_fast=True, connect=connect_except())
    assert [o.state for o in result.values()] == [HostState.FAILED] + [HostState.SKIPPED] * 4
    assert result.exit_code() is ExitCode.REMOTE


def test_parallel_bounds_concurrency():
    lock, running, peak = threading.Lock(), [0], [0]

    def task(ctx):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    run_fanout(hosts(12), task, parallel=3, connect=connect_except())
    assert peak[0] == 3


def test_deadline_marks_the_host_and_closes_its_connection():
    connect = connect_except()
    release = threading.Event()

    def task(ctx):
        if ctx.host.name == "h1":
            ctx.transport.closed.wait(10)  # a hung command, ended only by closing the connection
            release.set()
            raise RemoteStepError("late result that must be ignored")
        return "ok"

    result = run_fanout(hosts(3), task, deadline_s=0.3, connect=connect)
    assert result["h1"].state is HostState.TIMED_OUT
    assert "per-host deadline of 0.3s" in result["h1"].message()
    assert result.exit_code() is ExitCode.PARTIAL
    assert release.wait(5) and result["h1"].state is HostState.TIMED_OUT


def test_connection_lost_mid_task_is_a_failed_step_not_unreachable():
    from ddtree_ops.errors import ConnectionLost

    def task(ctx):
        raise ConnectionLost(ctx.host.name, "channel ended without an exit status")

    result = run_fanout(hosts(2), task, connect=connect_except())
    assert {o.state for o in result.values()} == {HostState.FAILED}
    assert result.exit_code() is ExitCode.REMOTE


def test_unexpected_exception_stays_with_its_host():
    def task(ctx):
        if ctx.host.name == "h0":
            raise KeyError("bug")
        return 1

    result = run_fanout(hosts(2), task, connect=connect_except())
    assert result["h0"].state is HostState.FAILED
    assert result["h0"].message() == "internal error: KeyError: 'bug'"
    assert result["h1"].ok


def test_on_launched_runs_once_the_hosts_have_started():
    started = threading.Event()
    seen = []

    def task(ctx):
        started.set()
        return ctx.host.name

    def launched():
        seen.append(started.wait(5))  # a host is already running when the hook runs

    result = run_fanout(hosts(2), task, connect=connect_except(), on_launched=launched)
    assert seen == [True] and result.exit_code() is ExitCode.OK


def test_live_table_reports_hosts_that_finished_before_its_display_started(capsys):
    from ddtree_ops.cli.console import LiveHostTable

    with LiveHostTable("push", ["h0", "h1"]) as live:
        for state in (HostState.CONNECTING, HostState.RUNNING, HostState.OK):
            live.on_progress("h0", state, "")
        assert capsys.readouterr().err == ""  # nothing drawn before start()
        live.start()
        live.on_progress("h1", HostState.CONNECTING, "")
        live.on_progress("h1", HostState.FAILED, "boom")
        live.start()  # idempotent
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["ddtree-ops: push: h0: ok", "ddtree-ops: push: h1: failed"]
    assert lines[1].endswith(": boom")


def test_live_table_is_silent_once_its_fan_out_is_over(capsys):
    """An interrupted fan-out's workers may report after the command ended: no line then
    (the command's own last line, `interrupted`, stays last)."""
    from ddtree_ops.cli.console import LiveHostTable

    with pytest.raises(KeyboardInterrupt):
        with LiveHostTable("push", ["h0", "h1"]) as live:
            live.start()
            live.on_progress("h0", HostState.OK, "")
            raise KeyboardInterrupt
    live.on_progress("h1", HostState.INTERRUPTED, "late")
    assert [line.split(" (")[0] for line in capsys.readouterr().err.splitlines()] == ["ddtree-ops: push: h0: ok"]
    assert live.rows["h1"][0] == "interrupted"  # still recorded


@pytest.mark.slow
def test_an_interrupt_marks_hosts_under_way_interrupted_not_failed():
    """Ctrl-C closes the connections to unblock the workers; the errors that follow are the
    interrupt's doing, not the hosts' failures."""
    import _thread

    from ddtree_ops.errors import ConnectionLost
    from ddtree_ops.fanout import INTERRUPTED_DETAIL

    connect = connect_except()
    seen: dict[str, list] = {}
    settled = threading.Event()

    def task(ctx):
        if ctx.host.name == "h0":
            return "done before the interrupt"
        ctx.transport.closed.wait(10)  # only the interrupt's close ends it
        raise ConnectionLost(ctx.host.name, "channel closed")

    def on_progress(name, state, detail):
        seen.setdefault(name, []).append((state, detail))
        if name == "h1" and state.terminal:
            settled.set()

    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        run_fanout(hosts(2), task, connect=connect, on_progress=on_progress)
    assert settled.wait(5)
    assert seen["h0"][-1][0] is HostState.OK
    assert seen["h1"][-1] == (HostState.INTERRUPTED, INTERRUPTED_DETAIL)


def test_live_table_past_the_terminal_height_shows_hosts_under_way_and_counts_the_rest():
    from rich.console import Console

    from ddtree_ops.cli.console import LiveHostTable

    names = [f"gpu-{i:02d}" for i in range(64)]
    live = LiveHostTable("push", names)
    for name in names[:50]:
        live.on_progress(name, HostState.OK, "")
    live.on_progress("gpu-50", HostState.RUNNING, "sending")
    live.on_progress("gpu-51", HostState.FAILED, "boom")
    console = Console(width=120, height=40, record=True, file=io.StringIO())
    console.print(live._render(height=40))
    text = console.export_text()
    assert len(text.splitlines()) <= 40
    assert "gpu-50" in text and "gpu-51" in text and "gpu-00" not in text
    assert "64 hosts: 50 ok, 1 running, 1 failed, 12 queued; 62 not shown" in " ".join(text.split())
    console = Console(width=120, height=200, record=True, file=io.StringIO())
    console.print(live._render(height=200))  # room for every host: all shown, no caption
    text = console.export_text()
    assert all(name in text for name in names) and "not shown" not in text
