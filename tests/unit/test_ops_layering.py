"""The layering rules of DESIGN.md, checked by importing each layer in a fresh interpreter."""
from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import ddtree_ops

ROOT = Path(__file__).resolve().parents[2]
SSH_LIBS = {"paramiko", "fabric", "invoke"}
CLI_LIBS = {"typer", "rich", "click"}


def loaded_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def ops_modules(prefix: str = "") -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(ddtree_ops.__path__, "ddtree_ops.")]
    return [n for n in names if n.startswith(prefix) and n != "ddtree_ops.__main__" and ".hostside" not in n]


def test_help_imports_no_torch_fabric_or_paramiko():
    code = "import contextlib, io\nfrom ddtree_ops.cli.app import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    for args in (["--help"], ["hosts", "--help"], ["push", "--help"]):
        loaded = loaded_after(code + f"    assert main({args!r}) == 0\n")
        assert not loaded & ({"torch"} | SSH_LIBS), (args, loaded & ({"torch"} | SSH_LIBS))


def test_only_the_transport_imports_ssh_libraries():
    paramiko_modules = {"ddtree_ops.transport." + m for m in ("ssh", "ssh_config", "known_hosts", "paramiko_import")}
    below_cli = [m for m in ops_modules() if not m.startswith("ddtree_ops.cli") and m not in paramiko_modules]
    loaded = loaded_after("\n".join(f"import {m}" for m in below_cli))
    assert not loaded & SSH_LIBS, loaded & SSH_LIBS
    assert not loaded & CLI_LIBS, loaded & CLI_LIBS
    assert "paramiko" in loaded_after("import ddtree_ops.transport.ssh")
    pattern = re.compile(r"^\s*(import|from)\s+(paramiko|fabric)\b", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "ddtree_ops").rglob("*.py")
        if pattern.search(path.read_text()) and "transport" not in path.relative_to(ROOT).parts
    ]
    assert offenders == []


def test_core_imports_no_ops_code():
    loaded = loaded_after("import ddtree")
    assert not loaded & ({"ddtree_ops", "yaml"} | SSH_LIBS | CLI_LIBS)


def test_host_agent_is_stdlib_only():
    source = (ROOT / "ddtree_ops" / "hostside" / "agent.py").read_text()
    imported = set(re.findall(r"^\s*(?:import|from)\s+([a-zA-Z_]+)", source, re.M))
    assert imported <= set(sys.stdlib_module_names) | {"torch"}, imported - set(sys.stdlib_module_names)
