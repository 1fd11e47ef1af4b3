"""Timed figures that qualify themselves: the host's load recorded around timed stages, the one
`noisy` rule (ddtree_ops/noise.py), and a report that marks noisy cells in its table, --json
and baseline verdicts (never a regression on a noisy cell)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.cli.app import main  # noqa: E402
from ddtree_ops.noise import LOAD_PER_CPU_LIMIT, MIN_SAMPLES, SPREAD_LIMIT, cell_noise, load_problem  # noqa: E402
from ddtree_ops.report.metric_checks import compare_metrics, load_baseline  # noqa: E402
from ddtree_ops.report.model import build_report  # noqa: E402
from ddtree_ops.results import RunStore  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event, timing_row  # noqa: E402

QUIET = {"before": {"loadavg_1m": 0.2, "cpus": 4}, "after": {"loadavg_1m": 3.9, "cpus": 4}}
BUSY = {"before": {"loadavg_1m": 6.1, "cpus": 2}, "after": {"loadavg_1m": 6.4, "cpus": 2}}


def test_the_rule_spread_and_load():
    steady = {"min": 1.0, "median": 1.1, "max": 1.4}
    assert not cell_noise(steady, QUIET).noisy
    assert cell_noise(steady, QUIET).spread == pytest.approx(0.4 / 1.1)
    wide = {"min": 0.05, "median": 1.0, "max": 16.0}
    assert cell_noise(wide, QUIET).why.startswith("spread 1595% of the median")
    busy = cell_noise(steady, BUSY)
    assert busy.noisy and "6.10 on 2 CPUs before the stage (3.05 per CPU > 1.25)" in busy.why
    # the stage's own work (one task per CPU) is not noise; a load above that is
    assert not load_problem({"after": {"loadavg_1m": 4 * LOAD_PER_CPU_LIMIT, "cpus": 4}})
    assert load_problem({"after": {"loadavg_1m": 4 * LOAD_PER_CPU_LIMIT + 0.1, "cpus": 4}})
    assert "GPU 93% busy before" in load_problem({"before": {"loadavg_1m": 0.1, "cpus": 8, "gpu_util_pct": 93}})
    assert not load_problem({"after": {"loadavg_1m": 0.1, "cpus": 8, "gpu_util_pct": 100}})  # ours
    assert cell_noise({"min": 1.0, "median": 1.0, "max": 1.0 + SPREAD_LIMIT}, None).why == ""
    assert not cell_noise(None, None).noisy and cell_noise(None, None).spread is None


def test_a_cell_cut_short_of_the_minimum_sample_count_is_noisy():
    # one call, or two that happen to agree, show no spread: a disturbed call would pass for
    # a steady figure (the tree-bench time budget cuts a busy host's cells to one call)
    one = timing_row("build_ms.public.bs16.b1024", [11.5], "ms")
    assert one["min"] == one["max"] and cell_noise(one, QUIET).why == "1 sample(s) < 3: too few to judge"
    two = timing_row("speedup.public_vs_heap.b32", [0.84, 0.85], "x")
    assert cell_noise(two, None).noisy and cell_noise(two, None).spread == pytest.approx(0.01 / 0.845)
    steady = timing_row("build_ms.public.bs1.b32", [0.84, 0.85, 0.86][:MIN_SAMPLES], "ms")
    assert MIN_SAMPLES == 3 and not cell_noise(steady, QUIET).noisy  # the default repeat is judged
    assert not cell_noise({"min": 1.0, "median": 1.0, "max": 1.0}, QUIET).noisy  # no count: spread and load


def test_timing_row_keeps_min_median_max():
    assert timing_row("build_ms.heap.bs1.b16", [3.0, 1.0, 2.0, 10.0], "ms") == {
        "cell": "build_ms.heap.bs1.b16", "unit": "ms", "samples": 4, "min": 1.0, "median": 2.5, "max": 10.0}


def test_the_runner_samples_load_and_cpus():
    from ddtree_ops.hostside.runner import host_load

    sample = host_load()
    assert sample["cpus"] >= 1 and sample["loadavg_1m"] >= 0 and sample["time"] > 0


def test_tree_bench_records_every_cell_with_its_spread(tmp_path):
    from ddtree_ops.hostside.stages import tree_bench
    from tests.unit.test_smoke_stages import make_ctx

    assert tree_bench.TIMED
    ctx = make_ctx(tmp_path, "tree-bench", budgets=[8], batch_sizes=[1], repeat=3, extra={"vocab": 512})
    result = tree_bench.run(ctx)
    cells = {row["cell"]: row for row in result.tables["timings"]}
    heap = cells["build_ms.heap.bs1.b8"]
    assert heap["samples"] == 3 and heap["min"] <= heap["median"] <= heap["max"]
    assert heap["median"] == result.metrics["build_ms.heap.bs1.b8"]
    ratio = cells["speedup.public_vs_heap.b8"]
    assert ratio["min"] <= result.metrics["speedup.public_vs_heap.b8"] <= ratio["max"]


def _stage_end(stage, index, metrics, tables, load):
    return encode_event(make_event(EventKind.STAGE_END, "r1", "gpu-a", stage=stage, index=index, status="pass",
                                   reason="", duration_s=2.0, metrics=metrics, tables=tables, traceback=None,
                                   output_tail=None, load=load))


@pytest.fixture
def noisy_run(tmp_path):
    """tree-bench on one host: budget 16 steady, budget 64 spread wide; host load as given."""
    def make(load, with_heap=False):
        store = RunStore(tmp_path / "runs")
        store.create_run("r1", {"hosts": ["gpu-a"], "stages": ["tree-bench"]})
        rows = [{"builder": "public", "batch_size": 1, "budget": b, "per_request_ms": m, "nodes": b}
                for b, m in ((16, 0.5), (64, 12.25))]
        timings = [timing_row("build_ms.public.bs1.b16", [0.48, 0.5, 0.52], "ms"),
                   timing_row("build_ms.public.bs1.b64", [1.0, 12.25, 40.0], "ms")]
        if with_heap:  # steady at both budgets: the b64 ratio is noisy through public alone
            rows += [{"builder": "heap", "batch_size": 1, "budget": b, "per_request_ms": 2.0, "nodes": b}
                     for b in (16, 64)]
            timings += [timing_row(f"build_ms.heap.bs1.b{b}", [1.9, 2.0, 2.1], "ms") for b in (16, 64)]
        recorder = store.host_recorder("r1", "gpu-a", {})
        for line in (encode_event(make_event(EventKind.RUN_START, "r1", "gpu-a", stages=["tree-bench"])),
                     _stage_end("tree-bench", 0, {"build_ms.public.bs1.b16": 0.5, "build_ms.public.bs1.b64": 12.25,
                                                  "vocab": 32000},
                                {"sweep": rows, "timings": timings}, load),
                     encode_event(make_event(EventKind.RUN_END, "r1", "gpu-a", status="pass"))):
            recorder.feed_line(line)
        recorder.close()
        return store
    return make


def _baseline(tmp_path, expected_16, expected_64):
    path = tmp_path / "baseline.yaml"
    path.write_text(json.dumps({"metrics": [
        {"metric": "tree-bench.build_ms.public.bs1.b16", "expected": expected_16, "tolerance": 0.1, "better": "lower"},
        {"metric": "tree-bench.build_ms.public.bs1.b64", "expected": expected_64, "tolerance": 0.1, "better": "lower"},
        {"metric": "tree-bench.vocab", "expected": 32000}]}))
    return path


def test_the_report_marks_noisy_cells_and_never_calls_them_regressions(noisy_run, tmp_path):
    store = noisy_run(QUIET)
    report = build_report(store.load("r1"))
    by_budget = {row["budget"]: row for row in report.sweep}
    assert by_budget[16]["noisy"] is False and by_budget[16]["min_ms"] == 0.48 and by_budget[16]["max_ms"] == 0.52
    assert by_budget[64]["noisy"] is True and by_budget[64]["noisy_why"].startswith("spread")
    stage = report.to_dict()["hosts"]["gpu-a"]["stages"]["tree-bench"]
    assert stage["load"] == QUIET and stage["load_problem"] is None
    assert stage["timings"]["build_ms.public.bs1.b64"]["noisy"] is True
    # a slower b64 would be a regression, but its cell is noisy: not judged; b16 is judged
    results = compare_metrics(store.load("r1"), load_baseline(_baseline(tmp_path, 0.4, 1.0)))
    verdicts = {c.check.metric: c.verdict for c in results}
    assert verdicts == {"tree-bench.build_ms.public.bs1.b16": "regression",
                        "tree-bench.build_ms.public.bs1.b64": "not judged", "tree-bench.vocab": "ok"}


def test_a_loaded_host_makes_every_timed_cell_noisy(noisy_run, tmp_path):
    store = noisy_run(BUSY)
    report = build_report(store.load("r1"))
    assert all(row["noisy"] for row in report.sweep)
    results = compare_metrics(store.load("r1"), load_baseline(_baseline(tmp_path, 0.4, 1.0)))
    assert [c.verdict for c in results] == ["not judged", "not judged", "ok"]  # vocab is no timing


def test_report_cli_says_noisy_in_table_json_and_exit_code(noisy_run, tmp_path, capsys):
    store = noisy_run(QUIET)
    runs = str(store.root)
    assert main(["report", "--runs-dir", runs]) == 0
    out = capsys.readouterr().out
    line_64 = next(line for line in out.splitlines() if " 64 " in line and "gpu-a" in line)
    assert "12.25 noisy" in line_64  # one format per column: 0.50 beside 12.25, not 0.500
    assert "0.50 " in next(line for line in out.splitlines() if " 16 " in line and "gpu-a" in line)
    assert "floor: torch.topk(k=budget) + logsumexp" in out and "noisy: the median cannot be trusted" in out
    assert "load gpu-a / tree-bench: load 0.20 -> 3.90 on 4 CPUs" in out
    # no regression, one value not judged: 6
    assert main(["report", "--runs-dir", runs, "--baseline", str(_baseline(tmp_path, 0.6, 1.0)), "--json"]) == 6
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["exit_code"] == 6 and document["baseline"]["not_judged_noisy"] == 1
    assert document["baseline"]["regressions"] == 0
    assert "1 baseline check(s) not judged" in captured.err
    # a regression on a quiet cell still exits 5
    assert main(["report", "--runs-dir", runs, "--baseline", str(_baseline(tmp_path, 0.4, 1.0))]) == 5
    assert "not judged" in capsys.readouterr().out
    # every check judged and passed: 0
    store = noisy_run(QUIET)
    path = tmp_path / "quiet.yaml"
    path.write_text(json.dumps({"metrics": [{"metric": "tree-bench.build_ms.public.bs1.b16", "expected": 0.6,
                                             "better": "lower"}]}))
    assert main(["report", "--runs-dir", runs, "--baseline", str(path)]) == 0


@pytest.mark.slow
def test_charts_give_every_series_its_own_look_and_band(noisy_run, tmp_path):
    pytest.importorskip("matplotlib")
    from ddtree_ops.report.plots import plot_sweep, series_style

    looks = {(series_style(b, h)["color"], str(series_style(b, h)["linestyle"])) for b in range(5) for h in range(3)}
    assert len(looks) == 15  # 12 lines shared a 10-colour cycle before
    assert len({series_style(b, 0)["color"] for b in range(20)}) == 20
    drawn = []
    import matplotlib.axes

    real_fill = matplotlib.axes.Axes.fill_between

    def fill(self, x, low, high, **kw):
        drawn.append((list(x), list(low), list(high)))
        return real_fill(self, x, low, high, **kw)

    matplotlib.axes.Axes.fill_between = fill
    try:
        paths = plot_sweep(build_report(noisy_run(QUIET).load("r1")), tmp_path / "plots")
    finally:
        matplotlib.axes.Axes.fill_between = real_fill
    assert [p.name for p in paths] == ["tree-build-vs-budget-bs1.png"] and paths[0].stat().st_size > 0
    assert drawn == [([16, 64], [0.48, 1.0], [0.52, 40.0])]  # the min-max band of public


def test_the_heap_public_ratio_is_as_noisy_as_its_parts(noisy_run, capsys):
    store = noisy_run(QUIET, with_heap=True)
    assert main(["report", "--runs-dir", str(store.root)]) == 0
    out = capsys.readouterr().out
    row_16 = next(line for line in out.splitlines() if " 16 " in line and "gpu-a" in line)
    row_64 = next(line for line in out.splitlines() if " 64 " in line and "gpu-a" in line)
    assert "4.00x" in row_16 and "noisy" not in row_16
    assert "0.16x noisy" in row_64
