"""Fetch what a host kept for a run (`ddtree-ops collect`, and after Ctrl-C) in ONE stream.

One process of the host's Python (the agent's `collect` operation) gets, on stdin, what we
already hold under `runs/<run-id>/<host>/remote/` ({relpath: [size, sha256]}), and answers with
one tar stream of every other file of the run, each member carrying its sha256. Here the
stream is unpacked as it arrives, member by member, with the checks a hostile or broken host
calls for: regular files only (no links, devices or directories), relative paths without
`..`, no link followed anywhere below the runs folder (hostside.safe_write: a linked run, host
or `remote/` folder is refused, a link at a file's name is replaced), every file written
under a temporary name and renamed only when its sha256 matches. Idempotent (a re-run fetches nothing) and resumable (every file that
landed before an interruption is complete and is not fetched again).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import stat
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ddtree_ops.errors import ConfigError, RemoteStepError, quoted
from ddtree_ops.hostside.safe_write import WriteRefused, is_temporary, make_folders, open_folder, replacing
from ddtree_ops.inventory import Host
from ddtree_ops.remote_layout import agent_argv, agent_preamble, parse_agent_reply
from ddtree_ops.results import adopt_remote_records
from ddtree_ops.transport.base import Transport

SHA256_PAX_KEY = "DDTREE.sha256"  # = hostside.agent.SHA256_PAX_KEY
# What one host may send in one collect, at most: a run keeps logs and traces (a profiler
# trace is ~100 MB), and a broken or hostile host must not fill the operator's disk.
DEFAULT_MAX_BYTES = 8 << 30
MAX_FILES = 10_000  # files in one collect: empty files cost no bytes, but each costs a file
MAX_HEADER_BYTES = 1 << 20  # one member's headers (a GNU long name, pax records) at most
MAX_NAME_BYTES = 4096  # a member's path (PATH_MAX)
MAX_PART_BYTES = 255  # one folder or file name in it (NAME_MAX)
PART_SUFFIX = ".part"  # a file being received; never counted as held
_QUEUE_CHUNKS = 64  # backpressure: at most this many chunks wait for the unpacker


@dataclass
class CollectSummary:
    host: str
    fetched: list[str] = field(default_factory=list)
    unchanged: int = 0
    merged_events: bool = False  # the host's own event log replaced ours (it had more)
    skipped: list[str] = field(default_factory=list)  # links etc. the host did not send

    def to_dict(self) -> dict[str, Any]:
        return {"fetched": self.fetched, "unchanged": self.unchanged,
                "merged_events": self.merged_events, "skipped": self.skipped}


class UnsafeMember(Exception):
    """An archive member that must not be written (the message says which and why)."""


def held_files(root: Path, relpath: list[str] | None = None) -> dict[str, list[Any]]:
    """{relpath: [size, sha256]} of the regular files under root/relpath (links are not held:
    they are fetched again, replacing the link). What an interrupted receive left (a partial or
    temporary file) is removed. The walk follows no link below root: a folder there that is a
    link is neither entered nor reported."""
    held: dict[str, list[Any]] = {}
    try:
        top = open_folder(root, relpath)
    except WriteRefused:
        return held  # absent (or not ours to walk): nothing is held, collect refuses the folder itself
    try:
        for dirpath, _, filenames, folder in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            for name in filenames:
                if name.endswith(PART_SUFFIX) or is_temporary(name):
                    try:
                        os.unlink(name, dir_fd=folder)
                    except OSError:
                        pass
                    continue
                digest = _regular_file_digest(folder, name)
                if digest is not None:
                    held[os.path.normpath(os.path.join(dirpath, name)).replace(os.sep, "/")] = digest
    finally:
        os.close(top)
    return held


def _regular_file_digest(folder: int, name: str) -> list[Any] | None:
    """[size, sha256] of the regular file `name` in `folder` (opened without following a link,
    without blocking on a FIFO); None for anything else."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        digest = hashlib.sha256()
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
        return [info.st_size, digest.hexdigest()]


