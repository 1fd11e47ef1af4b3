"""The local run store (ddtree_ops/results.py): writing records as they arrive, reading a
run back (complete, or cut short by a dead host), exit codes, and adopting collected files."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.errors import ConfigError, ExitCode, UsageError  # noqa: E402
from ddtree_ops.outcome import HostOutcome, exit_code_for  # noqa: E402
from ddtree_ops.results import (  # noqa: E402
    RunStore,
    StageStatus,
    adopt_remote_records,
    check_run_id,
    new_run_id,
    runs_root,
)
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event  # noqa: E402


def line(kind: EventKind, host: str = "h1", **fields) -> str:
    return encode_event(make_event(kind, "run-1", host, **fields))


def full_run(host: str = "h1", fail: bool = False) -> list[str]:
    end_status = "fail" if fail else "pass"
    return [
        line(EventKind.RUN_START, host, stages=["env", "golden"], python="3.11", torch="2.13"),
        line(EventKind.STAGE_START, host, stage="env", index=0),
        line(EventKind.STAGE_END, host, stage="env", index=0, status="pass", reason="",
             duration_s=0.5, metrics={"torch": "2.13"}, tables={}, traceback=None,
             output_tail=None),
        line(EventKind.STAGE_START, host, stage="golden", index=1),
        line(EventKind.STAGE_END, host, stage="golden", index=1, status=end_status,
             reason="mismatch" if fail else "", duration_s=0.1, metrics={}, tables={},
             traceback="Traceback...\nAssertionError: nope" if fail else None,
             output_tail=None),
        line(EventKind.RUN_END, host, status=end_status, counts={}, duration_s=1.0,
             exit_code=5 if fail else 0),
    ]


def test_run_ids_sort_by_time_and_reject_paths(tmp_path):
    assert new_run_id(1_000_000) < new_run_id(2_000_000)
    assert check_run_id("20261130-172400-ab12cd") == "20261130-172400-ab12cd"
    for bad in ("../etc", "a/b", "", ".hidden"):
        with pytest.raises(UsageError, match="run id"):
            check_run_id(bad)


def test_runs_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DDTREE_OPS_RUNS_DIR", raising=False)
    assert runs_root() == Path("runs")
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "env"))
    assert runs_root() == tmp_path / "env"
    assert runs_root(tmp_path / "opt") == tmp_path / "opt"


def test_recorder_writes_events_stage_files_and_meta(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"], "stages": []})
    recorder = store.host_recorder("run-1", "h1", {"inventory": {"name": "h1"}})
    for text in full_run():
        assert recorder.feed_line(text) is not None
    assert recorder.feed_line("stray warning from python") is None
    recorder.close()
    host_dir = tmp_path / "run-1" / "h1"
    assert len((host_dir / "events.jsonl").read_text().splitlines()) == 6
    assert json.loads((host_dir / "stages" / "env.json").read_text())["metrics"] == {"torch": "2.13"}
    meta = json.loads((host_dir / "run.json").read_text())
    assert meta["torch"] == "2.13" and meta["remote_status"] == "pass"
    assert meta["inventory"] == {"name": "h1"}
    assert "stray warning" in (host_dir / "output.log").read_text()
    run = store.load("run-1")
    host = run.hosts["h1"]
    assert host.outcome is HostOutcome.PASS
    assert [s.status for s in host.stages.values()] == [StageStatus.PASS, StageStatus.PASS]
    assert host.metric("env", "torch") == "2.13" and host.metric("env", "status") == "pass"
    assert store.latest_run() == "run-1"


def test_a_host_lost_mid_stage_keeps_what_arrived(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    for text in full_run()[:4]:  # died inside `golden`
        recorder.feed_line(text)
    recorder.note(outcome="lost", error="h1: connection lost: socket closed")
    recorder.close()
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.LOST
    assert host.stages["env"].status is StageStatus.PASS
    golden = host.stages["golden"]
    assert golden.status is StageStatus.FAIL
    assert golden.reason == "no result: h1: connection lost: socket closed during this stage"


def test_unknown_run_and_empty_store_are_usage_errors(tmp_path):
    store = RunStore(tmp_path / "none")
    with pytest.raises(UsageError, match="no runs under"):
        store.load()
    RunStore(tmp_path).create_run("run-1", {"hosts": []})
    with pytest.raises(UsageError, match=r"no run 'run-2' under .* \(latest: run-1\)"):
        RunStore(tmp_path).load("run-2")


@pytest.mark.parametrize("outcomes,code", [
    ([HostOutcome.PASS, HostOutcome.PASS], ExitCode.OK),
    ([HostOutcome.PASS, HostOutcome.LOST], ExitCode.PARTIAL),
    ([HostOutcome.PASS, HostOutcome.FAIL], ExitCode.PARTIAL),
    ([HostOutcome.FAIL], ExitCode.REMOTE),
    ([HostOutcome.FAIL, HostOutcome.UNREACHABLE], ExitCode.REMOTE),
    ([HostOutcome.UNREACHABLE, HostOutcome.UNREACHABLE], ExitCode.CONNECT),
    ([HostOutcome.PASS, HostOutcome.INTERRUPTED], ExitCode.INTERRUPTED),
    ([HostOutcome.PASS, HostOutcome.REFUSED], ExitCode.USAGE),
    ([HostOutcome.UNREACHABLE, HostOutcome.NOT_STARTED], ExitCode.CONNECT),  # a stopped rollout
    ([HostOutcome.HOST_KEY_REFUSED, HostOutcome.UNREACHABLE], ExitCode.CONNECT),
    ([HostOutcome.HOST_KEY_REFUSED, HostOutcome.FAIL], ExitCode.REMOTE),
    ([HostOutcome.NOT_STARTED], ExitCode.REMOTE),
    ([], ExitCode.OK),
])
def test_exit_codes_follow_design(outcomes, code):
    assert exit_code_for(outcomes) == code


def test_adopting_the_hosts_more_complete_log(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    records = full_run()
    for text in records[:2]:
        recorder.feed_line(text)
    recorder.note(outcome="lost", error="connection lost")
    recorder.close()
    host_dir = tmp_path / "run-1" / "h1"
    (host_dir / "remote" / "stages").mkdir(parents=True)
    (host_dir / "remote" / "events.jsonl").write_text("\n".join(records) + "\n")
    for text in records:
        record = json.loads(text)
        if record["event"] == "stage_end":
            (host_dir / "remote" / "stages" / f"{record['stage']}.json").write_text(text)
    assert adopt_remote_records(host_dir, "run-1", "h1") is True
    assert adopt_remote_records(host_dir, "run-1", "h1") is False  # idempotent: nothing more to take
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.LOST  # history is never rewritten: the run lost this host
    assert host.stages["golden"].status is StageStatus.PASS  # and it shows what the host finished
    assert host.history["completed_on_host"] == "pass" and host.history["collected_at"] is not None


def test_a_lost_host_keeps_when_after_what_silence_and_how_long_it_ran(tmp_path):
    """Injected clock: the runner started at t=100, the last line came at t=130 in stage
    golden (begun at t=110), the stream ended at t=190."""
    now = [100.0]
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {}, clock=lambda: now[0])
    recorder.note(runner_started=100.0)
    records = full_run()
    recorder.feed_line(records[0])  # run_start
    now[0] = 110.0
    recorder.feed_line(line(EventKind.STAGE_START, stage="golden", index=0))
    now[0] = 130.0
    recorder.feed_line("")  # a keepalive is hearing from the host too
    now[0] = 190.0
    recorder.connection_ended()
    now[0] = 400.0  # the other hosts finished much later: the facts are the loss's
    recorder.note_lost("h1: connection lost: sent nothing for 60s", "failed")
    recorder.close()
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.LOST
    assert host.history == {"lost_at": 190.0, "silent_s": 60.0, "ran_s": 90.0, "stage": "golden",
                            "stage_ran_s": 80.0, "error": "h1: connection lost: sent nothing for 60s",
                            "completed_on_host": None, "host_exit_code": None, "finished_on_host_at": None,
                            "collected_at": None}
    golden = host.stages["golden"]
    assert golden.lost and golden.duration_s == 80.0 and golden.reason.startswith("no result:")


@pytest.mark.parametrize("stage", ["env\n", "../env", "a/b", "", "x" * 65])
def test_a_stage_name_that_is_not_a_safe_file_name_writes_no_stage_file(tmp_path, stage):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    recorder.feed_line(line(EventKind.STAGE_END, stage=stage, index=0, status="pass", reason="",
                            duration_s=0.1, metrics={}, tables={}, traceback=None, output_tail=None))
    recorder.feed_line(line(EventKind.STAGE_END, stage="env", index=1, status="pass", reason="",
                            duration_s=0.1, metrics={}, tables={}, traceback=None, output_tail=None))
    recorder.close()
    written = sorted(p.name for p in (tmp_path / "run-1" / "h1" / "stages").iterdir())
    assert written == ["env.json"]  # the hostile name left nothing behind; the good one landed


def recorded_full_run(root: Path) -> RunStore:
    store = RunStore(root)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    for text in full_run():
        recorder.feed_line(text)
    recorder.close()
    return store


@pytest.mark.parametrize("field,value,message", [
    ("index", "first", "stage_end.index: expected an integer, got 'first'"),
    ("duration_s", "fast", "stage_end.duration_s: expected a finite number >= 0, got 'fast'"),
    ("duration_s", 1e999, "stage_end.duration_s: expected a finite number >= 0, got inf"),
    ("metrics", [1, 2], "stage_end.metrics: expected an object, got [1, 2]"),
    ("tables", [{"budget": 16, "ms": 1.0}], "stage_end.tables: expected {name: [row objects]}"),
    ("tables", {"sweep": "abc"}, "stage_end.tables: expected {name: [row objects]}"),
])
def test_a_record_edited_by_hand_fails_its_host_naming_file_line_and_field(tmp_path, field, value, message):
    store = recorded_full_run(tmp_path)
    events = tmp_path / "run-1" / "h1" / "events.jsonl"
    records = [json.loads(text) for text in events.read_text().splitlines()]
    bad = next(r for r in records if r["event"] == "stage_end" and r["stage"] == "golden")
    bad[field] = value
    events.write_text("".join(json.dumps(r) + "\n" for r in records))
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.FAIL
    assert host.error.startswith(f"{events}: line {records.index(bad) + 1}: {message}")


def test_the_runners_import_errors_are_kept_with_the_host(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    recorder.feed_line(line(EventKind.RUN_START, stages=["env"], python="3.11",
                            torch_error="OSError: libcudart.so.12: cannot open shared object file"))
    recorder.close()
    meta = json.loads((tmp_path / "run-1" / "h1" / "run.json").read_text())
    assert meta["torch_error"] == "OSError: libcudart.so.12: cannot open shared object file"


def test_a_truncated_stage_copy_is_not_needed_when_the_event_log_has_the_stage(tmp_path):
    store = recorded_full_run(tmp_path)
    copy = tmp_path / "run-1" / "h1" / "stages" / "golden.json"
    copy.write_text(copy.read_text()[:20])
    assert store.load("run-1").hosts["h1"].stages["golden"].status is StageStatus.PASS


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def lost_run_with_remote_copy(root: Path, remote_lines: list[str]) -> tuple[RunStore, Path]:
    """run-1 on h1: two records streamed, then lost; the host's copy (remote/) is given."""
    store = RunStore(root)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    for text in full_run(fail=True)[:4]:
        recorder.feed_line(text)
    recorder.note(outcome="lost", error="connection lost")
    recorder.close()
    host_dir = root / "run-1" / "h1"
    (host_dir / "remote" / "stages").mkdir(parents=True)
    (host_dir / "remote" / "events.jsonl").write_text("\n".join(remote_lines) + "\n")
    for text in remote_lines:
        record = json.loads(text)
        if record["event"] == "stage_end":
            (host_dir / "remote" / "stages" / f"{record['stage']}.json").write_text(text)
    return store, host_dir


