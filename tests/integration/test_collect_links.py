"""Red team round 3 (#49 item 1): a co-user with write access to the operator's runs folder
plants a link, `ln -s ~/.ssh runs/RUN/h0/remote`, and waits for `collect`: the host's files
(an `authorized_keys` among them) must never land through it. Links anywhere on the way (the
run folder, a host folder, `remote/`, a folder below it) are refused with one line naming the
link, that host fails, the others are collected, and nothing is written, read or hashed
behind the link. Over a real loopback sshd fleet."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_collect_stream import make_local_run

from ddtree_ops.cli.app import main

RUN_A, RUN_B = "20261201-090000-aaaaaa", "20261201-090000-bbbbbb"
PAYLOAD = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostileHostKeyxxxxxxxxxxxxxxxxxxxxxxxxx attacker\n"
REFUSED = "a link on the way to a file we write: refused (nothing is written through a link)"


def host_run(workdir: Path, run_id: str, host: str) -> None:
    """What a hostile host keeps for the run: an `authorized_keys` beside its records."""
    run = workdir / "runs" / run_id
    (run / "stages").mkdir(parents=True)
    (run / "events.jsonl").write_text(json.dumps({"v": 1, "event": "run_start", "run_id": run_id, "host": host,
                                                  "stages": ["env"], "time": 1}) + "\n")
    (run / "authorized_keys").write_text(PAYLOAD)
    (run / "stages" / "env.json").write_text(json.dumps({"run_id": run_id, "host": host, "stage": "env",
                                                         "status": "pass"}))


def fake_ssh_dir(path: Path) -> dict[str, str]:
    """A stand-in for the operator's ~/.ssh; returns its files' sha256 to compare afterwards."""
    path.mkdir(parents=True)
    (path / "authorized_keys").write_text("ssh-ed25519 AAAA... operator@laptop\n")
    (path / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n...\n")
    return tree(path)


def tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def collect(capsys, run_id: str, inventory: str) -> tuple[int, dict]:
    code = main(["collect", run_id, "-i", inventory, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.sshd
@pytest.mark.slow
def test_collect_never_writes_through_a_linked_run_host_or_remote_folder(sshd_fleet, tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(runs))
    fleet = sshd_fleet(2)
    inventory = str(fleet.write_inventory())
    workdirs = {h.name: h.workdir for h in fleet.hosts}
    for run_id in (RUN_A, RUN_B):
        for name, workdir in workdirs.items():
            host_run(workdir, run_id, name)

    # 1. `ln -s ~/.ssh runs/RUN/h0/remote`: h0 is refused, h1 collected as usual.
    ssh_dir = tmp_path / "home" / ".ssh"
    ssh_before = before = fake_ssh_dir(ssh_dir)
    run_a = make_local_run(runs, workdirs, RUN_A)
    (run_a / "h0" / "remote").symlink_to(ssh_dir)
    code, doc = collect(capsys, RUN_A, inventory)
    assert code == 6  # partial: one host refused, the other collected
    assert doc["hosts"]["h0"]["error"] == f"h0: collect: {run_a / 'h0' / 'remote'}: {REFUSED}"
    assert doc["hosts"]["h1"]["state"] == "ok"
    assert sorted(doc["hosts"]["h1"]["result"]["fetched"]) == ["authorized_keys", "events.jsonl", "stages/env.json"]
    assert tree(ssh_dir) == before  # nothing written there (and nothing of it hashed for the host)

    # 2. The host folder itself linked (`runs/RUN/h1 -> ~/.ssh`, run.json copied in to look right).
    run_b = make_local_run(runs, workdirs, RUN_B)
    linked_host = tmp_path / "home2" / ".ssh"
    fake_ssh_dir(linked_host)
    (linked_host / "run.json").write_bytes((run_b / "h1" / "run.json").read_bytes())
    before = tree(linked_host)
    for path in (run_b / "h1").iterdir():
        path.unlink()
    (run_b / "h1").rmdir()
    (run_b / "h1").symlink_to(linked_host)
    code, doc = collect(capsys, RUN_B, inventory)
    assert code == 6
    assert doc["hosts"]["h1"]["error"] == f"h1: collect: {run_b / 'h1'}: {REFUSED}"
    assert doc["hosts"]["h0"]["state"] == "ok"
    assert tree(linked_host) == before

    # 3. The run folder linked: every host of it is refused; what the link points to is untouched.
    moved = tmp_path / "elsewhere" / RUN_A
    moved.parent.mkdir()
    run_a.rename(moved)
    run_a.symlink_to(moved)
    before = tree(moved)
    code, doc = collect(capsys, RUN_A, inventory)
    assert code == 5
    for name in ("h0", "h1"):
        assert doc["hosts"][name]["error"] == f"{name}: collect: {run_a}: {REFUSED}"
    assert tree(moved) == before
    assert tree(ssh_dir) == ssh_before
