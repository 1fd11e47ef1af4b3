"""Run a command as a person runs it: at a real pseudo-terminal (with Rich's live table, or a
dumb terminal that gets lines), or piped, the way a CI log sees it.

A piped run has no terminal, so Rich never draws its live table there and whatever only a
terminal triggers (issue #47: a lock held while Rich rendered hung every verb) goes unseen.
"""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence


class Screen(Enum):
    """Where the output goes."""

    LIVE = "live"  # a pty, TERM=xterm-256color, 40x120: Rich draws the live tables
    DUMB = "dumb"  # a pty, TERM=dumb: no live table, one line per host or stage
    PIPE = "pipe"  # stdout and stderr into one pipe (`2>&1 | tee log`): what CI logs see


ROWS, COLS = 40, 120
HIDE_CURSOR = "\x1b[?25l"  # what Rich's Live writes as it starts: the live table was drawn
SHOW_CURSOR = "\x1b[?25h"  # ... and as it stops: a Live never stopped leaves the cursor hidden
_CSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass
class PtyResult:
    returncode: Optional[int]  # None: still running at the deadline (killed then)
    output: str  # everything the terminal showed, stdout and stderr together
    hung: bool

    @property
    def text(self) -> str:
        return plain(self.output)

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.text.splitlines() if line.strip()]


def plain(output: str) -> str:
    """Terminal output without control sequences and carriage returns."""
    return _CSI.sub("", output).replace("\r", "")


def run_in_pty(argv: Sequence[str], *, timeout_s: float, cwd: Optional[str] = None,
               env: Optional[dict[str, str]] = None, rows: int = ROWS, cols: int = COLS,
               interrupt_after: Optional[str] = None,
               interrupt_when: Optional[Callable[[str], bool]] = None) -> PtyResult:
    """`argv` with stdin, stdout and stderr on one pty of `rows` x `cols` (TERM from `env`,
    else xterm-256color); Ctrl-C (the terminal's own VINTR, to the foreground process group)
    once `interrupt_after` appeared in the output or `interrupt_when(output)` is true. A run
    past `timeout_s` is killed and reported as hung."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    full_env = _environment(env, (env or {}).get("TERM", "xterm-256color"))
    proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                            env=full_env, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    try:
        return _follow(proc, master, timeout_s, _trigger(interrupt_after, interrupt_when),
                       lambda: os.write(master, b"\x03"))  # what Ctrl-C types
    finally:
        os.close(master)


def run_piped(argv: Sequence[str], *, timeout_s: float, cwd: Optional[str] = None,
              env: Optional[dict[str, str]] = None,
              interrupt_when: Optional[Callable[[str], bool]] = None) -> PtyResult:
    """`argv` with stdout and stderr into one pipe and no terminal at all; Ctrl-C at the shell
    that runs such a pipeline is a SIGINT to its process group, sent so here."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end,
                            cwd=cwd, env=_environment(env, (env or {}).get("TERM", "xterm-256color")),
                            start_new_session=True)
    os.close(write_end)
    try:
        return _follow(proc, read_end, timeout_s, _trigger(None, interrupt_when),
                       lambda: os.killpg(proc.pid, signal.SIGINT))
    finally:
        os.close(read_end)


def run_on(screen: Screen, argv: Sequence[str], *, timeout_s: float, cwd: Optional[str] = None,
           env: Optional[dict[str, str]] = None,
           interrupt_when: Optional[Callable[[str], bool]] = None) -> PtyResult:
    if screen is Screen.PIPE:
        return run_piped(argv, timeout_s=timeout_s, cwd=cwd, env=env, interrupt_when=interrupt_when)
    term = "dumb" if screen is Screen.DUMB else "xterm-256color"
    return run_in_pty(argv, timeout_s=timeout_s, cwd=cwd, env={**(env or {}), "TERM": term},
                      interrupt_when=interrupt_when)


def _environment(env: Optional[dict[str, str]], term: str) -> dict[str, str]:
    full = {**os.environ, **(env or {}), "TERM": term}
    for inherited in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"):
        full.pop(inherited, None)  # the terminal says how wide and how colourful, nothing else
    return full


def _trigger(after: Optional[str], when: Optional[Callable[[str], bool]]) -> Optional[Callable[[str], bool]]:
    if after is not None:
        return lambda output: after in output
    return when


def _follow(proc: subprocess.Popen, fd: int, timeout_s: float,
            interrupt_when: Optional[Callable[[str], bool]], interrupt: Callable[[], None]) -> PtyResult:
    """Read `fd` until every writer closed it, interrupting once when asked; kill the process
    group at the deadline."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    interrupted = interrupt_when is None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return PtyResult(None, _text(chunks), hung=True)
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.2))
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every holder of the pty's slave side has closed it
                    data = b""
                if not data:
                    break
                chunks.append(data)
            if not interrupted and interrupt_when(_text(chunks)):
                interrupt()
                interrupted = True
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
        return PtyResult(proc.returncode, _text(chunks), hung=False)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", "replace")
