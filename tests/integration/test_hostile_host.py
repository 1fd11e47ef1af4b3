"""What a hostile or broken host can send or leave running, against real sshd hosts: a command
stopped on our side dies on the host with its process group, a signal is named as such, and
every stream is bounded."""
from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

from ddtree_ops.errors import CommandTimeout, OutputLimitExceeded
from ddtree_ops.transport import base
from ddtree_ops.transport.factory import open_transport

pytestmark = pytest.mark.sshd


def processes_with(marker: str) -> list[int]:
    """Processes of this machine (the fleet's hosts share it) whose command line holds marker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def wait_until_gone(marker: str, within_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with(marker)


def test_each_timed_out_command_is_killed_on_the_host_with_its_children(sshd_fleet):
    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    marker = f"hung-{uuid.uuid4().hex}"
    # a hung python that also started a child of its own (same process group)
    hung = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '300', sys.argv[1]]);"
            " time.sleep(300)", marker]
    with open_transport(host) as transport:
        for _ in range(3):  # each retry must not leave one more process behind
            with pytest.raises(CommandTimeout, match=r"ran longer than 1\.5s; killed on the host"):
                transport.run(hung, timeout=1.5)
            assert wait_until_gone(marker) == []
        assert transport.run(["true"]).ok  # the connection is still usable


def test_a_command_killed_by_a_signal_is_named_so_not_a_dropped_connection(sshd_fleet):
    fleet = sshd_fleet(1)
    with open_transport(fleet.inventory().hosts["h0"]) as transport:
        result = transport.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert (result.exit_status, result.status_text) == (137, "killed by SIGKILL (exit 137)")


def test_a_line_without_newline_is_stopped_at_the_line_limit_keeping_the_lines_before(sshd_fleet, monkeypatch):
    fleet = sshd_fleet(1)
    monkeypatch.setattr("ddtree_ops.transport.ssh.MAX_LINE_BYTES", 1 << 20)  # 8 MiB in use
    marker = f"long-{uuid.uuid4().hex}"
    lines: list[str] = []
    endless = [sys.executable, "-c", "import sys, time; print('first', flush=True); "
               "[sys.stdout.write('x' * 65536) or sys.stdout.flush() for _ in range(64)]; time.sleep(300)", marker]
    with open_transport(fleet.inventory().hosts["h0"]) as transport:
        started = time.monotonic()
        with pytest.raises(OutputLimitExceeded, match=r"h0: .* sent a line longer than 1048576 bytes; stopped"):
            transport.run(endless, on_stdout_line=lines.append, timeout=120)
        assert time.monotonic() - started < 60  # stopped at the limit, not at the timeout (300 s)
    assert lines == ["first"]
    assert wait_until_gone(marker) == []


def test_output_past_the_limit_stops_the_command_and_stderr_keeps_only_its_end(sshd_fleet, monkeypatch):
    fleet = sshd_fleet(1)
    marker = f"flood-{uuid.uuid4().hex}"
    flood = [sys.executable, "-c", "import sys, time\nfor i in range(100000): print('line %d' % i)\n"
             "sys.stdout.flush(); time.sleep(300)", marker]
    monkeypatch.setattr("ddtree_ops.transport.ssh.STDERR_KEPT_BYTES", 64 << 10)
    with open_transport(fleet.inventory().hosts["h0"]) as transport:
        with pytest.raises(OutputLimitExceeded, match=r"h0: .* sent more than 100000 bytes; stopped"):
            transport.run(flood, max_output_bytes=100_000, timeout=120)
        assert wait_until_gone(marker) == []
        noisy = transport.run([sys.executable, "-c", "import sys\nfor i in range(200000): "
                               "sys.stderr.write('err %d\\n' % i)\nsys.stderr.write('the end')"])
    assert noisy.ok and noisy.stderr.endswith("err 199999\nthe end")
    assert len(noisy.stderr) <= (64 << 10) + 65536  # the last 64 KiB (to a chunk), not 2.6 MB
    assert base.STDERR_KEPT_BYTES == 1 << 20


def test_one_hosts_bad_record_fails_that_host_and_every_other_host_is_shown(sshd_fleet, tmp_path, monkeypatch,
                                                                            capsys):
    import json

    from ddtree_ops.cli.app import main

    fleet = sshd_fleet(2)
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    # h1's python sends one well-formed record with a wrong value (a duration of 1e999) before
    # the real runner starts
    wrapper = tmp_path / "python-sending-a-bad-record"
    wrapper.write_text(
        f"#!{sys.executable}\nimport json, os, sys\nargv = sys.argv[1:]\n"
        "if len(argv) > 1 and argv[0].endswith('runner.py') and argv[1] == 'run':\n"
        "    ids = {k: argv[argv.index('--' + k) + 1] for k in ('run-id', 'host')}\n"
        "    sys.stdout.write('{\"v\":1,\"event\":\"stage_end\",\"run_id\":%s,\"host\":%s,\"stage\":\"env\",'\n"
        "                     '\"index\":0,\"status\":\"pass\",\"duration_s\":1e999}\\n'\n"
        "                     % (json.dumps(ids['run-id']), json.dumps(ids['host'])))\n"
        "    sys.stdout.flush()\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *argv])\n")
    os.chmod(wrapper, 0o755)
    inventory = str(fleet.write_inventory(host_overrides={"h1": {"python": str(wrapper)}}))
    code = main(["smoke", "-i", inventory, "--stages", "env", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 6, doc
    assert doc["hosts"]["h0"]["outcome"] == "pass" and doc["hosts"]["h0"]["stages"]["env"]["status"] == "pass"
    assert doc["hosts"]["h1"]["outcome"] == "fail"
    why = "a record was refused: stage_end.duration_s: expected a finite number >= 0, got inf"
    assert any(f["host"] == "h1" and why in f["reason"] for f in doc["failures"]), doc["failures"]
    assert main(["report"]) == 0
    shown = capsys.readouterr().out
    assert "infs" not in shown and why in shown and "h0" in shown
    assert main(["report", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run_exit_code"] == 6 and report["hosts"]["h0"]["outcome"] == "pass"


def test_a_probe_reply_past_its_bound_fails_the_host_and_stops_it(sshd_fleet, tmp_path, monkeypatch, capsys):
    import json

    from ddtree_ops.cli.app import main

    monkeypatch.setattr("ddtree_ops.remote_layout.AGENT_REPLY_MAX_BYTES", 1 << 20)  # 16 MiB in use
    fleet = sshd_fleet(1)
    chatty = tmp_path / "chatty-python"
    chatty.write_text(f"#!{sys.executable}\nimport sys, time\n"
                      "for _ in range(64): sys.stdout.write('{' + 'x' * 65535 + '\\n')\n"
                      "sys.stdout.flush(); time.sleep(300)\n")
    os.chmod(chatty, 0o755)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(chatty)}})
    started = time.monotonic()
    code = main(["hosts", "check", "-i", str(inventory), "--json"])
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert code == 5, hosts
    assert hosts["h0"]["error"] == f"h0: {chatty} sent more than 1048576 bytes; stopped (what arrived before is kept)"
    assert time.monotonic() - started < 25  # at the limit, not at the command timeout (30 s)
    assert wait_until_gone(str(chatty)) == []


def test_a_full_disk_during_push_names_the_file(sshd_fleet, tmp_path, capsys):
    import json

    from ddtree_ops.cli.app import main
    from fixtures.checkout import make_checkout

    fleet = sshd_fleet(1)
    # "a full disk": the kernel refuses every write past 64 KiB to the host's python (EFBIG, as
    # a full filesystem refuses it with ENOSPC); nothing names the file in that error itself
    limited = tmp_path / "python-on-a-full-disk"
    limited.write_text(f"#!/bin/sh\nulimit -f 64\nexec {sys.executable} \"$@\"\n")
    os.chmod(limited, 0o755)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(limited)}})
    source = make_checkout(tmp_path / "checkout")
    (source / "src" / "ddtree" / "weights.bin").write_bytes(os.urandom(256 << 10))
    code = main(["push", "--json", "-i", str(inventory), "--source", str(source)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 5, doc
    error = doc["hosts"]["h0"]["error"]
    assert "/src/ddtree/weights.bin: File too large" in error and ": : " not in error, error
