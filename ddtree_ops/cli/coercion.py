"""Parameter values converted only when they need converting.

Typer (0.29) converts each parameter's value with a pydantic TypeAdapter, which it builds
before it looks at the value. Every verb's start therefore imported pydantic and built an
adapter per parameter (~50 ms for `push`), though most values are absent or already what
they should be (a default). Here an absent value, or one already of the parameter's plain
type, is taken as it is; any other (a word from the command line) goes through Typer's own
conversion, built then, so its checks and error messages stay Typer's.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable

_PLAIN_TYPES = (str, int, float, bool)


class DeferredCoercion:
    """Stands in for a Typer parameter's runtime conversion until a value needs it."""

    def __init__(self, build: Callable[[], Any]):
        self.build = build

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return () if param.multiple or param.nargs == -1 else None
        annotation = param.type_descriptor.annotation
        if (annotation in _PLAIN_TYPES and type(value) is annotation) or (
                isinstance(annotation, type) and issubclass(annotation, Enum) and isinstance(value, annotation)):
            return value
        return self.build().coerce(value, param=param, ctx=ctx)


def defer_coercion(command: Any) -> None:
    """Every Typer parameter of `command` and its subcommands (`--help` included, which Click
    makes per context) builds its conversion only when a value needs it."""
    for sub in getattr(command, "commands", {}).values():
        defer_coercion(sub)
    for param in command.params:
        _defer(param)
    help_option = command.get_help_option

    def get_help_option(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None:
            _defer(option)
        return option

    command.get_help_option = get_help_option


def _defer(param: Any) -> None:
    build = getattr(param, "get_runtime_param", None)
    if build is None or not hasattr(param, "type_descriptor") or "get_runtime_param" in vars(param):
        return  # not a Typer parameter, or done already
    deferred = DeferredCoercion(build)
    param.get_runtime_param = lambda: deferred
