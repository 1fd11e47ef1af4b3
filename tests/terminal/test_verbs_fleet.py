"""Every verb on a fleet of two real sshd hosts on 127.0.0.1, at a terminal: verbs.py."""
from __future__ import annotations

import pytest

from sshd_fleet import SshdFleet, sshd_available
from terminal.host_envs import drifted_sglang_python
from terminal.operator_shell import OperatorShell, write_slow_python
from terminal.verbs import *  # noqa: F401,F403 - the tests themselves

pytestmark = [pytest.mark.slow, pytest.mark.sshd]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("operator-fleet")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two hosts for the whole module (started once: the suite's cost stays small)."""
    if not sshd_available():
        pytest.skip("OpenSSH sshd/ssh-keygen not installed (scripts/bootstrap.sh installs them)")
    fleet = SshdFleet(tmp_path_factory.mktemp("fleet"), command_timeout=120)
    try:
        yield fleet.start(2)
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def hosts(fleet):
    return [host.name for host in fleet.hosts]


@pytest.fixture(scope="module")
def operator(fleet, folder):
    pythons = {host.name: drifted_sglang_python(folder / f"env-{host.name}") for host in fleet.hosts}
    inventory = fleet.write_inventory(folder / "hosts.yaml",
                                      host_overrides={name: {"python": str(p)} for name, p in pythons.items()})
    return OperatorShell.in_folder(folder, inventory)


@pytest.fixture
def slow_operator(operator, fleet, folder):
    script, pids = write_slow_python(folder)
    inventory = fleet.write_inventory(folder / "slow-hosts.yaml",
                                      host_overrides={h.name: {"python": str(script)} for h in fleet.hosts})
    return OperatorShell.in_folder(folder, inventory), pids
