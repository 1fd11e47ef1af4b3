"""What ddtree-ops keeps on a host, and the operations on it (through the host agent).

Layout under the host's `workdir` (default `~/.ddtree-ops`, `~` resolved on the host):

    releases/<id>/      immutable releases (repository-relative layout + MANIFEST.sha256)
    current             symlink -> releases/<id>, switched atomically
    runs/<run-id>/      per-run result folders
    deployments/        records of what was deployed into which Python environment
    lock                flock()ed while the layout changes

Every operation is one process of the host's Python running `hostside/agent.py`, which
arrives on stdin behind a one-line bootstrap, so the command line stays short and the rest of
stdin can carry a release archive on the same channel.
"""
from __future__ import annotations

import io
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Optional

from ddtree_ops.errors import DdtreeOpsError, HostLocked, RemoteStepError
from ddtree_ops.ids import IdKind, check_host_id, check_optional_host_id
from ddtree_ops.inventory import Host
from ddtree_ops.release import ReleaseBundle
from ddtree_ops.transport.base import CommandResult, Transport

# Reads a length-prefixed script from stdin and runs it; what follows stays on stdin.
BOOTSTRAP = (
    "import sys;b=sys.stdin.buffer;n=int(b.readline());"
    "exec(compile(b.read(n),'ddtree-ops-agent','exec'))"
)
DEFAULT_KEEP = 5
DEFAULT_LOCK_WAIT_S = 30.0
DEFAULT_MAX_HOLD_S = 6 * 3600.0


def lock_wait_within(command_timeout: float, lock_wait_s: float = DEFAULT_LOCK_WAIT_S) -> float:
    """How long a command may wait for the host lock: at most half its own deadline, so a held
    lock is reported as held (naming its holder), never as a command that timed out."""
    return min(lock_wait_s, command_timeout / 2)


def release_dir(workdir: str, release_id: str) -> str:
    return posixpath.join(workdir, "releases", release_id)


def current_dir(workdir: str) -> str:
    return posixpath.join(workdir, "current")


def run_dir(workdir: str, run_id: str) -> str:
    return posixpath.join(workdir, "runs", run_id)


def deployments_dir(workdir: str) -> str:
    return posixpath.join(workdir, "deployments")


@lru_cache(maxsize=1)
def agent_source() -> bytes:
    return (Path(__file__).parent / "hostside" / "agent.py").read_bytes()


def agent_preamble() -> bytes:
    source = agent_source()
    return b"%d\n" % len(source) + source


def agent_argv(host: Host, op: str, *args: str, site: bool = False, workdir: Optional[str] = None) -> list[str]:
    """argv that runs one script sent behind BOOTSTRAP (the agent, or with `site=True` the
    SGLang installer) with the host's Python (by absolute path).

    Without `site`, `-S` skips site-packages at start (3-5x faster start in a big ML
    environment); the probe turns them on itself when it looks for torch and SGLang."""
    return [host.python, *(() if site else ("-S",)), "-c", BOOTSTRAP, op, workdir or host.workdir, *args]


class _PayloadGate(io.RawIOBase):
    """The stdin tail of a push: blocks until the agent says whether it needs the archive,
    then yields the archive (`open_`; made by `make_payload` then) or EOF (`finish`). Never
    blocks past `timeout`."""

    def __init__(self, make_payload: Callable[[], bytes], timeout: float):
        self.make_payload = make_payload
        self.payload: Optional[io.BytesIO] = None
        self.error: Optional[Exception] = None
        self.timeout = timeout
        self.decided = threading.Event()
        self.opened = False

    def readable(self) -> bool:
        return True

    def open_(self) -> None:
        self.opened = True
        self.decided.set()

    def finish(self) -> None:
        self.decided.set()

    def read(self, size: int = -1) -> bytes:
        if not self.decided.wait(self.timeout) or not self.opened:
            return b""
        if self.payload is None:
            try:
                self.payload = io.BytesIO(self.make_payload())
            except Exception as err:  # noqa: BLE001 - raised again in the caller's thread
                self.error = err
                self.payload = io.BytesIO()  # EOF: the agent stops waiting and fails
        return self.payload.read(size if size and size > 0 else -1)


