"""Red team round 3 (#49), the files the CLI is handed or writes, as a co-user with write access
to the operator's folders or a careless operator would hand them: real links, real FIFOs,
/dev/zero, sparse 3 GB files, bad encodings, deep nesting, alias bombs, odd host names.

Whatever could hang or eat memory on the code before the fix runs in a child process with a
deadline and an address-space limit, so a regression fails here instead of hanging the suite
or waking the OOM killer. Every refusal is one line naming the file, with the right exit code."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_report_recommend_cli import QUIET, load_rows, write_run

from ddtree_ops.cli.app import main
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event
from ddtree_ops.results import RunStore

REPO = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit in every recursive walk
CHILD_MEMORY = 1 << 30  # a child's address space: a read of /dev/zero ends in MemoryError, not the OOM killer


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def run_child(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m ARGS...` in a child with bounded memory; a hang is a failure, not a stuck suite."""
    try:
        return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=_limit_memory, env={**os.environ, "COLUMNS": "200"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still running after {timeout} s (blocked on a FIFO, or reading without end?)")


def one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr and "unexpected error" not in done.stderr, done.stderr[-2000:]
    assert len(lines) == 1, done.stderr[-2000:]
    return lines[0]


@pytest.fixture
def hostile(tmp_path):
    """Baseline and qualification files nobody should hand us, each a real file of its kind."""
    files = {"fifo": tmp_path / "fifo.json", "big": tmp_path / "big.json", "zero": Path("/dev/zero"),
             "deep": tmp_path / "deep.json", "latin1": tmp_path / "latin1.json"}
    os.mkfifo(files["fifo"])
    with open(files["big"], "wb") as handle:  # sparse: 3 GB on paper, nothing on disk
        handle.truncate(3 << 30)
    files["deep"].write_text(DEEP)
    files["latin1"].write_bytes(b'{"metrics": [{"metric": "caf\xe9.x", "expected": 1}]}')
    return files


# --------------------------------------------------------------------------- item 11: report --baseline


@pytest.mark.slow
@pytest.mark.parametrize("kind, why", [
    ("zero", "a character device, not a regular file: refused"),
    ("fifo", "a FIFO, not a regular file: refused"),
    ("big", f"{3 << 30} bytes, past the limit of {32 << 20}: refused"),
])
def test_report_refuses_a_device_a_fifo_and_a_huge_file_as_baseline_without_reading_them(tmp_path, hostile, kind, why):
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)})
    done = run_child(["-m", "ddtree_ops", "report", "--runs-dir", str(tmp_path / "runs"),
                      "--baseline", str(hostile[kind])], tmp_path)
    assert done.returncode == 3
    assert one_error_line(done) == f"ddtree-ops: error: {hostile[kind]}: cannot read baseline: {why}"


def _yaml_alias_bomb(levels: int) -> str:
    ladder = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels + 1):
        ladder.append(f"&a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    return "metrics: [" + ", ".join(ladder) + "]\n"


@pytest.mark.slow
def test_report_refuses_a_yaml_alias_bomb_as_baseline_at_once(tmp_path):
    """Nine levels: 10^9 values once expanded (76 s, then MemoryError, before the fix)."""
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)})
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_yaml_alias_bomb(9))
    done = run_child(["-m", "ddtree_ops", "report", "--runs-dir", str(tmp_path / "runs"), "--baseline", str(bomb)],
                     tmp_path, timeout=60)
    assert done.returncode == 3
    assert one_error_line(done) == (f"ddtree-ops: error: {bomb}: YAML aliases expand to 12345678990 more values, "
                                    "past the limit of 10000 (write the values out, or alias fewer)")


@pytest.mark.slow
def test_report_refuses_a_deep_or_non_utf8_baseline_naming_the_file(tmp_path, hostile, capsys):
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)})
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("metrics: " + "[" * 5000 + "]" * 5000 + "\n")
    for path, why in ((hostile["deep"], "values nested deeper than 64 levels: refused"),
                      (deep_yaml, "line 1: values nested deeper than 64 levels"),
                      (hostile["latin1"], "not a baseline: expected a metrics baseline")):
        assert main(["report", "--runs-dir", str(tmp_path / "runs"), "--baseline", str(path)]) == 3
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ddtree-ops: error: {path}: {why}") and "\n" not in err


