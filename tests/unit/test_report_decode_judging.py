"""How `report --baseline DECODE.json` judges what a host did or did not measure: only a skipped
decode-bench is a note; a pass without rows, an unreachable host, an unmeasured token identity
at T=0 and a baseline method decode-bench always measures but the run lacks are `not measured`
regressions; a budget the run did not sweep is a note; a tau above the baseline beyond the
tolerance is said as `outside tolerance` (still exit 5). Hand-built rows in decode-bench's
`methods` format, recorded the way the runner records a stage_end."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree.runsummary import MethodSummary  # noqa: E402
from ddtree_ops.report.baselines import Baseline  # noqa: E402
from ddtree_ops.cli.app import main  # noqa: E402
from ddtree_ops.report.decode_checks import compare_decode  # noqa: E402
from ddtree_ops.report.model import build_report  # noqa: E402
from ddtree_ops.results import RunStore  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event  # noqa: E402

CELL = "math500 · Qwen3-8B · T=0"


def cell(method: str, tau: float, identical: float | None = 1.0, temperature: float = 0.0) -> MethodSummary:
    budget = int(method.removeprefix("ddtree_tb")) if method.startswith("ddtree_tb") else None
    return MethodSummary(dataset="math500", model="Qwen3-8B", temperature=temperature, method=method, budget=budget,
                         tau=tau, speedup=None if method == "baseline" else tau / 2, time_per_output_token=0.01,
                         histogram={}, requests=2, identical_to_ar=identical)


BASELINE = Baseline(entries=[cell("baseline", 1.0), cell("dflash", 6.0), cell("ddtree_tb16", 8.0),
                             cell("ddtree_tb64", 9.0)])


def rows(*summaries: MethodSummary) -> dict:
    return {"methods": [s.to_dict() for s in summaries]}


def record(root: Path, per_host: dict[str, dict | None], stages=("decode-bench",)) -> RunStore:
    """Per host: decode-bench's stage_end fields, or None for a host that never answered."""
    store = RunStore(root)
    store.create_run("r1", {"hosts": list(per_host), "stages": list(stages)})
    for host, fields in per_host.items():
        recorder = store.host_recorder("r1", host, {})
        if fields is None:
            recorder.note(outcome="unreachable", error=f"{host}: connection refused: port 22")
        else:
            recorder.feed_line(encode_event(make_event(EventKind.RUN_START, "r1", host, stages=list(stages))))
            if "decode-bench" in stages:
                recorder.feed_line(encode_event(make_event(
                    EventKind.STAGE_END, "r1", host, stage="decode-bench", index=0, duration_s=1.0, traceback=None,
                    output_tail=None, metrics={}, **{"status": "pass", "reason": "", "tables": {}, **fields})))
            recorder.feed_line(encode_event(make_event(EventKind.RUN_END, "r1", host, status="pass")))
        recorder.close()
    return store


FULL = rows(cell("baseline", 1.0), cell("dflash", 6.1), cell("ddtree_tb16", 8.1), cell("ddtree_tb64", 9.1))


def test_only_a_skipped_decode_bench_is_a_note(tmp_path):
    store = record(tmp_path, {"gpu-a": {"tables": FULL}, "empty": {"reason": "3 methods measured"},
                              "skipped": {"status": "skip", "reason": "no models configured for this host"},
                              "gone": None})
    result = compare_decode(build_report(store.load("r1")), BASELINE, tau_tolerance=0.5)
    assert [c.line() for c in result.regressions] == [
        "decode-bench.methods on empty: expected decode-bench results, measured nothing "
        "(not measured: decode-bench pass without methods rows: 3 methods measured)",
        "decode-bench.methods on gone: expected decode-bench results, measured nothing "
        "(not measured: no decode-bench result (host unreachable))"]
    assert result.notes == ["skipped: not compared (decode-bench skip: no models configured for this host)"]


def test_a_run_without_decode_bench_notes_each_host_and_regresses_once(tmp_path):
    store = record(tmp_path, {"gpu-a": {}}, stages=("env",))
    result = compare_decode(build_report(store.load("r1")), BASELINE)
    assert result.notes == ["gpu-a: not compared (no decode-bench in this run)"]
    assert [c.why for c in result.regressions] == ["no host of run r1 measured decode-bench"]


def test_token_identity_not_measured_at_t0_is_a_regression(tmp_path):
    unmeasured = rows(cell("baseline", 1.0), cell("dflash", 6.1, identical=None), cell("ddtree_tb16", 8.1),
                      cell("ddtree_tb64", 9.1))
    result = compare_decode(build_report(record(tmp_path, {"gpu-a": {"tables": unmeasured}}).load("r1")),
                            BASELINE, tau_tolerance=0.5)
    assert [c.line() for c in result.regressions] == [
        "decode-bench.identical_to_ar.dflash on gpu-a: expected 1, measured nothing "
        "(not measured: no identical_to_ar at T=0)"]
    assert [r["verdict"] for r in result.rows if r["method"] == "dflash"] == ["regression"]


def test_baseline_methods_the_run_lacks_are_listed_and_always_measured_ones_regress(tmp_path):
    partial = rows(cell("baseline", 1.0), cell("ddtree_tb64", 9.1))  # no dflash, budget 16 not swept
    store = record(tmp_path, {"gpu-a": {"tables": partial}})
    result = compare_decode(build_report(store.load("r1")), BASELINE, tau_tolerance=0.5)
    assert [c.line() for c in result.regressions] == [
        f"decode-bench.tau.dflash on gpu-a: expected 6 ± 0.5, measured nothing "
        f"(not measured: the run has no dflash row for baseline {CELL})"]
    assert result.notes == [f"gpu-a: ddtree_tb16 of baseline {CELL} not compared (the run measured no budget 16)"]
    assert result.to_dict()["not_compared"] == [
        {"host": "gpu-a", "method": "dflash", "baseline_cell": CELL, "regression": True,
         "why": f"not measured: the run has no dflash row for baseline {CELL}"},
        {"host": "gpu-a", "method": "ddtree_tb16", "baseline_cell": CELL, "regression": False,
         "why": "the run measured no budget 16"}]


def test_a_tau_far_above_the_baseline_is_outside_tolerance_not_a_regression_and_exits_5(tmp_path, capsys):
    better = rows(cell("baseline", 1.0), cell("dflash", 6.1), cell("ddtree_tb16", 8.1), cell("ddtree_tb64", 10.6))
    record(tmp_path / "runs", {"gpu-a": {"tables": better}})
    path = tmp_path / "baseline.json"
    path.write_text(BASELINE.to_json())
    code = main(["report", "r1", "--runs-dir", str(tmp_path / "runs"), "--baseline", str(path), "--tau-tolerance", "0.3"])
    captured = capsys.readouterr()
    assert code == 5
    assert captured.err.splitlines() == [
        f"ddtree-ops: outside tolerance: decode-bench.tau.ddtree_tb64 on gpu-a: expected 9 ± 0.3, measured 10.6 "
        f"(+1.600, outside tolerance; baseline {CELL})"]
    assert "OUTSIDE TOLERANCE" in captured.out and "REGRESSION" not in captured.out
    assert main(["report", "r1", "--runs-dir", str(tmp_path / "runs"), "--baseline", str(path), "--tau-tolerance",
                 "0.3", "--json"]) == 5
    doc = json.loads(capsys.readouterr().out)["baseline"]
    assert [(c["metric"], c["verdict"]) for c in doc["comparisons"] if not c["ok"]] == [
        ("decode-bench.tau.ddtree_tb64", "outside tolerance")]
