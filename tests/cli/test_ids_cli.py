"""Hostile run ids on the command line (exit 2, one line), in a local run record (exit 3), and
release ids sent back by a host (a per-host failure naming the host: exit 5)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main

HOSTILE_RUN_IDS = ["../x", "a/b", "", ".", "..", "x" * 200, "../../etc/passwd"]


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "wd")}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    # A real run next door, so that "" can never fall back to "the latest run".
    (tmp_path / "runs" / "20261130-000000-aaaaaa").mkdir(parents=True)
    (tmp_path / "runs" / "20261130-000000-aaaaaa" / "run.json").write_text('{"hosts": []}')
    return tmp_path


@pytest.mark.parametrize("command", ["collect", "report"])
@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS, ids=lambda v: repr(v)[:20])
def test_a_hostile_run_id_argument_is_a_usage_error(env, capsys, command, run_id):
    assert main([command, run_id]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree-ops: error: run id ") and err.count("\n") == 1
    assert "expected 1-128 letters, digits" in err
    assert not (env / "x").exists() and not (env / "runs" / "..").resolve().joinpath("x").exists()


def test_a_hostile_host_name_in_a_run_record_is_a_config_error(env, capsys):
    run = env / "runs" / "20261130-000001-bbbbbb"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"hosts": ["../../outside"]}))
    assert main(["report", run.name]) == 3
    err = capsys.readouterr().err
    assert f"{run / 'run.json'}: hosts: unsafe host name '../../outside'" in err


FAKE_AGENT = """#!{python}
# A host whose agent names a hostile release id in its reply (whatever it is asked).
import json, sys
op = sys.argv[4]
replies = {{
    "push": {{"ok": True, "status": "activated", "previous": {bad!r}, "workdir": "/w", "pruned": []}},
    "probe": {{"ok": True, "hostname": "h", "os": "x", "kernel": "k", "python": {{"version": "3", "executable": "p"}},
              "torch": {{"installed": False}}, "sglang": {{"installed": False}}, "disk": {{"path": "/", "free_gib": 1}},
              "workdir": "/w", "active_release": {bad!r}}},
}}
print(json.dumps(replies[op]))
"""


@pytest.mark.parametrize("bad", ["../../etc", "a/b", "", "x" * 300])
def test_a_hostile_release_id_from_a_host_fails_that_host(env, capsys, tmp_path, bad):
    agent = tmp_path / "fake-python"
    agent.write_text(FAKE_AGENT.format(python=sys.executable, bad=bad))
    agent.chmod(0o755)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"liar": {"transport": "local", "python": str(agent),
                                                            "workdir": str(tmp_path / "wd")}}}))
    for command, where in ((["push"], "push: previous"), (["hosts", "check"], "probe: active_release")):
        assert main([*command, "--json"]) == 5
        doc = json.loads(capsys.readouterr().out)
        error = doc["hosts"]["liar"]["error"]
        assert error.startswith(f"liar: {where}: unsafe release id {repr(bad)[:20]}")
        assert "\n" not in error
