"""`push --dry-run` (`--check`) on real sshd hosts: per host what would be sent, activated,
replaced and pruned, and the size; nothing on the host changes (not even a folder made), and
the real push then does exactly what the plan said."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from fixtures.checkout import make_checkout

pytestmark = pytest.mark.sshd


def tree_state(root: Path) -> dict[str, tuple]:
    """Every path under root: kind, mode, mtime, size and content hash (links: their target)."""
    state: dict[str, tuple] = {}
    if not root.exists():
        return state
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if path.is_symlink():
                state[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif path.is_file():
                state[str(path.relative_to(root))] = ("file", st.st_mode, st.st_mtime_ns, st.st_size,
                                                      hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                state[str(path.relative_to(root))] = ("dir", st.st_mode, st.st_mtime_ns)
    st = root.lstat()
    state["."] = ("dir", st.st_mode, st.st_mtime_ns)
    return state


def push(capsys, inventory: Path, source: Path, *args: str) -> tuple[int, dict]:
    code = main(["push", "-i", str(inventory), "--source", str(source), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_dry_run_on_a_fresh_host_makes_nothing_and_says_upload_with_the_size(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(2)
    inventory = fleet.write_inventory()
    source = make_checkout(tmp_path / "a", version="a")
    code, doc = push(capsys, inventory, source, "--check")
    assert code == 0, doc
    assert doc["dry_run"] is True
    for host in fleet.hosts:
        plan = doc["hosts"][host.name]["result"]
        assert plan["action"] == "upload" and plan["previous"] is None and plan["pruned"] == []
        assert plan["bytes_to_send"] > 0
        assert not host.workdir.exists()  # not even the workdir was made
    code, pushed = push(capsys, inventory, source)
    assert code == 0
    assert {h: r["result"]["bytes_sent"] for h, r in pushed["hosts"].items()} == \
        {h: r["result"]["bytes_to_send"] for h, r in doc["hosts"].items()}


def test_dry_run_names_what_would_be_pruned_and_replaced_touches_nothing_and_the_push_agrees(
        sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    host = fleet.hosts[0]
    inventory = fleet.write_inventory()
    sources = [make_checkout(tmp_path / v, version=v) for v in "abcd"]
    ids = []
    for source in sources[:3]:
        code, doc = push(capsys, inventory, source, "--keep", "3")
        assert code == 0
        ids.append(doc["release"])
    # the active release (c): nothing to do
    code, doc = push(capsys, inventory, sources[2], "--dry-run", "--keep", "2")
    plan = doc["hosts"]["h0"]["result"]
    assert (plan["action"], plan["bytes_to_send"], plan["previous"]) == ("unchanged", 0, ids[2])
    assert plan["pruned"] == [ids[0]]  # keep 2: c (active) and b
    # a new release with --keep 2: uploads it, keeps it and c, prunes b and a
    before = tree_state(host.workdir)
    code, doc = push(capsys, inventory, sources[3], "--dry-run", "--keep", "2")
    assert code == 0, doc
    plan = doc["hosts"]["h0"]["result"]
    assert plan["action"] == "upload" and plan["previous"] == ids[2]
    assert sorted(plan["pruned"]) == sorted(ids[:2])
    assert tree_state(host.workdir) == before  # byte for byte, mtimes included
    # b, damaged: a dry run says it would replace it, and still touches nothing
    victim = next((host.workdir / "releases" / ids[1] / "src").rglob("*.py"))
    victim.write_text(victim.read_text() + "# edited\n")
    before = tree_state(host.workdir)
    code, doc = push(capsys, inventory, sources[1], "--check", "--keep", "2")
    plan = doc["hosts"]["h0"]["result"]
    assert plan["action"] == "upload" and "hash mismatch" in plan["replaces_broken"], plan
    assert plan["bytes_to_send"] > 0
    assert tree_state(host.workdir) == before
    # the real push of d does what the plan of d says now
    code, doc = push(capsys, inventory, sources[3], "--check", "--keep", "2")
    plan = doc["hosts"]["h0"]["result"]
    code, pushed = push(capsys, inventory, sources[3], "--keep", "2")
    result = pushed["hosts"]["h0"]["result"]
    assert code == 0 and result["action"] == "uploaded" and result["bytes_sent"] == plan["bytes_to_send"]
    assert result["pruned"] == plan["pruned"] == [ids[0]]  # b was edited since push: left, not pruned
    assert result["foreign"] == plan["foreign"] and any(line.startswith(ids[1]) for line in plan["foreign"])