@pytest.mark.slow
def test_baseline_import_refuses_dev_zero_and_a_fifo(tmp_path, hostile):
    for kind, why in (("zero", "a character device"), ("fifo", "a FIFO")):
        done = run_child(["-m", "ddtree_ops", "baseline", "import", str(hostile[kind])], tmp_path)
        assert done.returncode == 3, done.stderr[-2000:]
        assert one_error_line(done) == f"ddtree-ops: error: {hostile[kind]}: {why}, not a regular file: refused"


# --------------------------------------------------------------------------- items 11, 12: qualification files


@pytest.mark.slow
@pytest.mark.parametrize("kind, why", [
    ("zero", "cannot read: a character device, not a regular file: refused"),
    ("fifo", "cannot read: a FIFO, not a regular file: refused"),
    ("deep", "values nested deeper than 64 levels: refused"),
])
def test_the_gate_and_manifest_tool_refuse_a_bad_qualification_file_in_one_line(tmp_path, hostile, kind, why):
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    gate = run_child(["-m", "ddtree.sglang.gate", "--package-dir", str(package), "--qualified", str(hostile[kind])],
                     REPO)
    assert (gate.returncode, gate.stdout.strip()) == (2, f"{hostile[kind]}: {why}")
    assert gate.stderr == ""
    tool = run_child(["-m", "ddtree.sglang.manifest_tool", str(package), "--qualified", str(hostile[kind])], REPO)
    assert tool.returncode == 2 and tool.stdout == ""
    assert one_error_line(tool) == f"{hostile[kind]}: {why}"


def test_deploy_and_qualify_refuse_a_deep_qualification_file_before_any_host(tmp_path, hostile, capsys):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu-a": {"hostname": "gpu-a.invalid"}}}))
    for command in (["deploy", "--dry-run"], ["sglang", "qualify", "--stages", "plugin"]):
        assert main([*command, "-i", str(inventory), "--qualified", str(hostile["deep"])]) == 3, command
        err = capsys.readouterr().err.strip()
        assert err == f"ddtree-ops: error: {hostile['deep']}: values nested deeper than 64 levels: refused"


# --------------------------------------------------------------------------- item 12: run records