class _Chain(io.RawIOBase):
    """Several binary streams read back to back (agent source, then a payload)."""

    def __init__(self, *streams: BinaryIO):
        self.streams = list(streams)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        while self.streams:
            chunk = self.streams[0].read(size if size and size > 0 else 1 << 16)
            if chunk:
                return chunk
            self.streams.pop(0)
        return b""


def parse_agent_reply(host: Host, op: str, result: CommandResult) -> dict[str, Any]:
    """The agent's JSON reply, or a RemoteStepError that says what went wrong on which host."""
    if result.exit_status == 127:
        raise RemoteStepError(f"{host.name}: python not found at {host.python!r} (set `python:` in the inventory)")
    if result.exit_status == 126:
        raise RemoteStepError(f"{host.name}: python at {host.python!r} is not executable")
    from ddtree.bounded_files import FileRefused, parse_json

    lines = result.stdout.strip().splitlines()
    reply = None
    if lines:
        try:  # the host's word: nested past MAX_DEPTH it is no reply (it would break every later walk)
            reply = parse_json(lines[-1], f"{host.name}: agent {op} reply")
        except FileRefused:
            reply = None
    if not isinstance(reply, dict):
        raise RemoteStepError(
            f"{host.name}: agent {op} failed ({result.status_text}) with {host.python}: {result.tail()}"
        )
    if not reply.get("ok"):
        error_type = HostLocked if reply.get("kind") == "locked" else RemoteStepError
        raise error_type(f"{host.name}: {op}: {reply.get('error')}")
    return reply


# exit 3 and the link's target when `$1` is a symbolic link to nothing
_DANGLING_LINK_PROBE = 'if [ -L "$1" ] && [ ! -e "$1" ]; then readlink "$1"; exit 3; fi'


# An agent answers in a line or two of JSON (hosts-check facts included); a host sending more
# is stopped there, not read into memory.
AGENT_REPLY_MAX_BYTES = 16 << 20


def python_not_found(transport: Transport, host: Host) -> RemoteStepError:
    """The error for a `python:` the host could not run (exit 127): a link whose target is
    gone (a removed virtualenv's interpreter, say) is named as such, not as missing."""
    message = f"{host.name}: python not found at {host.python!r} (set `python:` in the inventory)"
    if "/" in host.python:
        try:
            probe = transport.run(["sh", "-c", _DANGLING_LINK_PROBE, "sh", host.python],
                                  timeout=min(host.command_timeout, 30))
        except DdtreeOpsError:
            probe = None  # the first answer stands
        if probe is not None and probe.exit_status == 3:
            message = (f"{host.name}: python {host.python!r} is a dangling link (to {probe.stdout.strip()!r}, "
                       "which does not exist): point `python:` in the inventory at an interpreter")
    return RemoteStepError(message)


def call_agent(
    transport: Transport,
    host: Host,
    op: str,
    *args: str,
    payload: Optional[BinaryIO] = None,
    timeout: Optional[float] = None,
) -> dict[str, Any]:
    stdin = _Chain(io.BytesIO(agent_preamble()), payload) if payload is not None else agent_preamble()
    result = transport.run(agent_argv(host, op, *args), stdin=stdin, timeout=timeout,
                           max_output_bytes=AGENT_REPLY_MAX_BYTES)
    if result.exit_status == 127:
        raise python_not_found(transport, host)
    return parse_agent_reply(host, op, result)


class PushAction(str, Enum):
    UNCHANGED = "unchanged"  # the host already ran this release; nothing sent
    ACTIVATED = "activated"  # it was there intact, `current` switched to it; nothing sent
    UPLOADED = "uploaded"  # archive sent, verified on the host, activated


