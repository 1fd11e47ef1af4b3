"""Ansible inventories (YAML or INI) read as ours, and ours written as one.

Groups, `children`, `all:vars` / group vars / host vars (a deeper group's value wins over its
parent's, groups of one depth in name order, host vars over all), host ranges (`gpu-[01:16]`)
and these variables:

    ansible_host, ansible_port, ansible_user, ansible_ssh_private_key_file,
    ansible_python_interpreter (-> python), ansible_connection (ssh, paramiko, smart or local),
    ddtree_<key> for any key of our own inventory (ddtree_workdir, ddtree_known_hosts, ...)

`ansible_ssh_common_args` / `ansible_ssh_extra_args` are read for `-o UserKnownHostsFile=`
(-> known_hosts) and `-F` (-> ssh_config); `StrictHostKeyChecking` and keep-alive or
multiplexing options are reported and not used: the host-key policy stays strict. A variable
that changes how a host is reached and that ddtree-ops cannot honour (a ProxyCommand, a
password, another connection plugin) is refused: ConfigError naming file, host and value.
Every other variable is reported once per name and never used.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

from ddtree_ops.errors import ConfigError, quoted
from ddtree_ops.host_patterns import RangeError, expand

ALL, UNGROUPED = "all", "ungrouped"
GROUP_KEYS = {"hosts", "vars", "children"}
OUR_KEYS = ("transport", "user", "port", "identity_file", "known_hosts", "ssh_config", "python", "workdir",
            "connect_timeout", "command_timeout", "models", "sglang_port")
ANSIBLE_KEYS = {
    "ansible_host": "hostname", "ansible_ssh_host": "hostname",
    "ansible_port": "port", "ansible_ssh_port": "port",
    "ansible_user": "user", "ansible_ssh_user": "user",
    "ansible_ssh_private_key_file": "identity_file", "ansible_private_key_file": "identity_file",
    "ansible_python_interpreter": "python",
}
SSH_ARG_VARS = ("ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_ssh_args")
# Ways to reach a host that we would get wrong if we ignored them.
REFUSED_VARS = {
    "ansible_password": "password logins", "ansible_ssh_pass": "password logins",
    "ansible_ssh_password": "password logins", "ansible_ssh_executable": "another ssh program",
    "ansible_sftp_extra_args": "sftp options", "ansible_scp_extra_args": "scp options",
}
SSH_CONNECTIONS = ("ssh", "paramiko", "smart")
IGNORED_SSH_OPTIONS = {  # -o options that do not change which host we reach, or how we trust it
    "stricthostkeychecking": "the host-key policy stays strict",
    "serveraliveinterval": "not used", "serveralivecountmax": "not used", "controlmaster": "not used",
    "controlpersist": "not used", "controlpath": "not used", "connecttimeout": "use ddtree_connect_timeout",
}
HOST_KEY_VARS = {"ansible_host_key_checking": "the host-key policy stays strict",
                 "ansible_ssh_host_key_checking": "the host-key policy stays strict"}


# Groups may nest this deep below `all`: far past any real fleet's, and a clear error, not a
# RecursionError, for a file generated wrong (every walk below is iterative anyway).
MAX_GROUP_DEPTH = 100


@dataclass
class _Group:
    # dicts as ordered sets: adding a member is O(1), so a 100k-host range is linear
    hosts: dict[str, None] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    children: dict[str, None] = field(default_factory=dict)


@dataclass
class AnsibleInventory:
    """The parsed file: groups in order of appearance, host vars, host order."""

    source: str
    groups: dict[str, _Group] = field(default_factory=dict)
    host_vars: dict[str, dict[str, Any]] = field(default_factory=dict)

    def group(self, name: str) -> _Group:
        return self.groups.setdefault(name, _Group())

    def add_host(self, group: str, pattern: str, variables: Optional[dict[str, Any]]) -> None:
        try:
            names = expand(str(pattern))
        except RangeError as err:
            raise ConfigError(f"{self.source}: group {group}: {err}") from None
        members = self.group(group).hosts
        for name in names:
            members[name] = None
            self.host_vars.setdefault(name, {}).update(variables or {})


# ------------------------------------------------------------------ detection and parsing

_SECTION = re.compile(r"\[([^\]]+)\]")


def is_ini(text: str) -> bool:
    """An INI inventory starts (after comments) with a `[group]` line or a `host key=value` line."""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        return _SECTION.fullmatch(stripped) is not None or ("=" in stripped and ":" not in stripped.split("=")[0])
    return False


def is_ansible_yaml(data: Any) -> bool:
    """Ours has only `defaults:` and `hosts:` at the top; Ansible's has groups (`all:`, ...),
    each a mapping of `hosts` / `vars` / `children`."""
    if not isinstance(data, dict) or not data or set(data) <= {"defaults", "hosts"}:
        return False
    return all(v is None or (isinstance(v, dict) and set(v) <= GROUP_KEYS) for v in data.values())


def parse_yaml(data: dict[str, Any], source: str) -> AnsibleInventory:
    inventory = AnsibleInventory(source)

    def walk(name: str, body: Any, where: str, depth: int = 1) -> None:
        if depth > MAX_GROUP_DEPTH:
            raise ConfigError(f"{source}: {where}: groups nested more than {MAX_GROUP_DEPTH} deep")
        if body is None:
            inventory.group(name)
            return
        if not isinstance(body, dict) or not set(body) <= GROUP_KEYS:
            raise ConfigError(f"{source}: {where}: expected a mapping of hosts / vars / children, got {quoted(body)}")
        group = inventory.group(name)
        for key, value in (body.get("vars") or {}).items():
            group.vars[str(key)] = value
        hosts = body.get("hosts") or {}
        if not isinstance(hosts, dict):
            raise ConfigError(f"{source}: {where}.hosts: expected a mapping of host names, got {quoted(hosts)}")
        for host, variables in hosts.items():
            if variables is not None and not isinstance(variables, dict):
                raise ConfigError(f"{source}: {where}.hosts.{host}: expected a mapping of variables, got {quoted(variables)}")
            inventory.add_host(name, host, variables)
        children = body.get("children") or {}
        if not isinstance(children, dict):
            raise ConfigError(f"{source}: {where}.children: expected a mapping of groups, got {quoted(children)}")
        for child, child_body in children.items():
            group.children[str(child)] = None
            walk(str(child), child_body, f"{where}.children.{child}", depth + 1)

    for name, body in data.items():
        walk(str(name), body, str(name))
    return inventory


MAX_INI_LINE_CHARS = 64 * 1024


def parse_ini(text: str, source: str) -> AnsibleInventory:
    inventory = AnsibleInventory(source)
    section, kind = UNGROUPED, "hosts"
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        where = f"{source}: line {number}"
        if len(stripped) > MAX_INI_LINE_CHARS:  # shlex takes time quadratic in a token's length
            raise ConfigError(f"{where}: {len(stripped)} characters, past the limit of {MAX_INI_LINE_CHARS} for "
                              "one line (a host and its variables)")
        header = _SECTION.fullmatch(stripped)
        if header:
            section, _, kind = header.group(1).partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise ConfigError(f"{where}: [{header.group(1)}]: expected [group], [group:vars] or [group:children]")
            inventory.group(section)
            continue
        try:
            words = shlex.split(stripped, comments=True)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}: {quoted(stripped)}") from None
        if not words:
            continue
        if kind == "children":
            inventory.group(section).children[words[0]] = None
            inventory.group(words[0])
        elif kind == "vars":
            key, sep, value = stripped.partition("=")
            if not sep:
                raise ConfigError(f"{where}: [{section}:vars]: expected key=value, got {quoted(stripped)}")
            inventory.group(section).vars[key.strip()] = _ini_value(value.strip())
        else:
            name, variables = words[0], {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep:
                    raise ConfigError(f"{where}: host {name}: expected key=value, got {quoted(word)}")
                variables[key] = value
            host, port = _host_and_port(name)
            if port is not None:
                variables.setdefault("ansible_port", port)
            inventory.add_host(section, host, variables)
    return inventory


def _ini_value(value: str) -> str:
    """A [group:vars] value: quotes around the whole value are not part of it."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _host_and_port(name: str) -> tuple[str, Optional[str]]:
    """`host:2222` (Ansible's INI shorthand) -> ("host", "2222"); an IPv6 address stays whole."""
    head, sep, tail = name.rpartition(":")
    if sep and tail.isdigit() and ":" not in head:
        return head, tail
    return name, None


