"""A hosts.yaml of plain values, taken without pydantic.

Importing pydantic and building the inventory's models costs a CLI start ~40 ms, more than
the rest of a one-host push's own work. Nearly every inventory holds only plain values: known
keys, strings where strings go, in-range integers for ports, finite positive numbers for
timeouts. `plain_inventory` takes exactly those and gives what the schema
(`inventory_schema.validate`, the validator of record) gives for them; it returns None for
anything else (a value pydantic would convert or refuse), and the schema decides, with its
error messages. `tests/unit/test_inventory_plain.py` holds the two against each other.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from ddtree_ops.inventory import TransportKind

_DECLINED = object()  # "not plainly valid": the schema decides


def _text(value: Any) -> Any:
    return value if type(value) is str and value else _DECLINED


def _port(value: Any) -> Any:
    return value if type(value) is int and 1 <= value <= 65535 else _DECLINED


def _seconds(value: Any) -> Any:
    if type(value) is int and 0 < value <= 2**53:  # exactly a float
        return float(value)
    return value if type(value) is float and 0 < value < math.inf else _DECLINED


def _transport(value: Any) -> Any:
    return TransportKind(value) if type(value) is str and value in ("ssh", "local") else _DECLINED


def _models(value: Any) -> Any:
    if type(value) is not dict or not value.keys() <= _MODEL_KEYS or not {"target", "drafter"} <= value.keys():
        return _DECLINED
    spec = {"target": value["target"], "drafter": value["drafter"], "block_size": value.get("block_size", 16),
            "prompts": value.get("prompts")}
    plain = (type(spec["target"]) is str and type(spec["drafter"]) is str
             and type(spec["block_size"]) is int and spec["block_size"] >= 1
             and (spec["prompts"] is None or type(spec["prompts"]) is str))
    return spec if plain else _DECLINED


def _groups(value: Any) -> Any:
    return list(value) if type(value) is list and all(type(g) is str for g in value) else _DECLINED


_MODEL_KEYS = frozenset({"target", "drafter", "block_size", "prompts"})
# The schema's HostKeys, key by key: how a plain value is checked (None is always allowed).
_HOST_KEYS: dict[str, Callable[[Any], Any]] = {
    "transport": _transport,
    "user": _text,
    "port": _port,
    "identity_file": _text,
    "known_hosts": _text,
    "ssh_config": _text,
    "python": _text,
    "workdir": _text,
    "connect_timeout": _seconds,
    "command_timeout": _seconds,
    "models": _models,
    "sglang_port": _port,
}


_ENTRY_KEYS = frozenset({"hostname", "groups"})  # a host entry's keys beyond _HOST_KEYS


def _keys(value: Any, entry: bool) -> Any:
    """`defaults:` or (entry) a host's entry, every key present, or _DECLINED."""
    if type(value) is not dict or not all(k in _HOST_KEYS or (entry and k in _ENTRY_KEYS) for k in value):
        return _DECLINED
    out: dict[str, Any] = {}
    for key, check in _HOST_KEYS.items():
        given = value.get(key)
        out[key] = None if given is None else check(given)
        if out[key] is _DECLINED:
            return _DECLINED
    if entry:
        hostname = value.get("hostname")
        out["hostname"] = None if hostname is None else _text(hostname)
        out["groups"] = _groups(value.get("groups", []))
        if _DECLINED in (out["hostname"], out["groups"]):
            return _DECLINED
    return out


def plain_inventory(data: Any) -> Optional[dict[str, Any]]:
    """`data` normalized as `inventory_schema.validate` would, or None when it is not all plain."""
    if type(data) is not dict or not data.keys() <= {"defaults", "hosts"} or type(data.get("hosts")) is not dict:
        return None
    defaults = _keys(data["defaults"], entry=False) if "defaults" in data else dict.fromkeys(_HOST_KEYS)
    if defaults is _DECLINED:
        return None
    hosts = {}
    for name, entry in data["hosts"].items():
        if type(name) is not str or (keys := _keys(entry, entry=True)) is _DECLINED:
            return None
        hosts[name] = keys
    return {"defaults": defaults, "hosts": hosts}
