"""The worked playbook of docs/ansible/ run by ansible-core against the sshd fleet, with the
inventory `hosts list --format ansible` wrote: every host runs the smoke runner of the release
`ddtree-ops push` activated; a failing canary stops Ansible's next batches; a host is judged by
ddtree-ops' own rule, so one whose run_end lies fails. ansible-core is in the test install set
(pyproject's `test` extra): these tests never skip."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.release import RUNNER_RELPATH

PLAYBOOK = Path(__file__).resolve().parents[2] / "docs" / "ansible" / "smoke.yml"
# Next to this Python first: `make test` runs .venv/bin/python without the venv on PATH.
ANSIBLE_PLAYBOOK = shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) or shutil.which("ansible-playbook")
pytestmark = [pytest.mark.sshd, pytest.mark.slow]


def test_the_playbook_runs_the_runner_where_push_put_it():
    play = yaml.safe_load(PLAYBOOK.read_text())[0]
    assert play["vars"]["runner_relpath"] == f"current/{RUNNER_RELPATH}"  # the docs follow the release layout


def export(inventory: Path, capsys, target: Path) -> Path:
    assert main(["hosts", "list", "-i", str(inventory), "--format", "ansible"]) == 0
    target.write_text(capsys.readouterr().out)
    return target


def playbook(inventory: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    assert ANSIBLE_PLAYBOOK, "ansible-playbook not found: ansible-core is in the test extra (pip install -e '.[test]')"
    control = Path(tempfile.mkdtemp(prefix="acp-", dir="/tmp"))  # ssh control sockets need a short path
    env = {**os.environ, "ANSIBLE_HOME": str(tmp_path / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "local-tmp"),
           "ANSIBLE_REMOTE_TMP": str(tmp_path / "remote-tmp"), "ANSIBLE_SSH_ARGS": "", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control), "ANSIBLE_RETRY_FILES_ENABLED": "0"}
    try:
        return subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(inventory), str(PLAYBOOK), *extra],
                              capture_output=True, text=True, env=env, timeout=600)
    finally:
        shutil.rmtree(control, ignore_errors=True)


def run_end(workdir: Path, run_id: str) -> dict:
    lines = (workdir / "runs" / run_id / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"run_end"' in line][-1]


def test_ansible_runs_the_smoke_stages_on_the_fleet_a_canary_first(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(3)
    ours = fleet.write_inventory()
    assert main(["push", "-i", str(ours)]) == 0
    capsys.readouterr()
    fleet_yml = export(ours, capsys, tmp_path / "fleet.yml")
    done = playbook(fleet_yml, tmp_path, "-e", "ddtree_run_id=ansible-ok", "-e", "stages=env")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for host in fleet.hosts:
        assert run_end(host.workdir, "ansible-ok")["status"] == "pass", host.name
    assert done.stdout.count("PLAY [DDTree smoke stages") == 3  # batches of 1, 10% (1) and the rest

    # the canary's Python is gone: its batch fails and no other host runs anything
    broken = export(fleet.write_inventory(host_overrides={"h0": {"python": "/nonexistent/python3"}}),
                    capsys, tmp_path / "broken.yml")
    done = playbook(broken, tmp_path, "-e", "ddtree_run_id=ansible-canary", "-e", "stages=env")
    assert done.returncode != 0
    assert all(not (h.workdir / "runs" / "ansible-canary").exists() for h in fleet.hosts)
    assert "h1" not in done.stdout.split("PLAY RECAP")[0] and "h2" not in done.stdout.split("PLAY RECAP")[0]


def test_the_play_judges_a_host_by_its_stage_records_never_its_run_end(sshd_fleet, tmp_path, capsys):
    """A host whose `python` forges the runner's output (stage env failed, run_end says pass):
    the play fails that host, by ddtree-ops' rule, as `ddtree-ops smoke` does."""
    from integration.test_hostile_outcome import forger, run_end as forged_run_end, stage_end

    fleet = sshd_fleet(2)
    ours = fleet.write_inventory()
    assert main(["push", "-i", str(ours)]) == 0
    capsys.readouterr()
    lies = [{"event": "run_start", "stages": ["env"]}, stage_end("env", 0, "fail"), forged_run_end("pass")]
    liar = forger(tmp_path / "forger", lies)
    fleet_yml = export(fleet.write_inventory(host_overrides={"h1": {"python": str(liar)}}), capsys, tmp_path / "lying.yml")
    done = playbook(fleet_yml, tmp_path, "-e", "ddtree_run_id=ansible-lie", "-e", "stages=env")
    out = done.stdout
    assert done.returncode != 0, out[-3000:]
    assert "h1: smoke fail: env fail; run_end says pass, but env is fail (run ansible-lie" in out, out[-3000:]
    assert "h0: smoke pass (run ansible-lie: env pass)" in out, out[-3000:]
    recap = out.split("PLAY RECAP")[-1]
    assert "h0" in recap and "failed=0" in recap.split("h1")[0] and "failed=1" in recap.split("h1")[1]
