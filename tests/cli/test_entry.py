"""The console script's process: exit codes, complete output, and a reader that leaves early.
(`entry.run` ends the process with os._exit after flushing, so these run it for real.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

ENTRY = [sys.executable, "-m", "ddtree_ops"]


def write_inventory(path, n):
    hosts = {f"gpu-{i:03d}": {"hostname": f"gpu-{i:03d}.example.internal", "groups": ["h200"]} for i in range(n)}
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    return path


def test_large_json_document_arrives_whole(tmp_path):
    inventory = write_inventory(tmp_path / "hosts.yaml", 400)
    done = subprocess.run([*ENTRY, "hosts", "list", "--json", "-i", str(inventory)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) > 1 << 16  # more than one pipe buffer: flushed before the process ends
    assert len(json.loads(done.stdout)["hosts"]) == 400


def test_error_exit_code_and_one_line(tmp_path):
    broken = tmp_path / "hosts.yaml"
    broken.write_text("hosts:\n  gpu-a: {port: x}\n")
    done = subprocess.run([*ENTRY, "hosts", "list", "-i", str(broken)], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stderr.strip().splitlines() == [f"ddtree-ops: error: {broken}: hosts.gpu-a.port: expected an integer, got 'x'"]


def test_reader_gone_before_the_output_is_a_quiet_exit_1(tmp_path):
    """Like `ddtree-ops hosts list --json | true`: click's convention (exit 1, no traceback)."""
    inventory = write_inventory(tmp_path / "hosts.yaml", 400)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([*ENTRY, "hosts", "list", "--json", "-i", str(inventory)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
