"""`ddtree-ops smoke` against a real loopback sshd fleet: a full run on several hosts, a
failing stage, a hanging stage, a host killed mid-run (exit 6, the others' results intact),
`collect` over SSH, and `report --json` / `--baseline` exit codes."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from fixtures.checkout import copy_release_files

pytestmark = [pytest.mark.sshd, pytest.mark.slow]


EXTRA_STAGES = {
    "broken": 'NAME = "broken"\nDESCRIPTION = "raises"\n'
              'def run(ctx):\n    raise ValueError("broken on " + ctx.host["name"])\n',
    "hang": 'NAME = "hang"\nDESCRIPTION = "hangs"\nimport time\n'
            'def run(ctx):\n    print("hanging on", ctx.host["name"], flush=True)\n'
            '    time.sleep(3600)\n',
    "slow": 'NAME = "slow"\nDESCRIPTION = "takes a few seconds"\nimport time\n'
            'from ddtree_ops.hostside.protocol import StageResult\n'
            'def run(ctx):\n    print("slow stage started", flush=True)\n'
            '    time.sleep(4)\n    return StageResult.passed("done")\n',
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of this checkout's release files plus the purpose-built stages above."""
    return copy_release_files(tmp_path_factory.mktemp("checkout"), EXTRA_STAGES)


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def smoke_json(args: list[str], capsys) -> tuple[int, dict]:
    code = main(["smoke", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_full_smoke_on_three_hosts_then_collect_and_report(sshd_fleet, runs, capsys, tmp_path):
    fleet = sshd_fleet(3)
    inventory = str(fleet.write_inventory())
    # The CPU-heavy stages are covered on the local transport; here the fleet mechanics.
    code, doc = smoke_json(["-i", inventory, "--stages", "env,import,golden"], capsys)
    assert code == 0, doc["failures"]
    assert set(doc["hosts"]) == {"h0", "h1", "h2"}
    for name, host in doc["hosts"].items():
        assert host["outcome"] == "pass"
        assert [host["stages"][s]["status"] for s in ("env", "import", "golden")] == ["pass"] * 3
    for host in fleet.hosts:
        record = json.loads((runs / doc["run_id"] / host.name / "stages" / "import.json").read_text())
        assert record["metrics"]["release"] == doc["release"]
        assert record["metrics"]["resolved_root"].startswith(str(host.workdir))
        on_host = host.workdir / "runs" / doc["run_id"] / "events.jsonl"
        assert on_host.read_text().splitlines() == \
            (runs / doc["run_id"] / host.name / "events.jsonl").read_text().splitlines()

    assert main(["collect", doc["run_id"], "-i", inventory, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    fetched = first["hosts"]["h1"]["result"]["fetched"]
    assert "logs/golden.log" in fetched and "stages/import.json" in fetched
    assert (runs / doc["run_id"] / "h1" / "remote" / "logs" / "golden.log").read_text() == \
        (fleet.hosts[1].workdir / "runs" / doc["run_id"] / "logs" / "golden.log").read_text()
    assert main(["collect", doc["run_id"], "-i", inventory, "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert all(h["result"]["fetched"] == [] for h in second["hosts"].values())

    assert main(["report", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run_id"] == doc["run_id"] and report["exit_code"] == report["run_exit_code"] == 0
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump({"metrics": [
        {"metric": "golden.seed_output_matches", "expected": False},
        {"metric": "golden.status", "expected": "pass"}]}))
    assert main(["report", "--baseline", str(baseline)]) == 5
    err = capsys.readouterr().err
    for name in ("h0", "h1", "h2"):
        assert (f"regression: golden.seed_output_matches on {name}: expected False, "
                f"measured True (differs)") in err
    assert "golden.status" not in err


def test_failing_and_hanging_stages_over_ssh(sshd_fleet, runs, capsys, checkout):
    fleet = sshd_fleet(2)
    inventory = str(fleet.write_inventory())
    code, doc = smoke_json(["-i", inventory, "--source", str(checkout), "--stages",
                            "env,broken,hang,golden", "--keep-going", "--stage-timeout", "3"],
                           capsys)
    assert code == 5
    for name in ("h0", "h1"):
        stages = doc["hosts"][name]["stages"]
        assert stages["broken"]["status"] == "fail"
        assert stages["broken"]["reason"] == f"ValueError: broken on {name}"
        assert stages["hang"]["status"] == "fail"
        assert stages["hang"]["reason"] == "timed out after 3s"
        assert stages["golden"]["status"] == "pass"
        record = json.loads((runs / doc["run_id"] / name / "stages" / "hang.json").read_text())
        assert f"hanging on {name}" in record["output_tail"]
        assert "Traceback" in json.loads(
            (runs / doc["run_id"] / name / "stages" / "broken.json").read_text())["traceback"]


def when_slow_starts(victim, action, runs: Path) -> threading.Thread:
    """A started thread that runs `action` once the victim host is inside the `slow` stage and
    the operator side has recorded that (its stage_start arrived), so the test knows what the
    report must say."""

    def started() -> bool:
        for events in runs.glob(f"*/{victim.name}/events.jsonl"):
            if '"event":"stage_start"' in (text := events.read_text()) and '"stage":"slow"' in text:
                return True
        return False

    def watch() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if started():
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_host_killed_mid_run_gives_exit_6_and_keeps_the_others(sshd_fleet, runs, capsys,
                                                                  checkout):
    fleet = sshd_fleet(3, command_timeout=60)
    inventory = str(fleet.write_inventory())
    victim = fleet.hosts[1]
    killer = when_slow_starts(victim, victim.kill, runs)
    code, doc = smoke_json(["-i", inventory, "--source", str(checkout), "--stages",
                            "env,slow,golden"], capsys)
    killer.join(5)
    assert code == 6
    for name in ("h0", "h2"):
        assert doc["hosts"][name]["outcome"] == "pass"
        assert {s["status"] for s in doc["hosts"][name]["stages"].values()} == {"pass"}
    lost = doc["hosts"]["h1"]
    assert lost["outcome"] == "lost"
    assert lost["stages"]["env"]["status"] == "pass"  # what arrived before the kill is kept
    assert lost["stages"]["slow"]["status"] == "lost"  # the stage under way when the host was lost
    assert lost["stages"]["slow"]["reason"].startswith("no result:")
    assert lost["stages"]["golden"]["status"] == "not_run"
    assert any(f["host"] == "h1" for f in doc["failures"])
    assert (runs / doc["run_id"] / "h1" / "stages" / "env.json").is_file()
    for name in ("h0", "h2"):
        assert (runs / doc["run_id"] / name / "stages" / "golden.json").is_file()


def test_a_host_frozen_mid_run_is_lost_after_the_silence_limit_not_the_run_bound(
        sshd_fleet, runs, capsys, checkout, monkeypatch):
    """SIGSTOP: TCP stays open and nothing arrives, so only the missing heartbeats tell."""
    import ddtree_ops.smoke as smoke_run

    # > the runner's 5 s heartbeat, with room for a busy machine (h0 must not be lost too)
    monkeypatch.setattr(smoke_run, "SILENCE_LIMIT_S", 20.0)
    fleet = sshd_fleet(2, command_timeout=600)
    inventory = str(fleet.write_inventory())
    victim = fleet.hosts[1]
    freezer = when_slow_starts(victim, victim.freeze, runs)
    started = time.monotonic()
    try:
        code, doc = smoke_json(["-i", inventory, "--source", str(checkout), "--stages", "env,slow,golden"],
                               capsys)
    finally:
        freezer.join(5)
        victim.thaw()
    assert time.monotonic() - started < 600  # the run bound here is over 90 minutes: 9x margin
    assert code == 6
    assert doc["hosts"]["h0"]["outcome"] == "pass"
    lost = doc["hosts"]["h1"]
    assert lost["outcome"] == "lost" and lost["stages"]["env"]["status"] == "pass"
    [failure] = [f for f in doc["failures"] if f["host"] == "h1" and f["stage"] == "-"]
    assert "sent nothing for 20s (the host or the connection froze)" in failure["reason"]
    # the stage under way reads `lost` with how long it had run (>= the silence), not `fail 0.0s`
    assert lost["stages"]["slow"]["status"] == "lost" and lost["stages"]["slow"]["duration_s"] >= 20
    history = lost["history"]
    assert history["stage"] == "slow" and 20 <= history["silent_s"] < 120 and history["ran_s"] >= history["silent_s"]
    assert history["completed_on_host"] is None and history["collected_at"] is None


def test_a_frozen_then_thawed_host_keeps_its_loss_after_collect(sshd_fleet, runs, capsys, checkout, monkeypatch):
    """The host finishes on its own once thawed and `collect` fetches its records: the report
    shows its results and still the loss (when, after what silence), never a clean pass."""
    import ddtree_ops.smoke as smoke_run

    # > the runner's 5 s heartbeat, with room for a busy machine (h0 must not be lost too)
    monkeypatch.setattr(smoke_run, "SILENCE_LIMIT_S", 20.0)
    fleet = sshd_fleet(2, command_timeout=600)
    inventory = str(fleet.write_inventory())
    victim = fleet.hosts[1]
    freezer = when_slow_starts(victim, victim.freeze, runs)
    try:
        code, doc = smoke_json(["-i", inventory, "--source", str(checkout), "--stages", "env,slow,golden"],
                               capsys)
    finally:
        freezer.join(5)
        victim.thaw()
    assert code == 6 and doc["hosts"]["h1"]["outcome"] == "lost"
    on_host = victim.workdir / "runs" / doc["run_id"] / "run.json"
    deadline = time.monotonic() + 300  # generous: a busy machine; the runner needs seconds
    while time.monotonic() < deadline and "status" not in json.loads(on_host.read_text() or "{}"):
        time.sleep(0.5)
    assert json.loads(on_host.read_text())["status"] == "pass"  # it finished after the thaw
    assert main(["collect", doc["run_id"], "-i", inventory, "--json"]) == 0
    capsys.readouterr()

    assert main(["report", doc["run_id"], "--json"]) == 0  # the command; the run's verdict is run_exit_code
    report = json.loads(capsys.readouterr().out)
    h1 = report["hosts"]["h1"]
    assert h1["outcome"] == "lost" and report["run_exit_code"] == report["original_exit_code"] == 6
    assert [h1["stages"][s]["status"] for s in ("env", "slow", "golden")] == ["pass"] * 3  # what it finished
    history = h1["history"]
    assert history["stage"] == "slow" and 20 <= history["silent_s"] < 120
    assert history["completed_on_host"] == "pass" and history["host_exit_code"] == 0
    assert history["lost_at"] < history["finished_on_host_at"] < history["collected_at"]
    assert any(f["host"] == "h1" and "sent nothing for 20s" in f["reason"] for f in report["failures"])

    assert main(["report", doc["run_id"]]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("lost h1: lost at "))
    assert "of silence" in line and "the runner then finished on the host: pass (exit 0)" in line
    assert "collected at " in line and "the run exited 6" in line


def test_an_unreachable_host_is_partial_and_alone_is_exit_4(sshd_fleet, runs, capsys):
    from sshd_fleet import free_port

    fleet = sshd_fleet(1)
    dead = {"dead": {"hostname": "127.0.0.1", "port": free_port()}}
    inventory = str(fleet.write_inventory(extra_hosts=dead))
    code = main(["smoke", "-i", inventory, "--stages", "env", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 6
    assert doc["hosts"]["h0"]["outcome"] == "pass"
    assert doc["hosts"]["dead"]["outcome"] == "unreachable"
    assert "dead: unreachable: " in captured.err and "dead: failed" not in captured.err  # as the JSON says
    assert "unreachable: unreachable" not in captured.err  # the state once
    assert doc["hosts"]["dead"]["stages"] == {}
    [failure] = doc["failures"]
    assert failure["host"] == "dead" and "refused" in failure["reason"]
    code, doc = smoke_json(["-i", inventory, "-H", "dead", "--stages", "env"], capsys)
    assert code == 4


def test_ctrl_c_stops_the_remote_runners_over_ssh(sshd_fleet, runs, checkout):
    import os
    import signal
    import subprocess
    import sys

    fleet = sshd_fleet(2, command_timeout=120)
    inventory = str(fleet.write_inventory())
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "smoke", "-i", inventory, "--source",
         str(checkout), "--stages", "env,hang,golden", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DDTREE_OPS_RUNS_DIR": str(runs)})
    try:  # a failed wait must not leave the CLI behind (the sshd fixture ends the hosts' side)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # both hosts inside `hang`
            logs = [list((h.workdir / "runs").glob("*/logs/hang.log")) for h in fleet.hosts]
            if all(found and "hanging on" in found[0].read_text() for found in logs):
                break
            time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail(f"hosts never reached the hang stage: {proc.communicate()[1][-2000:]}")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "ended without a result" not in err and "failed" not in err, err  # stopped, not failed
    doc = json.loads(out)
    for host in fleet.hosts:
        stages = doc["hosts"][host.name]["stages"]
        assert stages["env"]["status"] == "pass"
        assert stages["hang"]["status"] == "fail"
        assert stages["hang"]["reason"] == "interrupted (SIGINT)"  # the host's own record: Ctrl-C's signal
        assert stages["golden"]["status"] == "not_run"
        assert doc["hosts"][host.name]["outcome"] == "interrupted"
        run_dir = next((host.workdir / "runs").iterdir())
        deadline = time.monotonic() + 20
        while (run_dir / "runner.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (run_dir / "runner.pid").exists()  # the remote runner stopped
        last = json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])
        assert last["event"] == "run_end" and last["status"] == "interrupted"
        # fetched in one stream after the stop, as `collect` does
        assert (runs / doc["run_id"] / host.name / "remote" / "logs" / "hang.log").is_file()
    assert "could not stop the runner" not in err


def test_a_refused_host_key_and_a_dangling_python_are_named_as_such(sshd_fleet, runs, capsys, tmp_path):
    """Three hosts: h0 fine, h1 whose key is not in known_hosts, h2 whose `python:` is a link to
    a removed interpreter. Each host's state says which, once per line."""
    fleet = sshd_fleet(3)
    fleet.known_hosts.write_text(fleet.hosts[0].known_hosts_line() + fleet.hosts[2].known_hosts_line())
    gone = tmp_path / "venv-removed" / "bin" / "python"
    link = tmp_path / "python-link"
    link.symlink_to(gone)
    inventory = str(fleet.write_inventory(host_overrides={"h2": {"python": str(link)}}))
    code = main(["smoke", "-i", inventory, "--stages", "env", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 6
    assert [doc["hosts"][h]["outcome"] for h in ("h0", "h1", "h2")] == ["pass", "host key refused", "fail"]
    reasons = {f["host"]: f["reason"] for f in doc["failures"]}
    assert "not in" in reasons["h1"] and "known_hosts" in reasons["h1"]
    assert f"python {str(link)!r} is a dangling link (to {str(gone)!r}, which does not exist)" in reasons["h2"]
    assert "h1: host key refused: [127.0.0.1]" in captured.err  # the state once, not twice
    assert "host key refused: host key refused" not in captured.err
    # alone, a refused key is exit 4 (could not connect), like an unreachable host
    assert main(["smoke", "-i", inventory, "-H", "h1", "--stages", "env", "--json"]) == 4
    assert json.loads(capsys.readouterr().out)["hosts"]["h1"]["outcome"] == "host key refused"
