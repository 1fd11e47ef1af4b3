"""ssh_config for the SSH transport: `Host` aliases, HostName, User, Port, IdentityFile and
ProxyJump are honoured, values set in the inventory win. Directives we would silently get wrong
(Include, ProxyCommand, UserKnownHostsFile, CanonicalizeHostname, `Match exec` and criteria
paramiko cannot evaluate) are a ConfigError naming file, host and directive; StrictHostKeyChecking
is ignored (host keys are always checked strictly, see `known_hosts`)."""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from typing import Any, Optional

from ddtree.bounded_files import FileRefused, read_text

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import Host
from ddtree_ops.transport.paramiko_import import paramiko


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect, after ssh_config and the inventory are merged."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    proxy_jump: Optional[str]


def default_path(configured: Optional[str], fallback: str) -> Optional[str]:
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
    config_path = default_path(host.ssh_config, "~/.ssh/config")
    if not config_path or not os.path.lexists(config_path):
        return None
    try:  # the bounded reader: a FIFO or /dev/zero is refused, never read (paramiko would read it whole)
        config = paramiko.SSHConfig.from_text(read_text(config_path))
    except FileRefused as err:
        raise ConfigError(f"{config_path}: ssh_config of host {host.name}: cannot read it: {err.why}") from None
    except (OSError, paramiko.SSHException, ValueError) as err:
        reason = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{config_path}: ssh_config of host {host.name}: cannot read it: {reason}") from None
    _prepare_config(host, config)
    return config


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
    from ddtree_ops.transport.known_hosts import known_hosts_path  # here: known_hosts imports this module

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
