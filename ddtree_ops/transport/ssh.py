"""The SSH transport (Paramiko), built around the traps an SSH fleet sets.

- Host keys: only the inventory's `known_hosts` (default ~/.ssh/known_hosts) with a reject
  policy. `accept_new_host_keys=True` trusts an *unknown* key once and appends it to that file;
  a *changed* or `@revoked` key is always refused; `@cert-authority` lines are skipped.
- Every phase is bounded: TCP connect, banner + key exchange, auth and channel open by
  `connect_timeout`; each command and transfer by its own deadline.
- The socket is connected by us with TCP_NODELAY (Paramiko never sets it).
- A channel that ends without an exit status (Paramiko's `-1`) is a lost connection.
- ssh_config is read in `ssh_config`, host keys in `known_hosts`.
- Paramiko's exception zoo is classified once here into `ddtree_ops.errors` transport errors.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO, Optional

from ddtree_ops.errors import (
    AuthenticationFailed,
    OutputLimitExceeded,
    CommandTimeout,
    ConnectionLost,
    ConnectionRefused,
    ConnectTimeout,
    HostKeyRejected,
    HostUnreachable,
    RemoteStepError,
    TransportError,
)
from ddtree_ops.inventory import Host
from ddtree_ops.transport.known_hosts import (
    RejectUnknownKeys,
    RevokedHostKey,
    TrustOnFirstUse,
    UnknownHostKey,
    fingerprint,
    known_hosts_path,
    read_known_hosts,
)
from ddtree_ops.transport.paramiko_import import paramiko
from ddtree_ops.transport.ssh_config import SshTarget, jump_targets, resolve_target
from ddtree_ops.transport.base import (
    MAX_LINE_BYTES,
    MAX_OUTPUT_BYTES,
    STDERR_KEPT_BYTES,
    ChunkHandler,
    CommandResult,
    LineHandler,
    StdinSource,
    Transport,
    shell_quote_argv,
)


_CHUNK = 1 << 16
_POLL_S = 0.2
_KILL_WAIT_S = 5.0
# The remote shell says its pid first, on stderr: sshd made it a session and process group
# leader, so that pid names the group a stopped command is killed with.
_PID_MARK = b"ddtree-ops-pgid "


def _tcp_connect(host_name: str, hostname: str, port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((hostname, port), timeout=timeout)
    except ConnectionRefusedError:
        raise ConnectionRefused(host_name, f"nothing listens on {hostname}:{port}") from None
    except socket.gaierror as err:
        raise HostUnreachable(host_name, f"cannot resolve {hostname!r}: {err.strerror}") from None
    except UnicodeError as err:  # the idna codec refuses `a..b` or a label over 63 characters
        raise HostUnreachable(host_name, f"cannot resolve {hostname!r}: not a valid host name ({err})") from None
    except (socket.timeout, TimeoutError):
        raise ConnectTimeout(host_name, f"TCP connect to {hostname}:{port} took over {timeout:g}s") from None
    except OSError as err:
        raise HostUnreachable(host_name, f"{hostname}:{port}: {err.strerror or err}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _looks_like_private_key(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return b"PRIVATE KEY-----" in head


def usable_identity_files(host_name: str, paths: Sequence[str]) -> list[str]:
    """Like OpenSSH, skip IdentityFile entries that are missing or are not private keys (a
    `.pub`, some other file); only when none is left is it an authentication failure."""
    usable = [p for p in paths if os.path.isfile(p) and _looks_like_private_key(p)]
    if paths and not usable:
        problems = [f"identity_file {p} does not exist" if not os.path.isfile(p) else
                    f"identity_file {p} is not a private key"
                    + (" (a public key: name the file without .pub)" if p.endswith(".pub") else "")
                    for p in paths]
        raise AuthenticationFailed(host_name, "no usable key: " + "; ".join(problems))
    return usable


def _classify_handshake(host_name: str, where: str, err: BaseException, timeout: float,
                        known_hosts: Optional[str], elapsed: Optional[float] = None) -> TransportError:
    """Paramiko's zoo -> one of our transport errors (the socket was already connected).
    `elapsed`: how long the handshake ran, when known: Paramiko words a banner that never came
    and a peer that hung up before sending one alike, so only the clock tells them apart."""
    if isinstance(err, TransportError):
        return err
    if isinstance(err, RevokedHostKey):
        return HostKeyRejected(
            host_name,
            f"the host key of {err.name} ({err.key.get_name()} {fingerprint(err.key)}) is marked "
            f"@revoked in {known_hosts}; refusing to connect",
        )
    if isinstance(err, UnknownHostKey):
        return HostKeyRejected(
            host_name,
            f"{err.name} is not in {known_hosts or 'any known_hosts file'} "
            f"({err.key.get_name()} {fingerprint(err.key)}); verify it, then add it or pass "
            f"--accept-new-host-keys to trust it on first use",
        )
    if isinstance(err, paramiko.BadHostKeyException):
        return HostKeyRejected(
            host_name,
            f"the host key of {where} CHANGED (got {fingerprint(err.key)}, "
            f"{known_hosts} has {fingerprint(err.expected_key)}); refusing to connect",
        )
    if isinstance(err, paramiko.AuthenticationException):
        return AuthenticationFailed(host_name, f"{where}: {err}")
    text = str(err)
    if "No authentication methods available" in text:
        return AuthenticationFailed(host_name, f"{where}: no key and no agent: set identity_file (inventory) or "
                                               f"IdentityFile (ssh_config), or start ssh-agent")
    if "banner" in text and elapsed is not None and elapsed < 0.9 * timeout:
        return ConnectionLost(
            host_name, f"{where}: closed the connection after {elapsed:.1f}s without an SSH banner (is it an SSH server?)"
        )
    if isinstance(err, (socket.timeout, TimeoutError)) or any(
        marker in text for marker in ("banner", "No existing session", "timed out", "Negotiation")
    ):
        # Paramiko's wording ("No existing session", "Error reading SSH protocol banner") says
        # nothing an operator can act on: the debug log keeps it.
        return ConnectTimeout(host_name, f"{where}: no SSH handshake within {timeout:g}s (the host accepted the "
                                         "connection but did not answer: frozen, overloaded or not an SSH server?)")
    return ConnectionLost(host_name, f"{where}: connection closed during handshake ({type(err).__name__}: {text})")


class SshTransport(Transport):
    """One authenticated SSH connection to one host, reused for every command of a run."""

    def __init__(self, host: Host, *, accept_new_host_keys: bool = False):
        self.host_name = host.name
        self.host = host
        self.connect_timeout = host.connect_timeout
        self.command_timeout = host.command_timeout
        self.known_hosts = known_hosts_path(host)
        self._known = read_known_hosts(self.known_hosts, host.name)
        self.accept_new_host_keys = accept_new_host_keys
        self._clients: list[paramiko.SSHClient] = []  # jump hosts first, the target last
        self.target = resolve_target(host)
        try:
            self._client = self._connect_chain(self.target)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ connect

    def _new_client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        host_keys = client.get_host_keys()
        for name, key in self._known.entries:
            host_keys.add(name, key.get_name(), key)
        revoked = self._known.revoked
        client.set_missing_host_key_policy(
            TrustOnFirstUse(self.known_hosts, revoked) if self.accept_new_host_keys else RejectUnknownKeys(revoked)
        )
        return client

    def _connect_chain(self, target: SshTarget) -> paramiko.SSHClient:
        sock = None
        chain = jump_targets(self.host, target) + [target]  # resolved once: each reads ssh_config
        for hop in chain:
            where = f"{hop.hostname}:{hop.port}"
            if sock is None:
                sock = _tcp_connect(self.host_name, hop.hostname, hop.port, self.connect_timeout)
            client = self._new_client()
            self._clients.append(client)
            started = time.monotonic()
            try:
                keys = usable_identity_files(self.host_name, hop.identity_files)
                client.connect(
                    hop.hostname,
                    port=hop.port,
                    username=hop.user,
                    key_filename=keys or None,
                    look_for_keys=not keys,
                    allow_agent=bool(os.environ.get("SSH_AUTH_SOCK")),
                    sock=sock,
                    timeout=self.connect_timeout,
                    banner_timeout=self.connect_timeout,
                    auth_timeout=self.connect_timeout,
                    channel_timeout=self.connect_timeout,
                )
            except Exception as err:  # noqa: BLE001 - classified right here, once
                raise _classify_handshake(
                    self.host_name, where, err, self.connect_timeout, self.known_hosts, time.monotonic() - started
                ) from None
            transport = client.get_transport()
            transport.set_keepalive(15)
            if hop is not target:
                next_hop = chain[len(self._clients)]
                try:
                    sock = transport.open_channel(
                        "direct-tcpip", (next_hop.hostname, next_hop.port), ("127.0.0.1", 0),
                        timeout=self.connect_timeout,
                    )
                except Exception as err:  # noqa: BLE001
                    raise HostUnreachable(
                        self.host_name, f"jump host {where} cannot reach {next_hop.hostname}:{next_hop.port}: {err}"
                    ) from None
        return self._clients[-1]

    # ------------------------------------------------------------ commands

    def _open_channel(self, argv: Sequence[str], env, cwd) -> tuple[paramiko.Channel, str]:
        command = shell_quote_argv(argv)
        if env:
            # Inlined, so visible in `ps` on the host: never pass secrets this way.
            command = shell_quote_argv(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        if cwd:
            command = f"{shell_quote_argv(['cd', '--', cwd])} && {command}"
        # The shell stays the command's parent (`; exit $?`, never exec'd away): a command a
        # signal ends is then an exit status (128+N) like any other, not a channel without one.
        command = f"printf '{_PID_MARK.decode()}%s\\n' \"$$\" >&2; {command}; exit $?"
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionLost(self.host_name, "the SSH connection is closed")
        try:
            channel = transport.open_session(timeout=self.connect_timeout)
            channel.exec_command(command)
        except Exception as err:  # noqa: BLE001
            raise _classify_handshake(self.host_name, "opening a session", err, self.connect_timeout,
                                      self.known_hosts) from None
        return channel, command

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
        argv = tuple(argv)
        limit = timeout if timeout is not None else self.command_timeout
        started = time.monotonic()
        channel, _ = self._open_channel(argv, env, cwd)
        out = _LineCollector(self.host_name, argv[0], on_stdout_line,
                             MAX_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes)
        err = _LineCollector(self.host_name, argv[0], on_stderr_line, None)
        status = self._pump(channel, stdin, limit, argv, started, out.feed, err, idle_timeout)
        return CommandResult(
            host=self.host_name,
            argv=argv,
            exit_status=status,
            stdout=out.finish(),
            stderr=err.finish(),
            duration_s=time.monotonic() - started,
        )

    def _pump(self, channel: paramiko.Channel, stdin: StdinSource, limit: float, argv, started: float,
              on_out, err: "_LineCollector", idle_limit: float | None = None) -> int:
        """Feed stdin, drain stdout/stderr, and wait for the exit status, all before the deadline
        (and, with `idle_limit`, never longer than that without a byte from the command). A
        command stopped on our side (deadline, silence, a limit, a failing handler) is killed
        on the host with its process group."""
        try:
            return self._pump_until_exit(channel, stdin, limit, argv, started, on_out, err, idle_limit)
        except Exception:  # not Ctrl-C: an interrupted smoke stops its runners gracefully itself
            self._kill_remote_group(err.remote_pgid)
            channel.close()
            raise

    def _kill_remote_group(self, pgid: Optional[int]) -> None:
        """Best effort, bounded: SIGKILL to the command's process group, on a channel of its own."""
        if pgid is None or pgid <= 1:
            return
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            return
        try:
            channel = transport.open_session(timeout=_KILL_WAIT_S)
            channel.exec_command(f"kill -9 -{pgid} 2>/dev/null || kill -9 {pgid} 2>/dev/null")
            # Closed only once it has exited: a login shell cut off while it starts (its rc
            # files) can leave their locks behind on the host.
            if channel.status_event.wait(max(_KILL_WAIT_S, self.connect_timeout)):
                channel.close()
        except Exception:  # noqa: BLE001 - the host or link may be gone: the error raised says so
            pass

    def _pump_until_exit(self, channel: paramiko.Channel, stdin: StdinSource, limit: float, argv,
                         started: float, on_out, err: "_LineCollector", idle_limit: float | None) -> int:
        on_err = err.feed
        deadline = started + limit
        last_heard = started
        channel.settimeout(limit)
        writer = None
        if stdin is not None:
            writer = threading.Thread(target=_send_stdin, args=(channel, stdin), daemon=True)
            writer.start()
        else:
            channel.shutdown_write()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(self.host_name, f"{argv[0]} ran longer than {limit:g}s; killed on the "
                                                         "host with its process group")
                if idle_limit is not None and time.monotonic() - last_heard > idle_limit:
                    raise ConnectionLost(self.host_name, f"{argv[0]} sent nothing for {idle_limit:g}s (the host "
                                                         "or the connection froze); channel closed")
                if channel.eof_received and not (channel.recv_ready() or channel.recv_stderr_ready()):
                    # After EOF the channel's pipe stays readable forever, so select() would
                    # return at once and this loop would spin (holding the GIL) until the exit
                    # status arrives. Nothing more can arrive but that status: wait for it.
                    channel.status_event.wait(min(remaining, _POLL_S))
                else:
                    select.select([channel], [], [], min(remaining, _POLL_S))
                drained = False
                while channel.recv_ready():
                    on_out(channel.recv(_CHUNK))
                    drained = True
                while channel.recv_stderr_ready():
                    on_err(channel.recv_stderr(_CHUNK))
                    drained = True
                if drained:
                    last_heard = time.monotonic()
                    continue
                if channel.closed or (channel.exit_status_ready() and channel.eof_received):
                    break
                transport = channel.get_transport()
                if transport is None or not transport.is_active():
                    break
        except (OSError, EOFError, paramiko.SSHException) as error:
            raise ConnectionLost(self.host_name, f"while running {argv[0]}: {type(error).__name__}: {error}") from None
        status = channel.exit_status if channel.exit_status_ready() else -1
        channel.close()
        if status == -1:
            transport = channel.get_transport()
            if transport is not None and transport.is_active():
                # the remote shell itself was killed (its group, the OOM killer): no status to give
                raise RemoteStepError(f"{self.host_name}: {argv[0]} was killed on the host (by a signal, "
                                      "before it could exit)")
            raise ConnectionLost(self.host_name, f"{argv[0]} ended without an exit status (connection dropped)")
        return status

    def run_streaming(
        self,
        argv: Sequence[str],
        on_stdout: ChunkHandler,
        *,
        stdin: StdinSource = None,
        timeout: float | None = None,
    ) -> CommandResult:
        argv = tuple(argv)
        limit = timeout if timeout is not None else self.command_timeout
        started = time.monotonic()
        channel, _ = self._open_channel(argv, None, None)
        err = _LineCollector(self.host_name, argv[0], None, None)
        status = self._pump(channel, stdin, limit, argv, started, on_stdout, err)
        return CommandResult(host=self.host_name, argv=argv, exit_status=status, stdout="",
                             stderr=err.finish(), duration_s=time.monotonic() - started)

    def put_stream(self, source: BinaryIO, argv: Sequence[str], *, timeout: float | None = None) -> CommandResult:
        return self.run(argv, stdin=source, timeout=timeout)

    def get_file(self, remote_path: str, local_path: str, *, timeout: float | None = None) -> None:
        limit = timeout if timeout is not None else self.command_timeout
        started = time.monotonic()
        argv = ("cat", "--", remote_path)
        channel, _ = self._open_channel(argv, None, None)
        tmp = f"{local_path}.part-{os.getpid()}-{threading.get_ident()}"
        errors = _LineCollector(self.host_name, argv[0], None, None)
        try:
            with open(tmp, "wb") as handle:
                status = self._pump(channel, None, limit, argv, started, handle.write, errors)
            if status != 0:
                raise RemoteStepError(f"{self.host_name}: cannot read {remote_path}: {errors.finish().strip()}")
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def close(self) -> None:
        for client in reversed(self._clients):
            try:
                client.close()
            except Exception:  # noqa: BLE001 - close after a failure may itself raise
                pass
        self._clients = []


