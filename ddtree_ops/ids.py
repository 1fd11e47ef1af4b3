"""Run ids and release ids: they become path parts on the hosts (`releases/<id>/`,
`runs/<run-id>/`) and here (`runs/<run-id>/<host>/`), so only one safe shape is accepted,
wherever such an id enters: a command-line value (usage error, exit 2) or a value read back
from a host or a local record (an error that names the host or the file)."""
from __future__ import annotations

from enum import Enum
from typing import Any

from ddtree_ops.errors import ConfigError, RemoteStepError, UsageError
from ddtree_ops.hostside.agent import is_safe_id  # the hosts' rule: one definition for both sides

SAFE_ID_RULE = "expected 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
MAX_FOLDER_NAME_BYTES = 255  # NAME_MAX: a host name is the folder runs/<run-id>/<host>/


def folder_name_problem(name: Any) -> str | None:
    """Why `name` (a host name) cannot name a folder of a run, or None: the one rule for the
    inventory (refused at load) and for a name read back from a run record."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        return "no '/', NUL, '.' or '..', not empty"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "not valid text (a lone surrogate)"
    if size > MAX_FOLDER_NAME_BYTES:
        return f"{size} bytes long, past the limit of {MAX_FOLDER_NAME_BYTES} for a folder name"
    return None


class IdKind(str, Enum):
    RUN = "run id"
    RELEASE = "release id"


def shown(value: Any, limit: int = 48) -> str:
    """The bad value for a one-line message: repr, cut short when very long."""
    text = repr(value)
    if len(text) > limit:
        size = f"{len(value)} chars" if isinstance(value, str) else type(value).__name__
        text = f"{text[:limit]}... ({size})"
    return text


def check_cli_id(kind: IdKind, value: Any) -> str:
    """A command-line value: UsageError (exit 2) unless safe."""
    if not is_safe_id(value):
        raise UsageError(f"{kind.value} {shown(value)}: {SAFE_ID_RULE}")
    return value


def check_host_id(host: str, kind: IdKind, value: Any, where: str) -> str:
    """A value a host sent back (`where` says in which reply/field): a per-host failure."""
    if not is_safe_id(value):
        raise RemoteStepError(f"{host}: {where}: unsafe {kind.value} {shown(value)} from the host: {SAFE_ID_RULE}")
    return value


def check_optional_host_id(host: str, kind: IdKind, value: Any, where: str) -> Any:
    """Same, for fields that may be absent or null (no previous release)."""
    return None if value is None else check_host_id(host, kind, value, where)


def check_record_id(path: Any, kind: IdKind, value: Any, field: str) -> str:
    """A value read from a local record (run.json): ConfigError naming the file and field."""
    if not is_safe_id(value):
        raise ConfigError(f"{path}: {field}: unsafe {kind.value} {shown(value)}: {SAFE_ID_RULE}")
    return value