# ------------------------------------------------------------------ to our inventory


def _top_down(inventory: AnsibleInventory) -> list[str]:
    """Every group, each after all its parents (Kahn's order; `all` first); ConfigError naming
    a cycle of children."""
    waiting = {name: 0 for name in inventory.groups}
    for name, group in inventory.groups.items():
        for child in group.children:
            if name != ALL and child != ALL:  # `all` is every group's parent, whatever a file says
                waiting[child] += 1
    ready = [name for name, count in waiting.items() if count == 0]
    order: list[str] = []
    while ready:
        name = ready.pop()
        order.append(name)
        for child in inventory.groups[name].children:
            if name != ALL and child != ALL:
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
    if len(order) < len(waiting):
        raise ConfigError(f"{inventory.source}: group {_cycle(inventory, set(waiting) - set(order))}")
    return order


def _cycle(inventory: AnsibleInventory, stuck: set[str]) -> str:
    """`a: its children include itself (a -> b -> a)` for a cycle among `stuck`, the groups
    never placed: each waits on a parent that is stuck too, so walking up ends in a loop."""
    parents: dict[str, list[str]] = {}
    for name in sorted(stuck):
        for child in inventory.groups[name].children:
            if child in stuck and name != ALL:
                parents.setdefault(child, []).append(name)
    path, seen = [min(stuck)], {min(stuck): 0}
    while True:
        step = parents[path[-1]][0]
        if step in seen:
            loop = list(reversed(path[seen[step]:] + [step]))
            return f"{loop[0]}: its children include itself ({' -> '.join(loop)})"
        seen[step] = len(path)
        path.append(step)


