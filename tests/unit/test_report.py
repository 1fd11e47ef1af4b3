"""The report model, its rendering, baseline parsing and judging (ddtree_ops/report/)."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.errors import ConfigError  # noqa: E402
from ddtree_ops.report.metric_checks import Better, MetricCheck, compare_metrics, judge, load_baseline  # noqa: E402
from ddtree_ops.report.model import build_report, sweep_pivot  # noqa: E402
from ddtree_ops.results import RunStore  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event  # noqa: E402


def stage_end(host, stage, index, status, reason="", metrics=None, tables=None, tb=None, run_id="r1"):
    return encode_event(make_event(EventKind.STAGE_END, run_id, host, stage=stage, index=index,
                                   status=status, reason=reason, duration_s=1.25,
                                   metrics=metrics or {}, tables=tables or {}, traceback=tb,
                                   output_tail=None))


SWEEP = [{"builder": "heap", "batch_size": 1, "budget": 16, "per_request_ms": 2.0, "nodes": 16},
         {"builder": "public", "batch_size": 1, "budget": 16, "per_request_ms": 0.5, "nodes": 16},
         {"builder": "heap", "batch_size": 1, "budget": 64, "per_request_ms": 9.0, "nodes": 64}]


@pytest.fixture
def run(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("r1", {"hosts": ["gpu-a", "gpu-b", "gpu-c"],
                            "stages": ["env", "golden", "tree-bench"]})
    a = store.host_recorder("r1", "gpu-a", {})
    for text in [encode_event(make_event(EventKind.RUN_START, "r1", "gpu-a",
                                         stages=["env", "golden", "tree-bench"])),
                 stage_end("gpu-a", "env", 0, "pass", metrics={"gpu_count": 8}),
                 stage_end("gpu-a", "golden", 1, "pass"),
                 stage_end("gpu-a", "tree-bench", 2, "pass",
                           metrics={"build_ms.public.bs1.b16": 0.5},
                           tables={"sweep": SWEEP}),
                 encode_event(make_event(EventKind.RUN_END, "r1", "gpu-a", status="pass"))]:
        a.feed_line(text)
    a.close()
    b = store.host_recorder("r1", "gpu-b", {})
    for text in [encode_event(make_event(EventKind.RUN_START, "r1", "gpu-b",
                                         stages=["env", "golden", "tree-bench"])),
                 stage_end("gpu-b", "env", 0, "pass", metrics={"gpu_count": 0}),
                 stage_end("gpu-b", "golden", 1, "fail", reason="summary differs",
                           tb="Traceback\n  File x\nAssertionError: summary differs at key"),
                 stage_end("gpu-b", "tree-bench", 2, "not_run", reason="not run"),
                 encode_event(make_event(EventKind.RUN_END, "r1", "gpu-b", status="fail"))]:
        b.feed_line(text)
    b.close()
    c = store.host_recorder("r1", "gpu-c", {})
    c.note(outcome="unreachable", error="gpu-c: connection refused: port 22")
    c.close()
    return store.load("r1")


def test_report_model(run):
    report = build_report(run)
    assert report.stages == ["env", "golden", "tree-bench"]
    assert {h: o.value for h, o in report.outcomes.items()} == {
        "gpu-a": "pass", "gpu-b": "fail", "gpu-c": "unreachable"}
    assert report.statuses["gpu-b"] == {"env": "pass", "golden": "fail", "tree-bench": "not_run"}
    assert report.statuses["gpu-c"] == {}
    failures = [(f.host, f.stage, f.reason, f.detail) for f in report.failures]
    assert failures == [
        ("gpu-b", "golden", "summary differs", "AssertionError: summary differs at key"),
        ("gpu-c", "-", "gpu-c: connection refused: port 22", None),
    ]
    assert [r["host"] for r in report.sweep] == ["gpu-a"] * 3
    assert report.exit_code == 6  # one host passed, the others did not
    doc = report.to_dict()
    json.dumps(doc)
    assert doc["hosts"]["gpu-b"]["stages"]["golden"] == {
        "status": "fail", "duration_s": 1.25, "reason": "summary differs"}


def test_sweep_pivot_has_one_column_per_builder():
    builders, rows = sweep_pivot([{"host": "h", **r} for r in SWEEP])
    assert builders == ["heap", "public"]
    assert rows == [{"host": "h", "batch_size": 1, "budget": 16, "heap": 2.0, "public": 0.5,
                     "nodes": 16},
                    {"host": "h", "batch_size": 1, "budget": 64, "heap": 9.0, "nodes": 64}]


def test_rendering_shows_statuses_failures_and_sweep(run):
    from ddtree_ops.cli.console import inert_console

    from ddtree_ops.cli.report import render_report

    buffer = io.StringIO()
    render_report(build_report(run), inert_console(file=buffer, width=200, color_system=None))
    text = buffer.getvalue()
    assert "smoke run r1" in text
    assert "gpu-a" in text and "pass 1.2s" in text and "not_run" in text
    assert "FAIL gpu-b / golden: summary differs" in text
    assert "AssertionError: summary differs at key" in text
    assert "FAIL gpu-c: connection refused: port 22" in text  # the host once, not twice
    assert "tree-bench: build time per request" in text and "9.0" in text
    assert "heap/public" in text
    assert "4.00x" in text  # budget 16: heap 2.0 ms / public 0.5 ms, the same run's figures


@pytest.mark.parametrize("check,measured,ok", [
    (MetricCheck("s.m", 10.0, tolerance=0.1, better=Better.LOWER), 10.9, True),
    (MetricCheck("s.m", 10.0, tolerance=0.1, better=Better.LOWER), 11.1, False),
    (MetricCheck("s.m", 10.0, tolerance=0.1, better=Better.LOWER), 1.0, True),
    (MetricCheck("s.m", 10.0, tolerance=0.1, better=Better.HIGHER), 9.1, True),
    (MetricCheck("s.m", 10.0, tolerance=0.1, better=Better.HIGHER), 8.9, False),
    (MetricCheck("s.m", 10.0, abs_tolerance=0.5), 10.4, True),
    (MetricCheck("s.m", 10.0, abs_tolerance=0.5), 9.4, False),
    (MetricCheck("s.m", 3.0), 3, True),
    (MetricCheck("s.status", "pass"), "pass", True),
    (MetricCheck("s.status", "pass"), "fail", False),
    (MetricCheck("s.flag", True), True, True),
    (MetricCheck("s.flag", True), 1, False),
    (MetricCheck("s.m", 1.0), None, False),
    (MetricCheck("s.m", 1.0), "nan", False),
    # non-finite measurements (the runner writes them as strings) are never within tolerance
    (MetricCheck("s.speedup", 2.0, tolerance=0.1, better=Better.HIGHER), "inf", False),
    (MetricCheck("s.speedup", 2.0, tolerance=0.1, better=Better.HIGHER), float("inf"), False),
    (MetricCheck("s.build_ms", 1.5, tolerance=0.25, better=Better.LOWER), "-inf", False),
    (MetricCheck("s.build_ms", 1.5, tolerance=0.25, better=Better.LOWER), float("-inf"), False),
    (MetricCheck("s.m", 1.0, abs_tolerance=0.5), "Infinity", False),
    # an expected value that is not finite (a check built in code) passes nothing
    (MetricCheck("s.m", float("inf"), tolerance=0.1, better=Better.LOWER), 1.0, False),
    (MetricCheck("s.m", "inf", tolerance=0.1, better=Better.LOWER), 1.0, False),
])
def test_judge(check, measured, ok):
    assert judge(check, measured)[0] is ok


def test_infinite_measurements_from_the_runner_are_regressions_not_a_number(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("r4", {"hosts": ["gpu-a"], "stages": ["tree-bench"]})
    recorder = store.host_recorder("r4", "gpu-a", {})
    recorder.feed_line(stage_end("gpu-a", "tree-bench", 0, "pass", run_id="r4", metrics={
        "speedup.public.bs1.b64": float("inf"), "build_ms.public.bs1.b64": float("-inf"),
        "build_ms.public.bs1.b16": float("nan")}))  # encoded as "inf", "-inf", "nan" on the wire
    recorder.close()
    checks = [MetricCheck("tree-bench.speedup.public.bs1.b64", 2.0, tolerance=0.1, better=Better.HIGHER),
              MetricCheck("tree-bench.build_ms.public.bs1.b64", 1.5, tolerance=0.25, better=Better.LOWER),
              MetricCheck("tree-bench.build_ms.public.bs1.b16", 1.5, tolerance=0.25, better=Better.LOWER)]
    results = compare_metrics(store.load("r4"), checks)
    assert [(c.measured, c.ok, c.why) for c in results] == [
        ("inf", False, "not a number"), ("-inf", False, "not a number"), ("nan", False, "not a number")]


def test_comparisons_name_metric_host_expected_and_measured(run):
    checks = [MetricCheck("env.gpu_count", 8, hosts=("gpu-a", "gpu-b")),
              MetricCheck("golden.status", "pass")]
    results = compare_metrics(run, checks)
    lines = {c.line() for c in results if not c.ok}
    assert "env.gpu_count on gpu-b: expected 8, measured 0 (outside tolerance)" in lines
    assert "golden.status on gpu-b: expected pass, measured fail (differs)" in lines
    assert "golden.status on gpu-c: expected pass, measured nothing (not measured)" in lines
    assert sum(c.ok for c in results) == 2  # gpu-a twice


def test_a_check_of_a_host_the_run_did_not_select_is_not_made(run):
    """A fleet baseline against a run with `-H` a subset: the other hosts' checks are shown as
    not checked, neither passed nor regressions."""
    results = compare_metrics(run, [MetricCheck("env.gpu_count", 8, hosts=("gpu-a", "gpu-z"))])
    by_host = {c.host: c for c in results}
    assert by_host["gpu-a"].checked and by_host["gpu-a"].ok
    assert not by_host["gpu-z"].checked and by_host["gpu-z"].why == "host not in this run: not checked"
    assert by_host["gpu-z"].to_dict()["checked"] is False


@pytest.mark.parametrize("content,message", [
    ("[1, 2]", "not a baseline: expected a metrics baseline (a mapping with a `metrics:` list)"),
    ('{"metrics": {"a.b": 1}}', "metrics: expected a list of checks, got dict"),
    ('{"metrics": [{"metric": "a.b"}]}', "metrics[0]: missing `expected`"),
    ('{"metrics": [{"metric": "a.b", "expected": 1, "tol": 1}]}', "metrics[0]: unknown key(s) ['tol']"),
    ('{"metrics": [{"metric": "a.b", "expected": 1, "better": "up"}]}',
     "metrics[0].better: expected lower, higher or equal, got 'up'"),
    ('{"metrics": [{"metric": "a.b", "expected": 1, "tolerance": -1}]}',
     "metrics[0].tolerance: expected a finite number >= 0, got -1"),
    # NaN would fail every check and an infinite tolerance pass every one
    ('{"metrics": [{"metric": "a.b", "expected": 1, "tolerance": NaN}]}',
     "metrics[0].tolerance: expected a finite number >= 0, got nan"),
    ('{"metrics": [{"metric": "a.b", "expected": 1, "abs_tolerance": Infinity}]}',
     "metrics[0].abs_tolerance: expected a finite number >= 0, got inf"),
    ('{"metrics": [{"metric": "a.b", "expected": NaN}]}', "metrics[0].expected: expected a finite value, got nan"),
    # the runner's string form of a non-finite value is no expected value either
    ('{"metrics": [{"metric": "a.b", "expected": "inf", "tolerance": 0.1, "better": "lower"}]}',
     "metrics[0].expected: expected a finite value, got 'inf'"),
    ('{"metrics": [{"metric": "a.b", "expected": "-inf", "better": "higher"}]}',
     "metrics[0].expected: expected a finite value, got '-inf'"),
    ('{"metrics": [{"metric": "a.b", "expected": "nan"}]}', "metrics[0].expected: expected a finite value, got 'nan'"),
    ('{"metrics": [{"metric": "a.b", "expected": Infinity}]}', "metrics[0].expected: expected a finite value, got inf"),
    ('{"metrics": [{"metric": "a.b", "expected": 1, "hosts": [1]}]}',
     "metrics[0].hosts: expected a list of host names, got [1]"),
    ("{not json", "not valid JSON: Expecting property name"),
])
def test_bad_baselines_name_file_and_entry(tmp_path, content, message):
    path = tmp_path / "base.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_baseline(path)
    assert str(err.value).startswith(str(path))
    assert message in str(err.value)


def test_missing_baseline_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read baseline"):
        load_baseline(tmp_path / "nope.json")


def test_rendering_does_not_interpret_reasons_as_markup(tmp_path):
    from ddtree_ops.cli.console import inert_console

    from ddtree_ops.cli.report import render_report

    store = RunStore(tmp_path)
    store.create_run("r2", {"hosts": ["h"], "stages": ["golden"]})
    recorder = store.host_recorder("r2", "h", {})
    recorder.feed_line(stage_end("h", "golden", 0, "fail", reason="got [bold]x[/bold] [-1, 0]", run_id="r2"))
    recorder.close()
    buffer = io.StringIO()
    render_report(build_report(store.load("r2")), inert_console(file=buffer, width=200,
                                                          color_system=None))
    assert "FAIL h / golden: got [bold]x[/bold] [-1, 0]" in buffer.getvalue()


@pytest.mark.slow
def test_decode_rows_are_reported_rendered_and_plotted(tmp_path):
    from ddtree_ops.cli.console import inert_console

    from ddtree_ops.cli.report import render_report
    from ddtree_ops.report.plots import plot_run

    rows = [{"method": "baseline", "budget": None, "tau": 1.0, "speedup": 1.0,
             "time_per_output_token": 0.02, "identical_to_ar": 1.0},
            {"method": "dflash", "budget": None, "tau": 3.1, "speedup": 2.0,
             "time_per_output_token": 0.01, "identical_to_ar": 1.0},
            {"method": "ddtree_tb16", "budget": 16, "tau": 3.5, "speedup": 2.2,
             "time_per_output_token": 0.009, "identical_to_ar": 1.0},
            {"method": "ddtree_tb64", "budget": 64, "tau": 4.2, "speedup": 2.5,
             "time_per_output_token": 0.008, "identical_to_ar": 0.5}]
    store = RunStore(tmp_path / "runs")
    store.create_run("r3", {"hosts": ["gpu-a"], "stages": ["decode-bench"]})
    recorder = store.host_recorder("r3", "gpu-a", {})
    recorder.feed_line(stage_end("gpu-a", "decode-bench", 0, "pass", run_id="r3",
                                 metrics={"tau.ddtree_tb64": 4.2}, tables={"methods": rows}))
    recorder.close()
    report = build_report(store.load("r3"))
    assert [r["method"] for r in report.decode] == [r["method"] for r in rows]
    assert report.to_dict()["decode"][2]["host"] == "gpu-a"
    buffer = io.StringIO()
    render_report(report, inert_console(file=buffer, width=200, color_system=None))
    text = buffer.getvalue()
    assert "decode-bench: per method" in text and "ddtree_tb64" in text and "50%" in text
    written = plot_run(report, tmp_path / "plots",
                       decode_baseline=[{"budget": 64, "tau": 4.0, "speedup": 2.4,
                                         "label": "paper"}])
    assert [p.name for p in written] == ["decode-vs-budget.png"]
    assert written[0].read_bytes()[:4] == b"\x89PNG"


def test_a_plan_the_host_runner_refused_reports_exit_2_as_smoke_did(tmp_path, capsys):
    from ddtree_ops.cli.app import main

    store = RunStore(tmp_path)
    store.create_run("r3", {"hosts": ["h", "ok"], "stages": ["golden"]})
    refusal = "unknown stage 'goldne'"
    refused = store.host_recorder("r3", "h", {})
    for text in [encode_event(make_event(EventKind.RUN_START, "r3", "h", stages=[], error=refusal)),
                 encode_event(make_event(EventKind.RUN_END, "r3", "h", status="error", exit_code=2,
                                         error=refusal))]:
        refused.feed_line(text)
    refused.close()
    fine = store.host_recorder("r3", "ok", {})
    for text in [encode_event(make_event(EventKind.RUN_START, "r3", "ok", stages=["golden"])),
                 stage_end("ok", "golden", 0, "pass", run_id="r3"),
                 encode_event(make_event(EventKind.RUN_END, "r3", "ok", status="pass"))]:
        fine.feed_line(text)
    fine.close()
    report = build_report(store.load("r3"))
    assert report.outcomes["h"].value == "refused" and report.exit_code == 2
    assert [(f.host, f.reason) for f in report.failures] == [("h", refusal)]
    assert main(["report", "r3", "--json", "--runs-dir", str(tmp_path)]) == 0  # no baseline: nothing regressed
    assert json.loads(capsys.readouterr().out)["run_exit_code"] == 2  # the run's own code, as `smoke` returned
