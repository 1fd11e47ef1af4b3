"""The SSH transport (Paramiko), built around the traps measured in ssh-facts.md.

- Host keys: only the inventory's `known_hosts` (default ~/.ssh/known_hosts) with a reject
  policy. `accept_new_host_keys=True` trusts an *unknown* key once and appends it to that file;
  a *changed* or `@revoked` key is always refused; `@cert-authority` lines are skipped.
- Every phase is bounded: TCP connect, banner + key exchange, auth and channel open by
  `connect_timeout`; each command and transfer by its own deadline.
- The socket is connected by us with TCP_NODELAY (Paramiko never sets it).
- A channel that ends without an exit status (Paramiko's `-1`) is a lost connection.
- ssh_config (`Host` aliases, HostName, User, Port, IdentityFile, ProxyJump) is honoured;
  values set in the inventory win over ssh_config. Directives we would silently get wrong
  (Include, ProxyCommand, UserKnownHostsFile, CanonicalizeHostname, `Match exec` and criteria
  paramiko cannot evaluate) are a ConfigError instead; StrictHostKeyChecking is ignored
  (host keys are always checked strictly; --accept-new-host-keys trusts new ones).
- Paramiko's exception zoo is classified once here into `ddtree_ops.errors` transport errors.
"""
from __future__ import annotations

import base64
import getpass
import hashlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Optional

