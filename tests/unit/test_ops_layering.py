"""The layering rules of DESIGN.md, checked by importing each layer in a fresh interpreter
(and, for imports inside functions, by reading every import statement):

- the core (`ddtree`) imports nothing of the operator or host side, typer, rich, paramiko or yaml;
- the host side (`ddtree_ops.hostside`) imports only the standard library, torch and `ddtree`;
- nothing imports the CLI; only the transport imports SSH libraries;
- `--help` loads neither torch nor paramiko (nor pydantic, nor Rich's heavy parts: the CLI starts
  fast), and `--version` not even Rich."""
from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree_ops

ROOT = Path(__file__).resolve().parents[2]
SSH_LIBS = {"paramiko", "fabric", "invoke"}
CLI_LIBS = {"typer", "rich", "click"}


def modules_after(code: str) -> set[str]:
    """Every module name in sys.modules after running `code` in a fresh interpreter."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def loaded_after(code: str) -> set[str]:
    return {m.split(".")[0] for m in modules_after(code)}


def imports_in(path: Path) -> set[str]:
    """Every absolute module name an import statement of the file names (top level or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


CORE_FORBIDDEN = {"ddtree_ops", "yaml"} | SSH_LIBS | CLI_LIBS
CORE_MODULES = sorted(f"ddtree.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "src" / "ddtree")])
                      if m.name != "sglang")  # ddtree.sglang runs inside the SGLang server
HOSTSIDE_MODULES = sorted(
    "ddtree_ops.hostside." + path.relative_to(ROOT / "ddtree_ops" / "hostside").with_suffix("").as_posix().replace("/", ".")
    for path in (ROOT / "ddtree_ops" / "hostside").rglob("*.py") if path.name != "__init__.py")


def ops_modules(prefix: str = "") -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(ddtree_ops.__path__, "ddtree_ops.")]
    return [n for n in names if n.startswith(prefix) and n != "ddtree_ops.__main__" and ".hostside" not in n]


# What no `--help` may load: torch and the SSH libraries (layering), and what made the CLI
# slow to start: Typer's Rich help with Rich's markup, syntax and traceback machinery, and
# pydantic (Typer builds a pydantic adapter per parameter unless ddtree_ops.cli.coercion defers it).
HELP_FORBIDDEN = {"torch", "pydantic", "pygments", "markdown_it", "typer.rich_utils", "rich.markdown", "rich.syntax",
                  "rich.traceback"} | SSH_LIBS

HELP_PROBE = """
import contextlib, io, json, sys
import typer
from ddtree_ops.cli.app import app, main, prepare
forbidden = set(json.loads(sys.argv[1]))
prepare()
paths, todo = [[]], [([], typer.main.get_command(app))]
while todo:
    path, command = todo.pop()
    for name, sub in getattr(command, "commands", {}).items():
        paths.append(path + [name])
        todo.append((path + [name], sub))
found = {}
for path in sorted(paths):
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(path + ["--help"])
    found[" ".join(path + ["--help"])] = [code, sorted(m for m in sys.modules if m in forbidden or m.split(".")[0] in forbidden)]
print(json.dumps(found))
"""


@pytest.mark.slow
def test_no_help_imports_torch_paramiko_pydantic_or_richs_heavy_parts():
    """Every command's `--help`, one after another in one fresh interpreter: after each, none
    of HELP_FORBIDDEN is loaded (so the one that first loaded it is named)."""
    out = subprocess.run([sys.executable, "-c", HELP_PROBE, json.dumps(sorted(HELP_FORBIDDEN))], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"--help", "push --help", "hosts check --help", "sglang diff --help"} <= set(found)
    assert {args: loaded for args, (code, loaded) in found.items() if loaded or code != 0} == {}


PUSH_PROBE = """
import contextlib, io, json, sys
from ddtree_ops.cli.app import main, prepare
prepare()
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps([code, "pydantic" in sys.modules]))
"""


@pytest.mark.slow
def test_a_push_with_a_plain_inventory_and_plain_options_needs_no_pydantic(tmp_path: Path):
    """The verb's start as an operator types it: `-i FILE --source DIR --parallel N` are plain
    words and the inventory holds plain values, so neither Typer's conversion nor the
    inventory's schema (pydantic, ~40 ms) is loaded; a value that needs converting loads it."""
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(f"hosts:\n  here: {{transport: local, workdir: {tmp_path / 'work'}}}\n")
    args = ["push", "--dry-run", "--json", "-i", str(inventory), "--source", str(ROOT), "--parallel", "3"]
    run = lambda *extra: json.loads(subprocess.run([sys.executable, "-c", PUSH_PROBE, *args, *extra], capture_output=True,
                                                   text=True, cwd=tmp_path, check=True).stdout.strip().splitlines()[-1])
    assert run() == [0, False]
    assert run("--parallel", "+3") == [0, True]  # a word that is not plain digits: Typer converts it


