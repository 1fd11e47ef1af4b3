"""`make run`'s commands exactly as the Makefile runs them (`make -n run`, this venv as VENV),
at a live terminal as a person types `make run`: `hosts check` and the full default `smoke` on
the embedded `local` host, then Ctrl-C in that smoke. Its set-up step (scripts/bootstrap.sh)
is what CI's `make test` runs first.

Run in the checkout with its own hosts.yaml, like make; the runs folder and the `local` host's
workdir (`~/.ddtree-ops`) go to a temporary HOME instead of the person's."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from terminal.operator_shell import TIMEOUT_S, final_line, run_id_of
from terminal.pty_run import HIDE_CURSOR, SHOW_CURSOR, PtyResult, run_in_pty

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def make_run() -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    listed = subprocess.run(["make", "-n", "--no-print-directory", "run", f"VENV={sys.prefix}"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    commands = [line for line in listed if line.strip() and "scripts/bootstrap.sh" not in line]
    assert len(commands) == 2 and all(c.startswith(f"{sys.prefix}/bin/ddtree-ops ") for c in commands), listed
    return commands


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    return {"HOME": str(home), "DDTREE_OPS_RUNS_DIR": str(home / "runs"),
            "DDTREE_OPS_DEBUG_LOG": str(home / "debug.log")}


def at_terminal(command: str, env: dict[str, str], **kwargs) -> PtyResult:
    """The recipe line's own process at the terminal (make's `sh -c` would stand between it and
    the Ctrl-C: the exit status checked is the command's)."""
    argv = shlex.split(command)
    assert not set("|&;<>$`") & set(command), f"not a simple command: {command}"
    saved = os.environ.pop("DDTREE_OPS_INVENTORY", None)  # as make would see it: the checkout's hosts.yaml
    try:
        return run_in_pty(argv, timeout_s=TIMEOUT_S, cwd=str(REPO), env=env, **kwargs)
    finally:
        if saved is not None:
            os.environ["DDTREE_OPS_INVENTORY"] = saved


def check_finished(result: PtyResult, command: str, code: int) -> None:
    assert not result.hung, f"`{command}` hung at a terminal; it showed:\n{result.text[-3000:]}"
    assert result.returncode == code, f"`{command}`: exit {result.returncode}:\n{result.text[-3000:]}"
    assert HIDE_CURSOR in result.output, f"`{command}`: no live table:\n{result.text[-3000:]}"
    assert result.output.rfind(SHOW_CURSOR) >= result.output.rfind(HIDE_CURSOR), "a live display left running"
    assert "Traceback" not in result.text


def test_make_run_at_a_terminal(make_run, home):
    check, smoke = make_run
    result = at_terminal(check, home)
    check_finished(result, check, 0)
    assert final_line(result).startswith("ddtree-ops: hosts check: 1/1 host(s) ok in "), result.text
    result = at_terminal(smoke, home)
    check_finished(result, smoke, 0)
    assert final_line(result).startswith(f"ddtree-ops: smoke run {run_id_of(result)}: exit 0 ("), result.text[-3000:]


def test_ctrl_c_in_make_runs_smoke(make_run, home):
    smoke = make_run[1]
    runs = Path(home["DDTREE_OPS_RUNS_DIR"])
    before = set(runs.glob("*"))

    def a_stage_under_way(_: str) -> bool:
        new = [run for run in runs.glob("*") if run not in before]
        return bool(new) and '"event":"stage_start"' in _read(new[0] / "local" / "events.jsonl")

    result = at_terminal(smoke, home, interrupt_when=a_stage_under_way)
    check_finished(result, smoke, 130)
    assert "ddtree-ops: interrupted (SIGINT): stopping the remote runners, keeping what arrived" in result.text
    assert final_line(result).startswith(f"ddtree-ops: smoke run {run_id_of(result)}: exit 130 ("), result.text[-3000:]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