@dataclass(frozen=True)
class PushOutcome:
    release_id: str
    action: PushAction
    previous: Optional[str]
    workdir: str  # absolute on the host
    bytes_sent: int = 0
    pruned: tuple[str, ...] = field(default=())
    replaced_broken: Optional[str] = None  # why an existing copy of this release was rejected
    # "NAME: why" for what lies in releases/ that push did not install (or that was changed
    # since): never counted, never removed
    foreign: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "release": self.release_id,
            "action": self.action.value,
            "previous": self.previous,
            "workdir": self.workdir,
            "bytes_sent": self.bytes_sent,
            "pruned": list(self.pruned),
            "replaced_broken": self.replaced_broken,
            "foreign": list(self.foreign),
        }


def ensure_release(
    transport: Transport,
    host: Host,
    bundle: ReleaseBundle,
    *,
    keep: int = DEFAULT_KEEP,
    take_lock: bool = True,
    lock_wait_s: float = DEFAULT_LOCK_WAIT_S,
    timeout: Optional[float] = None,
) -> PushOutcome:
    """Make `bundle` the active release on the host, sending it only if the host lacks an
    intact copy (decided by hashes there). One agent process, one channel: the archive
    follows on the same stdin only after the agent asks for it.

    Pass `take_lock=False` inside `host_lock(...)`."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    limit = timeout if timeout is not None else host.command_timeout
    args = (bundle.release_id, str(keep), f"{lock_wait_within(limit, lock_wait_s):g}", "1" if take_lock else "0")
    reply, sent = run_with_release_on_demand(transport, agent_argv(host, "push", *args), bundle, timeout=limit)
    if reply.exit_status == 127:
        raise python_not_found(transport, host)
    return push_outcome(host, bundle, parse_agent_reply(host, "push", reply), sent)


def run_with_release_on_demand(
    transport: Transport, argv: list[str], bundle: ReleaseBundle, *, before: bytes = b"", timeout: float,
) -> tuple[CommandResult, int]:
    """Run an agent operation that may ask for the release (`{"need": ID}` on stdout, see
    agent.push_locked); stdin carries the agent, then `before`, then the archive only if
    asked. Returns the result and the archive bytes sent (0 when the host had it)."""
    gate = _PayloadGate(bundle.archive, timeout)

    def on_line(line: str) -> None:
        if line.startswith('{"need"'):
            gate.open_()
        elif line.startswith("{"):
            gate.finish()

    try:
        result = transport.run(
            argv,
            stdin=_Chain(io.BytesIO(agent_preamble() + before), gate),
            timeout=timeout,
            on_stdout_line=on_line,
            max_output_bytes=AGENT_REPLY_MAX_BYTES,
        )
    finally:
        gate.finish()
    if gate.error is not None:
        raise gate.error  # the archive could not be made here: that, not the host's reply
    return result, len(bundle.archive()) if gate.opened else 0


def push_outcome(host: Host, bundle: ReleaseBundle, reply: dict[str, Any], bytes_sent: int) -> PushOutcome:
    """A push reply as a PushOutcome; release ids the host names are checked (path parts)."""
    return PushOutcome(
        release_id=bundle.release_id,
        action=PushAction(reply["status"]),
        previous=check_optional_host_id(host.name, IdKind.RELEASE, reply.get("previous"), "push: previous"),
        workdir=reply["workdir"],
        bytes_sent=bytes_sent,
        pruned=tuple(check_host_id(host.name, IdKind.RELEASE, p, "push: pruned") for p in reply.get("pruned", ())),
        replaced_broken=reply.get("replaced_broken"),
        foreign=tuple(str(f) for f in reply.get("foreign", ())),
    )


@dataclass(frozen=True)
class PushPlan:
    """What `push` would do on a host (`push --dry-run`); nothing was changed there."""

    release_id: str
    action: str  # upload | activate | unchanged
    previous: Optional[str]
    workdir: str
    bytes_to_send: int  # the archive, when it would be uploaded
    pruned: tuple[str, ...] = ()  # releases that would be removed
    foreign: tuple[str, ...] = ()  # what would be left there, not ours
    replaces_broken: Optional[str] = None  # why the copy there would be replaced

    def to_dict(self) -> dict[str, Any]:
        return {"release": self.release_id, "action": self.action, "previous": self.previous,
                "workdir": self.workdir, "bytes_to_send": self.bytes_to_send, "pruned": list(self.pruned),
                "foreign": list(self.foreign), "replaces_broken": self.replaces_broken}


def plan_push(transport: Transport, host: Host, bundle: ReleaseBundle, *, keep: int = DEFAULT_KEEP) -> PushPlan:
    """Ask the host what `ensure_release` would do, touching nothing there (no lock, no folder)."""
    reply = call_agent(transport, host, "plan-push", bundle.release_id, str(keep), timeout=host.command_timeout)
    action = reply["status"]
    return PushPlan(
        release_id=bundle.release_id, action=action,
        previous=check_optional_host_id(host.name, IdKind.RELEASE, reply.get("previous"), "push plan: previous"),
        workdir=reply["workdir"], bytes_to_send=len(bundle.archive()) if action == "upload" else 0,
        pruned=tuple(check_host_id(host.name, IdKind.RELEASE, p, "push plan: pruned") for p in reply.get("pruned", ())),
        foreign=tuple(reply.get("foreign") or ()), replaces_broken=reply.get("replaces_broken"),
    )


def remote_workdir(transport: Transport, host: Host) -> str:
    """The host's workdir as an absolute path (`~` resolved there)."""
    return call_agent(transport, host, "whereis")["workdir"]


