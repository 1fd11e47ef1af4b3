"""`ddtree-ops collect RUN_ID` in one stream per host: over a real loopback sshd fleet and the
local transport. Several files in nested folders arrive; a re-run fetches nothing; a partial
earlier collect converges; the host's Python starts once per host per collect (a logging
wrapper counts it); a hostile archive (from a host whose `python` is a forger) is refused and
nothing lands outside the run folder."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main

RUN_ID = "20261130-200000-abc123"
HOST = "@HOST@"  # replaced by each host's name: a host's records name it (and the run)
RUN_FILES = {
    "events.jsonl": '{"v": 1, "event": "run_start", "run_id": "%s", "host": "@HOST@", "stages": ["env"], "time": 1}\n' % RUN_ID,
    "run.json": '{"status": "pass"}\n',
    "stages/env.json": '{"run_id": "%s", "host": "@HOST@", "stage": "env", "status": "pass"}\n' % RUN_ID,
    "logs/env.log": "env ok\n" * 50,
    "artifacts/deep/nested/table.csv": "a,b\n1,2\n",
    "artifacts/blob.bin": os.urandom(300_000).hex(),  # several chunks and tar records
}


def make_host_run(workdir: Path, host: str = "local") -> Path:
    """What a host keeps for a run: files in nested folders, plus what collect must skip."""
    run_dir = workdir / "runs" / RUN_ID
    for rel, text in RUN_FILES.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text.replace(HOST, host))
    (run_dir / "runner.pid").write_text("12345\n")  # live state, never collected
    (run_dir / ".hidden.tmp").write_text("partial\n")
    (run_dir / "link-out").symlink_to("/etc/hostname")  # never followed
    return run_dir


def make_local_run(runs: Path, hosts: dict[str, Path], run_id: str = RUN_ID) -> Path:
    """The operator's record of the run: which hosts, and each host's workdir."""
    run = runs / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "hosts": sorted(hosts)}))
    for name, workdir in hosts.items():
        (run / name).mkdir()
        (run / name / "run.json").write_text(json.dumps({"host": name, "workdir": str(workdir)}))
    return run


def counting_python(path: Path, log: Path, real: str = sys.executable) -> Path:
    """A `python` for the host that logs every start, then runs the real interpreter."""
    path.write_text(f'#!/bin/bash\necho "start $*" >> {log}\nexec -a "$0" {real} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def starts(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def collect_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["collect", RUN_ID, "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_same_files(host_run: Path, local_remote: Path) -> None:
    for rel in RUN_FILES:
        assert sha(local_remote / rel) == sha(host_run / rel), rel
    got = sorted(p.relative_to(local_remote).as_posix() for p in local_remote.rglob("*") if p.is_file())
    assert got == sorted(RUN_FILES)  # nothing skipped was sent: no pid file, dotfile or link


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


@pytest.mark.sshd
def test_collect_over_ssh_one_start_per_host_rerun_fetches_nothing(sshd_fleet, runs, tmp_path, capsys):
    log = tmp_path / "starts.log"
    python = counting_python(tmp_path / "python", log)
    fleet = sshd_fleet(2, python=str(python))
    inventory = str(fleet.write_inventory())
    host_runs = {h.name: make_host_run(h.workdir, h.name) for h in fleet.hosts}
    run = make_local_run(runs, {h.name: h.workdir for h in fleet.hosts})

    code, doc = collect_json(capsys, "-i", inventory)
    assert code == 0, doc
    for name in ("h0", "h1"):
        result = doc["hosts"][name]["result"]
        assert sorted(result["fetched"]) == sorted(RUN_FILES) and result["unchanged"] == 0
        assert result["skipped"] == ["link-out"]
        assert_same_files(host_runs[name], run / name / "remote")
    assert len(starts(log)) == 2 and all(" collect " in s for s in starts(log))  # one per host

    code, doc = collect_json(capsys, "-i", inventory)
    assert code == 0
    for name in ("h0", "h1"):
        assert doc["hosts"][name]["result"]["fetched"] == []
        assert doc["hosts"][name]["result"]["unchanged"] == len(RUN_FILES)
    assert len(starts(log)) == 4

    # A same-size edit on one host: only that file comes again (decided by sha256).
    log_file = host_runs["h1"] / "logs" / "env.log"
    log_file.write_text(log_file.read_text().replace("ok", "OK"))
    code, doc = collect_json(capsys, "-i", inventory)
    assert code == 0
    assert doc["hosts"]["h1"]["result"]["fetched"] == ["logs/env.log"]
    assert doc["hosts"]["h0"]["result"]["fetched"] == []
    assert (run / "h1" / "remote" / "logs" / "env.log").read_text() == log_file.read_text()


@pytest.fixture
def local_env(tmp_path, runs, monkeypatch):
    """One `local` host whose workdir holds the run; returns (host run dir, local host dir)."""
    workdir = tmp_path / "wd"
    host_run = make_host_run(workdir)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(workdir)}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    run = make_local_run(runs, {"local": workdir})
    return host_run, run / "local", inventory


def test_a_partial_earlier_collect_converges(local_env, capsys):
    host_run, host_dir, _ = local_env
    remote = host_dir / "remote"
    # What an interrupted collect leaves: some complete files, a stale partial file, and
    # one file that is wrong (e.g. edited by hand).
    (remote / "stages").mkdir(parents=True)
    (remote / "stages" / "env.json").write_bytes((host_run / "stages" / "env.json").read_bytes())
    (remote / "run.json").write_text('{"status": "running"}\n')
    (remote / "logs").mkdir()
    (remote / "logs" / "env.log.part").write_text("env o")
    code, doc = collect_json(capsys)
    assert code == 0, doc
    result = doc["hosts"]["local"]["result"]
    assert result["unchanged"] == 1
    assert sorted(result["fetched"]) == sorted(set(RUN_FILES) - {"stages/env.json"})
    assert not (remote / "logs" / "env.log.part").exists()
    assert_same_files(host_run, remote)
    code, doc = collect_json(capsys)
    assert (code, doc["hosts"]["local"]["result"]["fetched"]) == (0, [])


def test_collect_adopts_the_hosts_more_complete_event_log(local_env, capsys):
    host_run, host_dir, _ = local_env
    (host_dir / "events.jsonl").write_text("")
    code, doc = collect_json(capsys)
    assert code == 0 and doc["hosts"]["local"]["result"]["merged_events"] is True
    assert (host_dir / "events.jsonl").read_text() == (host_run / "events.jsonl").read_text()


FORGER = """#!{python}
# A hostile host: whatever it is asked, it answers with a forged archive.
import io, json, sys, tarfile
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name, kind in {members!r}:
        info = tarfile.TarInfo(name)
        if kind == "file":
            data = b"pwned\\n"
            info.size = len(data)
            info.pax_headers = {{"DDTREE.sha256": __import__("hashlib").sha256(data).hexdigest()}}
            tar.addfile(info, io.BytesIO(data))
        elif kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "{outside}"
            tar.addfile(info)
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "{outside}/victim"
            tar.addfile(info)
        elif kind == "nosha":
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
sys.stdout.buffer.write(buf.getvalue())
sys.stdout.flush()
sys.stderr.write(json.dumps({{"ok": True, "sent": 1, "kept": 0, "skipped": []}}) + "\\n")
"""


def forger(path: Path, members: list[tuple[str, str]], outside: Path) -> Path:
    path.write_text(FORGER.format(python=sys.executable, members=members, outside=outside))
    path.chmod(0o755)
    return path


HOSTILE = [
    pytest.param([("../escaped.txt", "file")], "'..' part", id="dotdot"),
    pytest.param([("logs/../../escaped.txt", "file")], "'..' part", id="nested-dotdot"),
    pytest.param([("ABSOLUTE", "file")], "not a relative path", id="absolute"),
    pytest.param([("ok.txt", "file"), ("evil-link", "symlink")], "is a link", id="symlink"),
    pytest.param([("hard", "hardlink")], "is a link", id="hardlink"),
    pytest.param([("nosha.txt", "nosha")], "carries no sha256", id="no-sha256"),
]


@pytest.mark.parametrize("members, why", HOSTILE)
def test_a_hostile_archive_member_is_refused(local_env, tmp_path, capsys, members, why):
    _, host_dir, inventory = local_env
    outside = tmp_path / "outside"
    outside.mkdir()
    members = [(str(outside / "abs.txt") if n == "ABSOLUTE" else n, k) for n, k in members]
    data = yaml.safe_load(inventory.read_text())
    data["hosts"]["local"]["python"] = str(forger(tmp_path / "forger", members, outside))
    inventory.write_text(yaml.safe_dump(data))
    code, doc = collect_json(capsys)
    assert code == 5
    error = doc["hosts"]["local"]["error"]
    assert error.startswith("local: collect: refused the host's archive: archive member") and why in error
    assert "\n" not in error
    assert list(outside.iterdir()) == []
    assert not (host_dir.parent / "escaped.txt").exists() and not (host_dir / "escaped.txt").exists()
    landed = [p for p in (host_dir / "remote").rglob("*")]
    assert all(p.is_file() and not p.is_symlink() for p in landed)


def test_an_existing_local_link_is_never_written_through(local_env, tmp_path, capsys):
    """A link placed inside the run folder (by anyone) must not redirect a fetched file."""
    _, host_dir, _ = local_env
    outside = tmp_path / "outside"
    outside.mkdir()
    (host_dir / "remote").mkdir(parents=True)
    (host_dir / "remote" / "logs").symlink_to(outside)
    code, doc = collect_json(capsys)
    assert code == 5
    assert f"{host_dir / 'remote' / 'logs'}: a link on the way to a file we write: refused" in doc["hosts"]["local"]["error"]
    assert list(outside.iterdir()) == []


@pytest.mark.sshd
def test_a_hostile_archive_over_ssh_fails_that_host_only(sshd_fleet, runs, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    fleet = sshd_fleet(2)
    bad = forger(tmp_path / "forger", [("../../escaped.txt", "file")], outside)
    inventory = str(fleet.write_inventory(host_overrides={"h1": {"python": str(bad)}}))
    host_runs = {h.name: make_host_run(h.workdir, h.name) for h in fleet.hosts}
    run = make_local_run(runs, {h.name: h.workdir for h in fleet.hosts})
    code, doc = collect_json(capsys, "-i", inventory)
    assert code == 6  # partial: h0 collected, h1 refused
    assert doc["hosts"]["h0"]["state"] == "ok"
    assert_same_files(host_runs["h0"], run / "h0" / "remote")
    assert "h1: collect: refused the host's archive: archive member '../../escaped.txt'" in doc["hosts"]["h1"]["error"]
    assert not (runs / "escaped.txt").exists() and not (run / "escaped.txt").exists()


def test_collect_of_a_run_the_host_does_not_have_names_the_host(local_env, capsys):
    host_run, _, _ = local_env
    host_run.rename(host_run.with_name("elsewhere"))
    code, doc = collect_json(capsys)
    assert code == 5
    assert doc["hosts"]["local"]["error"].startswith(f"local: collect: no run {RUN_ID} under ")


def test_a_host_sending_more_than_max_gib_fails_and_a_wider_limit_converges(local_env, capsys):
    host_run, host_dir, _ = local_env
    code, doc = collect_json(capsys, "--max-gib", "0.0001")  # ~107 kB: less than the 600 kB blob
    assert code == 5, doc
    error = doc["hosts"]["local"]["error"]
    assert "past the limit of 107374 bytes" in error
    landed = {p.relative_to(host_dir / "remote").as_posix() for p in (host_dir / "remote").rglob("*") if p.is_file()}
    assert "artifacts/blob.bin" not in landed
    code, doc = collect_json(capsys)  # the default limit: the rest comes, nothing twice
    assert code == 0, doc
    assert not set(doc["hosts"]["local"]["result"]["fetched"]) & landed
    assert_same_files(host_run, host_dir / "remote")


FLOODER = """#!{python}
# A hostile host answering collect with {what}.
import hashlib, io, json, sys, tarfile
out = sys.stdout.buffer
with tarfile.open(fileobj=out, mode="w|", format=tarfile.{format}) as tar:
    for index, (name, data) in enumerate({members}):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.pax_headers = {{"DDTREE.sha256": hashlib.sha256(data).hexdigest()}}
        tar.addfile(info, io.BytesIO(data))