from ddtree_ops.errors import (
    AuthenticationFailed,
    OutputLimitExceeded,
    ConfigError,
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


def _import_paramiko_without_invoke():
    """paramiko.config imports `invoke` (~190 ms, more than half of paramiko's import time)
    only to evaluate `Match exec` in ssh_config, which we do not support. Hide it during the
    import; anything imported later (Fabric) still gets the real invoke."""
    import sys

    if "invoke" in sys.modules:
        import paramiko as module

        return module
    sys.modules["invoke"] = None  # type: ignore[assignment]  # makes `import invoke` fail fast
    try:
        import paramiko as module
    finally:
        del sys.modules["invoke"]
    return module


paramiko = _import_paramiko_without_invoke()
# Paramiko logs a failed handshake's traceback at ERROR; with no handler of its own, Python's
# last-resort handler would print it on the operator's terminal. Our errors already say what
# happened in one line; the CLI routes these records to its debug log (`cli.app`).
logging.getLogger("paramiko").addHandler(logging.NullHandler())

_CHUNK = 1 << 16
_POLL_S = 0.2
_KILL_WAIT_S = 5.0
# The remote shell says its pid first, on stderr: sshd made it a session and process group
# leader, so that pid names the group a stopped command is killed with.
_PID_MARK = b"ddtree-ops-pgid "
_KNOWN_HOSTS_WRITE = threading.Lock()  # TOFU appends from several fan-out threads


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect, after ssh_config and the inventory are merged."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    proxy_jump: Optional[str]


def _default_path(configured: Optional[str], fallback: str) -> Optional[str]:
    if configured:
        return configured
    path = os.path.expanduser(fallback)
    return path if os.path.exists(path) else None


def _config_name(host: Host) -> str:
    return host.ssh_config or "~/.ssh/config"


def _config_error(host: Host, message: str) -> ConfigError:
    return ConfigError(f"{_config_name(host)}: ssh_config of host {host.name}: {message}")


# Match criteria paramiko evaluates itself. Any other (`exec` runs a shell command through
# `invoke`, which we hide; `localnetwork`, `tagged`, ... paramiko silently treats as matching).
_MATCH_CRITERIA = frozenset({"all", "canonical", "final", "host", "originalhost", "user", "localuser"})
# Directives that would change where or how OpenSSH connects but that we do not implement:
# honouring them silently wrong is worse than refusing. value -> None means "any value".
_REFUSED_DIRECTIVES: dict[str, tuple[str, Optional[frozenset[str]], str]] = {
    # key: (spelling, values that are fine, what to do instead)
    "include": ("Include", None, "copy the included settings into this file"),
    "proxycommand": ("ProxyCommand", None, "use ProxyJump"),
    "userknownhostsfile": ("UserKnownHostsFile", None,
                           "host keys are checked only against the inventory's known_hosts; "
                           "set `known_hosts:` in the inventory instead (naming that same file is accepted)"),
    # StrictHostKeyChecking is not here: ignoring it only ever keeps checks strict (`Host *`
    # with `accept-new` is a common setup, and refusing it would refuse every host).
    "x-ddtree-canonicalizehostname": ("CanonicalizeHostname", frozenset({"no"}),
                                      "write the full name in HostName"),
}
# paramiko expands %r in IdentityFile to ssh_config's User (or the local user) while looking
# up; the inventory's `user:` wins over both, so %r is parked here and filled in afterwards.
_REMOTE_USER_TOKEN = "\x00ddtree-remote-user\x00"


def _prepare_config(host: Host, config: "paramiko.SSHConfig") -> None:
    """Refuse Match criteria we cannot evaluate, and park what paramiko would act on during
    lookup (canonicalisation resolves names; %r expands to the wrong user). Uses paramiko's
    parsed sections (`_config`, stable since paramiko 2.7) since there is no public view."""
    for section in config._config:  # noqa: SLF001 - see docstring
        for criterion in section.get("matches", []):
            kind = criterion["type"]
            if kind not in _MATCH_CRITERIA:
                what = "runs a command" if kind == "exec" else "is a criterion paramiko cannot evaluate"
                raise _config_error(host, f"`Match {kind}` is not supported (it {what}); "
                                          f"use Host patterns instead")
        options = section["config"]
        if "canonicalizehostname" in options:
            options["x-ddtree-canonicalizehostname"] = options.pop("canonicalizehostname")
        if "identityfile" in options:
            options["identityfile"] = [p.replace("%r", _REMOTE_USER_TOKEN) for p in options["identityfile"]]


def load_ssh_config(host: Host) -> Optional["paramiko.SSHConfig"]:
    """The host's ssh_config (inventory `ssh_config`, else ~/.ssh/config), or None when there
    is no such file. One that exists but cannot be read or parsed (a folder, bad bytes, a
    malformed line, an unsupported `Match`) is an inventory/config problem: ConfigError (exit 3),
    naming file and host."""
    config_path = _default_path(host.ssh_config, "~/.ssh/config")
    if not config_path or not os.path.lexists(config_path):
        return None
    try:
        config = paramiko.SSHConfig.from_path(config_path)
    except (OSError, paramiko.SSHException, ValueError) as err:
        reason = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{config_path}: ssh_config of host {host.name}: cannot read it: {reason}") from None
    _prepare_config(host, config)
    return config


def known_hosts_path(host: Host) -> str:
    """The host's known_hosts: the inventory's, else ~/.ssh/known_hosts (created on first use
    with --accept-new-host-keys)."""
    return _default_path(host.known_hosts, "~/.ssh/known_hosts") or os.path.expanduser("~/.ssh/known_hosts")


@dataclass(frozen=True)
class KnownHosts:
    """Plain host keys plus the keys marked `@revoked` (refused even when listed).
    `@cert-authority` lines are skipped: Paramiko checks plain host keys only, so a CA key
    can never vouch for a host here."""

    entries: tuple[tuple[str, "paramiko.PKey"], ...]  # (host pattern or |1| hash, key)
    revoked: frozenset[str]  # base64 key blobs


def read_known_hosts(path: str, host_name: str) -> KnownHosts:
    """Parse a known_hosts file; a line that is not one is a ConfigError naming file:line."""
    from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

    def bad(lineno: int, reason: str) -> ConfigError:
        return ConfigError(f"{path}:{lineno}: known_hosts of host {host_name}: {reason}")

    if not os.path.lexists(path):
        return KnownHosts((), frozenset())
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: known_hosts of host {host_name}: not a file")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}: known_hosts of host {host_name}: cannot read it: {reason}") from None
    parsed: list[tuple[Optional[str], object]] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        marker = None
        if line.startswith("@"):
            marker, _, line = line.replace("\t", " ").partition(" ")
            line = line.strip()
            if marker not in ("@cert-authority", "@revoked"):
                raise bad(lineno, f"unknown marker {marker!r} (only @cert-authority and @revoked exist)")
        try:
            entry = HostKeyEntry.from_line(line, lineno)
        except (InvalidHostKey, paramiko.SSHException, ValueError) as err:
            raise bad(lineno, f"not a known_hosts line ({type(err).__name__})") from None
        if entry is not None:  # None: too few fields or a key type paramiko lacks, skipped as ssh does
            parsed.append((marker, entry))
    revoked = frozenset(e.key.get_base64() for m, e in parsed if m == "@revoked")
    entries = tuple(
        (name, e.key) for m, e in parsed if m is None and e.key.get_base64() not in revoked for name in e.hostnames
    )
    return KnownHosts(entries, revoked)


