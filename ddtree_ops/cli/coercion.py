"""Parameter values converted only when they need converting.

Typer (0.29) converts each parameter's value with a pydantic TypeAdapter, which it builds
before it looks at the value. Every verb's start therefore imported pydantic and built an
adapter per parameter (~50 ms for `push`), though most values are absent, already what they
should be (a default), or a plain word for a `Path` or an `int`. Those are taken here, by
rules that give exactly what Typer's conversion gives (`tests/cli/test_coercion.py` holds the
two against each other); any other value goes through Typer's own conversion, built then, so
its checks and error messages stay Typer's.
"""
from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Any, Callable

_PLAIN_TYPES = (str, int, float, bool)
# Plain decimal digits: what pydantic's lax int reads as int(word). Signs, spaces, underscores
# and the like are left to Typer (it takes some of them, with its own rules).
_PLAIN_INT = re.compile(r"[0-9]{1,18}")


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
        if type(value) is str and not (param.multiple or param.nargs == -1):
            info = param.type_descriptor.parameter_info
            if annotation is int and _PLAIN_INT.fullmatch(value) and _in_range(int(value), info):
                return int(value)
            if (annotation is Path and info.parser is None and info.path_type in (None, Path)
                    and param.type_descriptor.file_annotation is None and str(path := Path(value)) == value):
                from typer._param_types import coerce_cli_path

                # A Path value skips Typer's pydantic step (str -> Path(str)); exists=,
                # dir_okay=, resolve_path= and their messages are Typer's own. A word that
                # Path would rewrite ("a//b/") is left to Typer: its messages quote the word.
                return coerce_cli_path(path, info, path_type=Path, param=param, ctx=ctx)
        return self.build().coerce(value, param=param, ctx=ctx)


def _in_range(number: int, info: Any) -> bool:
    """Within min/max, unclamped: out of range, Typer says so (or clamps) itself."""
    if info.parser is not None or info.clamp:
        return False
    return (info.min is None or number >= info.min) and (info.max is None or number <= info.max)


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
