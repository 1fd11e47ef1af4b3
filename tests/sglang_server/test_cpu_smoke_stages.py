"""`ddtree-ops smoke -H local --stages plugin,sglang-e2e` on a CPU host configured for it:
the `local` host's Python is the CPU test server environment and its `models:` the tiny
target and drafter. Both stages then run for real (no "no GPU" skip): the plugin's hooks
applied by SGLang's own load_plugins(), and real servers compared token for token, the
numbers labelled as CPU numbers."""
from __future__ import annotations

import json

import pytest
import yaml

from ddtree_ops.cli.app import main

from .cpu_server import cpu_env_python, free_port, write_models

pytestmark = pytest.mark.slow


def test_plugin_and_sglang_e2e_stages_run_on_a_cpu_host(tmp_path, monkeypatch, capsys):
    python = cpu_env_python()
    models = write_models(python, tmp_path / "models")
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(tmp_path / "wd"), "python": str(python), "models": models}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    code = main(["smoke", "-H", "local", "--stages", "plugin,sglang-e2e", "--budgets", "8",
                 "--set", "sglang_concurrency=[1,2]", "--set", "sglang_max_new_tokens=16",
                 "--set", "sglang_start_timeout_s=600", "--set", f"sglang_port={free_port()}", "--json"])
    doc = json.loads(capsys.readouterr().out)
    stages = doc["hosts"]["local"]["stages"]
    assert code == 0, (doc["failures"], stages)
    records = tmp_path / "runs" / doc["run_id"] / "local" / "stages"
    plugin = json.loads((records / "plugin.json").read_text())
    assert plugin["status"] == "pass", plugin["reason"]
    assert "hooks applied by SGLang's load_plugins()" in plugin["reason"]
    record = json.loads((records / "sglang-e2e.json").read_text())
    assert record["status"] == "pass", record["reason"]
    assert "CPU numbers" in record["reason"]
    rows = record["tables"]["sglang_e2e"]
    assert [r["variant"] for r in rows] == ["no-spec", "dflash", "ddtree-b8"]
    assert all(r["device"] == "cpu" and r["divergent_prompts"] == 0 for r in rows)
    assert {r["device"] for r in record["tables"]["sglang_load"]} == {"cpu"}
