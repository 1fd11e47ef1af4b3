"""The layering rules of DESIGN.md, checked by importing each layer in a fresh interpreter
(and, for imports inside functions, by reading every import statement):

- the core (`ddtree`) imports nothing of the operator or host side, typer, rich, paramiko or yaml;
- the host side (`ddtree_ops.hostside`) imports only the standard library, torch and `ddtree`;
- nothing imports the CLI; only the transport imports SSH libraries;
- `--help` loads neither torch nor paramiko, and `--version` not even Rich."""
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


@pytest.mark.slow
def test_help_imports_no_torch_fabric_or_paramiko():
    code = "import contextlib, io\nfrom ddtree_ops.cli.app import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    for args in (["--help"], ["hosts", "--help"], ["push", "--help"], ["--version"]):
        loaded = loaded_after(code + f"    assert main({args!r}) == 0\n")
        heavy = {"torch"} | SSH_LIBS | ({"rich"} if args == ["--version"] else set())
        assert not loaded & heavy, (args, loaded & heavy)


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
