"""`ddtree-ops report` recommends a variant per host and load from sglang-e2e's load table and
sets decode-bench's predictions beside the measurements. sglang-e2e needs a GPU, so the run's
records are written here as the host runner writes them (its event lines, through RunStore)."""
from __future__ import annotations

import json

from ddtree_ops.cli.app import main
from ddtree_ops.results import RunStore
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event

STAGES = ["decode-bench", "sglang-e2e"]
QUIET = {"before": {"loadavg_1m": 0.5, "cpus": 16}, "after": {"loadavg_1m": 0.7, "cpus": 16}}
BUSY = {"before": {"loadavg_1m": 40.0, "cpus": 16}, "after": {"loadavg_1m": 41.0, "cpus": 16}}


def load_rows(level, no_spec, dflash, ddtree64):
    return [{"variant": "no-spec", "mode": "no-spec", "budget": None, "concurrency": level, "tokens_per_s": no_spec},
            {"variant": "dflash", "mode": "dflash", "budget": None, "concurrency": level, "tokens_per_s": dflash},
            {"variant": "ddtree-b64", "mode": "ddtree", "budget": 64, "concurrency": level, "tokens_per_s": ddtree64}]


def lossless_rows(load):
    """The stage's `sglang_e2e` table as a passing stage writes it: one row per variant, every
    prompt equal to no speculation's."""
    variants = dict.fromkeys(row["variant"] for row in load)
    return [{"variant": v, "tokens": 512, "divergent_prompts": 0, "near_ties": 0} for v in variants]


def write_run(runs, hosts, run_id="r1", status="pass", reason="", lossless=lossless_rows):
    """`lossless(load) -> the sglang_e2e table` (None: the record has none)."""
    store = RunStore(runs)
    store.create_run(run_id, {"hosts": list(hosts), "stages": STAGES})
    def e2e_tables(load):
        checks = lossless(load) if lossless else None
        return {"sglang_load": load, **({"sglang_e2e": checks} if checks is not None else {})}

    for host, (load, e2e_load) in hosts.items():
        recorder = store.host_recorder(run_id, host, {})
        predictions = [{"concurrency": 1, "method": "ddtree", "budget": 64, "width": 65, "tau": 3.1,
                        "tau_measured": True, "round_ms": 10.0, "tokens_per_s": 310.0}]
        for index, (stage, tables, stage_load) in enumerate([("decode-bench", {"predictions": predictions}, QUIET),
                                                             ("sglang-e2e", e2e_tables(load), e2e_load)]):
            event = make_event(EventKind.STAGE_END, run_id, host, stage=stage, index=index,
                               status=status if index else "pass", reason=reason if index else "",
                               duration_s=1.0, metrics={}, tables=tables, traceback=None, output_tail=None,
                               load=stage_load)
            if index == 0:
                recorder.feed_line(encode_event(make_event(EventKind.RUN_START, run_id, host, stages=STAGES)))
            recorder.feed_line(encode_event(event))
        recorder.feed_line(encode_event(make_event(EventKind.RUN_END, run_id, host, status="pass")))
        recorder.close()


def test_report_recommends_per_host_and_level_and_says_when_it_cannot(tmp_path, capsys):
    write_run(tmp_path, {
        "gpu-a": (load_rows(1, 100.0, 200.0, 300.0) + load_rows(8, 400.0, 600.0, 380.0), QUIET),
        "gpu-b": (load_rows(1, 100.0, 200.0, 300.0), BUSY),
    })
    assert main(["report", "--runs-dir", str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    verdicts = {(r["host"], r["concurrency"]): r for r in document["recommendations"]}
    assert verdicts[("gpu-a", 1)]["choice"] == "ddtree" and verdicts[("gpu-a", 1)]["budget"] == 64
    assert verdicts[("gpu-a", 1)]["speedup_vs_dflash"] == 1.5
    assert verdicts[("gpu-a", 8)]["choice"] == "dflash"
    assert verdicts[("gpu-b", 1)]["choice"] == "undecided" and "too noisy to decide: host load" in verdicts[("gpu-b", 1)]["why"]
    compared = {(r["host"], r["concurrency"], r["variant"]): r for r in document["predicted_vs_measured"]}
    assert set(compared) == {("gpu-a", 1, "ddtree-b64"), ("gpu-b", 1, "ddtree-b64")}
    assert compared[("gpu-a", 1, "ddtree-b64")]["error"] == round(310.0 / 300.0 - 1, 4)

    assert main(["report", "--runs-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "recommendation: which variant pays at each load" in text
    assert "deploy DDTree with budget 64" in text and "DDTree does not pay at 8 concurrent requests" in text
    assert "throughput model: predicted beside measured" in text and "+3%" in text


def test_a_run_without_load_measurements_shows_no_recommendation(tmp_path, capsys):
    write_run(tmp_path, {"gpu-a": ([], QUIET)})
    assert main(["report", "--runs-dir", str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["recommendations"] == [] and document["predicted_vs_measured"] == []
    assert main(["report", "--runs-dir", str(tmp_path)]) == 0
    assert "recommendation" not in capsys.readouterr().out


def test_a_failed_or_missing_lossless_check_recommends_nothing_and_says_so(tmp_path, capsys):
    fast = load_rows(1, 100.0, 200.0, 300.0)  # DDTree the clear winner, were its tokens right
    write_run(tmp_path / "failed", {"gpu-a": (fast, QUIET)}, status="fail",
              reason="ddtree-b64: prompt 0 differs at token 3 (expected 11, got 12, top-2 gap 2.1)")
    write_run(tmp_path / "missing", {"gpu-a": (fast, QUIET)}, lossless=lambda load: None)
    write_run(tmp_path / "diverged", {"gpu-a": (fast, QUIET)}, lossless=lambda load: [
        {**row, "divergent_prompts": 1 if row["variant"] == "ddtree-b64" else 0} for row in lossless_rows(load)])
    expected = {"failed": "not lossless: the sglang-e2e stage did not pass (fail: ddtree-b64: prompt 0 differs",
                "missing": "not lossless: no lossless check (sglang_e2e row) for variant 'dflash'",
                "diverged": "not lossless: variant 'ddtree-b64': its lossless check failed"}
    for runs, why in expected.items():
        assert main(["report", "--runs-dir", str(tmp_path / runs), "--json"]) == 0
        (verdict,) = json.loads(capsys.readouterr().out)["recommendations"]
        assert verdict["choice"] == "undecided" and verdict["budget"] is None, verdict
        assert verdict["why"].startswith(why), verdict["why"]
        assert main(["report", "--runs-dir", str(tmp_path / runs)]) == 0
        assert "deploy DDTree" not in capsys.readouterr().out


def test_a_row_whose_budget_the_plugin_refuses_recommends_nothing(tmp_path, capsys):
    for bad in (5000, True, -3, 0, "64", None, 64.0):
        runs = tmp_path / str(bad)
        rows = [dict(row, budget=bad) if row["mode"] == "ddtree" else row for row in load_rows(1, 100.0, 200.0, 300.0)]
        write_run(runs, {"gpu-a": (rows, QUIET)})
        assert main(["report", "--runs-dir", str(runs), "--json"]) == 0
        (verdict,) = json.loads(capsys.readouterr().out)["recommendations"]
        assert verdict["choice"] == "undecided", (bad, verdict)
        assert verdict["why"] == ("unusable measurement: the sglang_load row of variant 'ddtree-b64' has a budget "
                                  f"that must be an integer between 1 and 1024, got {bad!r}")
