"""`ddtree-ops smoke -H local --stages plugin,decode-bench,sglang-e2e` on a CPU host configured
for it: the `local` host's Python is the CPU test server environment and its `models:` the
tiny target and drafter. The stages run for real (no "no GPU" skip): the plugin's hooks applied
by SGLang's own load_plugins(), real servers compared token for token and every request's
acceptance held against the offline loop, the numbers labelled as CPU numbers; `report` then
holds the server's acceptance against decode-bench's tau and an imported offline baseline, and
draws the budget curve. A lossless drafting fault injected into the CPU server keeps every
token and fails both the stage and `report` (exit 5)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ddtree_ops.cli.app import main

from .cpu_server import cpu_env_python, free_port, write_models

pytestmark = pytest.mark.slow
BUDGET = 16
TOKENS = 16
PROMPTS = 8  # of the pair's 16: each one is a request per server


@pytest.fixture(scope="module")
def cpu_host(tmp_path_factory):
    python = cpu_env_python()
    root = tmp_path_factory.mktemp("cpu-host")
    models = write_models(python, root / "models", trained=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(Path(models["prompts"]).read_text().splitlines(keepends=True)[:PROMPTS]))
    return python, {**models, "prompts": str(prompts)}, root


def smoke(cpu_host, name: str, stages: str, *settings: str, capsys) -> tuple[int, dict, Path]:
    python, models, root = cpu_host
    inventory = root / f"{name}.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(root / f"wd-{name}"), "python": str(python), "models": models}}}))
    runs = root / f"runs-{name}"
    code = main(["smoke", "-i", str(inventory), "--runs-dir", str(runs), "-H", "local", "--stages", stages,
                 "--budgets", str(BUDGET), "--set", f"max_new_tokens={TOKENS}",
                 "--set", f"sglang_max_new_tokens={TOKENS}", "--set", "sglang_start_timeout_s=600",
                 "--set", f"sglang_port={free_port()}", *settings, "--json"])
    doc = json.loads(capsys.readouterr().out)
    return code, doc, runs


def stage_record(runs: Path, doc: dict, stage: str) -> dict:
    return json.loads((runs / doc["run_id"] / "local" / "stages" / f"{stage}.json").read_text())


def offline_baseline(models: dict, path: Path) -> Path:
    """The offline loop's runs on the pair's prompts in the reference's saved-run layout
    (`benchmark.py`: responses of method -> record), for `baseline import`."""
    from ddtree.decode import DecodeConfig, generate_autoregressive, generate_ddtree, generate_dflash
    from ddtree.dflash_drafter import load_dflash_drafter, load_target

    target = load_target(models["target"], "cpu", torch.float32)
    drafter = load_dflash_drafter(models["drafter"], target)
    config = DecodeConfig(max_new_tokens=TOKENS)
    responses = []
    for line in Path(models["prompts"]).read_text().splitlines():
        prompt = torch.tensor([json.loads(line)["input_ids"]])
        responses.append({"baseline": generate_autoregressive(target, prompt, config).to_namespace(),
                          "dflash": generate_dflash(target, drafter, prompt, config).to_namespace(),
                          f"ddtree_tb{BUDGET}": generate_ddtree(target, drafter, prompt, config, BUDGET).to_namespace()})
    torch.save({"responses": responses, "args": {"dataset": "prompts", "model_name_or_path": models["target"],
                                                 "temperature": 0.0}}, path)
    return path


def test_the_stages_run_on_a_cpu_host_and_report_holds_the_server_against_the_offline_numbers(cpu_host, capsys):
    code, doc, runs = smoke(cpu_host, "healthy", "plugin,decode-bench,sglang-e2e", "--set", "sglang_concurrency=[1,2]",
                            capsys=capsys)
    stages = doc["hosts"]["local"]["stages"]
    assert code == 0, (doc["failures"], stages)
    plugin = stage_record(runs, doc, "plugin")
    assert plugin["status"] == "pass", plugin["reason"]
    assert "hooks applied by SGLang's load_plugins()" in plugin["reason"]
    record = stage_record(runs, doc, "sglang-e2e")
    assert record["status"] == "pass", record["reason"]
    assert "CPU numbers" in record["reason"] and "as the offline loop's" in record["reason"]
    rows = {r["variant"]: r for r in record["tables"]["sglang_e2e"]}
    assert list(rows) == ["no-spec", "dflash", f"ddtree-b{BUDGET}"]
    assert all(r["device"] == "cpu" and r["divergent_prompts"] == 0 for r in rows.values())
    for name in ("dflash", f"ddtree-b{BUDGET}"):
        row = rows[name]
        assert row["acceptance_mismatch"] == 0 and row["rounds_held_exactly"] > 0, row
        assert row["acceptance_equal"] + row["acceptance_near_tie"] == PROMPTS
        assert record["metrics"][f"{name}.acceptance_histogram"] == row["acceptance_histogram"]
    assert {r["variant"] for r in record["tables"]["sglang_acceptance"]} == {"dflash", f"ddtree-b{BUDGET}"}
    assert {r["device"] for r in record["tables"]["sglang_load"]} == {"cpu"}
    noise = rows["no-spec"]["margin_noise"]  # how far this server and the offline target were seen to differ
    assert noise["positions"] == PROMPTS * TOKENS and noise["max"] is not None

    plots = runs.parent / "plots-healthy"
    assert main(["report", doc["run_id"], "--runs-dir", str(runs), "--json", "--plot", str(plots)]) == 0
    report = json.loads(capsys.readouterr().out)
    sources = {(c["method"], c["source"]) for c in report["server_vs_offline"]["checks"]}
    assert (f"ddtree_tb{BUDGET}", "decode-bench tau") in sources and ("dflash", "decode-bench tau") in sources
    assert (plots / "server-vs-budget.png").is_file()

    _, models, root = cpu_host
    baseline = root / "offline-baseline.json"
    assert main(["baseline", "import", str(offline_baseline(models, root / "offline.pt")), "-o", str(baseline)]) == 0
    capsys.readouterr()
    assert main(["report", doc["run_id"], "--runs-dir", str(runs), "--json", "--baseline", str(baseline)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any(c["source"].startswith("baseline prompts · target") for c in report["server_vs_offline"]["checks"])


def test_a_lossless_drafting_fault_keeps_the_tokens_and_fails_the_stage_and_report(cpu_host, capsys, monkeypatch):
    monkeypatch.setenv("CPU_TEST_SERVER_FAULT", "shift-depth")  # only the CPU test server reads it
    code, doc, runs = smoke(cpu_host, "fault", "decode-bench,sglang-e2e", "--set", "sglang_concurrency=[1]",
                            "--set", "sglang_requests_per_level=1", capsys=capsys)
    assert code == 5, doc["failures"]
    record = stage_record(runs, doc, "sglang-e2e")
    assert record["status"] == "fail"
    rows = {r["variant"]: r for r in record["tables"]["sglang_e2e"]}
    assert all(r["divergent_prompts"] == 0 for r in rows.values())  # lossless: the same tokens
    assert rows[f"ddtree-b{BUDGET}"]["acceptance_mismatch"] > 0 and rows["dflash"]["acceptance_mismatch"] == 0
    assert f"ddtree-b{BUDGET}: prompt " in record["reason"]
    _, _, root = cpu_host
    logs = root / "wd-fault" / "runs" / doc["run_id"] / "artifacts" / "sglang-e2e"
    assert "fault shift-depth injected" in (logs / f"server-ddtree-b{BUDGET}.log").read_text()
    code = main(["report", doc["run_id"], "--runs-dir", str(runs)])
    err = capsys.readouterr().err
    assert code == 5
    lines = [line for line in err.splitlines() if f"sglang-e2e.acceptance.ddtree_tb{BUDGET} (budget {BUDGET})" in line]
    assert lines and all(line.startswith("ddtree-ops: regression: ") for line in lines), err
    assert "server acceptance length" in lines[0] and "the offline loop" in lines[0]