def _depths(inventory: AnsibleInventory, order: list[str]) -> dict[str, int]:
    """Each group's depth below `all` (the longest path: a child's vars override its parent's);
    ConfigError naming the chain past MAX_GROUP_DEPTH."""
    depths = {name: 0 if name == ALL else 1 for name in inventory.groups}
    via: dict[str, str] = {}  # group -> the parent its depth comes through
    for name in order:
        if name == ALL:
            continue
        if depths[name] > MAX_GROUP_DEPTH:
            chain = [name]
            while chain[-1] in via:
                chain.append(via[chain[-1]])
            chain.reverse()
            shown = chain if len(chain) <= 7 else chain[:3] + ["..."] + chain[-3:]
            raise ConfigError(f"{inventory.source}: group {name}: children nested {len(chain)} deep, more than "
                              f"{MAX_GROUP_DEPTH} ({' -> '.join(shown)})")
        for child in inventory.groups[name].children:
            if child != ALL and depths[name] + 1 > depths[child]:
                depths[child], via[child] = depths[name] + 1, name
    return depths


def _members(inventory: AnsibleInventory, order: list[str]) -> dict[str, dict[str, None]]:
    """Each group's hosts, its own first, then its children's in their order, each host once;
    built bottom-up so every group is walked once, however many parents share it."""
    members: dict[str, dict[str, None]] = {}
    for name in reversed(order):
        if name == ALL:
            continue  # every host: not a group a host is listed in
        group = inventory.groups[name]
        found = dict(group.hosts)
        for child in group.children:
            if child != ALL:
                found.update(members[child])
        members[name] = found
    return members


def to_our_inventory(inventory: AnsibleInventory) -> tuple[dict[str, Any], list[str]]:
    """(our inventory as data, for `parse_inventory`; one note per variable name not used)."""
    top_down = _top_down(inventory)
    depths, members = _depths(inventory, top_down), _members(inventory, top_down)
    order = sorted((g for g in inventory.groups if g != ALL), key=lambda g: (depths[g], g))
    membership: dict[str, list[str]] = {}  # host -> its groups, in `order`
    for name in order:
        for host in members[name]:
            membership.setdefault(host, []).append(name)
    hosts: dict[str, Any] = {}
    unused: dict[str, list[str]] = {}
    for host in inventory.host_vars:
        variables: dict[str, tuple[Any, str]] = {}
        layers = [(ALL, inventory.groups.get(ALL, _Group()).vars)]
        layers += [(g, inventory.groups[g].vars) for g in membership.get(host, [])]
        for origin, values in layers:
            variables.update({k: (v, f"group {origin}") for k, v in values.items()})
        variables.update({k: (v, "host vars") for k, v in inventory.host_vars[host].items()})
        entry: dict[str, Any] = {"groups": [g for g in membership.get(host, []) if g != UNGROUPED]}
        for key, (value, origin) in variables.items():
            _translate(inventory.source, host, key, value, origin, entry, unused)
        hosts[host] = entry
    notes = [f"{inventory.source}: {name}: {why} (hosts: {_few(names)})"
             for name, (why, names) in sorted(_group_notes(unused).items())]
    return {"hosts": hosts}, notes


