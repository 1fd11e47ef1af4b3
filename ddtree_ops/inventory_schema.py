"""The inventory's schema: pydantic models, the validator of record for `hosts.yaml`.

`validate(data)` gives the file's content normalized (every key present, defaults filled in,
`transport` a TransportKind, timeouts floats) or raises ConfigError naming the field. A file of
plain values is normally taken by `inventory_plain` without importing pydantic (~40 ms of a
CLI start); whatever that declines, every error message included, is decided here.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from ddtree_ops.errors import ConfigError, quoted
from ddtree_ops.inventory import TransportKind


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class ModelsEntry(_Strict):
    """Which models a host evaluates with (used by smoke/bench stages)."""

    target: str
    drafter: str
    block_size: int = Field(default=16, ge=1)
    prompts: Optional[str] = None


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):  # an int subclass, so lax parsing would take it as 0 or 1
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


# An empty string would silently fall back to the default; `port: true` is not port 1.
_Text = Annotated[str, Field(min_length=1)]
_Port = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=1, le=65535)]
# Every phase is bounded: an infinite timeout is not a bound.
_Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class HostKeys(_Strict):
    """Keys allowed both in `defaults:` and in a host entry (a new one goes into
    `inventory_plain._HOST_KEYS` too; tests/unit/test_inventory_plain.py checks it)."""

    transport: Optional[TransportKind] = None
    user: Optional[_Text] = None
    port: Optional[_Port] = None
    identity_file: Optional[_Text] = None
    known_hosts: Optional[_Text] = None
    ssh_config: Optional[_Text] = None
    python: Optional[_Text] = None
    workdir: Optional[_Text] = None
    connect_timeout: Optional[_Seconds] = None
    command_timeout: Optional[_Seconds] = None
    models: Optional[ModelsEntry] = None
    sglang_port: Optional[_Port] = None


class HostEntry(HostKeys):
    hostname: Optional[_Text] = None
    groups: list[str] = Field(default_factory=list)


class InventoryFile(_Strict):
    defaults: HostKeys = Field(default_factory=HostKeys)
    hosts: dict[str, HostEntry]


def validate(data: Any, source: str) -> dict[str, Any]:
    """`data` (a parsed hosts.yaml) checked and normalized: `InventoryFile(...).model_dump()`."""
    try:
        return InventoryFile.model_validate(data).model_dump()
    except ValidationError as err:
        raise ConfigError(f"{source}: {describe_validation_error(err)}") from None


_EXPECTED = {
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_too_short": "expected a non-empty string",
    "finite_number": "expected a finite number",
}


def describe_validation_error(err: ValidationError) -> str:
    """The first pydantic error as `dotted.field: what was expected, got 'value'`."""
    first = err.errors(include_url=False)[0]
    where = ".".join(part if isinstance(part, str) and len(part) <= 60 else quoted(part)
                     for part in map(str, first["loc"])) or "(top level)"
    kind = first["type"]
    value = first.get("input")
    if kind == "extra_forbidden":
        return f"{where}: unknown key (check the spelling)"
    if kind == "missing":
        return f"{where}: required key is missing"
    if kind == "enum":
        allowed = ", ".join(repr(k.value) for k in TransportKind)
        return f"{where}: expected one of {allowed}, got {quoted(value)}"
    if kind in _EXPECTED:
        return f"{where}: {_EXPECTED[kind]}, got {quoted(value)}"
    return f"{where}: {first['msg'].lower()}, got {quoted(value)}"
