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


def test_a_linked_folder_in_a_pushed_release_is_replaced(tmp_path, capsys):
    inv = inventory(tmp_path)
    code, doc = push_json(["-i", str(inv)], capsys)
    release = tmp_path / "w" / "releases" / doc["release"]
    (tmp_path / "fake_torch").mkdir()
    (release / "src" / "torch").symlink_to(tmp_path / "fake_torch")
    code, doc = push_json(["-i", str(inv)], capsys)
    result = doc["hosts"]["local"]["result"]
    assert (code, result["action"], result["replaced_broken"]) == (0, "uploaded", "unexpected link src/torch")
    assert not (release / "src" / "torch").exists() and (tmp_path / "fake_torch").is_dir()
    (release / "src" / "ddtree" / "tree.py").write_text("edited")
    assert main(["push", "-i", str(inv)]) == 0
    assert "uploaded (replaced a damaged copy: hash mismatch in src/ddtree/tree.py)" in capsys.readouterr().out


def test_current_aimed_outside_the_releases_is_switched_back(tmp_path, capsys):
    import shutil

    inv = inventory(tmp_path)
    code, doc = push_json(["-i", str(inv)], capsys)
    release_id = doc["release"]
    foreign = tmp_path / "other" / "releases" / release_id
    shutil.copytree(tmp_path / "w" / "releases" / release_id, foreign)
    current = tmp_path / "w" / "current"
    current.unlink()
    current.symlink_to(foreign)
    code, doc = push_json(["-i", str(inv)], capsys)
    result = doc["hosts"]["local"]["result"]
    assert (code, result["action"], result["previous"]) == (0, "activated", None)
    assert os.readlink(current) == f"releases/{release_id}"


def test_a_linked_folder_in_the_source_is_refused_not_dropped(tmp_path, capsys):
    checkout = make_checkout(tmp_path / "c", "1")
    real = tmp_path / "real_sub"
    (real).mkdir()
    (real / "__init__.py").write_text("")
    (checkout / "src" / "ddtree" / "sub").symlink_to(real)
    assert main(["push", "-i", str(inventory(tmp_path)), "--source", str(checkout)]) == 2
    err = capsys.readouterr().err
    assert f"{checkout / 'src' / 'ddtree' / 'sub'}: a linked folder" in err
    assert not (tmp_path / "w" / "current").exists()


def test_unprintable_file_names_in_the_source_are_refused(tmp_path, capsys):
    for index, name in enumerate(["line\nbreak.py", "sep\u2028.py", "cr\r.py"]):
        checkout = make_checkout(tmp_path / f"c{index}", "1")
        (checkout / "ddtree_ops" / "hostside" / name).write_text("x")
        assert main(["push", "-i", str(inventory(tmp_path)), "--source", str(checkout)]) == 2
        err = capsys.readouterr().err
        assert "file name holds" in err and "must be printable UTF-8" in err and len(err.strip().splitlines()) == 1
    checkout = make_checkout(tmp_path / "c-bytes", "1")
    with open(os.path.join(os.fsencode(checkout / "ddtree_ops" / "hostside"), b"latin\xe9.py"), "w") as handle:
        handle.write("x")
    assert main(["push", "-i", str(inventory(tmp_path)), "--source", str(checkout)]) == 2
    assert "latin\\udce9.py" in capsys.readouterr().err
