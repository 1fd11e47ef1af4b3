"""The host inventory (`hosts.yaml`): parsing, validation, defaults and host selection.

Resolution of the file: `-i/--inventory` > `$DDTREE_OPS_INVENTORY` > `./hosts.yaml`; when none
of these names an existing file, the embedded default inventory (one host, `local`) is used.
Every error is a `ConfigError` whose message starts with the file and the field:
`hosts.yaml: hosts.gpu-a.port: expected an integer, got 'x'`. The schema is
`inventory_schema` (pydantic); a file of plain values is taken by `inventory_plain` without it.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from ddtree_ops.errors import ConfigError, quoted
from ddtree_ops.host_patterns import ALL_HOSTS, select_names, unaddressable

INVENTORY_ENV = "DDTREE_OPS_INVENTORY"
DEFAULT_INVENTORY_NAME = "hosts.yaml"
EMBEDDED_INVENTORY_NAME = "<embedded default inventory>"

# Built-in values for keys that neither the host nor `defaults:` sets.
BUILTIN_WORKDIR = "~/.ddtree-ops"
BUILTIN_CONNECT_TIMEOUT_S = 10.0
BUILTIN_COMMAND_TIMEOUT_S = 600.0
# Where `ddtree-ops status` finds the host's SGLang server (its HTTP port, `/metrics` with
# --enable-metrics), read on the host's loopback: SGLang's own default `--port`.
BUILTIN_SGLANG_PORT = 30000



class TransportKind(str, Enum):
    SSH = "ssh"
    LOCAL = "local"


@dataclass(frozen=True)
class ModelSpec:
    """Which models a host evaluates with (used by smoke/bench stages); checked by the schema
    (`inventory_schema.ModelsEntry`)."""

    target: str
    drafter: str
    block_size: int = 16
    prompts: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Host:
    """One resolved host. Local paths (identity_file, known_hosts, ssh_config) are absolute;
    `python` and `workdir` are host paths and may start with `~` (resolved on the host)."""

    name: str
    transport: TransportKind
    hostname: str  # what to connect to (may be an ssh_config alias)
    user: Optional[str]
    port: Optional[int]
    identity_file: Optional[str]
    known_hosts: Optional[str]
    ssh_config: Optional[str]
    python: str
    workdir: str
    connect_timeout: float
    command_timeout: float
    groups: tuple[str, ...] = ()
    models: Optional[ModelSpec] = None
    source: str = ""  # the inventory it comes from, for messages that point into it
    sglang_port: int = BUILTIN_SGLANG_PORT  # the serving SGLang's HTTP port on the host's loopback

    @property
    def is_local(self) -> bool:
        return self.transport is TransportKind.LOCAL

    def target(self) -> str:
        """`user@hostname:port` for display (only what is set)."""
        if self.is_local:
            return "(local)"
        text = self.hostname
        if self.user:
            text = f"{self.user}@{text}"
        if self.port:
            text = f"{text}:{self.port}"
        return text


@dataclass
class Inventory:
    source: str  # the file as the operator named it, or EMBEDDED_INVENTORY_NAME
    hosts: dict[str, Host] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the file sets that is not used (Ansible variables)

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for host in self.hosts.values():
            for group in host.groups:
                out.setdefault(group, []).append(host.name)
        return out

    def select(self, selection: str | Sequence[str] | None) -> list[Host]:
        """Hosts named by -H, in inventory order (all when -H is not given); the pattern rules
        are `host_patterns.select_names`. A selection given but empty (`-H ""`, as from an unset
        variable) is refused: it must never widen to the whole fleet."""
        items = [selection] if isinstance(selection, str) else list(selection or [])
        if not items:
            return list(self.hosts.values())
        wanted = select_names(items, self.hosts, self.groups(), self.source)
        return [h for name, h in self.hosts.items() if name in wanted]


EMBEDDED_INVENTORY: dict[str, Any] = {"hosts": {"local": {"transport": "local"}}}


def inventory_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The inventory file to read, or None for the embedded default.

    An explicitly named file (flag or environment) must exist; `./hosts.yaml` is optional.
    Whatever is there is read by the bounded reader, which refuses a FIFO, a device or a folder."""
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise ConfigError(f"{path}: inventory file not found (from -i/--inventory)")
        return path
    from_env = os.environ.get(INVENTORY_ENV)
    if from_env:
        path = Path(from_env)
        if not path.exists():
            raise ConfigError(f"{path}: inventory file not found (from ${INVENTORY_ENV})")
        return path
    default = Path(DEFAULT_INVENTORY_NAME)
    return default if default.exists() else None


