"""A server we started, answering on a port it owns, or a start that fails at once naming the port.

SGLang binds its HTTP port only after it has loaded the model (10-90 s on a busy host). A port
found free before the start can be taken by another process in between: SGLang then logs
"address already in use" and keeps running, and whatever else listens there answers /health.
So a start is judged by who holds the port, not by who answers on it:

- before launching, the port must be free (we bind it for a moment), else PortTakenError;
- while waiting, every poll asks the kernel (/proc/net/tcp{,6}) who listens on the port: a
  listener outside our server's session (start_new_session: the server leads it, its
  children stay in it) fails the start at once, naming the port and the holder's pid and
  command (PortTakenError); so does SGLang's own "address already in use" in its log;
- once /health answers from our own socket, `/server_info` must report the model path and
  port we launched with (NotOurServerError otherwise): the check that still holds where the
  kernel's tables cannot be read.

Standard library only (host side).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
PORT_IN_USE_LOG = "address already in use"  # uvicorn's bind failure, as SGLang logs it


class PortTakenError(RuntimeError):
    """The port is (or became) another process's: our server cannot be the one answering there."""


class NotOurServerError(RuntimeError):
    """Something answers on the port, but not with the model and port we launched."""


# ----------------------------------------------------------------------------- who holds a port


def _listening_inodes(port: int) -> list[str] | None:
    """Socket inodes listening on `port` (any address), or None where /proc/net cannot be read."""
    inodes, readable = [], False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN_STATE and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.append(fields[9])
    return inodes if readable else None


def _socket_owners(inodes: Sequence[str]) -> list[int]:
    """Pids with one of these sockets open, among the processes this account may look into."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # another account's process, or gone meanwhile
            continue
        if any(_link(fd) in wanted for fd in fds):
            owners.append(int(entry.name))
    return owners


def _link(fd: Path) -> str | None:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile (the listing's own descriptor, for one)
        return None


def port_holders(port: int) -> list[int] | None:
    """Pids listening on `port`: [] when nobody listens; None when the kernel's tables cannot be
    read here. A listener whose process this account cannot see is reported as pid -1."""
    inodes = _listening_inodes(port)
    if not inodes:
        return inodes
    return _socket_owners(inodes) or [-1]


def describe_pid(pid: int) -> str:
    if pid < 0:
        return "a process of another account"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {pid}" + (f" ({command[:120]})" if command else "")


def _in_session(pid: int, leader: int) -> bool:
    try:
        return os.getsid(pid) == leader
    except OSError:
        return False


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """PortTakenError naming the port (and who holds it, where visible) unless it is free now."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            holders = port_holders(port) or []
            held = f"held by {', '.join(describe_pid(p) for p in holders)}" if holders else (err.strerror or str(err))
            raise PortTakenError(f"port {port} on {host} is not free ({held}): not starting a server there") from None


# ----------------------------------------------------------------------------- start, wait, stop


def launch(argv: Sequence[str], env: Mapping[str, str], log_path: Path, port: int,
           host: str = "127.0.0.1") -> subprocess.Popen:
    """Start `argv` in a session of its own (so its whole group can be stopped), output to
    `log_path`, after checking that `port` is free."""
    check_port_free(port, host)
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(list(argv), stdout=log_file, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True)


def _http_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip() else None


def _log_says_port_in_use(log_path: Path | None) -> bool:
    if log_path is None:
        return False
    try:
        return PORT_IN_USE_LOG in log_path.read_text(errors="replace").lower()
    except OSError:
        return False


def check_owner(process: subprocess.Popen, port: int) -> None:
    """PortTakenError if someone other than our server's session listens on `port`."""
    holders = port_holders(port)
    if holders and not any(_in_session(pid, process.pid) for pid in holders):
        raise PortTakenError(
            f"port {port} was taken by {', '.join(describe_pid(p) for p in holders)} while our server "
            f"(pid {process.pid}) was starting: not measuring a server we did not start")


def wait_until_serving(process: subprocess.Popen, port: int, timeout_s: float, *, model_path: str,
                       log_path: Path | None = None, poll_s: float = 1.0) -> dict[str, Any]:
    """Wait until our server answers /health on `port` from its own socket; returns its
    /server_info. RuntimeError if it exits first, TimeoutError after `timeout_s`,
    PortTakenError / NotOurServerError as the module says."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server (pid {process.pid}) exited with status {process.returncode} "
                               f"before answering on port {port}")
        check_owner(process, port)
        if _log_says_port_in_use(log_path):
            holders = port_holders(port) or []
            who = f": held by {', '.join(describe_pid(p) for p in holders)}" if holders else ""
            raise PortTakenError(f"our server (pid {process.pid}) could not bind port {port} "
                                 f"(address already in use{who})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            break
        except (urllib.error.URLError, OSError):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"server (pid {process.pid}) not answering on port {port} after "
                                   f"{timeout_s:.0f}s") from None
            time.sleep(poll_s)
    check_owner(process, port)  # the answer came from our socket, not a squatter's
    return check_identity(port, model_path, process)


def check_identity(port: int, model_path: str, process: subprocess.Popen | None = None) -> dict[str, Any]:
    """The server on `port` reports the model path and port we launched with (`/server_info`)."""
    try:
        info = _http_json(f"http://127.0.0.1:{port}/server_info", timeout=30)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise NotOurServerError(f"port {port}: /health answered but /server_info did not ({err}): "
                                "not the SGLang server we started") from None
    if not isinstance(info, dict):
        raise NotOurServerError(f"port {port}: /server_info is not an object: not the SGLang server we started")
    found = (str(info.get("model_path")), info.get("port"))
    # model_path is SGLang's resolved value; launch_command what it was asked (srt/entrypoints/
    # http_server.py:863-891, srt/utils/common.py:3584-3593): either may name our model
    asked = str(info.get("launch_command") or "").split()
    named = str(model_path) in (found[0], *[asked[i + 1] for i, word in enumerate(asked[:-1]) if word == "--model-path"])
    if not (named and found[1] == port):
        who = f" (ours is pid {process.pid})" if process is not None else ""
        raise NotOurServerError(f"port {port}: the server there reports model {found[0]!r} on port {found[1]}, "
                                f"we launched {model_path!r} on port {port}{who}")
    return info


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's whole session group, then SIGKILL what is left (its children too
    when the server itself has exited: the kernel keeps the group's id while a member lives)."""
    if process.poll() is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
