"""A push to a host that keeps an older release sends only the files it lacks, builds the rest
from what it holds (each copy hashed as it is written), and stays atomic: on the local
transport, with the bytes that went to the agent's stdin read back as the tar they were."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import zlib
from pathlib import Path

import pytest

from ddtree_ops.errors import RemoteStepError
from ddtree_ops.inventory import parse_inventory
from ddtree_ops.release import build_bundle
from ddtree_ops.remote_layout import PushAction, asked_lines, ensure_release, plan_push
from ddtree_ops.transport.local import LocalTransport
from fixtures.checkout import make_checkout


def local_host(workdir: Path):
    inv = parse_inventory({"hosts": {"local": {"transport": "local", "workdir": str(workdir),
                                               "python": sys.executable}}}, source="t", base_dir=Path("."))
    return inv.hosts["local"]


class _Tee(io.RawIOBase):
    def __init__(self, source, sink: bytearray):
        self.source, self.sink = source, sink

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        self.sink.extend(data)
        return data


class RecordingTransport(LocalTransport):
    """The local transport, keeping every byte each command read from its stdin."""

    def __init__(self) -> None:
        super().__init__("local")
        self.stdins: list[bytearray] = []

    def run(self, argv, *, stdin=None, **kwargs):
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            self.stdins.append(bytearray())
            stdin = _Tee(stdin, self.stdins[-1])
        return super().run(argv, stdin=stdin, **kwargs)


def files_on_the_wire(stdin: bytes) -> list[str]:
    """The files a push's stdin carried, named by their content: past the agent (length-
    prefixed) and the offer line, a zlib stream of `<size>\n<bytes>` per file; each file's
    sha256 is looked up in the offered manifest."""
    size, _, rest = bytes(stdin).partition(b"\n")
    rest = rest[int(size):]
    offer, _, payload = rest.partition(b"\n")
    by_digest = {line[:64]: line[66:] for line in json.loads(offer)["manifest"].splitlines()}
    stream, names = zlib.decompress(payload) if payload else b"", []
    while stream:
        length, _, stream = stream.partition(b"\n")
        data, stream = stream[:int(length)], stream[int(length):]
        names.append(by_digest[hashlib.sha256(data).hexdigest()])
    return names


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def checkout_with_more(root: Path, version: str, extra: dict[str, str]) -> Path:
    make_checkout(root, version)
    for relpath, text in extra.items():
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / relpath).write_text(text)
    return root


SHARED = {f"src/ddtree/part{i}.py": f"PART = {i}\n" * 50 for i in range(6)}


@pytest.mark.slow
def test_a_host_with_an_older_release_is_sent_only_the_changed_file(tmp_path):
    host, transport = local_host(tmp_path / "w"), RecordingTransport()
    old = build_bundle(checkout_with_more(tmp_path / "a", "1", SHARED))
    new = build_bundle(checkout_with_more(tmp_path / "b", "2", SHARED))  # only __init__.py differs
    first = ensure_release(transport, host, old)
    assert (first.action, first.files_sent, first.files_reused) == (PushAction.UPLOADED, len(old.files), 0)
    assert sorted(files_on_the_wire(transport.stdins[-1])) == sorted(f.relpath for f in old.files)
    outcome = ensure_release(transport, host, new)
    assert files_on_the_wire(transport.stdins[-1]) == ["src/ddtree/__init__.py"]
    assert (outcome.action, outcome.previous) == (PushAction.UPLOADED, old.release_id)
    assert (outcome.files_sent, outcome.files_reused, outcome.reuse_rejected) == (1, len(new.files) - 1, ())
    changed_line = [f.relpath for f in new.files].index("src/ddtree/__init__.py")
    assert outcome.bytes_sent == len(new.files_payload((changed_line,)))
    current = tmp_path / "w" / "current"
    assert os.readlink(current) == f"releases/{new.release_id}"
    assert tree_hashes(current) == {**{f.relpath: f.sha256 for f in new.files},
                                    "MANIFEST.sha256": hashlib.sha256(new.manifest).hexdigest()}
    runner = current / "ddtree_ops" / "hostside" / "runner.py"  # copied from the old release: still executable
    assert stat.S_IMODE(runner.stat().st_mode) == 0o755
    assert stat.S_IMODE((current / "src" / "ddtree" / "part0.py").stat().st_mode) == 0o644
    assert tree_hashes(tmp_path / "w" / "releases" / old.release_id)["src/ddtree/__init__.py"] == \
        hashlib.sha256(b"VERSION = '1'\n").hexdigest()  # the old release is read, never changed


@pytest.mark.slow
def test_a_release_made_of_held_files_only_is_assembled_with_nothing_sent(tmp_path):
    host, transport = local_host(tmp_path / "w"), RecordingTransport()
    bigger = build_bundle(checkout_with_more(tmp_path / "a", "1", SHARED))
    smaller_root = checkout_with_more(tmp_path / "b", "1", SHARED)
    (smaller_root / "src" / "ddtree" / "part5.py").unlink()  # a file removed: every other one is held
    smaller = build_bundle(smaller_root)
    ensure_release(transport, host, bigger)
    plan = plan_push(transport, host, smaller)
    assert (plan.action, plan.files_to_send, plan.bytes_to_send) == ("assemble", 0, 0)
    outcome = ensure_release(transport, host, smaller)
    assert (outcome.action, outcome.files_sent, outcome.bytes_sent) == (PushAction.ASSEMBLED, 0, 0)
    assert files_on_the_wire(transport.stdins[-1]) == []
    assert not (tmp_path / "w" / "current" / "src" / "ddtree" / "part5.py").exists()
    assert ensure_release(transport, host, smaller).action is PushAction.UNCHANGED


@pytest.mark.slow
def test_a_tampered_held_file_is_caught_by_its_copy_hash_and_sent_instead(tmp_path):
    """The old release was edited after it was installed: the copy of that file hashes wrong
    as it is written, so it is not used; the host asks for it, and says which copy it refused."""
    host, transport = local_host(tmp_path / "w"), RecordingTransport()
    old = build_bundle(checkout_with_more(tmp_path / "a", "1", SHARED))
    new = build_bundle(checkout_with_more(tmp_path / "b", "2", SHARED))
    ensure_release(transport, host, old)
    tampered = tmp_path / "w" / "releases" / old.release_id / "src" / "ddtree" / "part3.py"
    tampered.write_text("PART = 'evil'\n")
    plan = plan_push(transport, host, new)
    assert plan.files_to_send == 2  # the plan hashes what it would reuse too
    outcome = ensure_release(transport, host, new)
    assert sorted(files_on_the_wire(transport.stdins[-1])) == ["src/ddtree/__init__.py", "src/ddtree/part3.py"]
    assert outcome.reuse_rejected == (f"{old.release_id}/src/ddtree/part3.py: hash mismatch",)
    assert (outcome.files_sent, outcome.files_reused) == (2, len(new.files) - 2)
    assert (tmp_path / "w" / "current" / "src" / "ddtree" / "part3.py").read_text() == SHARED["src/ddtree/part3.py"]
    assert tampered.read_text() == "PART = 'evil'\n"  # not ours to repair: left, named by prune
    later = build_bundle(checkout_with_more(tmp_path / "c", "3", SHARED))
    assert any(line.startswith(old.release_id) and "hash mismatch" in line
               for line in ensure_release(transport, host, later, keep=1).foreign)


def test_no_link_in_a_held_release_is_followed(tmp_path):
    """A held file replaced by a link (even to the right bytes), or a held folder replaced by a
    link, is not read: those files are sent."""
    host, transport = local_host(tmp_path / "w"), RecordingTransport()
    old = build_bundle(checkout_with_more(tmp_path / "a", "1", SHARED))
    new = build_bundle(checkout_with_more(tmp_path / "b", "2", SHARED))
    ensure_release(transport, host, old)
    held = tmp_path / "w" / "releases" / old.release_id
    right_bytes = tmp_path / "elsewhere.py"
    right_bytes.write_text(SHARED["src/ddtree/part1.py"])
    (held / "src" / "ddtree" / "part1.py").unlink()
    (held / "src" / "ddtree" / "part1.py").symlink_to(right_bytes)
    os.rename(held / "ddtree_ops", tmp_path / "moved")
    (held / "ddtree_ops").symlink_to(tmp_path / "moved")
    outcome = ensure_release(transport, host, new)
    assert sorted(files_on_the_wire(transport.stdins[-1])) == [
        "ddtree_ops/hostside/runner.py", "src/ddtree/__init__.py", "src/ddtree/part1.py"]
    assert all("unreadable" in why for why in outcome.reuse_rejected) and len(outcome.reuse_rejected) == 2
    assert tree_hashes(tmp_path / "w" / "current")["src/ddtree/part1.py"] == \
        hashlib.sha256(SHARED["src/ddtree/part1.py"].encode()).hexdigest()
    assert not (tmp_path / "w" / "current" / "src" / "ddtree" / "part1.py").is_symlink()


def test_a_foreign_folder_named_like_a_release_is_never_a_source(tmp_path):
    """Only releases that bear our mark (a manifest hashing to the folder's name) are read."""
    host, transport = local_host(tmp_path / "w"), RecordingTransport()
    new = build_bundle(checkout_with_more(tmp_path / "b", "2", SHARED))
    impostor = tmp_path / "w" / "releases" / "0123456789abcdef"
    for entry in new.files:
        (impostor / entry.relpath).parent.mkdir(parents=True, exist_ok=True)
        (impostor / entry.relpath).write_bytes(entry.source.read_bytes())
    (impostor / "MANIFEST.sha256").write_bytes(new.manifest)  # the right files, but not its name's manifest
    outcome = ensure_release(transport, host, new)
    assert outcome.files_sent == len(new.files) and outcome.files_reused == 0
    assert outcome.foreign == ("0123456789abcdef: its MANIFEST.sha256 does not hash to its name",)


def test_a_hosts_request_for_files_is_checked(tmp_path):
    bundle = build_bundle(make_checkout(tmp_path / "a"))
    assert asked_lines("h", bundle, {"files": [2, 0]}) == (2, 0)
    for bad in ([3], [-1], [0, 0], ["0"], [True], "all", None):
        with pytest.raises(RemoteStepError, match=r"^h: push: the host asked for files by .*not lines of the 3-line"):
            asked_lines("h", bundle, {"files": bad})


def test_an_offer_whose_manifest_is_not_the_release_is_refused(tmp_path):
    from ddtree_ops.remote_layout import call_agent

    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    one = build_bundle(make_checkout(tmp_path / "a", "1"))
    two = build_bundle(make_checkout(tmp_path / "b", "2"))
    with pytest.raises(RemoteStepError, match=f"offered manifest does not hash to release {one.release_id}"):
        call_agent(transport, host, "push", one.release_id, "5", "5", "1", payload=io.BytesIO(two.offer()))
    with pytest.raises(RemoteStepError, match="does not start with the release offer"):
        call_agent(transport, host, "push", one.release_id, "5", "5", "1", payload=io.BytesIO(b"junk\n"))
    assert not (tmp_path / "w" / "current").exists()


def frames(files: list[bytes]) -> bytes:
    return b"".join(b"%d\n" % len(data) + data for data in files)


@pytest.mark.parametrize("damage, message", [
    (lambda files: zlib.compress(frames(files[:-1] + [files[-1] + b"#"])), "arrived with the wrong sha256"),
    (lambda files: zlib.compress(frames(files))[:-9], "the files sent end inside"),
    (lambda files: zlib.compress(frames(files[:-1])), "the files sent break off before"),
    (lambda files: zlib.compress(frames(files) + b"3\nabc"), "more was sent than the 2 file"),
    (lambda files: frames(files), "not a zlib stream"),
])
def test_files_that_are_not_what_was_asked_for_install_nothing(tmp_path, damage, message):
    """The agent reads exactly the files it asked for: altered, cut short, missing or followed
    by more, nothing is installed and the previous release stays active."""
    from ddtree_ops.remote_layout import call_agent

    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    old = build_bundle(make_checkout(tmp_path / "a", "1"))
    ensure_release(transport, host, old)
    root = make_checkout(tmp_path / "b", "2", smoke=False)
    (root / "src" / "ddtree" / "tree.py").write_text("X = 2\n")
    new = build_bundle(root)  # two files, neither held: both asked for
    files = [f.source.read_bytes() for f in new.files]
    with pytest.raises(RemoteStepError, match=message):
        call_agent(transport, host, "push", new.release_id, "5", "5", "1",
                   payload=io.BytesIO(new.offer() + damage(files)))
    assert os.readlink(tmp_path / "w" / "current") == f"releases/{old.release_id}"
    assert sorted(os.listdir(tmp_path / "w" / "releases")) == [old.release_id]


class AskingTransport(LocalTransport):
    """Runs nothing: says `line` as the agent's stdout, then reads its stdin to the end (as an
    agent waiting for files would) and exits 1. A unit test of the layer above the agent."""

    def __init__(self, line: str):
        super().__init__("h")
        self.line, self.read = line, b""

    def run(self, argv, *, stdin=None, on_stdout_line=None, **kwargs):
        from ddtree_ops.transport.base import CommandResult

        on_stdout_line(self.line)
        self.read = stdin.read()
        return CommandResult("h", tuple(argv), 1, self.line + "\n", "", 0.0)


@pytest.mark.parametrize("line, message", [
    ('{"need": "x", "files": [7]}', r"asked for files by \[7\], not lines of the 3-line manifest"),
    ('{"need": "x", "files": "all"}', "asked for files by 'all'"),
    ('{"need": [[[' + "[" * 100_000, "an unreadable request for files"),
    ('{"need" nonsense', "an unreadable request for files"),
])
def test_a_request_for_files_that_is_not_one_fails_the_push_and_sends_nothing(tmp_path, line, message):
    """The host's request is read on the transport's thread: whatever it holds, nothing is sent
    and the push fails at once with what was wrong (never a wait for the command's timeout)."""
    from ddtree_ops.remote_layout import run_with_release_on_demand

    bundle = build_bundle(make_checkout(tmp_path / "a"))
    transport = AskingTransport(line)
    with pytest.raises(RemoteStepError, match=message):
        run_with_release_on_demand(transport, ["agent"], bundle, timeout=300)
    assert transport.read.endswith(bundle.offer())  # the agent and the offer, and no file


@pytest.mark.slow
def test_current_always_names_a_whole_release_while_a_delta_push_switches(tmp_path, monkeypatch):
    """The switch to a release built from held files is one rename: after every step the agent
    takes on the workdir's links (symlink, replace, unlink), `current` resolves to a release that
    holds every file of its manifest, the old one until the rename and the new one after it."""
    from ddtree_ops.hostside import agent

    host, transport = local_host(tmp_path / "w"), LocalTransport("local")
    old = build_bundle(checkout_with_more(tmp_path / "a", "1", SHARED))
    new = build_bundle(checkout_with_more(tmp_path / "b", "2", SHARED))
    ensure_release(transport, host, old)
    ensure_release(transport, host, new)  # built from old's files: the release the switch goes back to
    ensure_release(transport, host, old)
    current, seen = tmp_path / "w" / "current", []

    def observed(step):
        def run(*args, **kwargs):
            result = step(*args, **kwargs)
            target = os.readlink(current)  # raises if `current` is missing for a moment
            release = current.parent / target
            listed = (release / "MANIFEST.sha256").read_text().splitlines()
            assert all((release / line[66:]).is_file() for line in listed), target
            seen.append(target.split("/")[-1])
            return result
        return run

    for name in ("symlink", "replace", "unlink"):
        monkeypatch.setattr(agent.os, name, observed(getattr(os, name)))
    agent.set_current(str(tmp_path / "w"), new.release_id)
    monkeypatch.undo()
    assert seen == [old.release_id, new.release_id]  # the temporary link made, then renamed over `current`