@pytest.mark.parametrize("content, why", [
    (b'{"host": "gpu-b", "note": "\xff\xfe"}', "not UTF-8 text (byte 0xff at offset 27)"),
    (DEEP.encode(), "values nested deeper than 64 levels: refused"),
])
@pytest.mark.parametrize("record", ["run.json", "stages/sglang-e2e.json"])
def test_one_hosts_unreadable_record_fails_that_host_and_the_fleet_is_still_reported(
        tmp_path, capsys, content, why, record):
    runs = tmp_path / "runs"
    fleet = {host: (load_rows(1, 100.0, 200.0, 300.0), QUIET) for host in ("gpu-a", "gpu-b")}
    write_run(runs, fleet, run_id="20261201-100000-aaaa")
    if record.startswith("stages/"):  # the copy is read when the event log lacks the stage
        (runs / "20261201-100000-aaaa" / "gpu-b" / "events.jsonl").unlink()
    (runs / "20261201-100000-aaaa" / "gpu-b" / record).write_bytes(content)
    assert main(["report", "--runs-dir", str(runs), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["hosts"]["gpu-a"]["outcome"] == "pass"
    assert document["hosts"]["gpu-b"]["outcome"] == "fail"
    bad = runs / "20261201-100000-aaaa" / "gpu-b" / record
    assert [(f["host"], f["reason"]) for f in document["failures"]] == [("gpu-b", f"{bad}: unreadable run record: {why}")]
    assert [(r["host"], r["choice"]) for r in document["recommendations"]] == [("gpu-a", "ddtree")]


@pytest.mark.parametrize("content", [b"\xff\xfe not UTF-8", DEEP.encode()])
def test_another_runs_unreadable_record_never_hides_deploy_budget_auto(tmp_path, capsys, content):
    runs = tmp_path / "runs"
    write_run(runs, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-100000-aaaa")
    write_run(runs, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-110000-bbbb")
    newer = runs / "20261201-110000-bbbb" / "run.json"
    newer.write_bytes(content)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu-a": {"hostname": "gpu-a.invalid"}}}))
    code = main(["deploy", "-i", str(inventory), "-H", "gpu-a", "--runs-dir", str(runs), "--budget", "auto",
                 "--for-concurrency", "1", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 4  # decided from the readable run, then the host (whose name does not resolve) was reached for
    assert (f"gpu-a: DDTree enabled, budget 64 (run 20261201-100000-aaaa, 1 concurrent) (passed over 1 "
            f"run(s): {newer}: unreadable run record: ") in err
    assert main(["report", "20261201-110000-bbbb", "--runs-dir", str(runs)]) == 3  # that run itself: named
    assert capsys.readouterr().err.startswith(f"ddtree-ops: error: {newer}: unreadable run record: ")


def test_a_fifo_or_a_huge_line_in_a_hosts_event_log_fails_that_host_only(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_run(runs, {host: (load_rows(1, 100.0, 200.0, 300.0), QUIET) for host in ("gpu-a", "gpu-b", "gpu-c")},
              run_id="r1")
    fifo_log = runs / "r1" / "gpu-b" / "events.jsonl"
    fifo_log.unlink()
    os.mkfifo(fifo_log)
    long_log = runs / "r1" / "gpu-c" / "events.jsonl"
    with long_log.open("ab") as handle:
        handle.write(b"x" * ((8 << 20) + 10) + b"\n")
    assert main(["report", "r1", "--runs-dir", str(runs), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [document["hosts"][h]["outcome"] for h in ("gpu-a", "gpu-b", "gpu-c")] == ["pass", "fail", "fail"]
    assert [(f["host"], f["reason"]) for f in document["failures"]] == [
        ("gpu-b", f"{fifo_log}: unreadable event log: a FIFO, not a regular file: refused"),
        ("gpu-c", f"{long_log}: line 5: longer than {8 << 20} bytes: refused")]


# --------------------------------------------------------------------------- item 3: report --plot


@pytest.mark.slow
def test_report_plot_replaces_a_link_at_a_charts_name_and_never_writes_through_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs, plots = tmp_path / "runs", tmp_path / "plots"
    store = RunStore(runs)
    store.create_run("r1", {"hosts": ["gpu-a"], "stages": ["tree-bench"]})
    recorder = store.host_recorder("r1", "gpu-a", {})
    rows = [{"builder": "auto", "batch_size": 1, "budget": b, "per_request_ms": b / 10} for b in (16, 64)]
    for record in (make_event(EventKind.RUN_START, "r1", "gpu-a", stages=["tree-bench"]),
                   make_event(EventKind.STAGE_END, "r1", "gpu-a", stage="tree-bench", index=0, status="pass",
                              reason="", duration_s=1.0, metrics={}, tables={"sweep": rows}, traceback=None,
                              output_tail=None),
                   make_event(EventKind.RUN_END, "r1", "gpu-a", status="pass")):
        recorder.feed_line(encode_event(record))
    recorder.close()
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA... operator\n")
    plots.mkdir()
    chart = plots / "tree-build-vs-budget-bs1.png"
    chart.symlink_to(victim)
    assert main(["report", "r1", "--runs-dir", str(runs), "--plot", str(plots)]) == 0
    assert f"wrote {chart}" in capsys.readouterr().err
    assert victim.read_text() == "ssh-ed25519 AAAA... operator\n"  # the link's target: untouched
    assert not chart.is_symlink() and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in plots.iterdir()) == ["tree-build-vs-budget-bs1.png"]  # no temporary left


# --------------------------------------------------------------------------- item 13: a long host name


def test_a_host_name_too_long_for_a_folder_is_refused_at_load_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    name = "h" * 300
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {name: {"transport": "local", "workdir": str(tmp_path / "w")}}}))
    assert main(["smoke", "-i", str(inventory), "--stages", "env"]) == 3
    err = capsys.readouterr().err.strip()
    assert err == (f"ddtree-ops: error: {inventory}: hosts.'{'h' * 27}...{'h' * 28}': invalid host name (300 bytes "
                   "long, past the limit of 255 for a folder name; it names a folder of every run)")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "w").exists()


# --------------------------------------------------------------------------- item 14: YAML merge keys


def test_yaml_merge_keys_work_in_our_inventory_and_in_an_ansible_one(tmp_path, capsys):
    ours = tmp_path / "hosts.yaml"
    ours.write_text("hosts:\n"
                    "  gpu-a: &gpu {hostname: 10.0.0.1, port: 2222, user: ops, groups: [h100]}\n"
                    "  gpu-b:\n    <<: *gpu\n    hostname: 10.0.0.2\n")
    assert main(["hosts", "list", "-i", str(ours), "--json"]) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert (hosts["gpu-b"]["hostname"], hosts["gpu-b"]["port"], hosts["gpu-b"]["user"]) == ("10.0.0.2", 2222, "ops")
    assert hosts["gpu-b"]["groups"] == ["h100"]
    ansible = tmp_path / "inventory.yml"
    ansible.write_text("all:\n  vars:\n    common: &common {ansible_port: 2200, ansible_user: deploy}\n"
                       "  children:\n    gpus:\n      hosts:\n"
                       "        g1: {<<: *common, ansible_host: 10.0.1.1}\n"
                       "        g2:\n          <<: [*common]\n          ansible_port: 2201\n")
    assert main(["hosts", "list", "-i", str(ansible), "--json"]) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert (hosts["g1"]["hostname"], hosts["g1"]["port"], hosts["g1"]["user"]) == ("10.0.1.1", 2200, "deploy")
    assert (hosts["g2"]["port"], hosts["g2"]["user"]) == (2201, "deploy")


def test_a_merge_key_cannot_smuggle_an_alias_bomb_past_the_limit(tmp_path, capsys):
    bomb = tmp_path / "hosts.yaml"
    ladder = "\n".join(f"  l{n}: &l{n} {{" + ", ".join(f"k{i}: *l{n - 1}" for i in range(10)) + "}"
                       for n in range(1, 7))
    bomb.write_text("x: &l0 {a: 1}\nhosts:\n  h: {transport: local}\nladder:\n" + ladder + "\n"
                    "more: {<<: [*l6, *l6]}\n")
    assert main(["hosts", "list", "-i", str(bomb)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ddtree-ops: error: {bomb}: YAML aliases expand to ") and "past the limit of 10000" in err


# --------------------------------------------------------------------------- beyond the 14: what else was tried


def test_an_ini_inventory_line_of_a_million_characters_is_refused_at_once(tmp_path, capsys):
    """shlex splits a token in time quadratic in its length: 5 MB took over a minute."""
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[gpus]\n" + "h" * 1_000_000 + "\n")
    assert main(["hosts", "list", "-i", str(inventory)]) == 3
    assert capsys.readouterr().err.strip() == (f"ddtree-ops: error: {inventory}: line 2: 1000000 characters, past the "
                                               "limit of 65536 for one line (a host and its variables)")


def test_a_set_value_nested_past_the_limit_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    deep = "[" * 50_000 + "]" * 50_000  # fits one command-line argument
    assert main(["smoke", "--no-push", "--stages", "env", "--set", f"x={deep}"]) == 2
    assert capsys.readouterr().err.strip() == "ddtree-ops: error: --set x: values nested deeper than 64 levels: refused"
    assert not (tmp_path / "runs").exists()


def test_a_host_whose_reply_is_nested_past_the_limit_fails_as_a_bad_reply(tmp_path, capsys):
    """A hostile `python` answering the agent with JSON 100,000 deep: that host's reply is no
    reply (one line naming the host), never an internal error."""
    forger = tmp_path / "python"
    forger.write_text(f"#!/bin/sh\necho '{'[' * 100_000}{']' * 100_000}'\n")
    forger.chmod(0o755)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"forged": {"transport": "local", "python": str(forger),
                                                              "workdir": str(tmp_path / "w")}}}))
    assert main(["hosts", "check", "-i", str(inventory), "--json"]) == 5
    error = json.loads(capsys.readouterr().out)["hosts"]["forged"]["error"]
    assert error.startswith(f"forged: agent probe failed (exit 0) with {forger}: ") and "internal error" not in error


def test_a_traceback_is_never_written_through_a_link_at_the_debug_log(tmp_path, monkeypatch):
    from ddtree_ops.cli.app import _record_traceback

    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA... operator\n")
    log = tmp_path / "state" / "debug.log"
    log.parent.mkdir()
    log.symlink_to(victim)
    monkeypatch.setenv("DDTREE_OPS_DEBUG_LOG", str(log))
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        assert _record_traceback() is None  # refused: the one line on screen says no more
    assert victim.read_text() == "ssh-ed25519 AAAA... operator\n"
    log.unlink()
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        assert _record_traceback() == log
    assert "RuntimeError: a bug" in log.read_text()


@pytest.mark.slow
def test_table_rows_of_the_wrong_kind_are_left_out_named_and_the_rest_is_reported(tmp_path, capsys):
    """A host's (or a hand-edited) stage record whose rows hold lists, objects or text where
    numbers are grouped and sorted: report, its plots and its recommendation go on with the
    good rows and name the bad ones (before: TypeError, exit 1)."""
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    store = RunStore(runs)
    stages = ["tree-bench", "decode-bench", "sglang-e2e"]
    store.create_run("r1", {"hosts": ["gpu-a"], "stages": stages})
    recorder = store.host_recorder("r1", "gpu-a", {})
    sweep = [{"builder": "auto", "batch_size": 1, "budget": b, "per_request_ms": 1.0, "min_ms": "x", "max_ms": None}
             for b in (16, 64)] + [{"builder": "auto", "batch_size": 1, "budget": [], "per_request_ms": 1.0},
                                   {"builder": None, "batch_size": 1, "budget": 16, "per_request_ms": 1.0}]
    decode = [{"method": "ddtree_tb16", "budget": 16, "tau": 3.0, "speedup": 2.0},
              {"method": "ddtree_tb32", "budget": "nan", "tau": "nan", "speedup": 1.0}]
    load = load_rows(1, 100.0, 200.0, 300.0) + [dict(load_rows(1, 1.0, 1.0, 1.0)[2], concurrency=[], budget={})]
    tables = {"tree-bench": {"sweep": sweep}, "decode-bench": {"methods": decode, "predictions": [
        {"concurrency": [], "method": "ddtree", "budget": {}, "tokens_per_s": 1.0}]}, "sglang-e2e": {"sglang_load": load}}
    recorder.feed_line(encode_event(make_event(EventKind.RUN_START, "r1", "gpu-a", stages=stages)))
    for index, stage in enumerate(stages):
        recorder.feed_line(encode_event(make_event(
            EventKind.STAGE_END, "r1", "gpu-a", stage=stage, index=index, status="pass", reason="", duration_s=1.0,
            metrics={}, tables=tables[stage], traceback=None, output_tail=None)))
    recorder.feed_line(encode_event(make_event(EventKind.RUN_END, "r1", "gpu-a", status="pass")))
    recorder.close()
    assert main(["report", "r1", "--runs-dir", str(runs), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "sweep[2].budget: expected an integer, got [] (the row is left out)" in out
    assert "sweep[3].builder: expected a string, got None (the row is left out)" in out
    assert "methods[1].budget: expected an integer or null, got 'nan' (the row is left out)" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["decode-vs-budget.png",
                                                                     "tree-build-vs-budget-bs1.png"]
    assert main(["report", "r1", "--runs-dir", str(runs), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [row["budget"] for row in document["sweep"]] == [16, 64]
