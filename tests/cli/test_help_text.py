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


def test_smoke_help_names_every_stage_from_the_stage_registry(capsys, monkeypatch):
    """Issue #47: `smoke --help` did not list the stage names."""
    from ddtree_ops.hostside.protocol import STAGE_ORDER

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["smoke", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # help wrapped in a panel
    assert f"Default: {', '.join(STAGE_ORDER)}. Only when named: lossless-full." in out


def test_the_stage_list_in_help_follows_the_stage_modules(tmp_path, monkeypatch):
    """Read from the stage modules and STAGE_ORDER, not a copy: a new stage file shows up."""
    from ddtree_ops.cli.smoke import stages_help
    from ddtree_ops.hostside import protocol

    for stem in ("env", "tree_bench", "disk_check", "_helpers", "__init__"):
        (tmp_path / f"{stem}.py").write_text("")
    monkeypatch.setattr(protocol, "stages_dir", lambda: tmp_path)
    assert stages_help().endswith("Default: env, tree-bench. Only when named: disk-check.")