def check_known_hosts(host: Host) -> None:
    """A known_hosts that exists but cannot be read as one (a folder, no read permission, a
    malformed line) is a config problem of the whole command (ConfigError, exit 3), not of the
    host behind it."""
    read_known_hosts(known_hosts_path(host), host.name)


def _valid_port(host: Host, value: str, what: str) -> int:
    if not value.isdigit():
        raise _config_error(host, f"{what}: port {value!r} is not a number")
    if not 1 <= int(value) <= 65535:
        raise _config_error(host, f"{what}: port {value!r} is out of range 1-65535")
    return int(value)


def parse_jump(host: Host, spec: str, whole: str) -> tuple[Optional[str], str, Optional[int]]:
    """One ProxyJump hop as OpenSSH reads it: `[user@]host[:port]` or `ssh://[user@]host[:port]`,
    host possibly `[v6-address]` -> (user, host, port)."""
    what = f"ProxyJump {whole!r}"
    text = spec.strip()
    if text.startswith("ssh://"):
        text = text[len("ssh://"):].rstrip("/")
    user, at, rest = text.rpartition("@")
    if at and not user:
        raise _config_error(host, f"{what}: empty user in hop {spec!r}")
    if rest.startswith("["):
        name, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise _config_error(host, f"{what}: malformed bracketed address in hop {spec!r}")
        colon, port = bool(tail), tail[1:]
    else:
        name, colon_text, port = rest.partition(":")
        colon = bool(colon_text)
    if not name:
        raise _config_error(host, f"{what}: hop {spec!r} names no host")
    port_number = _valid_port(host, port, what) if colon else None
    return user or None, name, port_number


_MAX_JUMPS = 16


def jump_targets(host: Host, target: SshTarget, _seen: tuple[str, ...] = ()) -> list[SshTarget]:
    """The ProxyJump hops before `target`, in order (none without ProxyJump). Like OpenSSH, the
    first hop's own ProxyJump is followed (recursively), so `gpu -> inner -> outer` goes through
    outer first; a loop is a ConfigError."""
    if not target.proxy_jump:
        return []
    specs = target.proxy_jump.split(",")
    hops = []
    for spec in specs:
        if not spec.strip():
            raise _config_error(host, f"ProxyJump {target.proxy_jump!r}: empty hop")
        user, alias, port = parse_jump(host, spec, target.proxy_jump)
        hops.append(resolve_target(host, alias, user=user, port=port))
    seen = (*_seen, target.alias)
    first = hops[0]
    if first.alias in seen or len(seen) > _MAX_JUMPS:
        chain = " -> ".join([*seen, first.alias])
        raise _config_error(host, f"ProxyJump loop through {first.alias!r} ({chain})")
    return jump_targets(host, first, seen) + hops