def probe_host(
    transport: Transport, host: Host, *, deep: bool = False, timeout: Optional[float] = None
) -> dict[str, Any]:
    """Facts for `hosts check`, gathered by one process of the host's Python. `deep` imports
    torch there and asks torch.cuda (seconds); otherwise torch is found without importing it
    and GPUs come from nvidia-smi."""
    facts = call_agent(transport, host, "probe", "1" if deep else "0", timeout=timeout)
    check_optional_host_id(host.name, IdKind.RELEASE, facts.get("active_release"), "probe: active_release")
    return facts


@contextmanager
def host_lock(
    transport: Transport,
    host: Host,
    *,
    owner: str = "ddtree-ops",
    wait_s: float = DEFAULT_LOCK_WAIT_S,
    max_hold_s: float = DEFAULT_MAX_HOLD_S,
) -> Iterator[None]:
    """Hold `<workdir>/lock` on the host for the duration of the block.

    A remote agent process holds an flock() until its stdin closes, so the lock is released
    even if this process dies. Inside the block, call `ensure_release(..., take_lock=False)`.
    Raises HostLocked when another holder keeps it longer than `wait_s`."""
    read_fd, write_fd = os.pipe()
    release_stream = os.fdopen(read_fd, "rb", buffering=0)
    locked = threading.Event()
    outcome: dict[str, Any] = {}

    def on_line(line: str) -> None:
        if line.strip() == "locked":
            locked.set()

    def hold() -> None:
        try:
            outcome["result"] = transport.run(
                agent_argv(host, "hold-lock", owner, f"{wait_s:g}"),
                stdin=_Chain(io.BytesIO(agent_preamble()), release_stream),
                timeout=max_hold_s,
                on_stdout_line=on_line,
            )
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = err
        finally:
            locked.set()

    holder = threading.Thread(target=hold, name=f"lock-{host.name}", daemon=True)
    holder.start()
    locked.wait(wait_s + host.connect_timeout + 30)
    if "result" in outcome or "error" in outcome or not locked.is_set():
        os.close(write_fd)
        holder.join(timeout=10)
        release_stream.close()
        if "error" in outcome:
            raise outcome["error"]
        if "result" in outcome:
            parse_agent_reply(host, "hold-lock", outcome["result"])
        raise HostLocked(f"{host.name}: could not take {host.workdir}/lock within {wait_s:g}s")
    try:
        yield
    finally:
        os.close(write_fd)  # EOF on the agent's stdin: it releases the lock and exits
        holder.join(timeout=host.connect_timeout + 30)
        release_stream.close()
