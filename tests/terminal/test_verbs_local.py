"""Every verb on the embedded-style `local` host (transport: local), at a terminal: verbs.py."""
from __future__ import annotations

import pytest
import yaml

from terminal.host_envs import drifted_sglang_python
from terminal.operator_shell import OperatorShell, write_slow_python
from terminal.verbs import *  # noqa: F401,F403 - the tests themselves

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("operator-local")


def local_inventory(path, python, workdir):
    path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "python": str(python),
                                                        "workdir": str(workdir)}}}))
    return path


@pytest.fixture(scope="module")
def operator(folder):
    python = drifted_sglang_python(folder / "env")
    return OperatorShell.in_folder(folder, local_inventory(folder / "hosts.yaml", python, folder / "wd"))


@pytest.fixture(scope="module")
def hosts():
    return ["local"]


@pytest.fixture
def slow_operator(operator, folder):
    script, pids = write_slow_python(folder)
    inventory = local_inventory(folder / "slow-hosts.yaml", script, folder / "wd")
    return OperatorShell.in_folder(folder, inventory), pids
