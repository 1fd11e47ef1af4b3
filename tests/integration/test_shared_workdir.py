"""A workdir on a shared host, over real SSH, with a second (unprivileged) account made by the
test: whatever that account could plant or own in or above the workdir, push and the lock
refuse it (exit 5, naming the path, owner and mode) and write nothing outside the workdir."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main

pytestmark = pytest.mark.sshd


def push_json(args, capsys) -> tuple[int, dict]:
    code = main(["push", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def plant_link(link: Path, target: Path, account) -> None:
    """A symlink as `account` would leave it (its owner decides where it points)."""
    link.symlink_to(target)
    os.lchown(link, account.pw_uid, account.pw_gid)


@pytest.fixture
def pushed(sshd_fleet, capsys, tmp_path):
    """(inventory, workdir, a root-owned 0600 file outside it) after one push."""
    fleet = sshd_fleet(1)
    inventory = fleet.write_inventory()
    assert push_json(["-i", str(inventory)], capsys)[0] == 0
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    os.chmod(victim, 0o600)
    return inventory, fleet.hosts[0].workdir, victim


def test_a_planted_lock_link_never_truncates_a_file_outside(pushed, capsys, other_account):
    inventory, workdir, victim = pushed
    (workdir / "lock").unlink()
    os.chmod(workdir, 0o777)  # a workdir anyone could write: the other account plants a link
    plant_link(workdir / "lock", victim, other_account)
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5
    assert f"{workdir}: is writable by group or others (folder, owner root, mode 0777)" in doc["hosts"]["h0"]["error"]
    assert victim.read_text() == "root:secret\n"
    os.chmod(workdir, 0o755)  # fixed, but the planted link is still there
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5
    assert f"{workdir / 'lock'}: is a symlink (symlink, owner {other_account.pw_name}, mode 0777)" in doc["hosts"]["h0"]["error"]
    assert victim.read_text() == "root:secret\n"
    assert main(["hosts", "check", "-i", str(inventory)]) == 0  # a read-only probe still works


def test_a_lock_hard_linked_to_a_file_outside_is_refused(pushed, capsys):
    inventory, workdir, victim = pushed
    (workdir / "lock").unlink()
    os.link(victim, workdir / "lock")
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5 and f"{workdir / 'lock'}: has another name (a hard link)" in doc["hosts"]["h0"]["error"]
    assert victim.read_text() == "root:secret\n"


def test_a_lock_file_of_another_account_is_refused(pushed, capsys, other_account):
    inventory, workdir, _ = pushed
    os.chown(workdir / "lock", other_account.pw_uid, other_account.pw_gid)
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5
    assert f"{workdir / 'lock'}: is owned by another account (file, owner {other_account.pw_name}, mode 0644)" \
        in doc["hosts"]["h0"]["error"]


@pytest.mark.parametrize("part", ["", "releases", "runs", "deployments"])
def test_a_workdir_part_of_another_account_or_group_writable_is_refused(pushed, capsys, other_account, part):
    inventory, workdir, _ = pushed
    path = workdir / part if part else workdir
    os.chmod(path, 0o775)
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5
    assert f"{str(path).rstrip('/')}: is writable by group or others (folder, owner root, mode 0775)" \
        in doc["hosts"]["h0"]["error"]
    os.chmod(path, 0o755)
    os.chown(path, other_account.pw_uid, other_account.pw_gid)
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5
    assert f"{str(path).rstrip('/')}: is owned by another account (folder, owner {other_account.pw_name}, mode 0755)" \
        in doc["hosts"]["h0"]["error"]


def test_a_folder_above_the_workdir_another_account_controls_is_refused(sshd_fleet, capsys, other_account, tmp_path):
    fleet = sshd_fleet(1)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, no sticky bit: anyone could swap the workdir
    inventory = fleet.write_inventory(host_overrides={"h0": {"workdir": str(shared / "team" / "work")}})
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5 and f"{shared}: is writable by group or others (folder, owner root, mode 0777)" in doc["hosts"]["h0"]["error"]
    assert list(shared.iterdir()) == []
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot rename what is ours
    assert push_json(["-i", str(inventory)], capsys)[0] == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, other_account.pw_uid, other_account.pw_gid)
    inventory = fleet.write_inventory(host_overrides={"h0": {"workdir": str(theirs / "work")}})
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5 and f"{theirs}: is owned by another account" in doc["hosts"]["h0"]["error"]
    plant_link(shared / "link", theirs, other_account)
    inventory = fleet.write_inventory(host_overrides={"h0": {"workdir": str(shared / "link" / "work")}})
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 5 and f"{shared / 'link'}: is owned by another account (symlink" in doc["hosts"]["h0"]["error"]
    assert list(theirs.iterdir()) == []
