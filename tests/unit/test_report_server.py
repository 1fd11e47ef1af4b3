"""`report` holds the server's acceptance against the offline numbers (report/server_checks.py):
per host, method and budget, sglang-e2e's acceptance beside the stage's own offline loop,
the same host's decode-bench tau and a decode baseline's cell; below one of them beyond the
tolerance: exit 5, naming method, budget and both numbers. The run records here hold rows in
the shape the stages write (the real stages run in tests/sglang_server/test_cpu_smoke_stages.py)."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event
from ddtree_ops.results import RunStore


def server_row(variant, method, budget, server, offline, block_size=None, **extra):
    return {"variant": variant, "method": method, "budget": budget, "block_size": block_size, "device": "cpu",
            "dataset": "prompts", "model": "target", "temperature": 0.0, "tokens": 96, "tokens_per_s": 40.0,
            "acceptance_length": server, "offline_acceptance_length": offline, "acceptance_equal": 6,
            "acceptance_near_tie": 2, "acceptance_mismatch": 0, "acceptance_histogram": [10, 4],
            "offline_acceptance_histogram": [9, 5], "histogram_distance": 0.07, **extra}


def load_row(variant, mode, budget, concurrency, tokens_per_s):
    return {"variant": variant, "mode": mode, "budget": budget, "concurrency": concurrency,
            "tokens_per_s": tokens_per_s, "acceptance_length": 1.2, "device": "cpu"}


def decode_row(method, budget, tau):
    return {"dataset": "prompts", "model": "target", "temperature": 0.0, "method": method, "budget": budget,
            "tau": tau, "speedup": 1.0, "time_per_output_token": 0.01, "histogram": {}, "requests": 8,
            "identical_to_ar": 1.0, "source": "decode-bench on local"}


def record(root: Path, stages: dict[str, dict]) -> Path:
    store = RunStore(root)
    store.create_run("r1", {"hosts": ["local"], "stages": list(stages)})
    recorder = store.host_recorder("r1", "local", {})
    recorder.feed_line(encode_event(make_event(EventKind.RUN_START, "r1", "local", stages=list(stages))))
    for index, (stage, tables) in enumerate(stages.items()):
        recorder.feed_line(encode_event(make_event(EventKind.STAGE_END, "r1", "local", stage=stage, index=index,
                                                   duration_s=1.0, traceback=None, status="pass", reason="",
                                                   metrics={}, tables=tables)))
    recorder.feed_line(encode_event(make_event(EventKind.RUN_END, "r1", "local", status="pass")))
    recorder.close()
    return root


def e2e_tables(ddtree16: float, offline16: float):
    return {"sglang_e2e": [
        {"variant": "no-spec", "method": None, "budget": None, "acceptance_length": None, "device": "cpu"},
        server_row("dflash", "dflash", None, 1.30, 1.30),
        server_row("ddtree-b4", "ddtree_tb4", 4, 1.40, 1.40, block_size=5),
        server_row("ddtree-b16", "ddtree_tb16", 16, ddtree16, offline16)],
        "sglang_load": [load_row("no-spec", "no-spec", None, 1, 50.0), load_row("dflash", "dflash", None, 1, 45.0),
                        load_row("ddtree-b4", "ddtree", 4, 1, 44.0), load_row("ddtree-b16", "ddtree", 16, 1, 42.0)]}


def decode_tables(tau16: float):
    return {"methods": [decode_row("baseline", None, 1.0), decode_row("dflash", None, 1.32),
                        decode_row("ddtree_tb4", 4, 2.9), decode_row("ddtree_tb16", 16, tau16)]}


def report(runs: Path, capsys, *args: str) -> tuple[int, dict, str]:
    code = main(["report", "--runs-dir", str(runs), "--json", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_a_server_accepting_what_the_offline_numbers_say_passes(tmp_path, capsys):
    runs = record(tmp_path / "runs", {"decode-bench": decode_tables(1.6), "sglang-e2e": e2e_tables(1.55, 1.6)})
    code, doc, _ = report(runs, capsys)
    assert code == 0
    found = doc["server_vs_offline"]
    checks = {(c["method"], c["source"]): c for c in found["checks"]}
    assert checks[("ddtree_tb16", "decode-bench tau")]["offline"] == 1.6
    assert checks[("ddtree_tb16", "the offline loop on the server's text")]["ok"]
    # budget 4 was served with a draft block of 5: only the stage's offline loop (same block) judges it
    assert ("ddtree_tb4", "decode-bench tau") not in checks and ("ddtree_tb4", "the offline loop on the server's text") in checks
    assert found["notes"] == ["local: ddtree_tb4 was served with a draft block of 5 (budget + 1): "
                              "held against the stage's offline loop only"]
    rows = {r["method"]: r for r in found["rows"]}
    assert rows["ddtree_tb16"]["decode_bench_tau"] == 1.6 and rows["ddtree_tb16"]["verdict"] == "ok"


def test_a_server_below_the_offline_loop_and_decode_bench_is_a_regression_naming_both_numbers(tmp_path, capsys):
    runs = record(tmp_path / "runs", {"decode-bench": decode_tables(2.4), "sglang-e2e": e2e_tables(1.2, 2.4)})
    code, doc, err = report(runs, capsys)
    assert code == 5
    assert doc["server_vs_offline"]["regressions"] == 2
    lines = [line for line in err.splitlines() if line.startswith("ddtree-ops: regression: sglang-e2e")]
    assert lines == [
        "ddtree-ops: regression: sglang-e2e.acceptance.ddtree_tb16 (budget 16) on local: server acceptance length "
        "1.200, the offline loop on the server's text 2.400 (-1.200, below the tolerance 0.5)",
        "ddtree-ops: regression: sglang-e2e.acceptance.ddtree_tb16 (budget 16) on local: server acceptance length "
        "1.200, decode-bench tau 2.400 (-1.200, below the tolerance 0.5)"]
    code, _, _ = report(runs, capsys, "--acceptance-tolerance", "1.5")
    assert code == 0


def test_a_decode_baseline_cell_judges_the_server_too(tmp_path, capsys):
    import torch

    def reference(tau: int):
        return types.SimpleNamespace(
            output_ids=torch.tensor([[1, 2] + [5] * (tau * 4)]), num_input_tokens=2, num_output_tokens=tau * 4,
            time_to_first_token=0.0, time_per_output_token=0.01, acceptance_lengths=[tau] * 4, decode_rounds=4,
            stage_times={"verify": 1.0}, round_timestamps=[], round_trees=None)

    run_file = tmp_path / "offline.pt"
    torch.save({"responses": [{"baseline": reference(1), "dflash": reference(1), "ddtree_tb16": reference(3)}],
                "args": {"dataset": "held-out", "model_name_or_path": "x/tiny", "temperature": 0.0}}, run_file)
    assert main(["baseline", "import", str(run_file), "-o", str(tmp_path / "base.json")]) == 0
    runs = record(tmp_path / "runs", {"sglang-e2e": e2e_tables(1.55, 1.6)})  # no decode-bench in this run
    code, doc, err = report(runs, capsys, "--baseline", str(tmp_path / "base.json"),
                            "--baseline-dataset", "held-out", "--baseline-model", "tiny")
    assert code == 5
    assert "baseline held-out · tiny tau 3.000 (-1.450, below the tolerance 0.5)" in err
    assert not any("measured decode-bench" in c.get("why", "") for c in doc["baseline"]["comparisons"])
    code, doc, err = report(runs, capsys, "--baseline", str(tmp_path / "base.json"))
    assert code == 0 and "no sglang-e2e row matched a cell of the baseline" in doc["server_vs_offline"]["notes"][-1]


@pytest.mark.slow  # matplotlib draws
def test_the_table_and_the_budget_curve_beside_the_papers(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = record(tmp_path / "runs", {"decode-bench": decode_tables(1.6), "sglang-e2e": e2e_tables(1.55, 1.6)})
    assert main(["report", "--runs-dir", str(runs), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "sglang-e2e acceptance vs offline (tolerance 0.5 below)" in out and "local (CPU)" in out
    chart = tmp_path / "plots" / "server-vs-budget.png"
    assert chart.is_file() and chart.stat().st_size > 10_000


def test_requests_accepted_otherwise_without_a_near_tie_are_a_regression_whatever_the_means(tmp_path, capsys):
    tables = e2e_tables(1.3, 1.32)
    tables["sglang_e2e"][3]["acceptance_mismatch"] = 2  # the stage's per-request verdicts
    runs = record(tmp_path / "runs", {"sglang-e2e": tables})
    code, doc, err = report(runs, capsys)
    assert code == 5
    assert ("ddtree-ops: regression: sglang-e2e.acceptance.ddtree_tb16 (budget 16) on local: 2 of 10 request(s) "
            "accepted otherwise than the offline loop on the same prompt, with no near-tie to explain it (server "
            "acceptance length 1.300, the offline loop's 1.320)") in err.splitlines()
    assert doc["server_vs_offline"]["rows"][2]["verdict"] == "regression"


def test_a_server_row_with_a_key_of_the_wrong_kind_is_left_out_and_named(tmp_path, capsys):
    tables = e2e_tables(1.55, 1.6)
    tables["sglang_e2e"][3]["budget"] = "16"  # a host's record may hold anything
    runs = record(tmp_path / "runs", {"sglang-e2e": tables})
    code, doc, _ = report(runs, capsys)
    assert [r["method"] for r in doc["server_vs_offline"]["rows"]] == ["dflash", "ddtree_tb4"]
    assert any(f["reason"] == "sglang_e2e[3].budget: expected an integer or null, got '16' (the row is left out)"
               for f in doc["failures"])
