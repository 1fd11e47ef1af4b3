"""The operator side of the one-stream collect: what counts as held, which archive members are
written, and that a file whose sha256 does not match never replaces anything."""
from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from ddtree_ops.errors import quoted
from ddtree_ops.run_fetch import SHA256_PAX_KEY, UnsafeMember, held_files, member_relpath, unpack_stream


def tar_of(members: list[tuple[str, bytes, str | None]]) -> io.BytesIO:
    """(name, data, sha256 header or None) -> an in-memory PAX tar stream."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, digest in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if digest is not None:
                info.pax_headers = {SHA256_PAX_KEY: digest}
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_held_files_are_regular_files_with_size_and_sha256(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.log").write_bytes(b"xyz")
    (tmp_path / "y.json.part").write_bytes(b"partial")  # an interrupted receive: not held
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b" / "x.log")
    (tmp_path / "dirlink").symlink_to(tmp_path / "a")
    assert held_files(tmp_path) == {"a/b/x.log": [3, sha(b"xyz")]}
    assert held_files(tmp_path / "absent") == {}


@pytest.mark.parametrize("name, kind, why", [
    ("../up", tarfile.REGTYPE, "'..' part"),
    ("a//b", tarfile.REGTYPE, "empty"),
    ("./a", tarfile.REGTYPE, "'.'"),
    ("/etc/x", tarfile.REGTYPE, "not a relative path"),
    ("a\\..\\b", tarfile.REGTYPE, "not a relative path"),
    ("dir", tarfile.DIRTYPE, "not a regular file"),
    ("dev", tarfile.CHRTYPE, "not a regular file"),
    ("fifo", tarfile.FIFOTYPE, "not a regular file"),
    ("s", tarfile.SYMTYPE, "is a link"),
    ("h", tarfile.LNKTYPE, "is a link"),
    ("logs/" + "n" * 256 + "/x", tarfile.REGTYPE, "has a part longer than 255 bytes"),  # no folder can hold it
])
def test_unsafe_members_are_named_and_refused(name, kind, why):
    info = tarfile.TarInfo(name)
    info.type = kind
    with pytest.raises(UnsafeMember, match=why) as err:
        member_relpath(info)
    assert quoted(name) in str(err.value)  # the name, cut short when long


def test_a_link_on_the_way_is_refused_and_a_link_at_the_name_is_replaced_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (root / "hop").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "victim")
    stream = tar_of([("ok/new.txt", b"a", sha(b"a")), ("fresh/deeper/new.txt", b"b", sha(b"b")),
                     ("file-link", b"c", sha(b"c")), ("hop/x.txt", b"d", sha(b"d"))])
    outcome = unpack_stream(stream, root)
    assert outcome.fetched == ["ok/new.txt", "fresh/deeper/new.txt", "file-link"]
    assert outcome.local_error == f"{root / 'hop'}: a link on the way to a file we write: refused " \
                                  "(nothing is written through a link)"
    assert (root / "fresh" / "deeper" / "new.txt").read_bytes() == b"b"
    assert not (root / "file-link").is_symlink() and (root / "file-link").read_bytes() == b"c"
    assert list(outside.iterdir()) == []  # nothing written through either link


def test_a_member_whose_sha256_differs_is_reported_and_never_lands(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "kept.txt").write_bytes(b"old")
    stream = tar_of([("new/a.txt", b"fine", sha(b"fine")), ("kept.txt", b"changed", sha(b"something else"))])
    outcome = unpack_stream(stream, root)
    assert (outcome.fetched, outcome.changed, outcome.error) == (["new/a.txt"], ["kept.txt"], None)
    assert (root / "new" / "a.txt").read_bytes() == b"fine"
    assert (root / "kept.txt").read_bytes() == b"old"
    assert sorted(p.name for p in root.rglob("*")) == ["a.txt", "kept.txt", "new"]  # no .part left


def test_a_truncated_stream_keeps_the_complete_files(tmp_path):
    data = tar_of([("one.txt", b"1" * 2000, sha(b"1" * 2000)), ("two.txt", b"2" * 4000, sha(b"2" * 4000))]).getvalue()
    first = 3 * 512 + 2048  # pax header block + its data + tar header + data padded to 512
    outcome = unpack_stream(io.BytesIO(data[:first + 3 * 512 + 1000]), tmp_path)  # cut inside two.txt
    assert outcome.fetched == ["one.txt"] and "broken archive stream" in outcome.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.txt"]  # no two.txt, no .part
    outcome = unpack_stream(io.BytesIO(data[:1000]), tmp_path / "early")  # cut inside one.txt
    assert outcome.fetched == [] and "broken archive stream" in outcome.error


def test_a_stream_past_the_byte_limit_stops_before_the_member_that_crosses_it(tmp_path):
    stream = tar_of([("a.txt", b"a" * 600, sha(b"a" * 600)), ("b.txt", b"b" * 600, sha(b"b" * 600))])
    outcome = unpack_stream(stream, tmp_path, max_bytes=1000)
    assert outcome.fetched == ["a.txt"]
    assert "'b.txt' takes the stream past the limit of 1000 bytes (1 file(s) landed)" in outcome.error
    assert outcome.error.startswith("refused the host's archive")  # a per-host failure, not a retry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # b.txt never written
