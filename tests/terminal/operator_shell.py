"""An operator's shell for the terminal suite: a working folder holding hosts.yaml, the runs
folder and the debug log, and the `ddtree-ops` console script run in it on a given screen.

`expect(screen, *args)` runs one command and checks what a person would see: it finished (a
hang is reported with the screen's tail: the deadlock of issue #47 looked exactly so), with
the exit code asked for, no traceback, a live table drawn on a live terminal (Rich hides the
cursor as its Live starts) and stopped again (the cursor shown), and no terminal control
sequence at all on a dumb one or a pipe.
"""
from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from terminal.pty_run import HIDE_CURSOR, SHOW_CURSOR, PtyResult, Screen, run_on

SCRIPT = Path(sys.executable).with_name("ddtree-ops")  # the console script, as a person types it
CLI = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "ddtree_ops"]
# Far past any of these commands on a busy machine; a deadlock never ends. Shorter to check
# quickly that the suite catches one (e.g. DDTREE_TEST_PTY_TIMEOUT_S=30 on an idle machine).
TIMEOUT_S = float(os.environ.get("DDTREE_TEST_PTY_TIMEOUT_S", "240"))
HOST_VERB_SCREENS = (Screen.LIVE, Screen.DUMB, Screen.PIPE)


@dataclass
class OperatorShell:
    cwd: Path
    inventory: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def in_folder(cls, cwd: Path, inventory: Path) -> "OperatorShell":
        return cls(cwd, inventory, {
            "DDTREE_OPS_INVENTORY": str(inventory),
            "DDTREE_OPS_RUNS_DIR": str(cwd / "runs"),
            "DDTREE_OPS_DEBUG_LOG": str(cwd / "debug.log"),
        })

    def run(self, screen: Screen, *args: str, timeout_s: float = TIMEOUT_S,
            interrupt_when: Optional[Callable[[str], bool]] = None) -> PtyResult:
        return run_on(screen, [*CLI, *args], timeout_s=timeout_s, cwd=str(self.cwd), env=self.env,
                      interrupt_when=interrupt_when)

    def expect(self, screen: Screen, *args: str, code: int = 0, live_table: bool = True,
               interrupt_when: Optional[Callable[[str], bool]] = None) -> PtyResult:
        """Run and check (see the module doc); `live_table`: the command draws one on a live
        terminal (every verb that acts on hosts does)."""
        result = self.run(screen, *args, interrupt_when=interrupt_when)
        shown = f"`ddtree-ops {' '.join(args)}` on a {screen.value} screen"
        assert not result.hung, f"{shown} hung (killed after {TIMEOUT_S}s); it showed:\n{result.text[-3000:]}"
        assert result.returncode == code, f"{shown}: exit {result.returncode}, expected {code}:\n{result.text[-3000:]}"
        assert "Traceback" not in result.text, f"{shown}:\n{result.text[-3000:]}"
        if screen is Screen.LIVE and live_table:
            assert HIDE_CURSOR in result.output, f"{shown}: no live table was drawn:\n{result.text[-3000:]}"
        if screen is Screen.LIVE:  # every live display was stopped: it draws nothing more, the cursor is back
            assert result.output.rfind(SHOW_CURSOR) >= result.output.rfind(HIDE_CURSOR), \
                f"{shown}: a live display was left running (cursor hidden):\n{result.output[-2000:]!r}"
        if screen is not Screen.LIVE:
            controls = sorted(set(re.findall(r"\x1b\[[0-9;?]*[ -/]*[@-~]", result.output)))
            assert not controls, f"{shown}: terminal control sequences {controls}:\n{result.output[-2000:]}"
        return result


def final_line(result: PtyResult) -> str:
    return result.lines[-1] if result.lines else ""


def run_id_of(result: PtyResult) -> str:
    match = re.search(r"(?:smoke|bench) run (\d{8}-\d{6}-[0-9a-f]{6}): exit", result.text)
    assert match, f"no run id in:\n{result.text[-2000:]}"
    return match.group(1)


SLOW_PYTHON = '#!/bin/sh\necho $$ >> "{pids}"\nexec sleep 120\n'


def write_slow_python(folder: Path) -> tuple[Path, Path]:
    """A host `python:` that records its pid and sleeps: it holds any verb in its remote step
    until Ctrl-C. Returns (the script, its pid file)."""
    pids, script = folder / "slow.pids", folder / "slowpy"
    script.write_text(SLOW_PYTHON.format(pids=pids))
    script.chmod(0o755)
    return script, pids


def kill_recorded(pids: Path) -> None:
    """The sleeping `python:` processes left behind (a transport does not wait for them)."""
    if not pids.exists():
        return
    for pid in pids.read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    pids.unlink()


HANG_STAGE = ('NAME = "hang"\nDESCRIPTION = "hangs until stopped"\nimport time\n'
              'def run(ctx):\n    print("hanging now", flush=True)\n    time.sleep(3600)\n')
