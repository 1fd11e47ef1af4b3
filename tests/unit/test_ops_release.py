"""Release bundles (manifest, id, archive) and the host agent's push protocol, on the local
transport: re-push no-op, tampering, failed verification, pruning, the lock."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from ddtree_ops.errors import HostLocked, RemoteStepError, UsageError
from ddtree_ops.inventory import parse_inventory
from ddtree_ops.release import MANIFEST_NAME, build_bundle
from ddtree_ops.remote_layout import PushAction, call_agent, ensure_release, host_lock, remote_workdir
from ddtree_ops.transport.local import LocalTransport
from fixtures.checkout import make_checkout


def local_host(workdir: Path, python: str = sys.executable):
    inv = parse_inventory({"hosts": {"local": {"transport": "local", "workdir": str(workdir), "python": python}}},
                          source="t", base_dir=Path("."))
    return inv.hosts["local"]


def test_manifest_and_release_id(tmp_path):
    bundle = build_bundle(make_checkout(tmp_path / "c"))
    assert [f.relpath for f in bundle.files] == ["ddtree_ops/hostside/runner.py", "src/ddtree/__init__.py", "src/ddtree/tree.py"]
    assert bundle.release_id == hashlib.sha256(bundle.manifest).hexdigest()[:16]
    lines = bundle.manifest.decode().splitlines()
    assert lines[1] == hashlib.sha256(b"VERSION = '1'\n").hexdigest() + "  src/ddtree/__init__.py"
    same = build_bundle(make_checkout(tmp_path / "d"))
    assert same.release_id == bundle.release_id and same.archive() == bundle.archive()  # content-addressed
    changed = build_bundle(make_checkout(tmp_path / "e", version="2"))
    assert changed.release_id != bundle.release_id
    with tarfile.open(fileobj=io.BytesIO(bundle.archive())) as tar:
        members = tar.getmembers()
    assert members[0].name == MANIFEST_NAME
    assert {m.name: m.mode for m in members}["ddtree_ops/hostside/runner.py"] == 0o755


def test_bundle_without_smoke_and_bad_source(tmp_path):
    bundle = build_bundle(make_checkout(tmp_path / "c", smoke=False))
    assert [f.relpath for f in bundle.files] == ["src/ddtree/__init__.py", "src/ddtree/tree.py"]
    with pytest.raises(UsageError, match=r"--source .*: no src/ddtree/__init__.py there"):
        build_bundle(tmp_path)
    with pytest.raises(UsageError, match="not a directory"):
        build_bundle(tmp_path / "missing")


def test_default_bundle_is_this_checkout():
    bundle = build_bundle()
    assert Path(bundle.source_root, "src", "ddtree", "__init__.py").is_file()
    assert any(f.relpath == "src/ddtree/__init__.py" for f in bundle.files)


@pytest.mark.slow
def test_push_then_noop_then_switch_back(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "c1"))
    two = build_bundle(make_checkout(tmp_path / "c2", version="2"))
    first = ensure_release(transport, host, one)
    assert (first.action, first.previous, first.bytes_sent > 0) == (PushAction.UPLOADED, None, True)
    current = tmp_path / "w" / "current"
    assert os.readlink(current) == f"releases/{one.release_id}"
    assert (current / "src" / "ddtree" / "__init__.py").read_text() == "VERSION = '1'\n"
    again = ensure_release(transport, host, one)
    assert (again.action, again.bytes_sent) == (PushAction.UNCHANGED, 0)
    assert ensure_release(transport, host, two).action is PushAction.UPLOADED
    back = ensure_release(transport, host, one)  # still on the host: activated without sending
    assert (back.action, back.previous, back.bytes_sent) == (PushAction.ACTIVATED, two.release_id, 0)
    assert remote_workdir(transport, host) == str(tmp_path / "w")


@pytest.mark.slow
def test_tampered_release_is_never_activated_and_is_replaced(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "c1"))
    two = build_bundle(make_checkout(tmp_path / "c2", version="2"))
    ensure_release(transport, host, one)
    ensure_release(transport, host, two)
    tampered = tmp_path / "w" / "releases" / one.release_id / "src" / "ddtree" / "tree.py"
    tampered.write_text("X = 666\n")
    outcome = ensure_release(transport, host, one)
    assert outcome.action is PushAction.UPLOADED  # re-sent, not activated as found
    assert outcome.replaced_broken == "hash mismatch in src/ddtree/tree.py"
    assert tampered.read_text() == "X = 1\n"
    # An extra module dropped into a release counts as tampering too (bytecode caches do not).
    (tmp_path / "w" / "releases" / one.release_id / "src" / "ddtree" / "__pycache__").mkdir()
    (tmp_path / "w" / "releases" / one.release_id / "src" / "ddtree" / "__pycache__" / "x.pyc").write_bytes(b"")
    assert ensure_release(transport, host, one).action is PushAction.UNCHANGED
    (tmp_path / "w" / "releases" / one.release_id / "src" / "ddtree" / "evil.py").write_text("")
    assert ensure_release(transport, host, one).replaced_broken == "unexpected file src/ddtree/evil.py"


def test_a_link_where_a_release_belongs_is_replaced_and_a_file_is_refused(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "c1"))
    ensure_release(transport, host, one)
    release = tmp_path / "w" / "releases" / one.release_id
    shutil.rmtree(release)  # the intact copy the last push left
    release.symlink_to(tmp_path / "c1")  # even a folder of the right files is not ours
    outcome = ensure_release(transport, host, one)
    assert outcome.action is PushAction.UPLOADED
    assert outcome.replaced_broken == f"{release}: not a folder"
    assert release.is_dir() and not release.is_symlink() and (tmp_path / "c1" / "src").is_dir()
    assert sorted(p.name for p in release.parent.iterdir()) == [one.release_id]  # nothing set aside is left
    shutil.rmtree(release)
    release.write_text("hi\n")  # a file push never makes: someone's, kept
    with pytest.raises(RemoteStepError, match=rf"local: push: {release}: not a folder, so not a release ddtree-ops installed"):
        ensure_release(transport, host, one)
    assert release.read_text() == "hi\n"


def test_a_folder_where_current_belongs_is_refused_by_name_and_kept(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "c1"))
    ensure_release(transport, host, one)
    current = tmp_path / "w" / "current"
    current.unlink()
    current.mkdir()
    (current / "notes.txt").write_text("the operator's\n")
    with pytest.raises(RemoteStepError, match=rf"local: push: {current}: not a symlink made by ddtree-ops"):
        ensure_release(transport, host, one)
    assert (current / "notes.txt").read_text() == "the operator's\n"
    assert not [p for p in (tmp_path / "w").iterdir() if p.name.startswith(".current.tmp")]


def test_corrupt_archive_is_rejected_and_previous_stays_active(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "c1"))
    two = build_bundle(make_checkout(tmp_path / "c2", version="2"))
    ensure_release(transport, host, one)
    # An archive whose file differs from the manifest it carries.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [(MANIFEST_NAME, two.manifest)] + [(f.relpath, b"bad" if f.relpath.endswith("tree.py") else f.source.read_bytes()) for f in two.files]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    with pytest.raises(RemoteStepError, match="local: install: src/ddtree/tree.py arrived with the wrong sha256"):
        call_agent(transport, host, "install", two.release_id, "5", "5", "1", payload=buffer)
    assert os.readlink(tmp_path / "w" / "current") == f"releases/{one.release_id}"
    assert sorted(os.listdir(tmp_path / "w" / "releases")) == [one.release_id]  # no half release left


@pytest.mark.slow
def test_prune_keeps_newest_and_never_the_active(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    bundles = [build_bundle(make_checkout(tmp_path / f"c{i}", version=str(i))) for i in range(4)]
    for bundle in bundles:
        ensure_release(transport, host, bundle, keep=2)
    kept = sorted(os.listdir(tmp_path / "w" / "releases"))
    assert kept == sorted(b.release_id for b in bundles[2:])
    outcome = ensure_release(transport, host, bundles[3], keep=1)
    assert os.listdir(tmp_path / "w" / "releases") == [bundles[3].release_id]
    assert outcome.pruned == (bundles[2].release_id,)


@pytest.mark.slow
def test_lock_serialises_and_reports_the_holder(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    bundle = build_bundle(make_checkout(tmp_path / "c1"))
    with host_lock(transport, host, owner="deploy-test"):
        with pytest.raises(HostLocked, match=r"local: push: .*/lock is held by deploy-test pid=\d+"):
            ensure_release(transport, host, bundle, lock_wait_s=0.3)
        assert ensure_release(transport, host, bundle, take_lock=False).action is PushAction.UPLOADED
    assert ensure_release(transport, host, bundle, lock_wait_s=0.3).action is PushAction.UNCHANGED


def test_concurrent_pushes_do_not_interleave(tmp_path):
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    bundles = [build_bundle(make_checkout(tmp_path / f"c{i}", version=str(i))) for i in range(2)]
    errors = []

    def push(bundle):
        try:
            ensure_release(transport, host, bundle)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=push, args=(b,)) for b in bundles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    active = os.readlink(tmp_path / "w" / "current").split("/")[-1]
    assert active in {b.release_id for b in bundles}
    for bundle in bundles:
        assert ensure_release(transport, host, bundle).action in (PushAction.UNCHANGED, PushAction.ACTIVATED)


def test_missing_python_is_a_clear_remote_error(tmp_path):
    host = local_host(tmp_path / "w", python="/nonexistent/bin/python3")
    with pytest.raises(RemoteStepError, match=r"local: python not found at '/nonexistent/bin/python3'"):
        remote_workdir(LocalTransport("local"), host)


def test_hostile_workdir(tmp_path):
    workdir = tmp_path / "dd tree's; $(touch pwned) `id` \"q\""
    host, transport = local_host(workdir), LocalTransport("local")
    bundle = build_bundle(make_checkout(tmp_path / "c1"))
    assert ensure_release(transport, host, bundle).workdir == str(workdir)
    assert (workdir / "current" / "src" / "ddtree" / "tree.py").is_file()
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_archive_made_only_when_the_host_asks_and_a_local_failure_is_reported(tmp_path):
    """The archive is built lazily (while the hosts connect); a source file that vanished by
    then is this side's error, raised as such, and the host keeps no half release."""
    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    checkout = make_checkout(tmp_path / "c1")
    bundle = build_bundle(checkout)
    os.remove(checkout / "src" / "ddtree" / "__init__.py")
    with pytest.raises(FileNotFoundError, match="__init__.py"):
        ensure_release(transport, host, bundle)
    releases = tmp_path / "w" / "releases"
    assert not (tmp_path / "w" / "current").exists()
    assert [p.name for p in releases.iterdir()] == []  # the incoming copy was removed
    already = build_bundle(make_checkout(tmp_path / "c2"))
    ensure_release(transport, host, already)
    os.remove(Path(already.source_root) / "src" / "ddtree" / "__init__.py")
    again = ensure_release(transport, host, already)  # on the host already: no archive needed
    assert (again.action, again.bytes_sent) == (PushAction.UNCHANGED, 0)


def test_the_release_names_its_git_commit_and_whether_it_was_dirty(tmp_path):
    import subprocess

    root = make_checkout(tmp_path / "c")
    assert build_bundle(root).git is None  # not a git checkout: nothing claimed

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com",
                               *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (root / ".gitignore").write_text("__pycache__/\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    clean = build_bundle(root)
    assert clean.git.commit == head and clean.git.dirty is False
    assert clean.described == f"{clean.release_id} (git {head[:12]})"
    (root / "src" / "ddtree" / "tree.py").write_text("X = 2\n")
    changed = build_bundle(root)
    assert changed.git.dirty is True and changed.described.endswith(f"(git {head[:12]}, dirty)")
    git("checkout", "-q", "--", "src/ddtree/tree.py")
    (root / "ddtree_ops" / "hostside" / "extra.py").write_text("Y = 1\n")  # untracked, but bundled
    assert build_bundle(root).git.dirty is True
    (root / "ddtree_ops" / "hostside" / "extra.py").unlink()
    (root / "notes.txt").write_text("not bundled\n")  # outside the bundled folders: still clean
    assert build_bundle(root).git.dirty is False
