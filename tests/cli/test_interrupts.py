"""SIGTERM (a CI job cancel) and Ctrl-C end a command the same way: exit 130, `ddtree-ops:
interrupted (SIGINT)` (or `(SIGTERM)`: the signal that came) on stderr, one JSON document under `--json`, and `smoke` stops its remote runner
and finishes its records. Real processes of the console script on the `local` host; a host
`python:` that sleeps holds push/deploy/collect/hosts check in their remote step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.cli.interrupts import signals_interrupt
from fixtures.checkout import copy_release_files

SCRIPT = Path(sys.executable).with_name("ddtree-ops")
CLI = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "ddtree_ops"]

HANG = ('NAME = "hang"\nDESCRIPTION = "hangs"\nimport time\n'
        'def run(ctx):\n    print("hanging now", flush=True)\n    time.sleep(3600)\n')


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the CLI ended (exit {proc.returncode}) before {what}: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def slow_host(tmp_path, monkeypatch):
    """An inventory whose `local` host's python records its pid and sleeps."""
    pids = tmp_path / "slow.pids"
    slowpy = tmp_path / "slowpy"
    slowpy.write_text(f'#!/bin/sh\necho $$ >> "{pids}"\nexec sleep 60\n')
    slowpy.chmod(0o755)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(tmp_path / "wd"), "python": str(slowpy)}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("DDTREE_OPS_DEBUG_LOG", str(tmp_path / "debug.log"))
    yield pids
    if pids.exists():  # the local transport leaves the sleeping "python" behind
        for pid in pids.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def recorded_run(runs: Path) -> str:
    """A run of the `local` host in the local store, for `collect` to complete."""
    from ddtree_ops.results import RunStore, new_run_id

    store, run_id = RunStore(runs), new_run_id()
    store.create_run(run_id, {"hosts": ["local"]})
    store.host_recorder(run_id, "local", {}).close()
    return run_id


