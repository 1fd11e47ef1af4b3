"""Deferred parameter conversion (ddtree_ops.cli.coercion): absent values and defaults are
taken as they are, without building Typer's pydantic conversion; a word from the command line
still goes through Typer's conversion, its checks and its error messages."""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # a str given as a str, digits for an int and a word for a Path need nothing of Typer's
    assert sorted(builds) == ["hosts", "mode"]


def test_words_that_are_not_plain_go_to_typer():
    command, seen, builds = command_and_builds()
    command.main(["run", "--keep", " 3", "--source", "/tmp/s"], standalone_mode=False)
    assert seen["keep"] == 3 and builds == ["keep"]  # Typer takes " 3"; our rule does not


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


def path_and_int_commands(deferred: bool):
    """The same command with and without deferred conversion: what each makes of a word."""
    app = typer.Typer()
    seen = {}

    @app.command()
    def run(
        count: Annotated[int, typer.Option(min=1, max=1000)] = 5,
        free: int = 0,
        clamped: Annotated[int, typer.Option(min=2, max=9, clamp=True)] = 2,
        inventory: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False)] = None,
        folder: Annotated[Optional[Path], typer.Option(file_okay=False, resolve_path=True)] = None,
        anywhere: Optional[Path] = None,
    ) -> None:
        seen.update(count=count, free=free, clamped=clamped, inventory=inventory, folder=folder, anywhere=anywhere)

    @app.command()
    def other() -> None:
        pass

    command = typer.main.get_command(app)
    if deferred:
        defer_coercion(command)
    return command, seen


def outcome(deferred: bool, args: list[str]):
    command, seen = path_and_int_commands(deferred)
    try:
        command.main(["run", *args], standalone_mode=False)
    except typer.TyperException as err:
        return "error", err.format_message()
    return "ok", seen


WORDS = st.one_of(st.from_regex(r"[0-9]{1,22}", fullmatch=True), st.integers(-5, 2000).map(str),
                  st.text(alphabet="0123456789 _+-.e", max_size=6))
PATHS = st.one_of(st.sampled_from(["", ".", "..", "/", "/tmp", "/etc/hostname", "/nowhere/x", "~/x", "a//b/",
                                   "/tmp/", "-"]), st.text(alphabet="ab/. ~-", max_size=8))


@settings(max_examples=300, deadline=None)
@given(option=st.sampled_from(["--count", "--free", "--clamped"]), word=WORDS)
def test_an_int_word_is_what_typer_makes_of_it(option, word):
    assert outcome(True, [option, word]) == outcome(False, [option, word])


@settings(max_examples=300, deadline=None)
@given(option=st.sampled_from(["--inventory", "--folder", "--anywhere"]), word=PATHS)
def test_a_path_word_is_what_typer_makes_of_it(option, word):
    assert outcome(True, [option, word]) == outcome(False, [option, word])
