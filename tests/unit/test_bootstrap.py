"""scripts/bootstrap.sh prints its phases and, for the test suite, stops at once (saying what to
run) when sshd is missing and the user cannot install it. Run with a PATH that has no sshd,
rsync or apt-get and an `id` that says a non-root user; nothing is installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bootstrap(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    (tools / "id").write_text("#!/bin/sh\necho 1000\n")
    (tools / "id").chmod(0o755)
    for tool in ("dirname", "touch"):
        (tools / tool).unlink(missing_ok=True)
        (tools / tool).symlink_to(shutil.which(tool))
    return subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          timeout=120, env={"PATH": str(tools), "HOME": str(tmp_path),
                                            "SSHD": str(tmp_path / "no-sshd"), **env})


def test_no_sshd_and_not_root_stops_the_test_setup_at_once(tmp_path):
    venv = tmp_path / "venv"
    done = run_bootstrap(tmp_path, BOOTSTRAP_NEEDS_SSHD="1", VENV=str(venv))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == "bootstrap: [1/4] system packages (openssh-server openssh-client rsync)"
    assert "sshd is not installed and this user cannot install it" in done.stderr
    assert "run:  sudo apt-get install -y openssh-server openssh-client rsync" in done.stderr
    assert not venv.exists() and "[2/4]" not in done.stderr  # nothing slow was started


def test_without_the_test_suite_it_is_a_note_and_each_phase_is_named(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    stamp = venv / ".ddtree-ops-installed"
    stamp.touch()
    later = time.time() + 60
    os.utime(stamp, (later, later))  # newer than pyproject.toml: up to date
    done = run_bootstrap(tmp_path, VENV=str(venv))
    assert done.returncode == 0, done.stderr
    assert "note: missing some of openssh-server openssh-client rsync (only the test suite needs them)" in done.stderr
    assert f"bootstrap: [2/4] virtual environment {venv}: up to date" in done.stderr
    assert done.stderr.splitlines()[-1] == "bootstrap: ready"