def other_run(host: str = "h1") -> list[str]:
    """A passing run of another run id (what `cp runs/<PASS>/* runs/<FAIL>/` leaves on a host)."""
    return [text.replace('"run_id":"run-1"', '"run_id":"run-0"') for text in full_run(host)]


ANOTHER_RUN = "run_id 'run-0' is not this run's 'run-1': a record of another run"


@pytest.mark.parametrize("remote_lines, where, message", [
    (other_run(), "line 1", ANOTHER_RUN),
    (full_run("h2"), "line 1", "host 'h2' is not this host's 'h1': a record of another host"),
    (full_run()[:5] + other_run()[5:], "line 6", ANOTHER_RUN),  # a log spliced from two runs
    ([text.replace('"run_id":"run-1",', "") for text in full_run()], "line 1",
     "no run_id (expected 'run-1'): not a record of this run"),
])
def test_the_hosts_log_of_another_run_or_host_is_refused_and_ours_is_kept(tmp_path, remote_lines, where, message):
    store, host_dir = lost_run_with_remote_copy(tmp_path, remote_lines)
    local = {k: v for k, v in snapshot(host_dir).items() if not k.startswith("remote/")}
    with pytest.raises(ConfigError) as caught:
        adopt_remote_records(host_dir, "run-1", "h1")
    assert str(caught.value) == f"{host_dir / 'remote' / 'events.jsonl'}: {where}: {message}"
    assert caught.value.exit_code == ExitCode.CONFIG
    assert {k: v for k, v in snapshot(host_dir).items() if not k.startswith("remote/")} == local  # nothing lost
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.LOST and host.stages["golden"].status is StageStatus.FAIL


