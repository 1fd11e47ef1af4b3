"""Host keys for the SSH transport: only the inventory's `known_hosts` (default
~/.ssh/known_hosts). An unknown key is refused, or with --accept-new-host-keys trusted once and
appended; a changed or `@revoked` key is always refused; `@cert-authority` lines are skipped."""
from __future__ import annotations

import base64
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Optional

from ddtree.bounded_files import FileRefused, read_text

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import Host
from ddtree_ops.transport.paramiko_import import paramiko
from ddtree_ops.transport.ssh_config import default_path

_KNOWN_HOSTS_WRITE = threading.Lock()  # TOFU appends from several fan-out threads


def known_hosts_path(host: Host) -> str:
    """The host's known_hosts: the inventory's, else ~/.ssh/known_hosts (created on first use
    with --accept-new-host-keys)."""
    return default_path(host.known_hosts, "~/.ssh/known_hosts") or os.path.expanduser("~/.ssh/known_hosts")


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
    try:  # the bounded reader: a regular file of bounded size (one swapped for a FIFO is refused)
        lines = read_text(path).splitlines()
    except FileNotFoundError:
        return KnownHosts((), frozenset())
    except FileRefused as err:
        raise ConfigError(f"{path}: known_hosts of host {host_name}: cannot read it: {err.why}") from None
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


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class UnknownHostKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(name)
        self.name = name
        self.key = key


class RevokedHostKey(UnknownHostKey):
    pass


class RejectUnknownKeys(paramiko.MissingHostKeyPolicy):
    def __init__(self, revoked: frozenset[str]):
        self.revoked = revoked

    def missing_host_key(self, client, hostname, key):  # noqa: D401 - paramiko hook
        # Revoked keys were left out of the known ones, so they always arrive here.
        raise (RevokedHostKey if key.get_base64() in self.revoked else UnknownHostKey)(hostname, key)


class TrustOnFirstUse(RejectUnknownKeys):
    """Accept an unknown key once and record it; changed and revoked keys are still refused."""

    def __init__(self, known_hosts: str, revoked: frozenset[str]):
        super().__init__(revoked)
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        if key.get_base64() in self.revoked:
            raise RevokedHostKey(hostname, key)
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