class _LineCollector:
    """Collects a byte stream and hands complete lines to an optional handler as they come.

    Bounded: with `max_bytes` (stdout), more than that in all, or a line longer than
    MAX_LINE_BYTES, is OutputLimitExceeded; without (stderr), only the last STDERR_KEPT_BYTES
    are kept. A stderr stream also yields the remote shell's pid line (`_PID_MARK`) first."""

    def __init__(self, host: str, command: str, handler: LineHandler | None, max_bytes: int | None):
        self.host, self.command, self.handler, self.max_bytes = host, command, handler, max_bytes
        self.chunks: list[bytes] = []
        self.kept = 0  # bytes in chunks
        self.received = 0
        self.partial: list[bytes] = []  # the line being received, in pieces (no quadratic joins)
        self.partial_len = 0
        self.remote_pgid: Optional[int] = None
        self._head: Optional[bytes] = b"" if max_bytes is None else None  # stderr: the pid line first

    def feed(self, data: bytes) -> None:
        if self._head is not None:
            data = self._peel_pid(data)
            if not data:
                return
        self.received += len(data)
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise OutputLimitExceeded(f"{self.host}: {self.command} sent more than {self.max_bytes} bytes; "
                                      "stopped (what arrived before is kept)")
        self.chunks.append(data)
        self.kept += len(data)
        if self.max_bytes is None:
            while self.kept > STDERR_KEPT_BYTES and len(self.chunks) > 1:
                self.kept -= len(self.chunks.pop(0))
        if self.handler is not None:
            self._split_lines(data)

    def _peel_pid(self, data: bytes) -> bytes:
        head = self._head + data
        newline = head.find(b"\n")
        if newline < 0 and len(head) < 64 and _PID_MARK.startswith(head[:len(_PID_MARK)]):
            self._head = head  # the pid line is still arriving
            return b""
        self._head = None
        first = head[:newline] if newline >= 0 else b""
        if first.startswith(_PID_MARK) and first[len(_PID_MARK):].isdigit():
            self.remote_pgid = int(first[len(_PID_MARK):])
            return head[newline + 1:]
        return head

    def _split_lines(self, data: bytes) -> None:
        start = 0
        while True:
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            self.partial_len += end - start
            if self.partial_len > MAX_LINE_BYTES:
                raise OutputLimitExceeded(f"{self.host}: {self.command} sent a line longer than {MAX_LINE_BYTES} "
                                          "bytes; stopped (the lines before it are kept)")
            self.partial.append(data[start:end])
            if newline < 0:
                return
            line, self.partial, self.partial_len = b"".join(self.partial), [], 0
            self.handler(line.decode("utf-8", "replace"))
            start = newline + 1

    def finish(self) -> str:
        if self._head:
            head, self._head = self._head, None
            self.chunks.append(head)
        if self.handler is not None and self.partial_len:
            line, self.partial, self.partial_len = b"".join(self.partial), [], 0
            self.handler(line.decode("utf-8", "replace"))
        return b"".join(self.chunks).decode("utf-8", "replace")


def _send_stdin(channel: paramiko.Channel, source: bytes | BinaryIO) -> None:
    try:
        if isinstance(source, (bytes, bytearray)):
            channel.sendall(source)
        else:
            for chunk in iter(lambda: source.read(_CHUNK), b""):
                channel.sendall(chunk)
        channel.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the command stopped reading or the connection died; the reader decides which