def test_a_stage_copy_of_another_run_is_refused_before_anything_is_adopted(tmp_path):
    store, host_dir = lost_run_with_remote_copy(tmp_path, full_run())
    stage_copy = host_dir / "remote" / "stages" / "golden.json"
    stage_copy.write_text(other_run()[4])  # golden's stage_end, from run-0
    local = {k: v for k, v in snapshot(host_dir).items() if not k.startswith("remote/")}
    with pytest.raises(ConfigError, match=rf"^{stage_copy}: run_id 'run-0' is not this run's 'run-1'"):
        adopt_remote_records(host_dir, "run-1", "h1")
    assert {k: v for k, v in snapshot(host_dir).items() if not k.startswith("remote/")} == local


def test_a_local_log_holding_another_runs_records_is_refused_by_name(tmp_path):
    store = recorded_full_run(tmp_path)
    events = tmp_path / "run-1" / "h1" / "events.jsonl"
    events.write_text("\n".join(other_run()) + "\n")  # copied by hand from run-0
    host = store.load("run-1").hosts["h1"]  # the host fails; a run's other hosts are still read
    assert host.outcome is HostOutcome.FAIL and host.stages == {}
    assert host.error == f"{events}: line 1: run_id 'run-0' is not this run's 'run-1': a record of another run"


