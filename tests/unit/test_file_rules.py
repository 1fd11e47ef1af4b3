"""The file rules of #49, each once: the bounded reader (ddtree.bounded_files), the YAML reader
built on it (ddtree_ops.yaml_files) and the no-follow writer (ddtree_ops.hostside.safe_write),
on real files, FIFOs, devices and links."""
from __future__ import annotations

import os
import threading

import pytest
from ddtree.bounded_files import FileRefused, nesting_depth, parse_json, read_bytes, read_json, read_text

from ddtree_ops.errors import ConfigError
from ddtree_ops.hostside.safe_write import WriteRefused, make_folders, open_append, replacing, write_file
from ddtree_ops.yaml_files import parse_yaml


def finishes(call, *args, seconds: float = 30):
    """call(*args) in a thread: its result or exception, or a failure if it blocks (a FIFO)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call(*args)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call.__name__}{args} blocked"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("make, why", [
    (lambda p: os.mkfifo(p), "a FIFO, not a regular file: refused"),
    (lambda p: p.mkdir(), "a folder, not a regular file: refused"),
    (lambda p: p.symlink_to("/dev/zero"), "a character device, not a regular file: refused"),
])
def test_only_a_regular_file_is_read_and_a_fifo_never_blocks(tmp_path, make, why):
    path = tmp_path / "handed.json"
    make(path)
    with pytest.raises(FileRefused) as err:
        finishes(read_bytes, path)
    assert str(err.value) == f"{path}: {why}"


def test_size_is_capped_on_the_open_file_and_a_missing_file_is_not_found(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as handle:
        handle.truncate(101)
    with pytest.raises(FileRefused, match=r"big.json: 101 bytes, past the limit of 100: refused"):
        read_bytes(path, max_bytes=100)
    assert read_bytes(path, max_bytes=101) == b"\0" * 101
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "absent.json")
    link = tmp_path / "link.json"
    link.symlink_to(path)  # an operator's own link to a regular file is read through
    assert read_bytes(link, max_bytes=101) == b"\0" * 101


def test_text_is_strict_utf8_and_json_depth_is_bounded(tmp_path):
    path = tmp_path / "x.json"
    path.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(FileRefused, match=r"x.json: not UTF-8 text \(byte 0xe9 at offset 10\)$"):
        read_text(path)
    at_limit, past = "[" * 64 + "]" * 64, "[" * 65 + "]" * 65
    assert nesting_depth(parse_json(at_limit, "w")) == 64
    for text in (past, "[" * 100_000 + "]" * 100_000, '{"a":' * 70 + "1" + "}" * 70):
        with pytest.raises(FileRefused, match=r"^w: values nested deeper than 64 levels: refused$"):
            parse_json(text, "w")
    path.write_text('{"a": [1, 2,}')
    with pytest.raises(FileRefused, match=r"x.json: not JSON: Expecting value: line 1 column 13"):
        read_json(path)


# ------------------------------------------------------------------------------ YAML


def test_yaml_merge_keys_merge_and_the_mappings_own_keys_win():
    text = "base: &b {a: 1, b: 2}\nmore: &m {c: 3}\nx: {<<: [*b, *m], b: 20}\ny:\n  <<: *b\n  a: 10\n"
    data = parse_yaml(text, "f.yaml")
    assert data["x"] == {"a": 1, "b": 20, "c": 3} and data["y"] == {"a": 10, "b": 2}


@pytest.mark.parametrize("text, message", [
    ("x: {a: 1, a: 2}\n", "f.yaml: line 1: 'a': duplicate key (the later entry would win)"),
    ("x:\n  <<: {a: 1}\n  b: 1\n  b: 2\n", "f.yaml: line 4: 'b': duplicate key (the later entry would win)"),
    ("x: " + "[" * 65 + "]" * 65 + "\n", "f.yaml: line 1: values nested deeper than 64 levels"),
    ("x: " + "[" * 50_000 + "]" * 50_000 + "\n", "f.yaml: line 1: values nested deeper than 64 levels"),
    ("x: &a [1, *a]\n", "f.yaml: line 1: an alias refers to the value that contains it"),
    ("x: {<<: 3}\n", "f.yaml: line 1: invalid YAML: expected a mapping or list of mappings for merging, but found scalar"),
])
def test_yaml_refusals_name_file_and_line(text, message):
    with pytest.raises(ConfigError) as err:
        parse_yaml(text, "f.yaml")
    assert str(err.value) == message


# ------------------------------------------------------------------------------ writing


def test_a_link_on_the_way_is_refused_and_nothing_lands_behind_it(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (root / "run").mkdir(parents=True)
    (root / "run" / "host").symlink_to(outside)
    (root / "file").write_text("x")
    for relpath, where, why in (
            (["run", "host", "run.json"], root / "run" / "host",
             "a link on the way to a file we write: refused (nothing is written through a link)"),
            (["run", "host", "deeper", "x.json"], root / "run" / "host",
             "a link on the way to a file we write: refused (nothing is written through a link)"),
            (["file", "x.json"], root / "file", "a regular file where a folder belongs: refused")):
        with pytest.raises(WriteRefused) as err:
            write_file(root, relpath, "{}")
        assert str(err.value) == f"{where}: {why}"
        with pytest.raises(WriteRefused):
            open_append(root, relpath)
    with pytest.raises(WriteRefused, match="a link on the way"):
        make_folders(root, ["run", "host", "stages"])
    assert list(outside.iterdir()) == []
    with pytest.raises(WriteRefused, match="not a relative path of plain names"):
        write_file(root, ["run", "..", "x"], "{}")


def test_a_link_at_the_name_is_replaced_never_followed_and_an_append_refuses_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "run.json").symlink_to(victim)
    write_file(root, "run.json", '{"ok": 1}\n')
    assert victim.read_text() == "keep\n" and not (root / "run.json").is_symlink()
    assert (root / "run.json").read_text() == '{"ok": 1}\n'
    (root / "events.jsonl").symlink_to(victim)
    with pytest.raises(WriteRefused, match=r"events.jsonl: a link on the way to a file we write: refused"):
        open_append(root, "events.jsonl")
    os.mkfifo(root / "output.log")  # nobody reads it: opening it to write would block
    with pytest.raises(WriteRefused, match=r"output.log: a FIFO where a file belongs: refused"):
        finishes(open_append, root, "output.log")
    assert victim.read_text() == "keep\n"


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "kept.json").write_text("old")
    with pytest.raises(RuntimeError):
        with replacing(tmp_path, "kept.json") as out:
            out.write(b"half")
            raise RuntimeError("the source broke")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    assert (tmp_path / "kept.json").read_text() == "old"
    (tmp_path / "folder").mkdir()
    with pytest.raises(WriteRefused, match=r"folder: a folder where the file belongs: refused"):
        write_file(tmp_path, "folder", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "kept.json"]


def test_a_folder_that_cannot_be_made_is_refused_naming_it(tmp_path):
    long = "n" * 300  # past NAME_MAX: no file system takes it
    with pytest.raises(WriteRefused) as err:
        write_file(tmp_path, [long, "x.json"], "{}")
    assert str(err.value) == f"{tmp_path / long}: cannot create the folder: File name too long"


def test_a_manifest_nested_past_the_limit_is_a_value_error_naming_it():
    """Manifests travel to the host's gate as text (deploy) and are parsed there: one nested
    100,000 deep is a one-line ValueError, never a RecursionError out of the gate."""
    from ddtree.sglang.manifests import parse_manifests

    with pytest.raises(ValueError, match=r"^sglang-9\.9\.9\.json: manifest: values nested deeper than 64 levels"):
        parse_manifests({"sglang-9.9.9.json": "[" * 100_000 + "]" * 100_000})
