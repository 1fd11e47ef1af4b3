"""`collect` must never adopt another run's records as this run's result: a host whose run
folder holds the event log and stage copies of another (passing) run, e.g. copied there by
hand, fails the collect with one line naming the file, our records stay exactly as they were,
and `report` still shows the run's own (failed) result. Local transport, real CLI."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.cli.app import main  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event  # noqa: E402

PASSED, FAILED = "20261201-100000-aaaaa1", "20261201-100000-aaaaa2"


def run_records(run_id: str, stages: list[str], status: str) -> list[str]:
    lines = [encode_event(make_event(EventKind.RUN_START, run_id, "local", stages=stages))]
    for index, stage in enumerate(stages):
        lines.append(encode_event(make_event(EventKind.STAGE_START, run_id, "local", stage=stage, index=index)))
        lines.append(encode_event(make_event(
            EventKind.STAGE_END, run_id, "local", stage=stage, index=index, status=status,
            reason="" if status == "pass" else "summary differs", duration_s=0.1, metrics={}, tables={},
            traceback=None, output_tail=None)))
    lines.append(encode_event(make_event(EventKind.RUN_END, run_id, "local", status=status, counts={},
                                         duration_s=1.0, exit_code=0 if status == "pass" else 5)))
    return lines


def write_run(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "stages").mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    for text in lines:
        record = json.loads(text)
        if record["event"] == "stage_end":
            (run_dir / "stages" / f"{record['stage']}.json").write_text(text)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "remote" not in p.relative_to(folder).parts}


def test_collect_refuses_another_runs_log_on_the_host_and_report_keeps_the_runs_own_result(
        tmp_path, monkeypatch, capsys):
    runs, workdir = tmp_path / "runs", tmp_path / "wd"
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(runs))
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(workdir)}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    # The failed run as it streamed back (complete) ...
    failed = run_records(FAILED, ["golden"], "fail")
    (runs / FAILED).mkdir(parents=True)
    (runs / FAILED / "run.json").write_text(json.dumps({"run_id": FAILED, "hosts": ["local"], "stages": ["golden"]}))
    write_run(runs / FAILED / "local", failed)
    (runs / FAILED / "local" / "run.json").write_text(json.dumps({"host": "local", "workdir": str(workdir)}))
    # ... and on the host, `cp runs/<PASS>/events.jsonl runs/<PASS>/stages/*.json runs/<FAIL>/`:
    # more records than ours, so a log judged by its length alone would be adopted.
    write_run(workdir / "runs" / FAILED, run_records(PASSED, ["env", "golden"], "pass"))
    before = snapshot(runs / FAILED / "local")

    assert main(["collect", FAILED, "--json"]) == 5
    doc = json.loads(capsys.readouterr().out)
    error = doc["hosts"]["local"]["error"]
    remote_log = runs / FAILED / "local" / "remote" / "events.jsonl"
    assert error == (f"local: collect: not adopted, local records kept: {remote_log}: line 1: run_id "
                     f"'{PASSED}' is not this run's '{FAILED}': a record of another run")
    assert snapshot(runs / FAILED / "local") == before  # our records: byte for byte as they were
    assert remote_log.is_file()  # what the host sent stays for a look, under remote/

    assert main(["report", FAILED, "--json"]) == 0  # no baseline: the report itself succeeds
    report = json.loads(capsys.readouterr().out)
    assert report["run_exit_code"] == 5  # the run's own verdict: a stage failed
    host = report["hosts"]["local"]
    assert host["outcome"] == "fail" and list(host["stages"]) == ["golden"]
    assert host["stages"]["golden"]["status"] == "fail"