def load_inventory(explicit: str | os.PathLike[str] | None = None) -> Inventory:
    path = inventory_path(explicit)
    if path is None:
        return parse_inventory(EMBEDDED_INVENTORY, source=EMBEDDED_INVENTORY_NAME, base_dir=Path.cwd())
    # pyyaml is only needed when there is a file; the reader bounds size, depth and aliases
    from ddtree_ops.yaml_files import parse_yaml, read_text_file

    text = read_text_file(path, "inventory")
    from ddtree_ops import ansible_inventory as ansible

    if ansible.is_ini(text):
        return _from_ansible(ansible.parse_ini(text, str(path)), path)
    data = parse_yaml(text, path)
    if ansible.is_ansible_yaml(data):
        return _from_ansible(ansible.parse_yaml(data, str(path)), path)
    return parse_inventory(data, source=str(path), base_dir=path.resolve().parent)


def _from_ansible(parsed: Any, path: Path) -> Inventory:
    from ddtree_ops.ansible_inventory import to_our_inventory

    data, notes = to_our_inventory(parsed)
    inventory = parse_inventory(data, source=str(path), base_dir=path.resolve().parent)
    inventory.notes = notes
    return inventory


def parse_inventory(data: Any, *, source: str, base_dir: Path) -> Inventory:
    if data is None:
        raise ConfigError(f"{source}: the file is empty (expected a mapping with `hosts:`)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with `hosts:`, got {type(data).__name__}")
    from ddtree_ops.inventory_plain import plain_inventory

    parsed = plain_inventory(data)
    if parsed is None:  # not all plain: the schema converts what it may, and names what it refuses
        from ddtree_ops.inventory_schema import validate

        parsed = validate(data, source)
    if not parsed["hosts"]:
        raise ConfigError(f"{source}: hosts: at least one host is required")
    inventory = Inventory(source=source)
    for name, entry in parsed["hosts"].items():
        inventory.hosts[name] = _resolve_host(name, entry, parsed["defaults"], source, base_dir)
    clashes = set(inventory.groups()) & set(inventory.hosts)
    if clashes:
        name = sorted(clashes)[0]
        raise ConfigError(f"{source}: hosts.{name}: a group has the same name as this host")
    return inventory


def _resolve_host(name: str, entry: dict[str, Any], defaults: dict[str, Any], source: str, base_dir: Path) -> Host:
    """One host of the normalized file (every key present) with its defaults and paths resolved."""
    # A host name is also a folder of every local run (runs/<run>/<host>): no path separators.
    if (not name or name != name.strip() or "," in name or name == ALL_HOSTS
            or "/" in name or "\0" in name or name in (".", "..")):
        raise ConfigError(
            f"{source}: hosts.{quoted(name)}: invalid host name (no commas, no '/', no outer spaces, not '.', '..' or 'all')"
        )
    if (why := unaddressable(name)) is not None:
        raise ConfigError(f"{source}: hosts.{quoted(name)}: no -H pattern can select this host alone: {why}; rename it")
    from ddtree_ops.ids import folder_name_problem

    unfit = folder_name_problem(name)  # it names the folder runs/<run-id>/<host>/ of every run
    if unfit is not None:
        raise ConfigError(f"{source}: hosts.{quoted(name)}: invalid host name ({unfit}; it names a folder of every run)")

    def pick(key: str) -> Any:
        own = entry[key]
        return own if own is not None else defaults[key]

    transport = pick("transport") or TransportKind.SSH
    if transport is TransportKind.LOCAL:
        import sys

        # `defaults.python` describes the remote fleet; a local host runs our own interpreter
        # unless its own entry names another.
        python = entry["python"] or sys.executable
    else:
        python = pick("python") or "python3"
    for group in entry["groups"]:
        if not group or "," in group or group == ALL_HOSTS:
            raise ConfigError(f"{source}: hosts.{name}.groups: invalid group name {quoted(group)}")
        if (why := unaddressable(group)) is not None:
            raise ConfigError(f"{source}: hosts.{name}.groups: no -H pattern can select the group {quoted(group)}: "
                              f"{why}; rename it")

    def local_path(key: str) -> Optional[str]:
        value = pick(key)
        if value is None:
            return None
        path = Path(os.path.expanduser(value))
        return str(path if path.is_absolute() else (base_dir / path))

    return Host(
        name=name,
        transport=transport,
        hostname=entry["hostname"] or name,
        user=pick("user"),
        port=pick("port"),
        identity_file=local_path("identity_file"),
        known_hosts=local_path("known_hosts"),
        ssh_config=local_path("ssh_config"),
        python=python,
        workdir=pick("workdir") or BUILTIN_WORKDIR,
        connect_timeout=pick("connect_timeout") or BUILTIN_CONNECT_TIMEOUT_S,
        command_timeout=pick("command_timeout") or BUILTIN_COMMAND_TIMEOUT_S,
        groups=tuple(entry["groups"]),
        models=ModelSpec(**models) if (models := pick("models")) is not None else None,
        source=source,
        sglang_port=pick("sglang_port") or BUILTIN_SGLANG_PORT,
    )
