"""The transport interface every command talks to; SSH and local are its implementations.

Contract (every implementation keeps it):
- Commands are argv lists, never shell strings; an implementation that needs a shell quotes
  every element, so no inventory or CLI value can inject shell syntax.
- Every call is bounded: `timeout` (seconds) or the host's `command_timeout`; a command that
  outlives it is killed on the host with its whole process group, not merely abandoned.
- What a host sends is bounded (a host may be hostile): stdout lines at MAX_LINE_BYTES, stdout
  in all at `max_output_bytes` (MAX_OUTPUT_BYTES), both an OutputLimitExceeded that stops the
  command; of stderr only the last STDERR_KEPT_BYTES are kept.
- A failure to reach the host or a dropped connection raises a `TransportError` subclass
  (`ddtree_ops.errors`); a command that ran and exited non-zero is a `CommandResult`, not an
  exception. Library exceptions (paramiko, socket, subprocess) never escape this package.
- An argv element (or cwd) that is exactly `~` or starts with `~/` names the remote user's home
  (`~/.ddtree-ops`, `~/venv/bin/python`): each implementation expands that prefix on its side
  and treats everything else literally.
- `stdin` is bytes or a binary stream (read in chunks until EOF, then the command's stdin is
  closed), so one channel can carry a script followed by an archive.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Union


MAX_LINE_BYTES = 8 << 20  # one stdout line (a smoke record, a JSON reply)
MAX_OUTPUT_BYTES = 256 << 20  # stdout of one command, unless the caller says otherwise
STDERR_KEPT_BYTES = 1 << 20  # the end of stderr; what comes before is dropped


@dataclass(frozen=True)
class CommandResult:
    host: str
    argv: tuple[str, ...]
    exit_status: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def tail(self, chars: int = 400) -> str:
        """The end of stderr (or stdout when stderr is empty), for one-line error messages."""
        text = (self.stderr or self.stdout).strip()
        return text[-chars:].replace("\n", " | ")

    @property
    def status_text(self) -> str:
        """`exit 3`, or `killed by SIGKILL (exit 137)` for a command a signal ended (the shell's
        128+N, or a subprocess's -N)."""
        return describe_exit(self.exit_status)


def describe_exit(status: int) -> str:
    import signal

    number = -status if status < 0 else status - 128 if 128 < status < 128 + 65 else None
    try:
        name = signal.Signals(number).name if number else None
    except ValueError:
        name = None
    return f"killed by {name} (exit {status})" if name else f"exit {status}"


LineHandler = Callable[[str], None]
ChunkHandler = Callable[[bytes], None]
StdinSource = Union[bytes, BinaryIO, None]


def expand_home(arg: str, home: str) -> str:
    """`~` or `~/rest` -> `home` or `home/rest`; anything else unchanged."""
    if arg == "~":
        return home
    if arg.startswith("~/"):
        return home.rstrip("/") + arg[1:]
    return arg


def shell_quote_argv(argv: Sequence[str]) -> str:
    """One POSIX shell command line that runs exactly argv: every element single-quoted; a
    leading `~` / `~/` becomes `"$HOME"` / `"$HOME"/` so the remote shell supplies the home."""
    import shlex

    def one(arg: str) -> str:
        if arg == "~":
            return '"$HOME"'
        if arg.startswith("~/"):
            return '"$HOME"/' + shlex.quote(arg[2:]) if arg[2:] else '"$HOME"/'
        return shlex.quote(arg)

    if not argv:
        raise ValueError("empty argv")
    return " ".join(one(arg) for arg in argv)


class Transport(ABC):
    """One open connection to one host. Use as a context manager; `close()` never raises."""

    host_name: str

    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: StdinSource = None,
        cwd: str | None = None,
        timeout: float | None = None,
        on_stdout_line: LineHandler | None = None,
        on_stderr_line: LineHandler | None = None,
        idle_timeout: float | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandResult:
        """Run argv on the host and wait for it. With `on_stdout_line`, each complete stdout
        line is handed over as it arrives (and still collected in the result). With
        `idle_timeout`, a command that sends nothing (stdout or stderr) for that long is
        stopped and ConnectionLost raised: the host or the connection froze (a command that
        keeps a heartbeat, like the smoke runner, is never silent that long)."""

    @abstractmethod
    def run_streaming(
        self,
        argv: Sequence[str],
        on_stdout: ChunkHandler,
        *,
        stdin: StdinSource = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run argv and hand its stdout over as raw byte chunks as they arrive (e.g. a tar
        stream), in one channel; the result's `stdout` is empty, `stderr` is collected."""

    @abstractmethod
    def put_stream(
        self, source: BinaryIO, argv: Sequence[str], *, timeout: float | None = None
    ) -> CommandResult:
        """Pipe `source` into the stdin of argv on the host (e.g. `tar -x`), in one channel."""

    @abstractmethod
    def get_file(self, remote_path: str, local_path: str, *, timeout: float | None = None) -> None:
        """Copy one remote file to a local path (written to a temp name, then renamed).
        A remote file that cannot be read raises RemoteStepError."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
