"""`push` sends each host only the files it lacks, over real SSH: hosts with different histories
get different files in one push, and a push killed while the missing files arrive leaves the
previous release active and intact; the next push converges."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.release import build_bundle
from fixtures.checkout import make_checkout
from fixtures.releases import assert_active_and_intact

pytestmark = pytest.mark.sshd


def push_json(args, capsys) -> tuple[int, dict]:
    code = main(["push", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def checkout(root: Path, version: str, big_mib: int = 0) -> Path:
    make_checkout(root, version)
    for i in range(4):
        (root / "src" / "ddtree" / f"part{i}.py").write_text(f"PART = {i}\n" * 40)
    if big_mib:
        (root / "ddtree_ops" / "hostside" / "weights.bin").write_bytes(os.urandom(big_mib << 20))  # a slow transfer
    return root


def test_each_host_is_sent_what_it_lacks(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(2)
    inventory = fleet.write_inventory()
    old, new = checkout(tmp_path / "old", "1"), checkout(tmp_path / "new", "2")
    assert push_json(["-i", str(inventory), "-H", "h0", "--source", str(old)], capsys)[0] == 0
    code, doc = push_json(["-i", str(inventory), "--source", str(new)], capsys)
    assert code == 0, doc
    files = build_bundle(new).files
    h0, h1 = doc["hosts"]["h0"]["result"], doc["hosts"]["h1"]["result"]
    assert (h0["action"], h0["files_sent"], h0["files_reused"]) == ("uploaded", 1, len(files) - 1)
    assert (h1["action"], h1["files_sent"], h1["files_reused"]) == ("uploaded", len(files), 0)
    assert 0 < h0["bytes_sent"] < h1["bytes_sent"]
    for host in fleet.hosts:
        assert_active_and_intact(host.workdir, build_bundle(new))


def wait_for_partial(workdir: Path, name: str, timeout: float = 120) -> None:
    """Until a file called `name` has begun to arrive in a release being received."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in (workdir / "releases").glob(f".incoming-*/**/{name}")):
            return
        time.sleep(0.005)
    raise AssertionError(f"{name} never started arriving")


def test_a_push_killed_mid_delta_leaves_the_previous_release_and_the_next_converges(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    host = fleet.hosts[0]
    inventory = fleet.write_inventory()
    old = checkout(tmp_path / "old", "1")
    assert push_json(["-i", str(inventory), "--source", str(old)], capsys)[0] == 0
    new = checkout(tmp_path / "new", "2", big_mib=24)
    outcome = {}
    pusher = threading.Thread(target=lambda: outcome.update(doc=push_json(["-i", str(inventory), "--source", str(new)],
                                                                          capsys)))
    pusher.start()
    wait_for_partial(host.workdir, "weights.bin")  # the held files are copied by now; the new ones arriving
    host.kill()  # sshd, its session and the agent: a crash mid-transfer
    pusher.join(timeout=60)
    code, doc = outcome["doc"]
    assert code == 5 and "connection lost" in doc["hosts"]["h0"]["error"]
    assert_active_and_intact(host.workdir, build_bundle(old))
    assert sorted(p.name for p in (host.workdir / "releases").iterdir() if not p.name.startswith(".")) == \
        [build_bundle(old).release_id]  # no half release under a release name
    host.start()
    code, doc = push_json(["-i", str(inventory), "--source", str(new)], capsys)
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and (result["action"], result["files_sent"]) == ("uploaded", 2)  # __init__.py + weights.bin
    assert_active_and_intact(host.workdir, build_bundle(new))
    assert not list((host.workdir / "releases").glob(".*"))  # the killed push's leftover was cleaned up
