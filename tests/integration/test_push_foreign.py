"""`push` on a host where the workdir holds what it did not make, over real SSH: an application
folder with its own releases/, a releases/ moved elsewhere by a link, a releases/ of another
account, releases of ours that were edited since. Push removes only its own, untouched
releases and names the rest; a layout it cannot trust is refused (exit 5) with nothing lost."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main

from fixtures.checkout import make_checkout

pytestmark = pytest.mark.sshd


def push_json(args, capsys) -> tuple[int, dict]:
    code = main(["push", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file (bytes) and link (target) under root, by relative path."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            found[rel] = path.read_bytes()
    return found


def application_folder(root: Path) -> Path:
    """A deployed web application: timestamped releases, one that even looks like a release id."""
    for name in ("20240101120000", "20240102120000", "0123456789abcdef"):
        (root / "releases" / name / "public").mkdir(parents=True)
        (root / "releases" / name / "public" / "index.html").write_text(f"release {name}\n")
    (root / "releases" / "0123456789abcdef" / "MANIFEST.sha256").write_text("not ours\n")
    (root / "releases" / ".incoming-notes").mkdir()  # a name like push's leftovers, but not one
    (root / "shared" / "uploads").mkdir(parents=True)
    (root / "shared" / "uploads" / "photo.jpg").write_bytes(os.urandom(1024))
    return root


def test_a_workdir_pointed_at_an_application_folder_loses_nothing(sshd_fleet, tmp_path, capsys, monkeypatch):
    fleet = sshd_fleet(1)
    app = application_folder(fleet.hosts[0].workdir)
    before = snapshot(app)
    inventory = fleet.write_inventory()
    ids = []
    for version in "123":
        checkout = make_checkout(tmp_path / f"c{version}", version)
        code, doc = push_json(["-i", str(inventory), "--source", str(checkout), "--keep", "1"], capsys)
        assert code == 0, doc
        ids.append(doc["release"])
    result = doc["hosts"]["h0"]["result"]
    assert result["pruned"] == [ids[1]]  # only our own, past --keep
    assert sorted(p.name for p in (app / "releases").iterdir()) == sorted(
        [".incoming-notes", "0123456789abcdef", "20240101120000", "20240102120000", ids[2]])
    for rel, content in before.items():
        assert snapshot(app).get(rel) == content, rel
    assert result["foreign"] == [
        ".incoming-notes: not a release name",
        "0123456789abcdef: its MANIFEST.sha256 does not hash to its name",
        "20240101120000: not a release name",
        "20240102120000: not a release name",
    ]
    monkeypatch.setenv("COLUMNS", "400")  # one table row per host, unfolded
    assert main(["push", "-i", str(inventory), "--source", str(tmp_path / "c1"), "--keep", "1"]) == 0
    assert "0123456789abcdef: its MANIFEST.sha256 does not hash to its name" in capsys.readouterr().out


def test_an_applications_own_current_link_is_refused_not_switched(sshd_fleet, capsys):
    fleet = sshd_fleet(1)
    app = application_folder(fleet.hosts[0].workdir)
    (app / "current").symlink_to(app / "releases" / "20240102120000")
    before = snapshot(app)
    code, doc = push_json(["-i", str(fleet.write_inventory())], capsys)
    assert code == 5
    assert f"{app / 'current'} -> {app / 'releases' / '20240102120000'}: not a symlink made by ddtree-ops" \
        in doc["hosts"]["h0"]["error"]
    after = snapshot(app)
    assert {rel: after.get(rel) for rel in before} == before


def test_releases_moved_elsewhere_by_a_link_is_refused(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    workdir = fleet.hosts[0].workdir
    inventory = fleet.write_inventory()
    for version in "12":
        assert push_json(["-i", str(inventory), "--source", str(make_checkout(tmp_path / f"c{version}", version))], capsys)[0] == 0
    disk = tmp_path / "data-disk" / "releases"
    disk.parent.mkdir()
    (workdir / "releases").rename(disk)
    (workdir / "releases").symlink_to(disk)
    (disk / "dataset").mkdir()
    (disk / "dataset" / "part-0").write_bytes(b"precious")
    before = snapshot(disk)
    code, doc = push_json(["-i", str(inventory), "--source", str(make_checkout(tmp_path / "c3", "3")), "--keep", "1"], capsys)
    assert code == 5
    error = doc["hosts"]["h0"]["error"]
    assert f"{workdir / 'releases'}: is a symlink (symlink, owner root, mode 0777)" in error
    assert snapshot(disk) == before


def test_a_workdir_that_is_a_link_is_refused(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    workdir = fleet.hosts[0].workdir
    (tmp_path / "elsewhere").mkdir()
    workdir.symlink_to(tmp_path / "elsewhere")
    code, doc = push_json(["-i", str(fleet.write_inventory())], capsys)
    assert code == 5 and f"{workdir}: is a symlink" in doc["hosts"]["h0"]["error"]
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_releases_of_another_account_is_refused(sshd_fleet, tmp_path, capsys, other_account):
    fleet = sshd_fleet(1)
    workdir = fleet.hosts[0].workdir
    inventory = fleet.write_inventory()
    assert push_json(["-i", str(inventory)], capsys)[0] == 0
    before = snapshot(workdir / "releases")
    os.chown(workdir / "releases", other_account.pw_uid, other_account.pw_gid)
    code, doc = push_json(["-i", str(inventory), "--source", str(make_checkout(tmp_path / "c2", "2")), "--keep", "1"], capsys)
    assert code == 5
    assert f"{workdir / 'releases'}: is owned by another account (folder, owner {other_account.pw_name}, mode 0755)" \
        in doc["hosts"]["h0"]["error"]
    assert snapshot(workdir / "releases") == before


def test_our_releases_edited_or_added_to_since_push_are_kept_and_named(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    releases = fleet.hosts[0].workdir / "releases"
    inventory = fleet.write_inventory()
    ids = []
    for version in "12":
        code, doc = push_json(["-i", str(inventory), "--source", str(make_checkout(tmp_path / f"c{version}", version))], capsys)
        ids.append(doc["release"])
    (releases / ids[0] / "src" / "ddtree" / "tree.py").write_text("X = 2  # tuned by hand\n")
    (releases / ids[1] / "notes.txt").write_text("what I saw\n")
    (releases / ids[1] / "src" / "ddtree" / "__pycache__").mkdir()
    (releases / ids[1] / "src" / "ddtree" / "__pycache__" / "tree.cpython-311.pyc").write_bytes(b"runner's")
    code, doc = push_json(["-i", str(inventory), "--source", str(make_checkout(tmp_path / "c3", "3")), "--keep", "1"], capsys)
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and result["pruned"] == []
    assert result["foreign"] == sorted([f"{ids[0]}: hash mismatch in src/ddtree/tree.py since push",
                                        f"{ids[1]}: unexpected file notes.txt since push"])
    assert (releases / ids[0] / "src" / "ddtree" / "tree.py").read_text() == "X = 2  # tuned by hand\n"
    assert (releases / ids[1] / "notes.txt").read_text() == "what I saw\n"
    (releases / ids[1] / "notes.txt").unlink()  # only bytecode caches beyond the release: ours again
    code, doc = push_json(["-i", str(inventory), "--source", str(tmp_path / "c3"), "--keep", "1"], capsys)
    assert doc["hosts"]["h0"]["result"]["pruned"] == [ids[1]] and not (releases / ids[1]).exists()
