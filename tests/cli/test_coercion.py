"""Deferred parameter conversion (ddtree_ops.cli.coercion): absent values and defaults are
taken as they are, without building Typer's pydantic conversion; a word from the command line
still goes through Typer's conversion, its checks and its error messages."""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import pytest
import typer

from ddtree_ops.cli.coercion import defer_coercion


class Mode(str, enum.Enum):
    FAST = "fast"
    SLOW = "slow"


def command_and_builds():
    app = typer.Typer()
    seen = {}

    @app.command()
    def run(
        keep: Annotated[int, typer.Option(min=1)] = 5,
        hosts: Annotated[Optional[list[str]], typer.Option("-H")] = None,
        source: Optional[Path] = None,
        mode: Mode = Mode.FAST,
        label: str = "x",
        verbose: bool = False,
    ) -> None:
        seen.update(keep=keep, hosts=hosts, source=source, mode=mode, label=label, verbose=verbose)

    @app.command()
    def other() -> None:  # two commands: a group, as ddtree-ops is
        pass

    command = typer.main.get_command(app)
    defer_coercion(command)
    builds = []
    for param in command.commands["run"].params:
        deferred = param.get_runtime_param()
        build = deferred.build
        deferred.build = lambda build=build, name=param.name: (builds.append(name), build())[1]
    return command, seen, builds


def test_defaults_and_absent_values_need_no_conversion():
    command, seen, builds = command_and_builds()
    command.main(["run"], standalone_mode=False)
    assert seen == {"keep": 5, "hosts": None, "source": None, "mode": Mode.FAST, "label": "x", "verbose": False}
    assert builds == []


def test_words_from_the_command_line_are_converted_by_typer():
    command, seen, builds = command_and_builds()
    command.main(["run", "--keep", "3", "-H", "a", "-H", "b", "--source", "/tmp/s", "--mode", "slow", "--label", "y"],
                 standalone_mode=False)
    assert seen == {"keep": 3, "hosts": ["a", "b"], "source": Path("/tmp/s"), "mode": Mode.SLOW, "label": "y",
                    "verbose": False}
    assert sorted(builds) == ["hosts", "keep", "mode", "source"]  # a str given as a str needs nothing


@pytest.mark.parametrize("args, message", [
    (["--keep", "0"], "Invalid value for '--keep'"),
    (["--keep", "many"], "Invalid value for '--keep'"),
    (["--mode", "medium"], "Invalid value for '--mode'"),
])
def test_bad_words_get_typers_own_errors(args, message):
    command, _, _ = command_and_builds()
    with pytest.raises(typer.TyperException) as caught:
        command.main(["run", *args], standalone_mode=False)
    assert message in caught.value.format_message()