COMMANDS = [["push"], ["deploy"], ["collect", "RUN"], ["hosts", "check", "--deep"]]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_signal_mid_command_exits_130_with_one_json_document(slow_host, tmp_path, command, sig):
    if "RUN" in command:
        command = [recorded_run(tmp_path / "runs") if w == "RUN" else w for w in command]
    proc = subprocess.Popen([*CLI, *command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        wait_for(slow_host.exists, "the host's python started", proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    name = "hosts check" if command[0] == "hosts" else command[0]
    why = f"interrupted ({sig.name})"
    assert json.loads(out) == {"command": name, "exit_code": 130, "error": why}
    assert err.strip().splitlines()[-1] == f"ddtree-ops: {why}" and "Traceback" not in err


def test_ctrl_c_in_process_reports_and_restores_the_handlers(slow_host, capsys):
    """`main()` called in-process: the interrupt is reported like in the console script, and
    the caller's signal handlers are as they were afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def interrupt_once_started() -> None:
        wait_for(slow_host.exists, "the host's python started", timeout=30)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    code = main(["hosts", "check", "--deep", "--json"])
    captured = capsys.readouterr()
    assert code == 130
    assert json.loads(captured.out) == {"command": "hosts check", "exit_code": 130, "error": "interrupted (SIGINT)"}
    assert captured.err.strip().splitlines()[-1] == "ddtree-ops: interrupted (SIGINT)"
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_repeated_sigterm_does_not_cut_the_cleanup_short(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with signals_interrupt():
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode: never reached
        os.kill(os.getpid(), signal.SIGTERM)  # during cleanup: noted, nothing raised
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is before
    assert "terminated again: still stopping" in capsys.readouterr().err


class SignalsWhenCollected:
    """Raises a signal from `__del__`, where Python swallows any exception: the handler's
    KeyboardInterrupt lands there (as it can in an import's module-lock weakref callback)."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupt_swallowed_where_it_landed_is_sent_again(sig, capsys):
    hook_before = sys.unraisablehook
    with signals_interrupt():
        with pytest.raises(KeyboardInterrupt):
            SignalsWhenCollected(sig)  # dropped at once: __del__ runs here
            # the CLI waits in short polls (fanout: 0.1 s); a signal sent as the main thread
            # drops the GIL to block may land before the system call starts and not cut it short
            for _ in range(300):
                time.sleep(0.1)
    assert sys.unraisablehook is hook_before
    assert "Exception ignored" not in capsys.readouterr().err


def test_other_unraisable_errors_still_reach_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class FailsWhenCollected:
        def __del__(self):
            raise ValueError("not an interrupt")

    with signals_interrupt():
        FailsWhenCollected()
    assert [type(u.exc_value) for u in seen] == [ValueError]


def runner_pids(run_id: str) -> list[int]:
    """Processes of `runner.py run` for this run id (what SIGTERM must not leave behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"runner.py") for a in argv) and b"run" in argv and run_id.encode() in argv:
            found.append(int(entry.name))
    return found


def test_sigterm_stops_a_smoke_run_like_ctrl_c(tmp_path):
    """A CI cancel mid-stage: the runner is stopped, what arrived is kept, run.json is finished,
    and `--json` gets the run's own report (one document) with exit 130. A second SIGTERM
    during that cleanup is only noted."""
    checkout = copy_release_files(tmp_path / "checkout", {"hang": HANG})
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(
        {"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "wd")}}}))
    env = {**os.environ, "DDTREE_OPS_INVENTORY": str(inventory), "DDTREE_OPS_RUNS_DIR": str(tmp_path / "runs")}
    stderr_path = tmp_path / "stderr.txt"
    run_id = None
    try:
        with stderr_path.open("w") as stderr:
            proc = subprocess.Popen([*CLI, "smoke", "--source", str(checkout), "--stages", "env,hang,golden",
                                     "--json"], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path,
                                    env=env)
            try:
                hang_log = wait_for(lambda: next((p for p in (tmp_path / "wd" / "runs").glob("*/logs/hang.log")
                                                  if "hanging now" in p.read_text()), None),
                                    "the host inside the hanging stage", proc)
                run_id = hang_log.parent.parent.name
                assert runner_pids(run_id), "the runner should be running now"
                proc.send_signal(signal.SIGTERM)
                wait_for(lambda: "interrupted (SIGTERM): stopping the remote runners" in stderr_path.read_text(),
                         "the cleanup to begin", proc, timeout=30)
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=90)
            finally:
                proc.kill()
        err = stderr_path.read_text()
        assert proc.returncode == 130, err
        assert "Traceback" not in err
        doc = json.loads(out)  # exactly one document: the run's report, not a second one
        assert doc["command"] == "smoke" and doc["exit_code"] == 130 and doc["run_id"] == run_id
        assert doc["hosts"]["local"]["outcome"] == "interrupted"
        stages = doc["hosts"]["local"]["stages"]
        assert stages["env"]["status"] == "pass" and stages["hang"]["status"] == "fail"
        assert stages["hang"]["reason"] == "interrupted (SIGTERM)"  # the signal the CLI got
        # `runner.py stop` returns once the runner wrote its last records; it then exits
        wait_for(lambda: not runner_pids(run_id), "the runner to exit", timeout=15)
        meta = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())
        assert meta["exit_code"] == 130 and meta["interrupted"] is True and "finished" in meta
    finally:
        for pid in runner_pids(run_id) if run_id else []:  # a runner left behind hangs for an hour
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_during_a_deferred_step_lands_as_it_ends(sig):
    """Starting or stopping Rich's Live must not be cut half-way (an interrupted start left a
    Live that could not be stopped: it redrew below the final line, the cursor stayed hidden).
    The interrupt is held back, then raised as the step ends, naming its signal."""
    from ddtree_ops.cli.interrupts import signals_deferred
    from ddtree_ops.errors import Interrupted

    steps = []
    with signals_interrupt():
        with pytest.raises(Interrupted) as caught:
            with signals_deferred():
                os.kill(os.getpid(), sig)
                time.sleep(0.3)  # the handler ran meanwhile: held back
                steps.append("the step finished")
            time.sleep(5)  # raised as the block ended: never reached
    assert steps == ["the step finished"] and caught.value.signal_name == sig.name


RICH_IMPORT_PROBE = """
import importlib.abc, json, signal, sys
from ddtree_ops.cli.console import LiveHostTable
from ddtree_ops.cli.interrupts import signals_interrupt
from ddtree_ops.errors import Interrupted

class CtrlCAsRichLoads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "rich.console":
            signal.raise_signal(signal.SIGINT)  # lands as the hosts start, while Rich loads
        return None

sys.meta_path.insert(0, CtrlCAsRichLoads())
table = LiveHostTable("push", ["a"])
with signals_interrupt():
    try:
        table.start()
        caught = None
    except Interrupted as err:
        caught = err.signal_name
console = sys.modules.get("rich.console")
print(json.dumps({"caught": caught, "rich_whole": hasattr(console, "Console") and "rich.table" in sys.modules}))
"""


def test_ctrl_c_while_rich_loads_waits_for_it_to_load_whole():
    """Rich loads while the hosts start: Ctrl-C then used to cut a class body of rich.console
    short, which Python reports as a RuntimeError (exit 1, "unexpected error"), not exit 130."""
    out = subprocess.run([sys.executable, "-c", RICH_IMPORT_PROBE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"caught": "SIGINT", "rich_whole": True}