def test_a_local_stage_copy_of_another_host_is_refused_by_name(tmp_path):
    store = recorded_full_run(tmp_path)
    host_dir = tmp_path / "run-1" / "h1"
    (host_dir / "stages" / "extra.json").write_text(full_run("h2")[2].replace('"stage":"env"', '"stage":"extra"'))
    host = store.load("run-1").hosts["h1"]
    assert host.outcome is HostOutcome.FAIL
    assert host.error.startswith(f"{host_dir / 'stages' / 'extra.json'}: host 'h2' is not this host's 'h1'")


def test_a_streamed_record_of_another_run_is_stray_output_not_ours(tmp_path):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    theirs, ours = other_run()[:3], full_run()[:3]
    for text in theirs + ours:
        recorder.feed_line(text)
    recorder.close()
    host_dir = tmp_path / "run-1" / "h1"
    assert (host_dir / "events.jsonl").read_text().splitlines() == ours
    assert (host_dir / "output.log").read_text().splitlines() == theirs
    assert json.loads((host_dir / "stages" / "env.json").read_text())["run_id"] == "run-1"


@pytest.mark.parametrize("bad, why", [
    ('"stages":7', "run_start.stages: expected a list of stage names, got 7"),
    ('"stages":["env"],"stage":{"x":1}', "run_start.stage: expected a stage name, got {'x': 1}"),
])
def test_a_streamed_record_with_a_wrong_field_fails_only_its_host(tmp_path, bad, why):
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1", "h2"]})
    good = store.host_recorder("run-1", "h1", {})
    for text in full_run("h1"):
        good.feed_line(text)
    good.close()
    broken = store.host_recorder("run-1", "h2", {})
    record = '{"v":1,"event":"run_start","run_id":"run-1","host":"h2",' + bad + "}"
    assert broken.feed_line(record) is None  # never read as a result
    for text in full_run("h2"):
        broken.feed_line(text)
    broken.close()
    assert broken.record_error == f"a record was refused: {why}"
    run = store.load("run-1")
    assert run.hosts["h1"].outcome is HostOutcome.PASS
    assert (run.hosts["h2"].outcome, run.hosts["h2"].error) == (HostOutcome.FAIL, f"a record was refused: {why}")
    assert record in (tmp_path / "run-1" / "h2" / "output.log").read_text()  # kept for a look