def _names_our_known_hosts(host: Host, value: Any) -> bool:
    """UserKnownHostsFile naming exactly one file, the inventory's known_hosts (same file after
    `~` and links are resolved)."""
    files = str(value).split()
    if len(files) != 1:
        return False
    ours = os.path.realpath(os.path.expanduser(known_hosts_path(host)))
    return os.path.realpath(os.path.expanduser(files[0])) == ours


def resolve_target(host: Host, alias: Optional[str] = None, *, user: Optional[str] = None,
                   port: Optional[int] = None) -> SshTarget:
    """Merge ssh_config's entry for the alias under the inventory's explicit values; refuse
    directives we would otherwise ignore or get wrong (ConfigError naming file, host, directive)."""
    alias = alias or host.hostname
    config = load_ssh_config(host)
    try:
        entry: dict = config.lookup(alias) if config is not None else {}
    except Exception as err:  # noqa: BLE001 - paramiko's lookup raises anything; it is config
        raise _config_error(host, f"cannot look up {alias!r}: {type(err).__name__}: {err}") from None
    for key, (spelling, fine, instead) in _REFUSED_DIRECTIVES.items():
        value = entry.get(key)
        if key == "userknownhostsfile" and value is not None and _names_our_known_hosts(host, value):
            continue  # the very file the inventory checks against: nothing differs
        if value is not None and not (fine and str(value).lower() in fine):
            raise _config_error(host, f"{spelling} {value} (for {alias!r}) is not supported: {instead}")
    is_main = alias == host.hostname
    if port is None:
        port = host.port if is_main and host.port else _valid_port(host, str(entry.get("port", 22)).strip(),
                                                                  f"Port (for {alias!r})")
    user = user or (host.user if is_main and host.user else entry.get("user") or getpass.getuser())
    identity = ([host.identity_file] if (is_main and host.identity_file) else []) or [
        os.path.expanduser(p.replace(_REMOTE_USER_TOKEN, user)) for p in entry.get("identityfile", [])
    ]
    jump = entry.get("proxyjump")
    return SshTarget(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=port,
        user=user,
        identity_files=tuple(identity),
        proxy_jump=jump if jump and jump.lower() != "none" else None,
    )


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _UnknownHostKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(name)
        self.name = name
        self.key = key


class _RevokedHostKey(_UnknownHostKey):
    pass


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, revoked: frozenset[str]):
        self.revoked = revoked

    def missing_host_key(self, client, hostname, key):  # noqa: D401 - paramiko hook
        # Revoked keys were left out of the known ones, so they always arrive here.
        raise (_RevokedHostKey if key.get_base64() in self.revoked else _UnknownHostKey)(hostname, key)


class _TrustOnFirstUse(_RejectUnknown):
    """Accept an unknown key once and record it; changed and revoked keys are still refused."""

    def __init__(self, known_hosts: str, revoked: frozenset[str]):
        super().__init__(revoked)
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        if key.get_base64() in self.revoked:
            raise _RevokedHostKey(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        with _KNOWN_HOSTS_WRITE:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", exist_ok=True)
            with open(self.known_hosts, "a+b") as handle:
                handle.seek(0, os.SEEK_END)
                if handle.tell():
                    handle.seek(-1, os.SEEK_END)
                    glue = handle.read(1) != b"\n"  # else our line would join the last one
                else:
                    glue = False
                line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
                handle.write((("\n" if glue else "") + line).encode("ascii"))


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
    if isinstance(err, _RevokedHostKey):
        return HostKeyRejected(
            host_name,
            f"the host key of {err.name} ({err.key.get_name()} {fingerprint(err.key)}) is marked "
            f"@revoked in {known_hosts}; refusing to connect",
        )
    if isinstance(err, _UnknownHostKey):
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
            _TrustOnFirstUse(self.known_hosts, revoked) if self.accept_new_host_keys else _RejectUnknown(revoked)
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
