"""The host-side runner, run for real (`python ddtree_ops/hostside/runner.py run ...` in a subprocess) on a
scratch release that holds purpose-built stages: pass, fail, raise, hang, abort, segfault."""
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

REPO = Path(__file__).resolve().parents[2]
# every test starts the real runner (and its torch import) in a subprocess: not in `make test-quick`
pytestmark = pytest.mark.slow

STAGES = {
    "ok": """
NAME = "ok"
DESCRIPTION = "passes with a metric"
NEEDS_TORCH = False
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    ctx.log("hello from ok")
    ctx.emit_metric("answer", 42)
    return StageResult.passed("fine", metrics={"device": ctx.device},
                              tables={"rows": [{"a": 1}, {"a": 2}]})
""",
    "bad": """
NAME = "bad"
DESCRIPTION = "returns a failure"
NEEDS_TORCH = False
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.failed("bad on purpose", metrics={"x": 1.5})
""",
    "boom": """
NAME = "boom"
DESCRIPTION = "raises"
NEEDS_TORCH = False
def run(ctx):
    raise RuntimeError("boom from a stage")
""",
    "hang": """
NAME = "hang"
DESCRIPTION = "never returns"
NEEDS_TORCH = False
import time
def run(ctx):
    print("about to hang", flush=True)
    time.sleep(3600)
""",
    "abort": """
NAME = "abort"
DESCRIPTION = "kills the interpreter"
NEEDS_TORCH = False
import os, sys
def run(ctx):
    print("last words before abort", flush=True)
    os.abort()
""",
    "segv": """
NAME = "segv"
DESCRIPTION = "segfaults"
NEEDS_TORCH = False
import ctypes
def run(ctx):
    print("about to segfault", flush=True)
    ctypes.string_at(0)
""",
    "skipme": """
NAME = "skipme"
DESCRIPTION = "skips"
NEEDS_TORCH = False
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.skipped("nothing to do here")
""",
    "pid": """
NAME = "pid"
DESCRIPTION = "reports the worker pid"
NEEDS_TORCH = False
import os
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.passed(metrics={"pid": os.getpid()})
""",
    "spawner": """
NAME = "spawner"
DESCRIPTION = "starts a server in its own session (cleaned up in finally) and a plain child"
NEEDS_TORCH = False
import subprocess, time
def run(ctx):
    server = subprocess.Popen(["sleep", "333"], start_new_session=True)
    plain = subprocess.Popen(["sleep", "334"])  # no cleanup of its own
    (ctx.run_dir / "children").write_text(f"{server.pid} {plain.pid}")
    try:
        time.sleep(3600)
    finally:
        server.kill()
        server.wait()
""",
    "odd": """
NAME = "odd"
DESCRIPTION = "a reason that is no string"
NEEDS_TORCH = False
def run(ctx):
    from pathlib import Path
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.failed(ValueError("made by an exception"), metrics={"where": str(Path("/x"))})
""",
    "listtables": """
NAME = "listtables"
DESCRIPTION = "tables as a list"
NEEDS_TORCH = False
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.passed("rows", tables=[{"budget": 16, "ms": 1.0}])
""",
    "notorch": """
NAME = "notorch"
DESCRIPTION = "reports whether torch was imported"
NEEDS_TORCH = False  # a comment may follow
import sys
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    return StageResult.passed(metrics={"torch_loaded": "torch" in sys.modules, "device": ctx.device})
""",
    "serverlog": """
NAME = "serverlog"
DESCRIPTION = "writes its log and a server's log in its artifacts folder, then waits quietly"
NEEDS_TORCH = False
import sys, time
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    print("starting the server", flush=True)
    with open(ctx.artifacts_dir / "server-x.log", "w") as log:
        log.write("loading weights\\nhalf a li")
        log.flush()
        time.sleep(float(ctx.host.get("quiet_s", 1.0)))  # a few polls see the unended line
        log.write("ne\\nUvicorn running\\n")
    sys.stdout.write("no newline at the end")
    return StageResult.passed("served")
""",
    "threadlog": """
NAME = "threadlog"
DESCRIPTION = "logs from several threads at once"
NEEDS_TORCH = False
import threading
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    def chatter(tag):
        for i in range(1500):
            ctx.log(tag * 6000)
            ctx.emit_metric(f"m{tag}", i)
    threads = [threading.Thread(target=chatter, args=(t,)) for t in "abcd"]
    for t in threads: t.start()
    for t in threads: t.join()
    return StageResult.passed("done")
""",
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("release")
    (root / "ddtree_ops" / "hostside" / "stages").mkdir(parents=True)
    shutil.copy(REPO / "ddtree_ops" / "__init__.py", root / "ddtree_ops" / "__init__.py")
    for name in ("__init__.py", "agent.py", "protocol.py", "release_check.py", "runner.py", "safe_write.py", "signals.py",
                 "stage_output.py"):
        shutil.copy(REPO / "ddtree_ops" / "hostside" / name, root / "ddtree_ops" / "hostside" / name)
    shutil.copy(REPO / "ddtree_ops" / "hostside" / "stages" / "__init__.py", root / "ddtree_ops" / "hostside" / "stages")
    shutil.copy(REPO / "ddtree_ops" / "hostside" / "stages" / "env.py", root / "ddtree_ops" / "hostside" / "stages")
    for name, code in STAGES.items():
        (root / "ddtree_ops" / "hostside" / "stages" / f"{name}.py").write_text(code)
    (root / "src").symlink_to(REPO / "src")
    return root


def run_runner(release: Path, workdir: Path, stages: str, *extra: str, run_id: str = "r1",
               timeout: float = 300) -> tuple[int, list[dict], str]:
    argv = [sys.executable, str(release / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", run_id,
            "--workdir", str(workdir), "--release-root", str(release), "--host", "h1",
            "--stages", stages, *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, records, proc.stderr


def needing_torch(release: Path, stage: str) -> None:
    """Drop the stage's `NEEDS_TORCH = False`: the runner then imports torch and ddtree first."""
    module = release / "ddtree_ops" / "hostside" / "stages" / f"{stage}.py"
    module.write_text(module.read_text().replace("NEEDS_TORCH = False\n", ""))


def ends(records: list[dict]) -> dict[str, dict]:
    return {r["stage"]: r for r in records if r["event"] == "stage_end"}


def test_passing_stage_streams_records_and_writes_them_on_the_host(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "ok,skipme")
    assert code == 0
    kinds = [r["event"] for r in records]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert all(r["v"] == 1 and r["run_id"] == "r1" and r["host"] == "h1" for r in records)
    assert {"run_id", "host", "time"} <= set(records[0])
    ok = ends(records)["ok"]
    assert ok["status"] == "pass" and ok["reason"] == "fine"
    assert ok["metrics"] == {"answer": 42, "device": "cpu"}
    assert ok["tables"] == {"rows": [{"a": 1}, {"a": 2}]}
    assert ok["duration_s"] >= 0 and ok["traceback"] is None
    assert ends(records)["skipme"]["status"] == "skip"
    assert any(r["event"] == "log" and r["message"] == "hello from ok" for r in records)
    assert any(r["event"] == "metric" and r["name"] == "answer" for r in records)
    run_dir = tmp_path / "runs" / "r1"
    on_disk = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert on_disk == records
    assert json.loads((run_dir / "stages" / "ok.json").read_text()) == ok
    assert "hello from ok" in (run_dir / "logs" / "ok.log").read_text()
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["status"] == "pass" and summary["counts"]["pass"] == 1
    assert not (run_dir / "runner.pid").exists()


def test_the_runner_writes_nothing_through_a_linked_run_folder_or_record(release, tmp_path):
    """#49: the host side's writes follow no link below the workdir either (hostside.safe_write):
    a linked run folder is refused in one line; a link at a record's name is replaced."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(outside)
    code, records, stderr = run_runner(release, tmp_path, "ok")
    assert (code, records) == (2, [])
    assert stderr.strip() == f"runner: {tmp_path / 'runs' / 'r1'}: a link on the way to a file we write: refused " \
                             "(nothing is written through a link)"
    assert list(outside.iterdir()) == []
    (tmp_path / "runs" / "r1").unlink()
    (tmp_path / "runs" / "r1" / "stages").mkdir(parents=True)
    victim = outside / "victim.json"
    victim.write_text("operator's\n")
    (tmp_path / "runs" / "r1" / "stages" / "ok.json").symlink_to(victim)
    code, records, _ = run_runner(release, tmp_path, "ok")
    assert code == 0 and victim.read_text() == "operator's\n"
    assert json.loads((tmp_path / "runs" / "r1" / "stages" / "ok.json").read_text()) == ends(records)["ok"]


def test_failed_stage_stops_the_run_and_the_rest_is_not_run(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "ok,bad,skipme")
    assert code == 5
    by_stage = ends(records)
    assert [by_stage[s]["status"] for s in ("ok", "bad", "skipme")] == ["pass", "fail", "not_run"]
    assert by_stage["bad"]["reason"] == "bad on purpose"
    assert "--keep-going" in by_stage["skipme"]["reason"]
    assert records[-1]["status"] == "fail" and records[-1]["exit_code"] == 5


def test_exception_is_a_failure_with_its_traceback(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "boom,ok", "--keep-going")
    assert code == 5
    boom = ends(records)["boom"]
    assert boom["status"] == "fail" and boom["reason"] == "RuntimeError: boom from a stage"
    assert "Traceback" in boom["traceback"] and "boom from a stage" in boom["traceback"]
    assert ends(records)["ok"]["status"] == "pass"


def test_hanging_stage_times_out_with_its_last_output(release, tmp_path):
    started = time.monotonic()
    # 5 s: time for the stage to print on a busy machine; the bound below is the stage's hour
    code, records, _ = run_runner(release, tmp_path, "hang,ok", "--stage-timeout", "5",
                                  "--keep-going", timeout=600)
    assert time.monotonic() - started < 600  # not the stage's 3600 s
    assert code == 5
    hang = ends(records)["hang"]
    assert hang["status"] == "fail" and hang["reason"] == "timed out after 5s"
    assert "about to hang" in hang["output_tail"]
    assert ends(records)["ok"]["status"] == "pass"  # a fresh worker ran the rest


@pytest.mark.parametrize("stage,signame,words", [("abort", "SIGABRT", "last words before abort"),
                                                 ("segv", "SIGSEGV", "about to segfault")])
def test_crashing_interpreter_is_reported_and_keep_going_runs_the_rest(
        release, tmp_path, stage, signame, words):
    code, records, _ = run_runner(release, tmp_path, f"ok,{stage},skipme", "--keep-going")
    assert code == 5
    crashed = ends(records)[stage]
    assert crashed["status"] == "fail"
    assert crashed["reason"] == f"worker killed by {signame}"
    assert words in crashed["output_tail"]
    assert "Fatal Python error" in crashed["output_tail"]  # faulthandler's stack, kept
    assert ends(records)["ok"]["status"] == "pass"
    assert ends(records)["skipme"]["status"] == "skip"
    assert records[-1]["event"] == "run_end"


def test_crash_without_keep_going_reports_the_rest_as_not_run(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "abort,ok")
    assert code == 5
    assert ends(records)["abort"]["status"] == "fail"
    assert ends(records)["ok"]["status"] == "not_run"


def test_stages_share_one_worker_process(release, tmp_path):
    (release / "ddtree_ops" / "hostside" / "stages" / "pid2.py").write_text(
        STAGES["pid"].replace('NAME = "pid"', 'NAME = "pid2"'))
    code, records, _ = run_runner(release, tmp_path, "pid,pid2")
    assert code == 0
    pids = {ends(records)[s]["metrics"]["pid"] for s in ("pid", "pid2")}
    runner_pid = records[0]["pid"]
    assert len(pids) == 1 and runner_pid not in pids


def test_a_run_of_stages_that_need_no_torch_never_imports_it(release, tmp_path):
    """Stages declaring `NEEDS_TORCH = False` run on the CPU without torch imported, in the
    worker or the runner; one stage without the declaration brings the import back."""
    code, records, _ = run_runner(release, tmp_path, "notorch,ok")
    assert code == 0
    assert "torch" not in records[0] and records[0]["event"] == "run_start"
    assert ends(records)["notorch"]["metrics"] == {"torch_loaded": False, "device": "cpu"}

    code, records, _ = run_runner(release, tmp_path, "notorch,env", run_id="r2")
    assert code == 0
    assert records[0]["torch"] == __import__("torch").__version__
    assert ends(records)["notorch"]["metrics"]["torch_loaded"] is True


def test_unknown_stage_is_a_usage_error_naming_it(release, tmp_path):
    code, records, stderr = run_runner(release, tmp_path, "ok,nope")
    assert code == 2
    assert "unknown stage(s) 'nope'" in stderr
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "error"


def test_bad_options_are_a_usage_error(release, tmp_path):
    code, _, stderr = run_runner(release, tmp_path, "ok", "--options", '{"budgets": [-3]}')
    assert code == 2
    assert "budgets: expected an integer >= 0, got -3" in stderr


def test_stream_output_sends_what_the_stage_and_its_server_write_as_it_is_written(release, tmp_path):
    """`smoke -v`: the runner sends each line of the stage's log and of the *.log files it keeps
    in its artifacts folder; an unended line waits for its end (or the stage's); nothing of it
    goes into events.jsonl (the log files are the record)."""
    code, records, _ = run_runner(release, tmp_path, "serverlog,ok", "--stream-output")
    assert code == 0
    sent: dict = {}
    for record in records:
        if record["event"] == "output":
            sent.setdefault((record["stage"], record["file"]), []).extend(record["lines"])
    assert sent[("serverlog", None)] == ["starting the server", "no newline at the end"]
    assert sent[("serverlog", "server-x.log")] == ["loading weights", "half a line", "Uvicorn running"]
    assert "[ok] hello from ok" in sent[("ok", None)]
    kinds = [r["event"] for r in records]
    assert kinds.index("output") > kinds.index("stage_start")
    last_output = max(i for i, r in enumerate(records) if r["event"] == "output" and r["stage"] == "serverlog")
    assert last_output < next(i for i, r in enumerate(records) if r["event"] == "stage_end")  # before its end
    kept = (tmp_path / "runs" / "r1" / "events.jsonl").read_text()
    assert '"output"' not in kept and kept.count("\n") == len(records) - kinds.count("output")
    code, records, _ = run_runner(release, tmp_path, "serverlog", run_id="r2")  # without: none sent
    assert code == 0 and "output" not in [r["event"] for r in records]


@pytest.mark.slow
def test_a_heartbeat_names_the_last_line_a_quiet_stage_or_its_server_wrote(release, tmp_path):
    """A long silent phase (a server loading its model) still says where it is."""
    code, records, _ = run_runner(release, tmp_path, "serverlog", "--host-entry", '{"quiet_s": 6}')
    assert code == 0
    beats = [r for r in records if r["event"] == "heartbeat" and r["stage"] == "serverlog"]
    assert beats and beats[0]["last_output"] == "loading weights"


def test_an_unknown_knob_is_a_usage_error_on_the_host_too(release, tmp_path):
    """A release older than the operator (--no-push) meets a knob it does not have: refused
    naming it, never ignored."""
    code, records, stderr = run_runner(release, tmp_path, "ok", "--options", '{"extra": {"max_new_token": 64}}')
    assert code == 2
    assert "--set max_new_token: unknown knob (did you mean max_new_tokens?)" in stderr
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "error"


def test_stop_interrupts_a_running_run_and_keeps_what_arrived(release, tmp_path):
    argv = [sys.executable, str(release / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "r9",
            "--workdir", str(tmp_path), "--release-root", str(release), "--stages",
            "ok,hang,skipme"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        if not line.strip():  # the runner's keepalive while torch imports
            continue
        lines.append(json.loads(line))
        if lines[-1]["event"] == "stage_start" and lines[-1]["stage"] == "hang":
            break
    stop = subprocess.run([sys.executable, str(release / "ddtree_ops" / "hostside" / "runner.py"), "stop",
                           "--run-id", "r9", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    assert json.loads(stop.stdout)["stopped"] is True
    rest, _ = proc.communicate(timeout=30)
    lines += [json.loads(line) for line in rest.splitlines() if line.strip()]
    assert proc.returncode == 130
    by_stage = ends(lines)
    assert by_stage["ok"]["status"] == "pass"
    assert by_stage["hang"]["status"] == "fail" and "interrupted" in by_stage["hang"]["reason"]
    assert "about to hang" in by_stage["hang"]["output_tail"]
    assert "_Terminated" not in by_stage["hang"]["output_tail"]  # the runner's own stop, no traceback
    assert by_stage["skipme"]["status"] == "not_run"
    assert lines[-1]["status"] == "interrupted"


def test_closed_stdout_does_not_stop_the_run(release, tmp_path):
    """A dropped SSH channel: the runner keeps writing its files for `collect`."""
    argv = [sys.executable, str(release / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "r7",
            "--workdir", str(tmp_path), "--release-root", str(release), "--stages", "ok,bad"]
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(argv, stdout=write_end)
    os.close(write_end)
    os.close(read_end)  # nobody reads: every stdout write fails
    assert proc.wait(timeout=300) == 5
    events = (tmp_path / "runs" / "r7" / "events.jsonl").read_text().splitlines()
    assert json.loads(events[-1])["event"] == "run_end"
    assert json.loads((tmp_path / "runs" / "r7" / "stages" / "bad.json").read_text())["status"] == "fail"


def test_files_lists_the_run_with_hashes(release, tmp_path):
    run_runner(release, tmp_path, "ok")
    proc = subprocess.run([sys.executable, str(release / "ddtree_ops" / "hostside" / "runner.py"), "files",
                           "--run-id", "r1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    listed = {json.loads(line)["path"]: json.loads(line) for line in proc.stdout.splitlines()}
    assert {"events.jsonl", "run.json", "stages/ok.json", "logs/ok.log"} <= set(listed)
    data = (tmp_path / "runs" / "r1" / "events.jsonl").read_bytes()
    import hashlib
    assert listed["events.jsonl"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert listed["events.jsonl"]["size"] == len(data)


def test_a_stopped_stage_unwinds_and_leaves_no_child_behind(release, tmp_path):
    """A timeout sends SIGTERM first: the stage's `finally` stops its server (in a session of
    its own); what it left in the worker's process group is killed with the group."""
    code, records, _ = run_runner(release, tmp_path, "spawner,ok", "--stage-timeout", "2", "--keep-going")
    assert code == 5
    assert ends(records)["spawner"]["reason"] == "timed out after 2s"
    assert ends(records)["ok"]["status"] == "pass"
    server, plain = map(int, (tmp_path / "runs" / "r1" / "children").read_text().split())
    deadline = time.monotonic() + 30  # polled: generous for a busy machine
    while (_alive(server) or _alive(plain)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server) and not _alive(plain)


def test_a_malformed_result_fails_its_stage_not_the_runner(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "listtables,odd,ok", "--keep-going")
    assert code == 5 and records[-1]["event"] == "run_end"
    by_stage = ends(records)
    assert by_stage["listtables"]["status"] == "fail"
    assert by_stage["listtables"]["reason"].startswith("TypeError: stage listtables tables: expected {name: [row dicts]}")
    assert (by_stage["odd"]["status"], by_stage["odd"]["reason"]) == ("fail", "made by an exception")
    assert by_stage["ok"]["status"] == "pass"


def test_logging_from_several_threads_keeps_the_stream_whole(release, tmp_path):
    code, records, _ = run_runner(release, tmp_path, "threadlog,ok")
    assert code == 0, records[-1]
    assert sum(r["event"] == "log" and r["stage"] == "threadlog" for r in records) == 6000
    assert ends(records)["ok"]["status"] == "pass"


def test_a_stop_while_torch_imports_runs_nothing(release, tmp_path):
    """The runner imports torch and ddtree before any stage (seconds on a GPU host); a stop
    then is an interrupted run with every stage not run, never a run that carries on."""
    slow = tmp_path / "slow-release"
    shutil.copytree(release, slow, symlinks=True, ignore=shutil.ignore_patterns("src"))
    (slow / "src" / "ddtree").mkdir(parents=True)
    (slow / "src" / "ddtree" / "__init__.py").write_text("import time\ntime.sleep(30)\n")
    needing_torch(slow, "skipme")
    argv = [sys.executable, str(slow / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "r5",
            "--workdir", str(tmp_path), "--release-root", str(slow), "--stages", "ok,skipme"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    pid_file = tmp_path / "runs" / "r5" / "runner.pid"
    deadline = time.monotonic() + 120  # a Python start on a busy machine: generous, not timed
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_file.exists(), "the runner never started"
    time.sleep(0.5)  # into the release check or the import: either way nothing may run
    subprocess.run([sys.executable, str(slow / "ddtree_ops" / "hostside" / "runner.py"), "stop", "--run-id", "r5",
                    "--workdir", str(tmp_path)], capture_output=True, timeout=30, check=True)
    out, _ = proc.communicate(timeout=30)
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert proc.returncode == 130
    assert [ends(records)[s]["status"] for s in ("ok", "skipme")] == ["not_run", "not_run"]
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "interrupted"


def test_a_stop_that_lands_where_python_swallows_it_still_stops_the_run(release, tmp_path):
    """A stop whose handler runs inside a `__del__` (as in an import's module-lock weakref
    callback, where it was once lost under load): Python swallows what the handler raises, the
    runner sends the signal again, and the run is interrupted instead of carrying on."""
    swallowing = tmp_path / "swallowing-release"
    shutil.copytree(release, swallowing, symlinks=True, ignore=shutil.ignore_patterns("src"))
    (swallowing / "src" / "ddtree").mkdir(parents=True)
    (swallowing / "src" / "ddtree" / "__init__.py").write_text(
        "import signal, time\n"
        "class StopLandsHere:\n"
        "    def __del__(self):\n"
        "        signal.raise_signal(signal.SIGTERM)\n"
        "StopLandsHere()\n"
        "for _ in range(300):  # 30 s: a lost stop would let the stages run after it\n"
        "    time.sleep(0.1)\n")
    needing_torch(swallowing, "skipme")
    argv = [sys.executable, str(swallowing / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "r7",
            "--workdir", str(tmp_path), "--release-root", str(swallowing), "--stages", "ok,skipme"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert [ends(records)[s]["status"] for s in ("ok", "skipme")] == ["not_run", "not_run"]
    assert "Exception ignored" not in proc.stderr


def test_a_stop_that_the_interrupted_code_swallows_still_stops_the_run(release, tmp_path):
    """A stop that lands in code catching everything (a release's import with a bare
    `except`; a library's C code that clears errors) never reaches the runner as an exception:
    the runner remembers the signal and stops before any stage all the same."""
    swallowing = tmp_path / "catch-all-release"
    shutil.copytree(release, swallowing, symlinks=True, ignore=shutil.ignore_patterns("src"))
    (swallowing / "src" / "ddtree").mkdir(parents=True)
    importing = tmp_path / "importing"
    (swallowing / "src" / "ddtree" / "__init__.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(importing)!r}).touch()\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except BaseException:\n"
        "    pass  # the stop is caught here, and the import ends early\n")
    needing_torch(swallowing, "skipme")
    runner = swallowing / "ddtree_ops" / "hostside" / "runner.py"
    argv = [sys.executable, str(runner), "run", "--run-id", "r8", "--workdir", str(tmp_path),
            "--release-root", str(swallowing), "--stages", "ok,skipme"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # torch's import on a busy machine: generous, not timed
    while not importing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert importing.exists(), "the runner never imported the release"
    subprocess.run([sys.executable, str(runner), "stop", "--run-id", "r8", "--workdir", str(tmp_path)],
                   capture_output=True, timeout=30, check=True)
    out, _ = proc.communicate(timeout=60)
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert proc.returncode == 130
    assert [ends(records)[s]["status"] for s in ("ok", "skipme")] == ["not_run", "not_run"]
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "interrupted"


def test_a_stop_while_the_release_is_checked_runs_nothing(release, tmp_path):
    """The stop lands while the runner checks the release (before torch is imported): the run
    is interrupted with every stage not run and exit 130, not a traceback."""
    runner = release / "ddtree_ops" / "hostside" / "runner.py"
    argv = ["run", "--run-id", "r6", "--workdir", str(tmp_path), "--release-root", str(release),
            "--stages", "ok,skipme"]
    stop_mid_check = f"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("runner_under_test", {str(runner)!r})
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
check = runner.release_problem
def checked_when_the_stop_arrives(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return check(*args, **kwargs)
runner.release_problem = checked_when_the_stop_arrives
sys.exit(runner.main({argv!r}))
"""
    proc = subprocess.run([sys.executable, "-c", stop_mid_check], capture_output=True, text=True, timeout=300)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 130, proc.stderr
    assert [ends(records)[s]["status"] for s in ("ok", "skipme")] == ["not_run", "not_run"]
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "interrupted"


def test_the_runner_keeps_talking_while_a_slow_torch_imports(release, tmp_path):
    """Importing torch can take a minute on a GPU host; the operator side counts a silent
    host as frozen (smoke's SILENCE_LIMIT_S), so the runner sends blank keepalive lines."""
    slow = tmp_path / "slow-release"
    shutil.copytree(release, slow, symlinks=True)
    (slow / "torch").mkdir()
    (slow / "torch" / "__init__.py").write_text("import time\ntime.sleep(6.5)\n__version__ = '0.fake'\n")
    needing_torch(slow, "skipme")
    argv = [sys.executable, str(slow / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "r2", "--workdir",
            str(tmp_path), "--release-root", str(slow), "--host", "h1", "--stages", "skipme"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.split("\n")
    first_record = next(i for i, line in enumerate(lines) if line.strip())
    assert first_record >= 1 and all(line == "" for line in lines[:first_record])  # keepalives first
    assert json.loads(lines[first_record])["event"] == "run_start"
    assert json.loads(lines[first_record])["torch"] == "0.fake"
