"""Long work at a terminal (issue #47): the live table shows it, so no `still running` line is
written there, and `-v`'s streamed lines go above the table without breaking it."""
from __future__ import annotations

import sys

import pytest
import yaml

from fixtures.checkout import copy_release_files
from terminal.pty_run import run_in_pty

pytestmark = pytest.mark.slow

QUIET = ('NAME = "quiet"\nDESCRIPTION = "says one thing, then works quietly for 3 s"\nNEEDS_TORCH = False\n'
         'import time\ndef run(ctx):\n    from ddtree_ops.hostside.protocol import StageResult\n'
         '    print("a line of output", flush=True)\n    time.sleep(3)\n    return StageResult.passed("done")\n')


def test_verbose_smoke_at_a_terminal_streams_above_the_live_table_and_says_no_still_running_lines(tmp_path):
    checkout = copy_release_files(tmp_path / "checkout", {"quiet": QUIET})
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "wd")}}}))
    result = run_in_pty([sys.executable, "-m", "ddtree_ops", "smoke", "-v", "--source", str(checkout),
                         "--stages", "quiet"], timeout_s=240, cwd=str(tmp_path),
                        env={"DDTREE_OPS_INVENTORY": str(inventory), "DDTREE_OPS_RUNS_DIR": str(tmp_path / "runs"),
                             "DDTREE_OPS_PROGRESS_EVERY_S": "0.5"})
    assert not result.hung, f"hung at a terminal; it showed:\n{result.output[-2000:]}"
    assert result.returncode == 0, result.output[-3000:]
    assert "local: quiet | a line of output" in result.output
    assert "still running" not in result.output  # the live table shows it
    assert "smoke (live)" in result.output  # the live table was drawn
