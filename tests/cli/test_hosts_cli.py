"""`ddtree-ops hosts list` / `hosts check` through the real CLI entry point (local host)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main


def inventory(tmp_path: Path, hosts: dict) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    return path


def python_without_torch(tmp_path: Path) -> str:
    """A real, empty virtual environment of this Python: no torch in it."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "empty-env")], check=True)
    return str(tmp_path / "empty-env" / "bin" / "python")


def test_list_embedded_inventory(isolated_cwd, capsys):
    assert main(["hosts", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inventory"] == "<embedded default inventory>"
    assert doc["hosts"]["local"]["transport"] == "local"
    assert doc["hosts"]["local"]["python"] == sys.executable


def test_list_table_and_selection(tmp_path, capsys):
    path = inventory(tmp_path, {"a": {"hostname": "a.example.internal", "groups": ["h200"], "port": 2222, "user": "u"},
                                "b": {"groups": ["h200"]}, "local": {"transport": "local"}})
    assert main(["hosts", "list", "-i", str(path), "-H", "h200"]) == 0
    out = capsys.readouterr().out
    assert "u@a.example.internal:2222" in out and "│ b " in out and "│ local " not in out


def test_bad_inventory_is_exit_3_with_one_line(tmp_path, capsys):
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts:\n  gpu-a: {port: x}\n")
    assert main(["hosts", "list", "-i", str(path)]) == 3
    err = capsys.readouterr().err
    assert err == f"ddtree-ops: error: {path}: hosts.gpu-a.port: expected an integer, got 'x'\n"


def test_unknown_host_is_usage_error(tmp_path, capsys):
    path = inventory(tmp_path, {"local": {"transport": "local"}})
    assert main(["hosts", "check", "-i", str(path), "-H", "gpu-z"]) == 2
    assert "no host or group named 'gpu-z'" in capsys.readouterr().err


def test_check_local_reports_facts(tmp_path, capsys):
    path = inventory(tmp_path, {"local": {"transport": "local", "workdir": str(tmp_path / "w")}})
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    facts = json.loads(captured.out)["hosts"]["local"]["result"]
    import platform

    import torch

    assert facts["python"]["version"] == platform.python_version()
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["cuda_available"] == torch.cuda.is_available()
    assert facts["kernel"] == platform.release()
    assert facts["disk"]["free_gib"] > 0
    assert facts["active_release"] is None and facts["release_problem"] is None
    assert "sglang" in facts and "installed" in facts["sglang"]
    assert "local: ok" in captured.err  # progress goes to stderr, never into the JSON
    assert facts["torch"]["imported"] is False  # the default probe finds torch without importing it


def test_check_deep_imports_torch_there(tmp_path, capsys):
    path = inventory(tmp_path, {"local": {"transport": "local", "workdir": str(tmp_path / "w")}})
    assert main(["hosts", "check", "-i", str(path), "--json", "--deep"]) == 0
    import torch

    facts = json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]["torch"]
    assert facts["imported"] is True and facts["version"] == torch.__version__
    assert facts["cuda_available"] == torch.cuda.is_available()
    assert len(facts["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_check_reports_missing_python_and_missing_torch(tmp_path, capsys):
    path = inventory(tmp_path, {
        "good": {"transport": "local", "workdir": str(tmp_path / "w1")},
        "nopython": {"transport": "local", "python": "/nonexistent/env/bin/python3", "workdir": str(tmp_path / "w2")},
        "notorch": {"transport": "local", "python": python_without_torch(tmp_path), "workdir": str(tmp_path / "w3")},
    })
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 6  # partial
    doc = json.loads(capsys.readouterr().out)["hosts"]
    assert doc["good"]["ok"]
    assert doc["nopython"]["error"] == "nopython: python not found at '/nonexistent/env/bin/python3' (set `python:` in the inventory)"
    assert doc["notorch"]["error"].startswith("notorch: torch is not importable by ")
    assert "ModuleNotFoundError" in doc["notorch"]["error"]
    assert doc["notorch"]["result"]["python"]["version"]  # the other facts still came back


def test_check_table(tmp_path, capsys):
    path = inventory(tmp_path, {"local": {"transport": "local", "workdir": str(tmp_path / "w")}})
    assert main(["hosts", "check", "-i", str(path)]) == 0
    out = capsys.readouterr().out
    import torch

    assert torch.__version__ in out and "GiB" in out and "│ ok " in out


def test_check_says_when_the_active_release_is_damaged(tmp_path, capsys):
    path = inventory(tmp_path, {"local": {"transport": "local", "workdir": str(tmp_path / "w")}})
    assert main(["push", "-i", str(path), "--json"]) == 0
    release = json.loads(capsys.readouterr().out)["release"]
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]
    assert (facts["active_release"], facts["release_problem"]) == (release, None)
    (tmp_path / "w" / "releases" / release / "src" / "ddtree" / "tree.py").write_text("edited")
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]
    assert facts["release_problem"] == "hash mismatch in src/ddtree/tree.py"
    from ddtree_ops.cli.hosts import check_row

    assert check_row(facts)[-1] == f"{release} (damaged: hash mismatch in src/ddtree/tree.py; the next push replaces it)"
    assert main(["hosts", "check", "-i", str(path)]) == 0
    assert "damaged" in capsys.readouterr().out
    current = tmp_path / "w" / "current"
    current.unlink()
    current.symlink_to(tmp_path / "elsewhere")
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]
    assert facts["active_release"] is None
    assert facts["release_problem"] == f"current -> {tmp_path / 'elsewhere'}: not a release push made here"


