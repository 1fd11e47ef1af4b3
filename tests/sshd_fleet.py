"""A real SSH fleet on 127.0.0.1 for tests: several `sshd -D` processes, each with its own host
key, port, PidFile and AuthorizedKeysFile, plus one client key and a known_hosts file.

Use it through the `sshd_fleet` fixture (tests/conftest.py), which stops every sshd it started:

    def test_something(sshd_fleet, tmp_path):
        fleet = sshd_fleet(3)                      # three hosts: h0, h1, h2 (python = sys.executable)
        inventory = fleet.write_inventory()        # hosts.yaml with those hosts (and their workdirs)
        main(["push", "-i", str(inventory)])       # ... or open_transport(fleet.inventory().hosts["h0"])
        fleet.hosts[1].freeze()                    # SIGSTOP that sshd and its sessions; .thaw() resumes
        fleet.hosts[2].kill()                      # kill it (sessions included); .start() brings it back

All hosts share this machine's filesystem, so each one gets its own `workdir`
(`fleet.hosts[i].workdir`), which tests may inspect directly. Options:
`sshd_fleet(n, python="/path/to/python", connect_timeout=5, command_timeout=30)` (the defaults);
`write_inventory(extra_hosts={...}, host_overrides={"h0": {...}})` adds or changes entries.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)


def descendants(pid: int) -> list[int]:
    """All processes below pid (sshd's per-connection children and the commands they run)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read().decode("utf-8", "replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class SshdHost:
    name: str
    directory: Path
    port: int
    authorized_keys: Path
    workdir: Path
    login_user: str = field(default_factory=getpass.getuser)
    proc: Optional[subprocess.Popen] = None
    host_key: Path = field(init=False)

    def __post_init__(self) -> None:
        self.host_key = self.directory / "ssh_host_ed25519_key"
        keygen(self.host_key)

    @property
    def home(self) -> Path:
        """$HOME of the host's sessions (sshd still starts them in the account's own home)."""
        return self.directory

    @property
    def config(self) -> Path:
        return self.directory / "sshd_config"

    def known_hosts_line(self) -> str:
        kind, blob = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {blob}\n"

    def start(self) -> None:
        user = self.login_user
        self.config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "UsePAM no",
                    "StrictModes no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "PermitRootLogin prohibit-password",
                    f"AllowUsers {user}",
                    "PrintMotd no",
                    "PrintLastLog no",
                    "MaxStartups 64",
                    "MaxSessions 64",
                    "LogLevel ERROR",
                    # Each host gets a home of its own, like a separate machine: `~` on the
                    # host is its directory, and its sessions run no rc files of the account
                    # that runs the tests (a `.bashrc` running `pyenv init` costs seconds per
                    # session on a busy machine, and a session killed mid-rehash leaves a lock
                    # that stalls later logins; the rehash timeout bounds that if a home has one).
                    f"SetEnv HOME={self.home} PYENV_REHASH_TIMEOUT=1",
                    "",
                ]
            )
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        log = open(self.directory / "sshd.log", "ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 60  # a busy machine starts sshd slowly; polled, so no cost when quick
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd for {self.name} exited: {(self.directory / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    if sock.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd for {self.name} did not come up on port {self.port}")

    def _tree(self) -> list[int]:
        if self.proc is None:
            return []
        return [self.proc.pid, *descendants(self.proc.pid)]

    def freeze(self) -> None:
        """SIGSTOP the sshd and everything below it: the host looks alive (TCP accepts) but is silent."""
        _signal(self._tree(), signal.SIGSTOP)

    def thaw(self) -> None:
        _signal(self._tree(), signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the sshd and its sessions (the commands they ran included), like a crash."""
        if self.proc is None:
            return
        tree = self._tree()
        _signal(tree, signal.SIGKILL)
        _signal(tree, signal.SIGCONT)
        self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()


class SshdFleet:
    def __init__(self, base: Path, *, python: str = sys.executable, connect_timeout: float = 5,
                 command_timeout: float = 30, login_user: Optional[str] = None):
        """`login_user`: log in as this existing account instead of the current user (root only;
        e.g. one whose login shell runs no rc files, to measure without a heavy `.bashrc`)."""
        self.base = base
        self.login_user = login_user or getpass.getuser()
        self.python = python
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.client_key = base / "client_ed25519"
        keygen(self.client_key)
        self.authorized_keys = base / "authorized_keys"
        self.authorized_keys.write_text(self.client_key.with_suffix(".pub").read_text())
        self.known_hosts = base / "known_hosts"
        self.known_hosts.write_text("")
        self.hosts: list[SshdHost] = []
        if self.login_user != getpass.getuser():
            # sshd reads authorized_keys as the login user: it must reach the file.
            os.chmod(base, 0o755)
            os.chmod(self.authorized_keys, 0o644)

    def add_host(self, name: Optional[str] = None) -> SshdHost:
        name = name or f"h{len(self.hosts)}"
        directory = self.base / name
        directory.mkdir()
        host = SshdHost(name, directory, free_port(), self.authorized_keys, directory / "work", self.login_user)
        if self.login_user != getpass.getuser():
            shutil.chown(directory, user=self.login_user)  # workdirs are created inside it
        host.start()
        self.hosts.append(host)
        with self.known_hosts.open("a") as handle:
            handle.write(host.known_hosts_line())
        return host

    def start(self, n: int) -> "SshdFleet":
        for _ in range(n):
            self.add_host()
        return self

    def host_entry(self, host: SshdHost) -> dict[str, Any]:
        return {"hostname": "127.0.0.1", "port": host.port, "workdir": str(host.workdir), "groups": ["fleet"]}

    def inventory_dict(self, *, extra_hosts: Optional[dict] = None,
                       host_overrides: Optional[dict] = None) -> dict[str, Any]:
        hosts = {h.name: self.host_entry(h) for h in self.hosts}
        for name, override in (host_overrides or {}).items():
            hosts[name].update(override)
        hosts.update(extra_hosts or {})
        return {
            "defaults": {
                "user": self.login_user,
                "identity_file": str(self.client_key),
                "known_hosts": str(self.known_hosts),
                "ssh_config": str(self.base / "no-ssh-config"),
                "python": self.python,
                "connect_timeout": self.connect_timeout,
                "command_timeout": self.command_timeout,
            },
            "hosts": hosts,
        }

    def write_inventory(self, path: Optional[Path] = None, **kwargs: Any) -> Path:
        path = path or self.base / "hosts.yaml"
        path.write_text(yaml.safe_dump(self.inventory_dict(**kwargs), sort_keys=False))
        return path

    def inventory(self, **kwargs: Any):
        from ddtree_ops.inventory import load_inventory

        return load_inventory(self.write_inventory(**kwargs))

    def stop(self) -> None:
        for host in self.hosts:
            host.stop()