def member_relpath(member: tarfile.TarInfo) -> str:
    """The member's path if it is a regular file with a safe relative name, else UnsafeMember."""
    name = member.name
    if not member.isreg():
        kind = "a link" if (member.issym() or member.islnk()) else "not a regular file"
        raise UnsafeMember(f"archive member {quoted(name)} is {kind}")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise UnsafeMember(f"archive member {quoted(name)} has a name longer than {MAX_NAME_BYTES} bytes")
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise UnsafeMember(f"archive member {quoted(name)} is not a relative path")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise UnsafeMember(f"archive member {quoted(name)} has an empty, '.' or '..' part")
    if any(len(part.encode("utf-8", "surrogateescape")) > MAX_PART_BYTES for part in name.split("/")):
        raise UnsafeMember(f"archive member {quoted(name)} has a part longer than {MAX_PART_BYTES} bytes")
    return name


class _ChunkStream:
    """A readable file fed with byte chunks from the transport's thread (bounded queue).
    Once the reader stops (`stop_reading`), further chunks are dropped, so the transport
    never blocks on a reader that is gone."""

    def __init__(self) -> None:
        self.chunks: queue.Queue[Optional[bytes]] = queue.Queue(maxsize=_QUEUE_CHUNKS)
        self.buffer = b""
        self.ended = False
        self.reading = threading.Event()
        self.reading.set()
        self.consumed = 0  # bytes handed to the reader
        self.allowed = MAX_HEADER_BYTES  # ... at most this many, so far (see `allow`)

    def allow(self, more: int) -> None:
        """Let the reader take `more` bytes past what it has taken (a member's data, or the next
        member's headers): tarfile buffers a header whole, so a 1 GB long name is refused here,
        before it is read."""
        self.allowed = self.consumed + more

    def feed(self, chunk: bytes) -> None:
        while self.reading.is_set():
            try:
                self.chunks.put(chunk, timeout=0.2)
                return
            except queue.Full:
                continue

    def end(self) -> None:
        self.feed(None)  # type: ignore[arg-type]  # the end-of-stream marker

    def stop_reading(self) -> None:
        self.reading.clear()

    def read(self, size: int = -1) -> bytes:
        while not self.ended and (size < 0 or len(self.buffer) < size):
            chunk = self.chunks.get()
            if chunk is None:
                self.ended = True
            else:
                self.buffer += chunk
        if size < 0:
            size = len(self.buffer)
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        self.consumed += len(data)
        if self.consumed > self.allowed:
            raise UnsafeMember(f"an archive header longer than {MAX_HEADER_BYTES} bytes (a huge name?)")
        return data


@dataclass
class _Unpacked:
    fetched: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # sha256 differed (changed while sent)
    error: Optional[str] = None  # the host's archive was refused or broken
    local_error: Optional[str] = None  # a place here we will not write (a link on the way)


