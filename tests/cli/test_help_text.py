"""`--help` names values as an operator writes them: no Python type names (`<bool>`,
`<list[str]>`, `<int range>`) and no `{run_id}` anywhere, for every command."""
from __future__ import annotations

import re

import typer

from ddtree_ops.cli.app import app, main, prepare

PYTHON_TYPE = re.compile(r"<(bool|str|int|float|path|Path|datetime|uuid)( range)?>|<list\[[^\]]*\]>|\{[A-Za-z_]+\}|list\[")


def command_paths() -> list[list[str]]:
    prepare()
    paths: list[list[str]] = [[]]

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            paths.append([*path, name])
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def test_no_help_shows_a_python_type_name(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    paths = command_paths()
    assert ["baseline", "import"] in paths and ["collect"] in paths
    for path in paths:
        assert main([*path, "--help"]) == 0
        out = capsys.readouterr().out
        found = PYTHON_TYPE.findall(out) and PYTHON_TYPE.search(out).group()
        assert not found, f"ddtree-ops {' '.join(path)} --help shows {found!r}"
    assert main(["collect", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: ddtree-ops collect [OPTIONS] RUN_ID" in out and "--parallel" in out and "INTEGER" in out


def test_rollback_says_why_it_takes_a_source(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["rollback", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # help wrapped in a panel
    assert "Checkout whose installer does the rollback on the hosts" in out
    assert "what is removed comes from each host's own deploy record" in out
