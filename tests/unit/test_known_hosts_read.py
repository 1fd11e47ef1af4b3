"""known_hosts is parsed once per content, not once per host of a fan-out: the same bytes give
the same parse, and any change (a key appended on first use, a key replaced by one of the same
length within the same clock tick) is parsed again."""
from __future__ import annotations

import subprocess

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.transport import known_hosts


def public_key(tmp_path, name: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    return " ".join((tmp_path / f"{name}.pub").read_text().split()[:2])


def test_parsed_once_per_content_and_again_after_any_change(tmp_path):
    path = tmp_path / "known_hosts"
    one, two = public_key(tmp_path, "one"), public_key(tmp_path, "two")
    path.write_text(f"[127.0.0.1]:2201 {one}\n")
    first = known_hosts.read_known_hosts(str(path), "h0")
    assert known_hosts.read_known_hosts(str(path), "h1") is first  # the same bytes: the same parse
    path.write_text(f"[127.0.0.1]:2201 {two}\n")  # same length, same inode: only the bytes differ
    replaced = known_hosts.read_known_hosts(str(path), "h2")
    assert replaced is not first and replaced.entries[0][1].get_base64() == two.split()[1]
    with path.open("a") as handle:
        handle.write(f"[127.0.0.1]:2202 {one}\n")
    assert len(known_hosts.read_known_hosts(str(path), "h3").entries) == 2
    path.write_text("[127.0.0.1]:2201 ssh-ed25519 not-base64!\n")
    with pytest.raises(ConfigError, match=r"known_hosts:1: known_hosts of host h4: not a known_hosts line"):
        known_hosts.read_known_hosts(str(path), "h4")