out.flush()
sys.stderr.write(json.dumps({{"ok": True, "sent": 1, "kept": 0, "skipped": []}}) + "\\n")
"""


@pytest.mark.sshd
@pytest.mark.parametrize("what, tar_format, members, why, landed", [
    ("a GNU long name of 2 MiB", "GNU_FORMAT", "[('x' * (2 << 20), b'2')]",
     "an archive header longer than 1048576 bytes (a huge name?)", 0),
    ("a pax name of 2 MiB", "PAX_FORMAT", "[('first.txt', b'1'), ('y' * (2 << 20), b'2')]",
     "an archive header longer than 1048576 bytes (a huge name?)", 1),
    ("more empty files than a collect takes", "PAX_FORMAT", "[('f%05d' % i, b'') for i in range(300)]",
     "archive member 'f00100' is past the limit of 100 files (100 file(s) landed)", 100),
])
def test_a_host_flooding_collect_with_names_or_files_fails_keeping_what_landed(
        sshd_fleet, runs, tmp_path, capsys, monkeypatch, what, tar_format, members, why, landed):
    monkeypatch.setattr("ddtree_ops.run_fetch.MAX_FILES", 100)  # 10,000 in use
    fleet = sshd_fleet(2)
    flooder = tmp_path / "flooder"
    flooder.write_text(FLOODER.format(python=sys.executable, what=what, format=tar_format, members=members))
    flooder.chmod(0o755)
    inventory = str(fleet.write_inventory(host_overrides={"h1": {"python": str(flooder)}}))
    host_runs = {h.name: make_host_run(h.workdir, h.name) for h in fleet.hosts}
    run = make_local_run(runs, {h.name: h.workdir for h in fleet.hosts})
    code, doc = collect_json(capsys, "-i", inventory)
    assert code == 6, doc  # partial: h0 collected, h1 refused
    assert_same_files(host_runs["h0"], run / "h0" / "remote")
    assert doc["hosts"]["h1"]["error"] == f"h1: collect: refused the host's archive: {why}"
    assert len([p for p in (run / "h1" / "remote").rglob("*") if p.is_file()]) == landed