def _group_notes(unused: dict[str, list[str]]) -> dict[str, tuple[str, list[str]]]:
    notes: dict[str, tuple[str, list[str]]] = {}
    for key, hosts in unused.items():
        name, _, why = key.partition("\0")
        notes[name] = (why or "not used by ddtree-ops", hosts)
    return notes


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _translate(source: str, host: str, key: str, value: Any, origin: str, entry: dict[str, Any],
               unused: dict[str, list[str]]) -> None:
    def refuse(why: str) -> None:
        raise ConfigError(f"{source}: host {host}: {key}={quoted(value)} ({origin}): {why}")

    def note(why: str = "") -> None:
        unused.setdefault(f"{key}\0{why}", []).append(host)

    if key in ANSIBLE_KEYS:
        entry[ANSIBLE_KEYS[key]] = value
    elif key.startswith("ddtree_") and key[len("ddtree_"):] in OUR_KEYS:
        entry[key[len("ddtree_"):]] = value
    elif key == "ansible_connection":
        if value == "local":
            entry["transport"] = "local"
        elif value not in SSH_CONNECTIONS:
            refuse(f"ddtree-ops connects over SSH ({', '.join(SSH_CONNECTIONS)}) or locally (local)")
    elif key in REFUSED_VARS:
        refuse(f"{REFUSED_VARS[key]} are not supported (ddtree-ops logs in with keys; use an ssh-agent "
               "or ansible_ssh_private_key_file)")
    elif key in SSH_ARG_VARS:
        _ssh_args(str(value), entry, refuse, note)
    elif key in HOST_KEY_VARS:
        note(HOST_KEY_VARS[key])
    else:
        note()


def _ssh_args(text: str, entry: dict[str, Any], refuse: Any, note: Any) -> None:
    """The ssh options we can honour (-o UserKnownHostsFile, -F) or safely leave; anything
    else changes how the host is reached: refused."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        refuse(str(err))
        return
    index = 0
    while index < len(words):
        word = words[index]
        if word in ("-o", "-F") and index + 1 < len(words):
            flag, argument, index = word, words[index + 1], index + 2
        elif word.startswith(("-o", "-F")) and len(word) > 2:
            flag, argument, index = word[:2], word[2:], index + 1
        else:
            refuse(f"ssh option {word!r} is not supported (ddtree-ops reads -o UserKnownHostsFile=, -F and "
                   "options that do not change the route; put jump hosts in an ssh_config: ProxyJump)")
            return
        if flag == "-F":
            entry["ssh_config"] = argument
            continue
        option, _, setting = argument.replace(" ", "=", 1).partition("=")
        if option.lower() == "userknownhostsfile" and len(setting.split()) == 1:
            entry["known_hosts"] = setting
        elif option.lower() == "stricthostkeychecking" and setting.lower() == "yes":
            continue  # what we do anyway
        elif option.lower() in IGNORED_SSH_OPTIONS:
            note(f"-o {option}: {IGNORED_SSH_OPTIONS[option.lower()]}")
        else:
            refuse(f"ssh option -o {option} is not supported (ddtree-ops reads -o UserKnownHostsFile=, -F and "
                   "options that do not change the route; put jump hosts in an ssh_config: ProxyJump)")


# ------------------------------------------------------------------ from our inventory


def export(hosts: list[Any]) -> dict[str, Any]:
    """Our resolved hosts as an Ansible YAML inventory (`hosts list --format ansible`): what
    Ansible needs to reach them the same way (key, user, port, known_hosts, strict host keys)
    plus `ddtree_*` for the rest, so reading it back gives the same hosts."""
    import os

    from ddtree_ops.inventory import BUILTIN_SGLANG_PORT

    entries: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for host in hosts:
        entry: dict[str, Any] = {"ansible_connection": "local"} if host.is_local else {}
        entry["ansible_host"] = host.hostname
        for key, value in (("ansible_port", host.port), ("ansible_user", host.user),
                           ("ansible_ssh_private_key_file", host.identity_file)):
            if value is not None:
                entry[key] = value
        if not host.is_local:
            args = ["-o", "StrictHostKeyChecking=yes"]
            if host.known_hosts:
                args += ["-o", f"UserKnownHostsFile={host.known_hosts}"]
            if host.ssh_config and os.path.isfile(host.ssh_config):
                args += ["-F", host.ssh_config]
            entry["ansible_ssh_common_args"] = shlex.join(args)
        entry["ansible_python_interpreter"] = host.python
        for key in ("transport", "known_hosts", "ssh_config", "workdir", "connect_timeout", "command_timeout"):
            value = getattr(host, key)
            if value is not None:
                entry[f"ddtree_{key}"] = getattr(value, "value", value)
        if host.models is not None:
            entry["ddtree_models"] = host.models.to_dict()
        if host.sglang_port != BUILTIN_SGLANG_PORT:
            entry["ddtree_sglang_port"] = host.sglang_port
        entries[host.name] = entry
        for group in host.groups:
            groups.setdefault(group, {"hosts": {}})["hosts"][host.name] = None
    document: dict[str, Any] = {"hosts": entries}
    if groups:
        document["children"] = groups
    return {ALL: document}