def test_streamed_output_is_shown_not_kept_and_a_malformed_one_fails_its_host(tmp_path, monkeypatch):
    """`-v`'s output records: returned for the view, never in events.jsonl (the host's logs are
    the record), never counted against the stage's records; a malformed one is refused."""
    from ddtree_ops import results

    monkeypatch.setattr(results, "MAX_RECORDS_PER_STAGE", 50)
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1", "h2"]})
    recorder = store.host_recorder("run-1", "h1", {})
    for text in full_run()[:2]:
        recorder.feed_line(text)
    for number in range(200):
        record = recorder.feed_line(line(EventKind.OUTPUT, stage="env", file=None, lines=[f"line {number}"]))
        assert record["lines"] == [f"line {number}"]
    for text in full_run()[2:]:
        recorder.feed_line(text)
    recorder.close()
    assert recorder.record_error is None
    assert '"output"' not in (tmp_path / "run-1" / "h1" / "events.jsonl").read_text()
    assert store.load("run-1").hosts["h1"].outcome is HostOutcome.PASS
    broken = store.host_recorder("run-1", "h2", {})
    assert broken.feed_line(line(EventKind.OUTPUT, host="h2", stage="env", file=None, lines="not a list")) is None
    assert broken.record_error == "a record was refused: output.lines: expected a list of strings, got 'not a list'"
    beat = line(EventKind.HEARTBEAT, host="h2", stage="env", elapsed_s=1.0, last_output=7)
    assert broken.feed_line(beat) is None


def test_a_host_flooding_one_stage_with_records_fails_past_the_budget(tmp_path, monkeypatch):
    from ddtree_ops import results

    monkeypatch.setattr(results, "MAX_RECORDS_PER_STAGE", 50)
    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1"]})
    recorder = store.host_recorder("run-1", "h1", {})
    recorder.feed_line(full_run()[0])
    for number in range(200):
        recorder.feed_line(line(EventKind.LOG, stage="env", message=f"log {number}"))
    recorder.close()
    assert recorder.record_error == "a record was refused: stage 'env': more than 50 records"
    assert sum(1 for _ in (tmp_path / "run-1" / "h1" / "events.jsonl").open()) == 51  # run_start + 50
    assert store.load("run-1").hosts["h1"].outcome is HostOutcome.FAIL


def test_a_bad_event_log_on_one_host_leaves_the_report_of_the_others(tmp_path, capsys):
    from ddtree_ops.cli.app import main

    store = RunStore(tmp_path)
    store.create_run("run-1", {"hosts": ["h1", "h2"]})
    for host in ("h1", "h2"):
        recorder = store.host_recorder("run-1", host, {})
        for text in full_run(host):
            recorder.feed_line(text)
        recorder.close()
    events = tmp_path / "run-1" / "h2" / "events.jsonl"
    events.write_text(events.read_text().replace('"duration_s":0.5', '"duration_s":"soon"'))
    assert main(["report", "run-1", "--runs-dir", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run_exit_code"] == 6 and doc["hosts"]["h1"]["outcome"] == "pass"
    assert doc["hosts"]["h2"]["outcome"] == "fail"
    assert [f["reason"] for f in doc["failures"]] == [
        f"{events}: line 3: stage_end.duration_s: expected a finite number >= 0, got 'soon'"]
