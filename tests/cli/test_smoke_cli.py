"""`ddtree-ops smoke`, `report`, `collect` and `bench` through the real CLI entry point on
the local transport: a real push into a scratch workdir and the real host-side runner."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from fixtures.checkout import copy_release_files

QUICK = ["--budgets", "16,64", "--batch-sizes", "1,2", "--repeat", "1"]

EXTRA_STAGES = {
    "broken": 'NAME = "broken"\nDESCRIPTION = "raises"\n'
              'def run(ctx):\n    raise RuntimeError("broken on purpose")\n',
    "hang": 'NAME = "hang"\nDESCRIPTION = "hangs"\nimport time\n'
            'def run(ctx):\n    print("hanging now", flush=True)\n    time.sleep(3600)\n',
    "quiet": 'NAME = "quiet"\nDESCRIPTION = "says one thing, then works quietly for 3 s"\nNEEDS_TORCH = False\n'
             'import time\ndef run(ctx):\n    from ddtree_ops.hostside.protocol import StageResult\n'
             '    print("a line of output", flush=True)\n    ctx.log("halfway there")\n    time.sleep(3)\n'
             '    return StageResult.passed("done")\n',
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of this checkout's release files plus the purpose-built stages above."""
    return copy_release_files(tmp_path_factory.mktemp("checkout"), EXTRA_STAGES)


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(
        {"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "wd")}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path


def run_json(args: list[str], capsys) -> tuple[int, dict]:
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_full_smoke_on_local_passes_and_is_stored(env, capsys):
    code, doc = run_json(["smoke", "--stages", "env,import,golden,invariants,tree-bench", *QUICK],
                         capsys)
    assert code == 0 and doc["exit_code"] == 0, doc["failures"]
    stages = doc["hosts"]["local"]["stages"]
    assert {s: v["status"] for s, v in stages.items()} == {
        "env": "pass", "import": "pass", "golden": "pass", "invariants": "pass",
        "tree-bench": "pass"}
    assert doc["hosts"]["local"]["outcome"] == "pass" and doc["failures"] == []
    assert {(r["builder"], r["batch_size"], r["budget"]) for r in doc["sweep"]} >= {
        ("heap", 1, 16), ("public", 1, 64), ("batched", 2, 64), ("floor", 2, 16)}
    host_dir = env / "runs" / doc["run_id"] / "local"
    assert {p.stem for p in (host_dir / "stages").glob("*.json")} == set(stages)
    meta = json.loads((host_dir / "run.json").read_text())
    assert meta["release"] == doc["release"] == meta["push"]["release"]
    assert meta["inventory"]["transport"] == "local" and meta["torch"]
    import_record = json.loads((host_dir / "stages" / "import.json").read_text())
    assert import_record["metrics"]["release"] == doc["release"]
    # the host kept the same records under <workdir>/runs/<run-id>/
    remote = env / "wd" / "runs" / doc["run_id"]
    assert (remote / "events.jsonl").read_text().splitlines() == \
        (host_dir / "events.jsonl").read_text().splitlines()

    # report: latest run by default, same document
    code, report = run_json(["report"], capsys)
    assert code == 0 and report["run_id"] == doc["run_id"]
    assert report["hosts"] == doc["hosts"]
    assert main(["report", doc["run_id"]]) == 0
    text = capsys.readouterr().out
    assert "golden" in text and "tree-bench: build time per request" in text


def test_failing_stage_exit_5_with_reason_and_not_run_rest(env, checkout, capsys):
    code, doc = run_json(["smoke", "--source", str(checkout), "--stages", "env,broken,golden"],
                         capsys)
    assert code == 5
    stages = doc["hosts"]["local"]["stages"]
    assert [stages[s]["status"] for s in ("env", "broken", "golden")] == ["pass", "fail", "not_run"]
    assert doc["failures"][0]["reason"] == "RuntimeError: broken on purpose"
    assert doc["failures"][0]["stage"] == "broken"
    code = main(["smoke", "--source", str(checkout), "--stages", "broken,golden", "--keep-going"])
    captured = capsys.readouterr()
    assert code == 5
    assert "FAIL local / broken: RuntimeError: broken on purpose" in captured.out
    assert "pass" in captured.out  # golden ran after the failure


def test_hanging_stage_is_stopped_by_the_stage_timeout(env, checkout, capsys):
    code, doc = run_json(["smoke", "--source", str(checkout), "--stages", "hang,env",
                          "--stage-timeout", "2", "--keep-going"], capsys)
    assert code == 5
    stages = doc["hosts"]["local"]["stages"]
    assert stages["hang"]["status"] == "fail"
    assert stages["hang"]["reason"] == "timed out after 2s"
    assert stages["env"]["status"] == "pass"
    record = json.loads((env / "runs" / doc["run_id"] / "local" / "stages" / "hang.json").read_text())
    assert "hanging now" in record["output_tail"]


@pytest.mark.parametrize("args,message", [
    (["--stages", "env,nosuch"], "--stages: unknown stage(s) nosuch"),
    (["--stages", "__init__"], "--stages: unknown stage(s) __init__"),  # a module of the folder, no stage
    (["--stages", " , "], "--stages: empty stage list ' , ' (omit --stages for the default order)"),
    (["--stage-timeout", "inf"], "Invalid value for '--stage-timeout'"),
    (["--set", "strict"], "--set: expected KEY=VALUE with a name of letters, digits and _, got 'strict'"),
    (["--set", "x=NaN"], "--set x: expected a finite value, got 'NaN'"),
    (["--runs-dir", "/proc/no-such-folder"], "--runs-dir /proc/no-such-folder: cannot create the folder"),
    (["--budgets", "16,x"], "--budgets: expected comma-separated integers >= 0, got 'x'"),
    (["--batch-sizes", "0"], "--batch-sizes: expected comma-separated integers >= 1, got '0'"),
])
def test_bad_options_are_usage_errors(env, capsys, args, message):
    assert main(["smoke", *args]) == 2
    assert message in capsys.readouterr().err


def test_report_baseline_and_plot(env, capsys, tmp_path):
    code, doc = run_json(["smoke", "--stages", "env,golden,tree-bench", *QUICK], capsys)
    assert code == 0, doc["failures"]
    measured = doc["sweep"][0]
    metric = f"tree-bench.build_ms.{measured['builder']}.bs{measured['batch_size']}.b{measured['budget']}"
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"metrics": [
        {"metric": "golden.status", "expected": "pass"},
        {"metric": metric, "expected": measured["per_request_ms"] * 2, "better": "lower"},
        {"metric": "env.gpu_count", "expected": 0, "hosts": ["local"]},
    ]}))
    # a real timing on this machine: judged when its cell is steady, `not judged` (exit 6) when noisy
    noisy = measured["noisy"]
    code, report = run_json(["report", "--baseline", str(good)], capsys)
    assert code == (6 if noisy else 0) and report["baseline"]["regressions"] == 0
    assert len(report["baseline"]["comparisons"]) == 3
    assert report["baseline"]["not_judged_noisy"] == int(noisy)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"metrics": [
        {"metric": metric, "expected": measured["per_request_ms"] / 1000, "tolerance": 0.1,
         "better": "lower"},
        {"metric": "golden.nosuch", "expected": 1},
    ]}))
    assert main(["report", "--baseline", str(bad)]) == 5
    err = capsys.readouterr().err
    if noisy:
        assert "1 baseline check(s) not judged" in err and f"regression: {metric}" not in err
    else:
        assert f"regression: {metric} on local: expected" in err
        assert f"measured {measured['per_request_ms']:g} " in err  # values are shown as %g, never as reprs
    assert "golden.nosuch on local: expected 1, measured nothing (not measured)" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"metrics": [{"metric": "nodot", "expected": 1}]}))
    assert main(["report", "--baseline", str(broken)]) == 3
    assert f"{broken}: metrics[0].metric: expected '<stage>.<name>', got 'nodot'" in \
        capsys.readouterr().err

    plots = tmp_path / "plots"
    assert main(["report", "--plot", str(plots)]) == 0
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert pngs == ["tree-build-vs-budget-bs1.png", "tree-build-vs-budget-bs2.png"]
    assert (plots / pngs[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_plot_folder_is_refused_before_any_work(env, capsys):
    """bench checks it before the sweep (not after it, losing the sweep's exit code)."""
    blocker = env / "plots.txt"
    blocker.write_text("a file\n")
    assert main(["bench", "--budgets", "16", "--batch-sizes", "1", "--repeat", "1", "--plot", str(blocker)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"ddtree-ops: error: --plot {blocker}: exists and is not a folder"
    assert not (env / "runs").exists()  # no sweep ran, no run was recorded
    assert main(["report", "--plot", str(blocker)]) == 2
    assert blocker.read_text() == "a file\n"


def test_report_without_runs_is_a_usage_error(env, capsys):
    assert main(["report"]) == 2
    assert "no runs under" in capsys.readouterr().err
    assert main(["report", "nope-123"]) == 2


def test_collect_is_idempotent_and_adopts_missing_records(env, capsys):
    code, doc = run_json(["smoke", "--stages", "env,golden"], capsys)
    assert code == 0, doc["failures"]
    run_id = doc["run_id"]
    host_dir = env / "runs" / run_id / "local"
    # Simulate a stream cut short: only the first two records made it back.
    events = (host_dir / "events.jsonl").read_text().splitlines()
    (host_dir / "events.jsonl").write_text("\n".join(events[:2]) + "\n")
    shutil.rmtree(host_dir / "stages")
    code, first = run_json(["collect", run_id], capsys)
    assert code == 0
    result = first["hosts"]["local"]["result"]
    assert "events.jsonl" in result["fetched"] and "logs/golden.log" in result["fetched"]
    assert result["merged_events"] is True
    code, second = run_json(["collect", run_id], capsys)
    assert code == 0
    again = second["hosts"]["local"]["result"]
    assert again["fetched"] == [] and again["unchanged"] == len(result["fetched"])
    assert again["merged_events"] is False
    code, report = run_json(["report", run_id], capsys)
    assert report["hosts"]["local"]["stages"]["golden"]["status"] == "pass"


def test_bench_runs_the_sweep_and_plots_before_its_final_line(env, capsys, tmp_path):
    """Issue #47: bench printed its final "exit 0" line, then drew the charts (~25 s)."""
    code = main(["bench", "--budgets", "16", "--batch-sizes", "1", "--repeat", "1", "--plot", str(tmp_path / "p")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 0
    assert lines[-1].startswith("ddtree-ops: bench run ") and ": exit 0 (" in lines[-1]
    assert f"ddtree-ops: wrote {tmp_path / 'p' / 'tree-build-vs-budget-bs1.png'}" in lines[:-1]
    code, doc = run_json(["report"], capsys)
    assert code == 0
    assert set(doc["hosts"]["local"]["stages"]) >= {"env", "tree-bench"}
    assert {r["builder"] for r in doc["sweep"]} == {"heap", "public", "batched", "floor"}
    assert (tmp_path / "p" / "tree-build-vs-budget-bs1.png").is_file()
    assert doc["hosts"]["local"]["outcome"] == "pass"
    record = json.loads((env / "runs" / doc["run_id"] / "local" / "stages" / "tree-bench.json").read_text())
    assert record["metrics"]["time_budget_s"] == 0  # the thorough sweep: no time budget


def test_ctrl_c_stops_the_runner_and_keeps_what_arrived(env, checkout):
    argv = [sys.executable, "-m", "ddtree_ops", "smoke", "--source", str(checkout),
            "--stages", "env,hang,golden", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=env)
    runs = env / "runs"
    try:  # a failed wait must not leave the CLI and its hanging runner behind
        deadline = time.monotonic() + 60
        hang_log = None
        while time.monotonic() < deadline:  # wait until the host is inside `hang`
            logs = list((env / "wd" / "runs").glob("*/logs/hang.log"))
            if logs and "hanging now" in logs[0].read_text():
                hang_log = logs[0]
                break
            time.sleep(0.2)
        assert hang_log is not None, proc.stderr.read() if proc.poll() is not None else "no hang"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    doc = json.loads(out)
    stages = doc["hosts"]["local"]["stages"]
    assert stages["env"]["status"] == "pass"
    assert stages["hang"]["status"] == "fail" and "interrupted" in stages["hang"]["reason"]
    assert stages["golden"]["status"] == "not_run"
    assert doc["hosts"]["local"]["outcome"] == "interrupted"
    # the runner is gone: its pid file was removed when it stopped
    assert not (hang_log.parent.parent / "runner.pid").exists()
    assert list(runs.iterdir())


def test_long_work_speaks_in_piped_output_and_verbose_streams_the_stage_log(env, checkout):
    """Issue #47: a stage silent in a pipe for 499 s. With the interval shortened to 0.5 s (the
    variable the docs name), a 3 s stage gets `still running` lines naming host, stage, elapsed
    time and its last words; `-v` streams its output, host-prefixed."""
    argv = [sys.executable, "-m", "ddtree_ops", "smoke", "--source", str(checkout), "--stages", "quiet", "-v"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=env, timeout=300,
                          env={**os.environ, "DDTREE_OPS_PROGRESS_EVERY_S": "0.5"})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    still = [line for line in lines if line.startswith("ddtree-ops: smoke: local: quiet: still running (")]
    assert len(still) >= 2, done.stderr  # ~5 expected in 3 s; 2 leaves a wide margin for a busy machine
    assert all(line.endswith('s; last: "halfway there")') for line in still), still
    assert "ddtree-ops: local: quiet | a line of output" in lines
    assert "ddtree-ops: local: quiet | [quiet] halfway there" in lines
    assert lines.index("ddtree-ops: local: quiet | a line of output") < lines.index(still[0])
    assert any(line.startswith("ddtree-ops: smoke: local: quiet: pass (") for line in lines)


def test_no_push_tests_the_active_release(env, capsys):
    code, first = run_json(["smoke", "--stages", "env"], capsys)
    assert code == 0
    code, doc = run_json(["smoke", "--no-push", "--stages", "import,golden"], capsys)
    assert code == 0
    assert doc["release"] is None
    record = json.loads((env / "runs" / doc["run_id"] / "local" / "stages" / "import.json").read_text())
    assert record["metrics"]["release"] == first["release"]
    assert record["metrics"]["expected_release"] is None


def test_live_view_renders_hosts_and_stages():
    from ddtree_ops.cli.console import inert_console

    from ddtree_ops.cli.smoke import SmokeView

    view = SmokeView("smoke", ["gpu-[a]", "b"], quiet=True)
    view.record("gpu-[a]", {"event": "run_start", "stages": ["env", "golden"]})
    view.record("gpu-[a]", {"event": "stage_start", "stage": "env"})
    view.record("gpu-[a]", {"event": "stage_end", "stage": "env", "status": "pass"})
    view.record("gpu-[a]", {"event": "stage_start", "stage": "golden"})
    view.record("gpu-[a]", {"event": "log", "stage": "golden", "message": "torch [2.13]"})
    view.phase("b", "failed", "b: connection refused")
    console = inert_console(width=160, color_system=None, record=True)
    console.print(view.render())
    text = console.export_text()
    assert "gpu-[a]" in text and "torch [2.13]" in text
    assert "pass" in text and "running" in text and "failed" in text


def test_no_push_on_a_host_without_a_release_fails_with_the_reason(env, capsys):
    code, doc = run_json(["smoke", "--no-push", "--stages", "env"], capsys)
    assert code == 5
    assert doc["hosts"]["local"]["outcome"] == "fail"
    [failure] = doc["failures"]
    assert failure["host"] == "local" and failure["stage"] == "-"
    assert failure["reason"] == (f"local: no release is active in {env / 'wd'} "
                                 "(run `ddtree-ops push`, or drop --no-push)")


def test_a_missing_host_python_is_reported(env, capsys, monkeypatch, tmp_path):
    inventory = tmp_path / "bad-python.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(tmp_path / "wd2"),
        "python": str(tmp_path / "no" / "python")}}}))
    code, doc = run_json(["smoke", "-i", str(inventory), "--stages", "env"], capsys)
    assert code == 5  # the host answered; its python did not
    assert doc["hosts"]["local"]["outcome"] == "fail"
    assert str(tmp_path / "no" / "python") in doc["failures"][0]["reason"]


def test_stage_names_are_spelled_as_the_runner_spells_them():
    from ddtree_ops.cli.smoke import parse_stages

    assert parse_stages(None) == []  # not given: every stage
    assert parse_stages("tree_bench,env,tree-bench") == ["tree-bench", "env"]


def test_stage_knobs_reach_the_stages(env, capsys):
    """--set fills options.extra, which the stages read (here tree-bench's vocabulary)."""
    code, doc = run_json(["smoke", "--stages", "tree-bench", "--budgets", "4", "--batch-sizes", "1",
                          "--repeat", "1", "--set", "vocab=500", "--set", "sglang_attention_backend=plain text",
                          "--set", "sglang_concurrency=1,2"], capsys)
    assert code == 0, doc["failures"]
    run = json.loads((env / "runs" / doc["run_id"] / "local" / "run.json").read_text())
    assert run["options"]["extra"] == {"vocab": 500, "sglang_attention_backend": "plain text",
                                       "sglang_concurrency": [1, 2]}


def test_a_fleet_baseline_on_a_run_of_some_hosts_checks_only_those(env, capsys, tmp_path):
    code, _ = run_json(["smoke", "--stages", "env"], capsys)
    assert code == 0
    baseline = tmp_path / "fleet.yaml"
    baseline.write_text(yaml.safe_dump({"metrics": [
        {"metric": "env.status", "expected": "pass", "hosts": ["local", "gpu-elsewhere"]}]}))
    code, report = run_json(["report", "--baseline", str(baseline)], capsys)
    assert code == 0 and report["baseline"]["regressions"] == 0 and report["baseline"]["not_checked"] == 1
    assert main(["report", "--baseline", str(baseline)]) == 0
    captured = capsys.readouterr()
    assert "not checked" in captured.out and "host(s) gpu-elsewhere not in this run" in captured.err


@pytest.mark.parametrize("command", ["smoke", "bench"])
@pytest.mark.parametrize("setting, message", [
    ("max_new_token=64", "--set max_new_token: unknown knob (did you mean max_new_tokens?); known knobs: "),
    ("vocab=abc", "--set vocab: expected an integer >= 1, got 'abc'"),
])
def test_a_bad_or_unknown_knob_is_refused_before_anything_is_allocated_or_pushed(env, capsys, command, setting,
                                                                                  message):
    """Issue #47: `--set max_new_token=64` (a typo) ran and exited 0; a bad value was refused
    only after a run id was allocated and the release pushed (and became the latest run)."""
    code = main([command, "--set", setting, "--plot" if command == "bench" else "--keep-going",
                 *([str(env / "charts")] if command == "bench" else [])])
    err = capsys.readouterr().err
    assert code == 2
    assert f"error: {message}" in err and len(err.strip().splitlines()) == 1
    if "unknown" in message:
        assert "max_new_tokens, max_prompts, near_tie_gap" in err  # the known ones, listed
    assert not (env / "runs").exists() and not (env / "wd").exists() and not (env / "charts").exists()
    code, doc = run_json([command, "--set", setting], capsys)
    assert code == 2 and doc["exit_code"] == 2 and doc["error"].startswith(message)


def test_collect_names_the_run_hosts_it_cannot_reach_through_the_inventory(env, capsys):
    code, doc = run_json(["smoke", "--stages", "env"], capsys)
    assert code == 0
    run_id = doc["run_id"]
    run_json_path = env / "runs" / run_id / "run.json"
    meta = json.loads(run_json_path.read_text())
    meta["hosts"] = ["local", "ghost"]  # a host since removed from the inventory
    run_json_path.write_text(json.dumps(meta))
    (env / "runs" / run_id / "ghost").mkdir()
    (env / "runs" / run_id / "ghost" / "run.json").write_text("{}")
    code = main(["collect", run_id, "--json"])
    captured = capsys.readouterr()
    assert code == 0 and set(json.loads(captured.out)["hosts"]) == {"local"}
    assert f"1 host(s) of run {run_id} are not in {env / 'hosts.yaml'}, not collected: ghost" in captured.err
    other = env / "other.yaml"
    other.write_text(yaml.safe_dump({"hosts": {"elsewhere": {"transport": "local"}}}))
    assert main(["collect", run_id, "-i", str(other)]) == 2
    assert f"run {run_id} has hosts local, ghost; none of them in {other}" in capsys.readouterr().err
