"""Run a command under a real pseudo-terminal, as a person at a terminal runs it.

A piped run has no terminal, so Rich never draws its live table there and whatever only a
terminal triggers (issue #47: a lock held while Rich rendered hung every verb) goes unseen.
"""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class PtyResult:
    returncode: Optional[int]  # None: still running at the deadline (killed then)
    output: str  # everything the terminal showed, stdout and stderr together
    hung: bool


def run_in_pty(argv: Sequence[str], *, timeout_s: float, cwd: Optional[str] = None,
               env: Optional[dict[str, str]] = None, rows: int = 40, cols: int = 120,
               interrupt_after: Optional[str] = None) -> PtyResult:
    """`argv` with stdin, stdout and stderr on one pty of `rows` x `cols`; `interrupt_after`:
    send Ctrl-C (the terminal's own VINTR, to the foreground process group) once that text
    appeared. A run past `timeout_s` is killed and reported as hung."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    full_env = {**os.environ, **(env or {}), "TERM": (env or {}).get("TERM", "xterm-256color")}
    full_env.pop("COLUMNS", None)
    full_env.pop("LINES", None)
    proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                            env=full_env, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    interrupted = interrupt_after is None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return PtyResult(None, _text(chunks), hung=True)
            ready, _, _ = select.select([master], [], [], min(remaining, 0.2))
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the slave side has closed it
                    data = b""
                if not data:
                    break
                chunks.append(data)
            if not interrupted and interrupt_after in _text(chunks):
                os.write(master, b"\x03")  # what Ctrl-C types
                interrupted = True
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
        return PtyResult(proc.returncode, _text(chunks), hung=False)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", "replace")