def test_check_names_an_sglang_plugins_list_without_ddtree(tmp_path, capsys, monkeypatch):
    """SGLang skips every plugin SGLANG_PLUGINS does not name: hosts check says so, per host."""
    path = inventory(tmp_path, {"local": {"transport": "local", "workdir": str(tmp_path / "w")}})
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    sglang = json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]["sglang"]
    assert sglang["plugins_env"] == "someone_else"
    assert sglang["plugins_problem"].startswith("SGLANG_PLUGINS='someone_else' does not list ddtree")
    from ddtree_ops.cli.hosts import check_row

    assert "SGLANG_PLUGINS='someone_else' does not list ddtree" in check_row({"sglang": sglang})[4]
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, ddtree")
    assert main(["hosts", "check", "-i", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hosts"]["local"]["result"]["sglang"]["plugins_problem"] is None


# (name, also refused in an Ansible inventory: there a range names the hosts it expands to)
UNADDRESSABLE = [("!prod", True), ("&x", True), ("*", True), ("gpu-*", True), ("gpu?", True), ("gpu-[01:02]", False)]


@pytest.mark.parametrize("name, in_ansible", UNADDRESSABLE)
def test_a_host_no_pattern_can_select_is_refused_at_load_naming_it(tmp_path, capsys, name, in_ansible):
    """#49 item 4: `-H '!prod'` means every host but prod, so a host named `!prod` could never
    be selected alone (it was, with the rest, by that very pattern). Such names, in our
    hosts.yaml and in an Ansible inventory, are refused when the inventory loads: exit 3,
    one line naming the file and the host."""
    ours = tmp_path / "hosts.yaml"
    ours.write_text(yaml.safe_dump({"hosts": {"prod": {"hostname": "prod.invalid"},
                                              name: {"hostname": "other.invalid"}}}))
    ansible = tmp_path / "inventory.yml"
    ansible.write_text(yaml.safe_dump({"all": {"hosts": {"prod": {"ansible_host": "prod.invalid"},
                                                         name: {"ansible_host": "other.invalid"}}}}))
    for inventory in (ours, ansible) if in_ansible else (ours,):
        assert main(["hosts", "list", "-i", str(inventory), "-H", "!prod"]) == 3
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(inventory) in err and repr(name) in err, err
        assert "no -H pattern can select this host alone" in err, err


def test_a_group_no_pattern_can_select_is_refused_at_load(tmp_path, capsys):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"prod": {"hostname": "p.invalid", "groups": ["!gpus"]}}}))
    assert main(["hosts", "list", "-i", str(inventory)]) == 3
    assert "hosts.prod.groups: no -H pattern can select the group '!gpus'" in capsys.readouterr().err
