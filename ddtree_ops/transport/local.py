"""The local transport: the `local` host runs commands here as subprocesses (no shell)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from ddtree_ops.errors import CommandTimeout, ConnectionLost, HostUnreachable, OutputLimitExceeded, RemoteStepError
from ddtree_ops.transport.base import (
    MAX_LINE_BYTES,
    MAX_OUTPUT_BYTES,
    STDERR_KEPT_BYTES,
    ChunkHandler,
    CommandResult,
    LineHandler,
    StdinSource,
    Transport,
    expand_home,
)

_CHUNK = 1 << 16


class LocalTransport(Transport):
    def __init__(self, host_name: str, *, command_timeout: float = 600.0):
        self.host_name = host_name
        self.command_timeout = command_timeout

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
        _stdout_chunks: ChunkHandler | None = None,
    ) -> CommandResult:
        argv = tuple(argv)
        limit = timeout if timeout is not None else self.command_timeout
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [expand_home(arg, os.path.expanduser("~")) for arg in argv],
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
                cwd=expand_home(cwd, os.path.expanduser("~")) if cwd else None,
                start_new_session=True,  # so a timeout can kill the whole process group
            )
        except FileNotFoundError:
            # Same status a shell gives, so callers treat local and SSH alike.
            return CommandResult(self.host_name, argv, 127, "", f"{argv[0]}: command not found", 0.0)
        except PermissionError:
            return CommandResult(self.host_name, argv, 126, "", f"{argv[0]}: permission denied", 0.0)
        except OSError as err:
            raise HostUnreachable(self.host_name, f"cannot start {argv[0]!r}: {err}") from None

        out_chunks: list[bytes] = []
        err_chunks: list[bytes] = []
        heard = [started]  # when the command last wrote anything (pump threads update it)
        over: list[str] = []  # why a pump stopped the command (a limit), if one did
        stdout_limit = _Limit(MAX_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes, over,
                              f"{self.host_name}: {argv[0]}", proc)
        out_pump = (threading.Thread(target=_pump_chunks, args=(proc.stdout, _stdout_chunks), daemon=True)
                    if _stdout_chunks is not None else
                    threading.Thread(target=_pump_lines, args=(proc.stdout, out_chunks, on_stdout_line, heard,
                                                               stdout_limit), daemon=True))
        threads = [
            out_pump,
            threading.Thread(target=_pump_lines, args=(proc.stderr, err_chunks, on_stderr_line, heard), daemon=True),
        ]
        for thread in threads:
            thread.start()
        if stdin is not None:
            # Not joined: a stdin source may block until the command's output decides (push).
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        status = self._wait(proc, argv, started, limit, idle_timeout, heard)
        for thread in threads:
            # A chunk consumer (an unpacker) may lag behind the exited process: let it finish
            # within the command's deadline so no chunk arrives after we return.
            slack = limit - (time.monotonic() - started) if _stdout_chunks is not None else 0
            thread.join(timeout=max(5.0, slack))
        if over:
            raise OutputLimitExceeded(over[0])
        return CommandResult(
            host=self.host_name,
            argv=argv,
            exit_status=status,
            stdout=b"".join(out_chunks).decode("utf-8", "replace"),
            stderr=b"".join(err_chunks).decode("utf-8", "replace"),
            duration_s=time.monotonic() - started,
        )

    def _wait(self, proc: subprocess.Popen, argv: tuple[str, ...], started: float, limit: float,
              idle_timeout: float | None, heard: list[float]) -> int:
        deadline = started + limit
        while True:
            now = time.monotonic()
            if idle_timeout is not None and now - heard[0] > idle_timeout:
                _kill_group(proc)
                raise ConnectionLost(self.host_name, f"{argv[0]} sent nothing for {idle_timeout:g}s "
                                                     "(it froze); killed")
            step = deadline - now if idle_timeout is None else min(deadline - now, 0.5)
            try:
                return proc.wait(timeout=max(step, 0))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    _kill_group(proc)
                    raise CommandTimeout(self.host_name, f"{argv[0]} ran longer than {limit:g}s; killed") from None

    def run_streaming(
        self,
        argv: Sequence[str],
        on_stdout: ChunkHandler,
        *,
        stdin: StdinSource = None,
        timeout: float | None = None,
    ) -> CommandResult:
        return self.run(argv, stdin=stdin, timeout=timeout, _stdout_chunks=on_stdout)

    def put_stream(self, source: BinaryIO, argv: Sequence[str], *, timeout: float | None = None) -> CommandResult:
        return self.run(argv, stdin=source, timeout=timeout)

    def get_file(self, remote_path: str, local_path: str, *, timeout: float | None = None) -> None:
        source = expand_home(remote_path, os.path.expanduser("~"))
        tmp = f"{local_path}.part-{os.getpid()}"
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, local_path)
        except OSError as err:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise RemoteStepError(f"{self.host_name}: cannot copy {remote_path}: {err.strerror}") from None

    def close(self) -> None:
        return None


class _Limit:
    """The stdout bounds of one command (base.py): past one, the command's group is killed."""

    def __init__(self, max_bytes: int, over: list[str], who: str, proc: subprocess.Popen):
        self.max_bytes, self.over, self.who, self.proc = max_bytes, over, who, proc
        self.received = 0

    def exceeded(self, line: bytes) -> bool:
        self.received += len(line)
        if len(line) > MAX_LINE_BYTES:
            why = f"{self.who} sent a line longer than {MAX_LINE_BYTES} bytes; stopped (the lines before it are kept)"
        elif self.received > self.max_bytes:
            why = f"{self.who} sent more than {self.max_bytes} bytes; stopped (what arrived before is kept)"
        else:
            return False
        self.over.append(why)
        _kill_group(self.proc)
        return True


def _pump_lines(stream: BinaryIO, sink: list[bytes], handler: LineHandler | None,
                heard: list[float] | None = None, limit: _Limit | None = None) -> None:
    kept = 0
    for line in iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""):
        if heard is not None:
            heard[0] = time.monotonic()
        if limit is not None and limit.exceeded(line):
            break
        sink.append(line)
        kept += len(line)
        while limit is None and kept > STDERR_KEPT_BYTES and len(sink) > 1:  # stderr: its end
            kept -= len(sink.pop(0))
        if handler is not None:
            handler(line.decode("utf-8", "replace").rstrip("\n"))
    stream.close()


def _pump_chunks(stream: BinaryIO, handler: ChunkHandler) -> None:
    for chunk in iter(lambda: stream.read1(_CHUNK), b""):
        handler(chunk)
    stream.close()


def _feed(pipe: BinaryIO, source: bytes | BinaryIO) -> None:
    try:
        if isinstance(source, (bytes, bytearray)):
            pipe.write(source)
        else:
            for chunk in iter(lambda: source.read(_CHUNK), b""):
                pipe.write(chunk)
                pipe.flush()  # the next read may wait on the command (push's files): it must have this much
    except (BrokenPipeError, ValueError):
        pass  # the command stopped reading; its exit status tells the story
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
