"""`ddtree-ops status --watch` as a person runs it at a terminal: one table redrawn in place
each poll, until Ctrl-C (exit 130)."""
from __future__ import annotations

import sys

import pytest

from sshd_fleet import free_port
from terminal.pty_run import run_in_pty

pytestmark = pytest.mark.slow


def test_status_watch_redraws_its_table_until_ctrl_c(tmp_path):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(f"hosts:\n  local:\n    transport: local\n    sglang_port: {free_port()}\n")
    argv = [sys.executable, "-m", "ddtree_ops", "status", "-i", str(inventory), "--watch", "--interval", "0.5"]
    result = run_in_pty(argv, timeout_s=120, cwd=str(tmp_path), interrupt_after="poll 3")
    assert not result.hung, f"hung at a terminal; it showed:\n{result.output[-2000:]}"
    assert result.returncode == 130, result.output[-2000:]
    assert "poll 1" in result.output and "poll 3" in result.output and "not judged" in result.output
    assert "interrupted" in result.output
