"""`push` and `hosts check` over real SSH: several hosts, no-op re-push, a push killed or frozen
half-way, a tampered release, concurrent pushes, hostile names and paths."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.errors import ConnectionLost
from ddtree_ops.release import build_bundle
from ddtree_ops.remote_layout import PushAction, ensure_release
from ddtree_ops.transport.factory import open_transport

from fixtures.checkout import make_checkout
from fixtures.releases import assert_active_and_intact

pytestmark = pytest.mark.sshd


def assert_release_intact(workdir: Path, release_id: str) -> None:
    """Active, its manifest hashes to the id, every file matches (no bundle needed: the
    checkout may change under a running suite)."""
    assert os.readlink(workdir / "current") == f"releases/{release_id}"
    manifest = (workdir / "current" / "MANIFEST.sha256").read_bytes()
    assert hashlib.sha256(manifest).hexdigest()[:16] == release_id
    for line in manifest.decode().splitlines():
        digest, relpath = line.split("  ", 1)
        assert hashlib.sha256((workdir / "current" / relpath).read_bytes()).hexdigest() == digest, relpath


def big_checkout(tmp_path: Path, mib: int = 24) -> Path:
    root = make_checkout(tmp_path / "big", version="big")
    (root / "ddtree_ops" / "hostside" / "weights.bin").write_bytes(os.urandom(mib << 20))  # incompressible: a slow transfer
    return root


def wait_for_incoming(workdir: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    releases = workdir / "releases"
    while time.monotonic() < deadline:
        if releases.is_dir():
            for incoming in releases.glob(".incoming-*"):
                if any(incoming.iterdir()):  # receiving has begun
                    return
        time.sleep(0.005)
    raise AssertionError("the push never started receiving")


def push_json(args, capsys) -> tuple[int, dict]:
    code = main(["push", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_push_to_several_hosts_then_noop(sshd_fleet, capsys):
    fleet = sshd_fleet(3)
    inventory = fleet.write_inventory()
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 0
    for host in fleet.hosts:
        assert doc["hosts"][host.name]["result"]["action"] == "uploaded"
        assert_release_intact(host.workdir, doc["release"])
    code, doc = push_json(["-i", str(inventory), "-H", "fleet"], capsys)
    assert code == 0
    assert {r["result"]["action"] for r in doc["hosts"].values()} == {"unchanged"}
    assert {r["result"]["bytes_sent"] for r in doc["hosts"].values()} == {0}


def test_push_killed_half_way_keeps_previous_and_next_push_converges(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    inventory = fleet.write_inventory()
    host = fleet.hosts[0]
    first = build_bundle(make_checkout(tmp_path / "first"))
    assert push_json(["-i", str(inventory), "--source", str(tmp_path / "first")], capsys)[0] == 0
    big = big_checkout(tmp_path)
    outcome = {}
    pusher = threading.Thread(target=lambda: outcome.update(doc=push_json(["-i", str(inventory), "--source", str(big)], capsys)))
    pusher.start()
    wait_for_incoming(host.workdir)
    host.kill()  # sshd, its session and the receiving agent: like a host crash mid-transfer
    pusher.join(timeout=60)
    code, doc = outcome["doc"]
    assert code == 5 and "connection lost" in doc["hosts"]["h0"]["error"]  # reached, then lost: a failed step
    assert_active_and_intact(host.workdir, first)
    host.start()
    code, doc = push_json(["-i", str(inventory), "--source", str(big)], capsys)
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "uploaded"
    assert_active_and_intact(host.workdir, build_bundle(big))
    assert not list((host.workdir / "releases").glob(".*"))  # the half-received copy was cleaned up


def test_sshd_dying_under_the_agent_leaves_nothing_half_done(sshd_fleet, tmp_path):
    """Only the sshd processes die (the agent lives on and sees its stdin end)."""
    fleet = sshd_fleet(1)
    host = fleet.hosts[0]
    inv_host = fleet.inventory().hosts["h0"]
    first = build_bundle(make_checkout(tmp_path / "first"))
    big = build_bundle(big_checkout(tmp_path))
    with open_transport(inv_host) as transport:
        ensure_release(transport, inv_host, first)
        errors = []
        pusher = threading.Thread(target=lambda: errors.append(pytest.raises(ConnectionLost, ensure_release, transport, inv_host, big)))
        pusher.start()
        wait_for_incoming(host.workdir)
        import signal

        from sshd_fleet import descendants

        sshds = [host.proc.pid] + [p for p in descendants(host.proc.pid) if Path(f"/proc/{p}/comm").read_text().strip().startswith("sshd")]
        for pid in sshds:
            os.kill(pid, signal.SIGKILL)
        pusher.join(timeout=60)
        assert errors
    host.proc.wait(timeout=10)
    host.proc = None
    deadline = time.monotonic() + 60  # polled: the orphaned agent notices EOF, cleans up and exits
    while list((host.workdir / "releases").glob(".incoming-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((host.workdir / "releases").glob(".incoming-*"))
    assert_active_and_intact(host.workdir, first)
    host.start()
    with open_transport(inv_host) as transport:
        assert ensure_release(transport, inv_host, big).action is PushAction.UPLOADED
    assert_active_and_intact(host.workdir, big)


def test_frozen_host_mid_push_is_bounded_and_recovers(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(2)
    # The frozen push: h0 gets a command timeout that only a frozen host runs out of (it must
    # start receiving first: packing 24 MiB takes a few seconds on a busy machine), h1 a long
    # one (it must finish). The pushes before and after it give every host a long one.
    inventory = fleet.write_inventory(host_overrides={"h0": {"command_timeout": 20}, "h1": {"command_timeout": 120}})
    patient = fleet.write_inventory(tmp_path / "patient.yaml", host_overrides={
        "h0": {"command_timeout": 120}, "h1": {"command_timeout": 120}})
    first = build_bundle(make_checkout(tmp_path / "first"))
    assert push_json(["-i", str(patient), "--source", str(tmp_path / "first")], capsys)[0] == 0
    big = big_checkout(tmp_path, mib=24)
    outcome = {}
    pusher = threading.Thread(target=lambda: outcome.update(doc=push_json(["-i", str(inventory), "--source", str(big)], capsys)))
    pusher.start()
    wait_for_incoming(fleet.hosts[0].workdir)
    fleet.hosts[0].freeze()
    try:
        pusher.join(timeout=120)
        code, doc = outcome["doc"]
        h0 = doc["hosts"]["h0"]
        assert h0["state"] == "timed out" and "ran longer than 20s" in h0["error"]
        assert h0["duration_s"] < 100  # bounded by its command_timeout, not a hang
    finally:
        fleet.hosts[0].thaw()
    assert code == 6 and doc["hosts"]["h1"]["ok"]
    assert_active_and_intact(fleet.hosts[1].workdir, build_bundle(big))
    assert_active_and_intact(fleet.hosts[0].workdir, first)
    code, doc = push_json(["-i", str(patient), "--source", str(big)], capsys)
    assert code == 0
    for host in fleet.hosts:
        assert_active_and_intact(host.workdir, build_bundle(big))


def test_tampered_release_is_replaced(sshd_fleet, capsys):
    fleet = sshd_fleet(1)
    inventory = fleet.write_inventory()
    code, doc = push_json(["-i", str(inventory)], capsys)
    assert code == 0
    victim = fleet.hosts[0].workdir / "current" / "src" / "ddtree" / "__init__.py"
    victim.write_text(victim.read_text() + "\nTAMPERED = True\n")
    code, doc = push_json(["-i", str(inventory)], capsys)
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and result["action"] == "uploaded"
    assert result["replaced_broken"] == "hash mismatch in src/ddtree/__init__.py"
    assert_release_intact(fleet.hosts[0].workdir, result["release"])


def test_concurrent_pushes_to_one_host_are_serialised(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    bundles = [build_bundle(make_checkout(tmp_path / f"c{i}", version=str(i))) for i in range(3)]
    errors = []

    def push(bundle):
        try:
            with open_transport(host) as transport:
                ensure_release(transport, host, bundle)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=push, args=(b,)) for b in bundles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    active = os.readlink(fleet.hosts[0].workdir / "current").split("/")[-1]
    assert_active_and_intact(fleet.hosts[0].workdir, next(b for b in bundles if b.release_id == active))
    assert sorted(os.listdir(fleet.hosts[0].workdir / "releases")) == sorted(b.release_id for b in bundles)


def test_hostile_names_and_paths(sshd_fleet, tmp_path, capsys, monkeypatch):
    fleet = sshd_fleet(1)
    nasty = "d d'; $(touch PWNED) `touch PWNED2` \"q\" ;"
    python_dir = tmp_path / nasty
    python_dir.mkdir()
    (python_dir / "py thon").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # keeps the venv
    os.chmod(python_dir / "py thon", 0o755)
    name = "evil host; $(touch PWNED3)"
    entry = {**fleet.host_entry(fleet.hosts[0]), "workdir": str(tmp_path / nasty / "work dir"), "python": str(python_dir / "py thon")}
    inventory = fleet.write_inventory(extra_hosts={name: entry})
    monkeypatch.chdir(tmp_path)
    code, doc = push_json(["-i", str(inventory), "-H", name], capsys)
    assert code == 0, doc
    assert doc["hosts"][name]["result"]["workdir"] == str(tmp_path / nasty / "work dir")
    assert_release_intact(tmp_path / nasty / "work dir", doc["release"])
    assert main(["hosts", "check", "-i", str(inventory), "-H", name, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["hosts"][name]["result"]
    assert facts["active_release"] == doc["release"]
    # Where an injected `touch` would land: here, the account's home (a session's first cwd)
    # and the host's $HOME.
    for folder in (tmp_path, Path.home(), fleet.hosts[0].home):
        for marker in ("PWNED", "PWNED2", "PWNED3"):
            assert not (folder / marker).exists()


def test_check_over_ssh_with_a_host_missing_python(sshd_fleet, capsys):
    fleet = sshd_fleet(2)
    inventory = fleet.write_inventory(host_overrides={"h1": {"python": "/opt/missing env/bin/python3"}})
    assert main(["hosts", "check", "-i", str(inventory), "--json"]) == 6
    doc = json.loads(capsys.readouterr().out)["hosts"]
    import torch

    assert doc["h0"]["result"]["torch"]["version"] == torch.__version__
    assert doc["h0"]["result"]["workdir"] == str(fleet.hosts[0].workdir)
    assert doc["h1"]["error"] == "h1: python not found at '/opt/missing env/bin/python3' (set `python:` in the inventory)"


def test_host_lock_over_ssh_blocks_other_pushes_and_dies_with_its_holder(sshd_fleet, tmp_path):
    from ddtree_ops.errors import HostLocked
    from ddtree_ops.remote_layout import host_lock

    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    bundle = build_bundle(make_checkout(tmp_path / "c1"))
    with open_transport(host) as holder, open_transport(host) as other:
        with host_lock(holder, host, owner="deploy-test"):
            # The lock channel and this push share one connection.
            assert ensure_release(holder, host, bundle, take_lock=False).action is PushAction.UPLOADED
            with pytest.raises(HostLocked, match=r"h0: push: .*/lock is held by deploy-test pid=\d+"):
                ensure_release(other, host, bundle, lock_wait_s=0.5)
        assert ensure_release(other, host, bundle, lock_wait_s=5).action is PushAction.UNCHANGED
    # A holder whose connection dies releases the lock (the kernel drops the flock).
    holder = open_transport(host)
    lock = host_lock(holder, host, owner="doomed")
    lock.__enter__()
    holder.close()
    with open_transport(host) as other:
        assert ensure_release(other, host, bundle, lock_wait_s=10).action is PushAction.UNCHANGED
    lock.__exit__(None, None, None)  # closes our end; the holder thread already saw the loss


def test_fail_fast_and_parallel_through_the_cli(sshd_fleet, capsys):
    from sshd_fleet import free_port

    fleet = sshd_fleet(2)
    dead = {"hostname": "127.0.0.1", "port": free_port(), "workdir": str(fleet.base / "dead")}
    inventory = fleet.write_inventory()
    # Put the dead host first, so with one worker it fails before the others start.
    doc = yaml.safe_load(inventory.read_text())
    doc["hosts"] = {"dead": dead, **doc["hosts"]}
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out = push_json(["-i", str(inventory), "--parallel", "1", "--fail-fast"], capsys)
    assert code == 4
    assert [out["hosts"][n]["state"] for n in ("dead", "h0", "h1")] == ["unreachable", "skipped", "skipped"]
    code, out = push_json(["-i", str(inventory), "--parallel", "1"], capsys)
    assert code == 6
    assert [out["hosts"][n]["state"] for n in ("dead", "h0", "h1")] == ["unreachable", "ok", "ok"]


def test_a_held_lock_is_reported_as_held_even_past_the_command_timeout(sshd_fleet, tmp_path):
    """The lock wait fits inside the command's own time: with a 6 s command timeout a 30 s
    lock wait is cut to 3 s, and the push says who holds the lock rather than 'timed out'
    (the other 3 s are for the agent to start and answer: plenty even on a busy machine)."""
    from ddtree_ops.errors import HostLocked
    from ddtree_ops.remote_layout import host_lock

    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    bundle = build_bundle(make_checkout(tmp_path / "c1"))
    with open_transport(host) as holder, open_transport(host) as other:
        with host_lock(holder, host, owner="long-deploy"):
            started = time.monotonic()
            with pytest.raises(HostLocked, match=r"lock is held by long-deploy pid=\d+ .*\(waited 3s\)"):
                ensure_release(other, host, bundle, lock_wait_s=30, timeout=6)
            assert time.monotonic() - started < 30  # not the full lock wait