def unpack_stream(stream: Any, root: Path, max_bytes: int = DEFAULT_MAX_BYTES,
                  prefix: tuple[str, ...] = ()) -> _Unpacked:
    """Write each member of a tar stream under root/prefix (see the module docstring), following
    no link below root; stops at the first unsafe member, the first member past `max_bytes` or
    MAX_FILES in all, a header past MAX_HEADER_BYTES (with a `_ChunkStream`), or a broken
    stream, and says why in `error`; at a link (or a file) where a folder belongs, and says so
    in `local_error`. What landed before stays."""
    outcome = _Unpacked()
    total = 0
    bounded = isinstance(stream, _ChunkStream)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for count, member in enumerate(archive, 1):
                relpath = member_relpath(member)
                total += member.size
                if total > max_bytes:
                    raise UnsafeMember(f"archive member {quoted(relpath)} takes the stream past the limit of "
                                       f"{max_bytes} bytes ({len(outcome.fetched)} file(s) landed)")
                if count > MAX_FILES:
                    raise UnsafeMember(f"archive member {quoted(relpath)} is past the limit of {MAX_FILES} files "
                                       f"({len(outcome.fetched)} file(s) landed)")
                if bounded:  # this member's data (in 512-byte blocks), then the next one's headers
                    stream.allow(-(-member.size // 512) * 512 + MAX_HEADER_BYTES)
                expected = member.pax_headers.get(SHA256_PAX_KEY, "")
                if len(expected) != 64:
                    raise UnsafeMember(f"archive member {quoted(relpath)} carries no sha256")
                if _receive(archive.extractfile(member), root, (*prefix, *relpath.split("/")), expected):
                    outcome.fetched.append(relpath)
                else:
                    outcome.changed.append(relpath)
    except UnsafeMember as err:
        outcome.error = f"refused the host's archive: {err}"
    except (tarfile.TarError, EOFError) as err:
        outcome.error = f"broken archive stream: {err}"
    except WriteRefused as err:
        outcome.local_error = str(err)
    return outcome


class _Changed(Exception):
    """The member's bytes do not hash to the sha256 it carries."""


def _receive(source: Any, root: Path, parts: tuple[str, ...], expected: str) -> bool:
    """Write root/parts under a temporary name (hostside.safe_write.replacing: no link followed
    below root), renamed over its name only if the sha256 matches."""
    digest = hashlib.sha256()
    try:
        with replacing(root, parts) as out:
            for chunk in iter(lambda: source.read(1 << 16), b""):
                digest.update(chunk)
                out.write(chunk)
            if digest.hexdigest() != expected:
                raise _Changed()
    except _Changed:
        return False
    return True


def collect_host_files(transport: Transport, host: Host, workdir: str, run_id: str, host_dir: Path,
                       timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> CollectSummary:
    """Fetch the files the host kept for run_id into `<host_dir>/remote/` that we do not hold
    yet (one agent process, one stream), then adopt the host's event log and stage records
    when they are more complete than what streamed back and every record is this run's and
    this host's (else RemoteStepError naming the file; the local records stay as they were)."""
    from ddtree_ops.ids import IdKind, check_cli_id

    check_cli_id(IdKind.RUN, run_id)
    if host_dir.name != host.name or host_dir.parent.name != run_id:
        raise ConfigError(f"{host_dir}: not the folder of host {host.name} in run {run_id}")
    runs, remote = host_dir.parent.parent, (run_id, host.name, "remote")  # written following no link below runs/
    try:
        make_folders(runs, remote)
    except WriteRefused as err:
        raise ConfigError(f"{host.name}: collect: {err}") from None
    stdin = agent_preamble() + json.dumps(held_files(runs, list(remote))).encode("utf-8") + b"\n"
    stream = _ChunkStream()
    unpacked: list[_Unpacked] = []

    def unpack() -> None:
        try:
            unpacked.append(unpack_stream(stream, runs, max_bytes, prefix=remote))
        finally:
            stream.stop_reading()

    reader = threading.Thread(target=unpack, name=f"collect-{host.name}", daemon=True)
    reader.start()
    try:
        result = transport.run_streaming(agent_argv(host, "collect", run_id, workdir=workdir), stream.feed,
                                         stdin=stdin, timeout=timeout)
    finally:
        stream.end()
        reader.join(timeout)
    outcome = unpacked[0] if unpacked else _Unpacked(error="the unpacker did not finish")
    if outcome.local_error:
        raise ConfigError(f"{host.name}: collect: {outcome.local_error} ({len(outcome.fetched)} file(s) landed)")
    if outcome.error and "refused" in outcome.error:
        raise RemoteStepError(f"{host.name}: collect: {outcome.error}")
    # The agent's reply is the last line of stderr (stdout carried the archive).
    reply = parse_agent_reply(host, "collect", dataclasses.replace(result, stdout=result.stderr))
    if outcome.error:
        raise RemoteStepError(f"{host.name}: collect: {outcome.error}")
    if outcome.changed:
        raise RemoteStepError(
            f"{host.name}: collect: {len(outcome.changed)} file(s) changed while being sent (first "
            f"{outcome.changed[0]}); {len(outcome.fetched)} landed; run collect again")
    summary = CollectSummary(host.name, fetched=outcome.fetched, unchanged=int(reply.get("kept", 0)),
                             skipped=[str(s) for s in reply.get("skipped", [])])
    try:
        summary.merged_events = adopt_remote_records(host_dir, run_id, host.name)
    except ConfigError as err:  # e.g. another run's log on the host: the files stay in remote/
        raise RemoteStepError(f"{host.name}: collect: not adopted, local records kept: {err}") from None
    return summary
