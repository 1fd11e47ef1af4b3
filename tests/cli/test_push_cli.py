"""`ddtree-ops push` through the real CLI entry point, on the local transport."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml

from ddtree_ops.cli.app import main
from fixtures.checkout import make_checkout


def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "w")}}}))
    return path


def push_json(args, capsys) -> tuple[int, dict]:
    code = main(["push", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_push_this_checkout_then_noop(tmp_path, capsys):
    inv = inventory(tmp_path)
    code, doc = push_json(["-i", str(inv)], capsys)
    assert code == 0 and doc["exit_code"] == 0
    result = doc["hosts"]["local"]["result"]
    assert result["action"] == "uploaded" and result["bytes_sent"] > 0
    assert result["release"] == doc["release"]
    current = tmp_path / "w" / "current"
    assert Path(doc["source"], "src", "ddtree", "__init__.py").is_file()  # this checkout
    manifest = (current / "MANIFEST.sha256").read_text()
    assert "  src/ddtree/__init__.py\n" in manifest
    for line in manifest.splitlines():
        digest, relpath = line.split("  ", 1)
        assert hashlib.sha256((current / relpath).read_bytes()).hexdigest() == digest
    code, doc = push_json(["-i", str(inv)], capsys)
    assert (code, doc["hosts"]["local"]["result"]["action"], doc["hosts"]["local"]["result"]["bytes_sent"]) == (0, "unchanged", 0)


def test_push_source_and_keep(tmp_path, capsys):
    inv = inventory(tmp_path)
    ids = []
    for version in "123":
        code, doc = push_json(["-i", str(inv), "--source", str(make_checkout(tmp_path / f"c{version}", version)), "--keep", "2"], capsys)
        assert code == 0
        ids.append(doc["release"])
    assert sorted(os.listdir(tmp_path / "w" / "releases")) == sorted(ids[1:])
    assert doc["hosts"]["local"]["result"]["pruned"] == [ids[0]]


def test_push_table_output(tmp_path, capsys):
    assert main(["push", "-i", str(inventory(tmp_path))]) == 0
    captured = capsys.readouterr()
    assert "uploaded" in captured.out and "│ local " in captured.out
    assert "release " in captured.err and "1/1 host(s) ok" in captured.err


def test_bad_source_is_usage_error(tmp_path, capsys):
    assert main(["push", "-i", str(inventory(tmp_path)), "--source", str(tmp_path)]) == 2
    assert "no src/ddtree/__init__.py there" in capsys.readouterr().err


def test_bad_keep_is_usage_error(tmp_path, capsys):
    assert main(["push", "-i", str(inventory(tmp_path)), "--keep", "0"]) == 2
