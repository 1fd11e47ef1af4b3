"""What a running stage writes, read as it is written (host side; stdlib only).

A stage's output lands in `<run>/logs/<stage>.log` (its stdout, stderr and `ctx.log` lines);
a stage that starts a program keeps that program's log in its artifacts folder
(`<run>/artifacts/<stage>/*.log`, e.g. sglang-e2e's `server-<variant>.log`). The runner
follows both: with `--stream-output` (the operator's `-v`) it sends the new lines as `output`
events, and every heartbeat names the last line written, so a long silent phase (a server
loading its model) still says where it is.
"""
from __future__ import annotations

from pathlib import Path

LINE_CHARS = 2000  # a longer line is cut (a progress bar redrawn with `\r` is one "line")
READ_BYTES = 256 * 1024  # per file and read: past this much new output, the oldest is skipped


class StageOutput:
    def __init__(self, run_dir: Path, stage: str):
        self.log = run_dir / "logs" / f"{stage}.log"
        self.artifacts = run_dir / "artifacts" / stage
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.last_line = ""  # the last non-blank line read, from any of the files

    def files(self) -> list[Path]:
        found = [self.log]
        try:
            found += sorted(p for p in self.artifacts.glob("*.log") if p.is_file())
        except OSError:
            pass
        return found

    def read(self, final: bool = False) -> list[tuple[str | None, list[str]]]:
        """The whole lines written since the last read, per file: (None for the stage's log,
        else the artifact's name; lines). `final`: the stage is over, a last unended line too."""
        batches: list[tuple[str | None, list[str]]] = []
        for path in self.files():
            lines = self._read_file(path, final)
            if lines:
                batches.append((None if path == self.log else path.name, lines))
        return batches

    def _read_file(self, path: Path, final: bool) -> list[str]:
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, 2)
                offset = self.offsets.get(path, 0)
                skipped = 0
                if size < offset:  # truncated or replaced: read it again from the start
                    offset, self.partial[path] = 0, b""
                if size - offset > READ_BYTES:
                    skipped, offset = size - READ_BYTES - offset, size - READ_BYTES
                    self.partial[path] = b""
                handle.seek(offset)
                data = self.partial.pop(path, b"") + handle.read(size - offset)
                self.offsets[path] = size
        except OSError:
            return []
        if not data:
            return []
        *whole, rest = data.split(b"\n")
        if final:
            whole.append(rest)
        elif rest:
            self.partial[path] = rest
        # a line redrawn with `\r` (a progress bar): what a terminal would show, its last state
        lines = [line.decode("utf-8", "replace").rstrip("\r").rsplit("\r", 1)[-1][:LINE_CHARS] for line in whole]
        if skipped:
            lines.insert(0, f"... {skipped} bytes of output not shown ...")
        lines = [line for line in lines if line.strip()]
        if lines:
            self.last_line = lines[-1]
        return lines
