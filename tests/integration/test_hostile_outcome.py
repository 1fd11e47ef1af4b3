"""A host's word is never the verdict (issue 40), tried as a hostile host would over a real
loopback sshd fleet: the host's `python` is a forger that answers the runner's `run` with
records of its own making (and runs the real interpreter for everything else, so the push
works). The outcome is judged on our side from the stages we asked for."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main

pytestmark = [pytest.mark.sshd, pytest.mark.slow]

ASKED = ["env", "import", "golden"]

# The forger: for `<python> .../runner.py run --run-id R --host H ...` it prints the records in
# FORGED (with R and H filled in) and exits 0; anything else runs the real interpreter.
FORGER = '''#!{real}
import json, os, sys
argv = sys.argv[1:]
if len(argv) > 1 and argv[0].endswith("runner.py") and argv[1] == "run":
    run_id, host = argv[argv.index("--run-id") + 1], argv[argv.index("--host") + 1]
    for record in json.loads({forged!r}):
        record.update(v=1, run_id=run_id, host=host, time=1.0)
        print(json.dumps(record), flush=True)
    sys.exit(0)
os.execv({real!r}, [{real!r}, *argv])
'''


def forger(path: Path, records: list[dict]) -> Path:
    path.write_text(FORGER.format(real=sys.executable, forged=json.dumps(records)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def stage_end(stage: str, index: int, status: str) -> dict:
    return {"event": "stage_end", "stage": stage, "index": index, "status": status, "reason": f"forged {status}",
            "duration_s": 0.1, "metrics": {}, "tables": {}, "traceback": None, "output_tail": None, "load": None}


def run_end(status: str = "pass") -> dict:
    return {"event": "run_end", "status": status, "counts": {"pass": 3}, "duration_s": 0.3, "exit_code": 0}


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def smoke_as(sshd_fleet, tmp_path, capsys, records: list[dict], *args: str) -> tuple[int, dict]:
    fleet = sshd_fleet(1, python=str(forger(tmp_path / "forger", records)))
    code = main(["smoke", "-i", str(fleet.write_inventory()), *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_run_end_saying_pass_over_failed_stages_fails_the_host(sshd_fleet, runs, tmp_path, capsys):
    records = [{"event": "run_start", "stages": ASKED},
               *(stage_end(s, i, "fail") for i, s in enumerate(ASKED)), run_end("pass")]
    code, doc = smoke_as(sshd_fleet, tmp_path, capsys, records, "--stages", ",".join(ASKED))
    host = doc["hosts"]["h0"]
    assert (code, host["outcome"]) == (5, "fail")
    assert [host["stages"][s]["status"] for s in ASKED] == ["fail"] * 3
    assert host["disagreements"] == ["run_end says pass, but env is fail, import is fail, golden is fail"]
    said = [f["reason"] for f in doc["failures"] if f["stage"] == "-"]
    assert len(said) == 1 and "events.jsonl: run_end says pass" in said[0]
    assert main(["report", doc["run_id"], "--json"]) == 0  # read back from the store: the same verdict
    again = json.loads(capsys.readouterr().out)
    assert (again["run_exit_code"], again["hosts"]["h0"]["outcome"]) == (5, "fail")


def test_a_run_start_leaving_out_asked_stages_reports_them_missing(sshd_fleet, runs, tmp_path, capsys):
    records = [{"event": "run_start", "stages": ["env"]}, stage_end("env", 0, "pass"), run_end("pass")]
    code, doc = smoke_as(sshd_fleet, tmp_path, capsys, records, "--stages", ",".join(ASKED))
    host = doc["hosts"]["h0"]
    assert (code, host["outcome"]) == (5, "fail")
    assert {s: host["stages"][s]["status"] for s in ASKED} == {"env": "pass", "import": "missing", "golden": "missing"}
    assert host["disagreements"][0] == "run_start listed env, but env,import,golden were asked for"
    assert {f["stage"] for f in doc["failures"]} == {"-", "import", "golden"}


def test_the_default_plan_is_ours_so_a_short_run_start_cannot_shrink_it(sshd_fleet, runs, tmp_path, capsys):
    """No --stages: the plan is the pushed release's default stages, spelled out on our side."""
    records = [{"event": "run_start", "stages": ["env"]}, stage_end("env", 0, "pass"), run_end("pass")]
    code, doc = smoke_as(sshd_fleet, tmp_path, capsys, records)
    host = doc["hosts"]["h0"]
    assert (code, host["outcome"]) == (5, "fail")
    assert doc["stages"][:3] == ASKED and host["stages"]["golden"]["status"] == "missing"


def test_a_run_end_saying_fail_over_passed_stages_is_kept_as_a_fail(sshd_fleet, runs, tmp_path, capsys):
    records = [{"event": "run_start", "stages": ASKED},
               *(stage_end(s, i, "pass") for i, s in enumerate(ASKED)), run_end("fail")]
    code, doc = smoke_as(sshd_fleet, tmp_path, capsys, records, "--stages", ",".join(ASKED))
    assert (code, doc["hosts"]["h0"]["outcome"]) == (5, "fail")
    assert "run_end says 'fail' while every stage passed" in doc["hosts"]["h0"]["disagreements"][0]