@pytest.mark.slow
def test_version_imports_not_even_rich():
    code = "import contextlib, io\nfrom ddtree_ops.cli.app import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    loaded = loaded_after(code + "    assert main(['--version']) == 0\n")
    assert not loaded & ({"torch", "rich"} | SSH_LIBS), loaded & ({"torch", "rich"} | SSH_LIBS)


@pytest.mark.slow
def test_only_the_transport_imports_ssh_libraries():
    paramiko_modules = {"ddtree_ops.transport." + m for m in ("ssh", "ssh_config", "known_hosts", "paramiko_import")}
    below_cli = [m for m in ops_modules() if not m.startswith("ddtree_ops.cli") and m not in paramiko_modules]
    modules = modules_after("\n".join(f"import {m}" for m in below_cli))
    loaded = {m.split(".")[0] for m in modules}
    assert not loaded & SSH_LIBS, loaded & SSH_LIBS
    assert not [m for m in modules if m.startswith("ddtree_ops.cli")]  # nothing below the CLI imports it
    assert not loaded & CLI_LIBS, loaded & CLI_LIBS
    assert "paramiko" in loaded_after("import ddtree_ops.transport.ssh")
    pattern = re.compile(r"^\s*(import|from)\s+(paramiko|fabric)\b", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "ddtree_ops").rglob("*.py")
        if pattern.search(path.read_text()) and "transport" not in path.relative_to(ROOT).parts
    ]
    assert offenders == []


@pytest.mark.slow
def test_core_imports_no_ops_code():
    loaded = loaded_after("import ddtree\n" + "\n".join(f"import {m}" for m in CORE_MODULES))
    assert not loaded & CORE_FORBIDDEN, loaded & CORE_FORBIDDEN
    for path in (ROOT / "src" / "ddtree").rglob("*.py"):  # ddtree.sglang and imports inside functions too
        offenders = {name for name in imports_in(path) if name.split(".")[0] in CORE_FORBIDDEN}
        assert not offenders, (str(path.relative_to(ROOT)), offenders)


@pytest.mark.slow
def test_host_side_imports_only_stdlib_torch_and_ddtree():
    """In a fresh interpreter: what importing every host-side module adds to `torch` + the core
    is standard library and the host side itself; every import statement names one of those."""
    core = "import importlib, torch, ddtree\n" + "\n".join(f"import {m}" for m in CORE_MODULES)
    before = modules_after(core)
    after = modules_after(core + "\n" + "\n".join(f"importlib.import_module({m!r})" for m in HOSTSIDE_MODULES))
    added = after - before
    foreign = {m for m in added if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "ddtree_ops"}
    assert not foreign, foreign
    ops = {m for m in added if m.startswith("ddtree_ops.")}
    assert all(m.startswith("ddtree_ops.hostside") for m in ops), ops
    allowed = set(sys.stdlib_module_names) | {"torch", "ddtree"}
    for path in (ROOT / "ddtree_ops" / "hostside").rglob("*.py"):
        offenders = {name for name in imports_in(path)
                     if name.split(".")[0] not in allowed and not name.startswith("ddtree_ops.hostside")}
        assert not offenders, (str(path.relative_to(ROOT)), offenders)


@pytest.mark.slow
def test_nothing_imports_the_cli():
    for path in [*(ROOT / "ddtree_ops").rglob("*.py"), *(ROOT / "src" / "ddtree").rglob("*.py")]:
        if "cli" in path.relative_to(ROOT).parts or path.name == "__main__.py":
            continue
        offenders = {name for name in imports_in(path) if name.startswith("ddtree_ops.cli")}
        assert not offenders, (str(path.relative_to(ROOT)), offenders)


def test_host_agent_is_stdlib_only():
    source = (ROOT / "ddtree_ops" / "hostside" / "agent.py").read_text()
    imported = set(re.findall(r"^\s*(?:import|from)\s+([a-zA-Z_]+)", source, re.M))
    assert imported <= set(sys.stdlib_module_names) | {"torch"}, imported - set(sys.stdlib_module_names)
