"""`ddtree-ops report --baseline` with decode baselines, end to end: a real `smoke` run of the
decode-bench stage on the local transport (tiny target + tiny DFlash drafter configured in the
inventory), and baselines written by the real `ddtree-ops baseline import` from torch.save'd
files in the reference's layout."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from ddtree.lossless import TINY_VOCAB, build_tiny_target, save_tiny_dflash_drafter, tiny_dflash_config  # noqa: E402
from ddtree_ops.cli.app import main  # noqa: E402


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory) -> dict:
    """One real smoke run of decode-bench on `local` (one prompt, budgets 4 and 16)."""
    root = tmp_path_factory.mktemp("decode-cli")
    build_tiny_target(seed=0, dtype=torch.float32).model.save_pretrained(root / "tiny-target")
    save_tiny_dflash_drafter(root / "tiny-drafter", tiny_dflash_config())
    prompt = torch.randint(0, TINY_VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    (root / "mini.jsonl").write_text(json.dumps({"input_ids": prompt}) + "\n")
    inventory = root / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(root / "wd"),
        "models": {"target": str(root / "tiny-target"), "drafter": str(root / "tiny-drafter"), "block_size": 6,
                   "prompts": str(root / "mini.jsonl")}}}}))
    runs = root / "runs"
    # 24 new tokens: enough rounds for tau and the lossless check, a tenth of the default's time
    code = main(["smoke", "-i", str(inventory), "--runs-dir", str(runs), "--stages", "decode-bench",
                 "--budgets", "4,16", "--set", "max_new_tokens=24", "--json"])
    assert code == 0
    stage = json.loads(next((runs).glob("*/local/stages/decode-bench.json")).read_text())
    assert stage["status"] == "pass", stage["reason"]
    return {"root": root, "runs": runs, "rows": {r["method"]: r for r in stage["tables"]["methods"]}}


def reference_run_file(path: Path, taus: dict[str, int], dataset: str = "mini", rounds: int = 4) -> Path:
    """A reference-layout run file whose methods accepted `taus[method]` tokens every round."""
    def record(accepted: int):
        return types.SimpleNamespace(
            output_ids=torch.tensor([[1, 2, 3] + [5] * (accepted * rounds)]), num_input_tokens=3,
            num_output_tokens=accepted * rounds, time_to_first_token=0.0, time_per_output_token=0.02 / accepted,
            acceptance_lengths=[accepted] * rounds, decode_rounds=rounds, stage_times={"verify": 1.0},
            round_timestamps=[], round_trees=None)

    torch.save({"responses": [{method: record(tau) for method, tau in taus.items()}], "block_size": 6,
                "draft_attn_implementation": "sdpa", "target_attn_implementation": "sdpa",
                "args": {"dataset": dataset, "model_name_or_path": "local/tiny-target", "temperature": 0.0}}, path)
    return path


def imported(tmp_path: Path, name: str, taus: dict[str, int], capsys, **kw) -> Path:
    out = tmp_path / f"{name}.json"
    assert main(["baseline", "import", str(reference_run_file(tmp_path / f"{name}.pt", taus, **kw)),
                 "-o", str(out)]) == 0
    capsys.readouterr()
    return out


def report(decode_run, capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", "--runs-dir", str(decode_run["runs"]), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_matching_decode_baseline_passes(decode_run, tmp_path, capsys):
    # The random tiny drafter is almost never right: tau ~1 for every method.
    baseline = imported(tmp_path, "ones", {"baseline": 1, "dflash": 1, "ddtree_tb4": 1, "ddtree_tb16": 1}, capsys)
    code, out, _ = report(decode_run, capsys, "--baseline", str(baseline), "--tau-tolerance", "0.5", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["exit_code"] == 0
    section = doc["baseline"]
    assert section["kind"] == "decode" and section["tau_tolerance"] == 0.5 and section["regressions"] == 0
    checks = {c["metric"]: c for c in section["comparisons"]}
    assert checks["decode-bench.tau.ddtree_tb16"]["expected"] == 1.0
    assert checks["decode-bench.tau.ddtree_tb16"]["measured"] == round(decode_run["rows"]["ddtree_tb16"]["tau"], 4)
    assert checks["decode-bench.identical_to_ar.dflash"]["ok"] is True
    code, out, _ = report(decode_run, capsys, "--baseline", str(baseline))
    assert code == 0
    assert "decode-bench vs baseline (tau ± 0.5)" in out and "mini · tiny-target · T=0" in out


def test_a_tau_regression_exits_5_naming_metric_host_expected_and_measured(decode_run, tmp_path, capsys):
    baseline = imported(tmp_path, "better", {"baseline": 1, "dflash": 1, "ddtree_tb16": 3}, capsys)
    code, out, err = report(decode_run, capsys, "--baseline", str(baseline), "--tau-tolerance", "0.25")
    assert code == 5
    tau = decode_run["rows"]["ddtree_tb16"]["tau"]
    assert err.splitlines() == [
        f"ddtree-ops: regression: decode-bench.tau.ddtree_tb16 on local: expected 3 ± 0.25, measured {round(tau, 4):g} "
        f"({tau - 3.0:+.3f}, outside tolerance; baseline mini · tiny-target · T=0)"]
    assert "REGRESSION" in out


def test_a_baseline_for_another_dataset_needs_naming(decode_run, tmp_path, capsys):
    baseline = imported(tmp_path, "gsm", {"baseline": 1, "ddtree_tb4": 1}, capsys, dataset="gsm8k")
    code, _, err = report(decode_run, capsys, "--baseline", str(baseline))
    assert code == 5 and "decode-bench.tau on local: expected a baseline cell, measured mini · tiny-target · " \
                          "T=0 (no such cell in the baseline, which has datasets gsm8k" in err
    code, out, _ = report(decode_run, capsys, "--baseline", str(baseline), "--baseline-dataset", "gsm8k", "--json")
    assert code == 0
    assert {c["metric"] for c in json.loads(out)["baseline"]["comparisons"] if ".tau." in c["metric"]} == {
        "decode-bench.tau.ddtree_tb4"}


def test_plot_overlays_the_baseline(decode_run, tmp_path, capsys):
    baseline = imported(tmp_path, "sweep", {"baseline": 1, "dflash": 1, "ddtree_tb4": 1, "ddtree_tb16": 2}, capsys)
    plots = tmp_path / "plots"
    code, out, _ = report(decode_run, capsys, "--baseline", str(baseline), "--tau-tolerance", "1", "--plot",
                          str(plots), "--json")
    assert code == 0 and json.loads(out)["plots"] == [str(plots / "decode-vs-budget.png")]
    assert (plots / "decode-vs-budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, message", [
    ('{"hosts": {}}', ": not a baseline: expected a metrics baseline (a mapping with a `metrics:` list) or a "
                      "decode baseline written by `ddtree-ops baseline import|paper`"),
    ('{"format": "ddtree-ops-baseline/9"}', ": not a ddtree-ops baseline (format 'ddtree-ops-baseline/9'"),
])
def test_a_file_that_is_neither_kind_exits_3_with_one_line(decode_run, tmp_path, capsys, content, message):
    path = tmp_path / "odd.json"
    path.write_text(content)
    code, out, err = report(decode_run, capsys, "--baseline", str(path))
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and f"{path}{message}" in err


def test_a_reference_run_given_as_baseline_gets_the_import_hint(decode_run, tmp_path, capsys):
    run_file = reference_run_file(tmp_path / "raw.pt", {"baseline": 1})
    code, _, err = report(decode_run, capsys, "--baseline", str(run_file))
    assert code == 3 and "`ddtree-ops baseline import raw.pt -o baseline.json`" in err


def test_decode_options_with_a_metrics_baseline_are_a_usage_error(decode_run, tmp_path, capsys):
    metrics = tmp_path / "m.yaml"
    metrics.write_text(yaml.safe_dump({"metrics": [{"metric": "decode-bench.status", "expected": "pass"}]}))
    code, _, err = report(decode_run, capsys, "--baseline", str(metrics), "--tau-tolerance", "0.1")
    assert code == 2 and "--tau-tolerance applies to a decode baseline" in err
    code, _, _ = report(decode_run, capsys, "--baseline", str(metrics))
    assert code == 0


PAPER_TABLES = Path(__file__).resolve().parents[2] / "baselines"


@pytest.mark.parametrize("table, compared", [
    ("ddtree-paper-table1.csv", {"decode-bench.tau.dflash", "decode-bench.tau.ddtree_best"}),
    ("ddtree-paper-budget-sweep.csv", {"decode-bench.tau.ddtree_tb16"}),
])
def test_the_shipped_paper_tables_load_as_baselines(decode_run, capsys, table, compared):
    """Issue #47: each shipped CSV said "not valid csv" after a JSON parser's error. Named for
    the paper's cell, the run is compared with it (the tiny models' tau is far below: exit 5)."""
    code, out, err = report(decode_run, capsys, "--baseline", str(PAPER_TABLES / table), "--baseline-dataset",
                            "math500", "--baseline-model", "Qwen3-8B", "--json")
    doc = json.loads(out)
    assert code == 5 and doc["baseline"]["kind"] == "decode", err
    assert compared <= {c["metric"] for c in doc["baseline"]["comparisons"]}


def test_the_shipped_histogram_alone_is_refused_with_the_true_reason(decode_run, capsys):
    table = PAPER_TABLES / "ddtree-paper-acceptance-histogram.csv"
    code, out, err = report(decode_run, capsys, "--baseline", str(table))
    assert code == 3 and out == "" and err.count("\n") == 1
    assert f"{table}: the paper's acceptance-length histogram alone has no tau or speedup" in err
    assert "baselines/ddtree-paper.json" in err and "not valid" not in err
