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


def test_version_names_the_package_and_the_release_it_pushes():
    """`--version`: the installed version, then the release `push` would send from this checkout
    with the git commit it comes from (what `push` and `smoke` print as `release ... (git ...)`)."""
    from importlib.metadata import version
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([*ENTRY, "--version"], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    from ddtree_ops.release import build_bundle

    bundle = build_bundle()
    first, second = done.stdout.splitlines()
    assert first == f"ddtree-ops {version('ddtree-ops')}"
    assert second.startswith(f"release {bundle.release_id} (git {head.stdout.strip()[:12]}")
    assert second.endswith(f" from {bundle.source_root}")
