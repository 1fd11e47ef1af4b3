"""Shared fixtures. `sshd_fleet` starts real sshd processes on 127.0.0.1 (see tests/sshd_fleet.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `from sshd_fleet import ...`

from sshd_fleet import SshdFleet, sshd_available  # noqa: E402


def pytest_configure(config):
    """Ctrl-C handling as in an interactive shell, even when the suite was started in the
    background (`make test &`, nohup, some CI runners): such a start ignores SIGINT, Python then
    raises no KeyboardInterrupt, and the children the tests start inherit the ignore, so the
    tests that stop a run with Ctrl-C would hang or fail. Runs in every xdist worker too."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The files that take longest (measured on 2 idle cores: 15-155 s each, the rest under 15 s),
# longest first. pytest-xdist hands out whole files (`--dist loadfile`) in collection order
# when `--no-loadscope-reorder` is given (the Makefile does): these then start first and the
# short files fill in around them, instead of one of them starting last and running on alone.
LONGEST_FILES = (
    "tests/sglang_server/test_cpu_server_e2e.py",  # five real SGLang servers on CPU
    "tests/terminal/test_verbs_fleet.py",  # every verb on each screen over sshd, at a terminal
    "tests/terminal/test_doc_commands.py",  # every command the docs print, as written
    "tests/sglang_server/test_metrics_and_status.py",  # one more (about 100 s idle), shared by its tests
    "tests/terminal/test_verbs_local.py",
    "tests/integration/test_deploy_sglang.py",
    "tests/integration/test_deploy_lifecycle.py",
    "tests/integration/test_deploy_steps.py",  # a deploy and a rollback killed at every step (about 100 s idle)
    "tests/integration/test_ansible_playbook.py",  # three ansible-playbook runs (about 80 s)
    "tests/property/test_core_parity.py",
    "tests/integration/test_smoke_fleet.py",
    "tests/unit/test_decode_lossless.py",
    "tests/unit/test_smoke_runner.py",
    "tests/integration/test_push_ssh.py",
    "tests/cli/test_smoke_cli.py",
    "tests/sglang_server/test_cpu_smoke_stages.py",
    "tests/integration/test_rollout_fleet.py",
    "tests/integration/test_ssh_transport.py",  # these three mostly wait (timeouts, a download):
    "tests/unit/test_sglang_upgrade.py",  # started early, they overlap with work
    "tests/unit/test_ops_local_transport.py",
)


def pytest_collection_modifyitems(items):
    first = {path: rank for rank, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))  # stable: the rest keep their order


@pytest.fixture
def sshd_fleet(tmp_path_factory):
    """Factory: `sshd_fleet(n, python=..., connect_timeout=5, command_timeout=30) -> SshdFleet`.

    Every sshd (and its sessions) started through it is killed at teardown."""
    if not sshd_available():
        pytest.skip("OpenSSH sshd/ssh-keygen not installed (scripts/bootstrap.sh installs them)")
    fleets: list[SshdFleet] = []

    def start(n: int = 1, **options) -> SshdFleet:
        fleet = SshdFleet(tmp_path_factory.mktemp("fleet"), **options)
        fleets.append(fleet)
        return fleet.start(n)

    yield start
    for fleet in fleets:
        fleet.stop()


_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _is_loopback(host) -> bool:
    import ipaddress

    if host is None or (isinstance(host, (str, bytes)) and not host):
        return True  # a passive/any-address lookup (a server binding), not a destination
    name = host.decode() if isinstance(host, bytes) else str(host)
    if name.lower().rstrip(".") in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True, scope="session")
def lookups_reach_only_loopback():
    """Tests send traffic only to loopback. A host a test means to be unreachable
    (`gpu-a.invalid`, an example inventory's `10.0.0.9`) would still send a DNS query to the
    machine's resolver, or a SYN to that address, when the code under test reaches for it. In
    this process every lookup of anything but loopback fails as an unknown name does (the code
    then reports "cannot resolve", exit 4), and nothing leaves the machine."""
    import socket

    real = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):
        if not _is_loopback(host):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", loopback_only)
        patch.setattr(socket, "gethostbyname", lambda host: loopback_only(host, None)[0][4][0])
        yield


@pytest.fixture(autouse=True)
def no_inherited_terminal_size(monkeypatch):
    """Output is tested as a pipe or CI log sees it: with no COLUMNS/LINES inherited from the
    shell or the test runner (pytest-xdist's workers set COLUMNS=80). A test that wants a
    width sets one itself."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


@pytest.fixture
def isolated_cwd(tmp_path, monkeypatch):
    """Run with an empty cwd and no $DDTREE_OPS_INVENTORY, so the embedded inventory applies."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of many tiny tensor ops (thread hand-offs cost more
    than the ops on a shared 2-core machine); the previous count is restored afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def other_account():
    """A second, unprivileged account made for this test session (and removed after it), for
    the shared-host cases: what another user of a GPU host could plant or own. Needs root."""
    import os
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("creating a second account needs root (CI and the dev container run tests as root)")
    if shutil.which("useradd") is None:
        pytest.skip("useradd not installed")
    name = f"ddtree-t{os.getpid()}"  # unique: several suites may run on one machine at once
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)
