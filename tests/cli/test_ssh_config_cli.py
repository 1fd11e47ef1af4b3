"""An ssh_config that exists but cannot be read (a folder in its place, bytes that are not
text, a line paramiko cannot parse) is an inventory/config problem: exit 3 with one line that
names the file and the host, before any host is contacted (not exit 4, "unreachable").
chmod 000 would not stop root, so each case is something that truly fails to read."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import load_inventory
from sshd_fleet import free_port


def broken_config(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """(path, a word of the reason the message must carry)."""
    path = tmp_path / f"ssh_config-{kind}"
    if kind == "folder":
        path.mkdir()
        return path, "a folder, not a regular file"
    if kind == "fifo":
        os.mkfifo(path)  # read as a file it would hang the command
        return path, "a FIFO, not a regular file"
    if kind == "bytes":
        path.write_bytes(b"Host gpu-a\n  HostName \xff\xfe\xfd\n")
        return path, "not UTF-8 text (byte 0xff at offset 22)"
    path.write_text("Host gpu-a\n  =broken\n")
    return path, "Unparsable line"


def write_inventory(tmp_path: Path, config: Path, *, per_host: bool) -> Path:
    entry = {"hostname": "127.0.0.1", "port": free_port(), "workdir": str(tmp_path / "wd")}
    data: dict = {"hosts": {"gpu-a": dict(entry), "gpu-b": dict(entry)}}
    if per_host:
        data["hosts"]["gpu-b"]["ssh_config"] = str(config)
    else:
        data["defaults"] = {"ssh_config": str(config)}
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(data))
    return inventory


@pytest.mark.parametrize("kind", ["folder", "fifo", "bytes", "unparsable"])
@pytest.mark.parametrize("per_host", [False, True], ids=["defaults", "per-host"])
def test_an_unreadable_ssh_config_is_a_config_error(tmp_path, capsys, monkeypatch, kind, per_host):
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    config, reason = broken_config(tmp_path, kind)
    inventory = write_inventory(tmp_path, config, per_host=per_host)
    host = "gpu-b" if per_host else "gpu-a"
    for command in (["hosts", "check"], ["push"], ["smoke", "--stages", "env"]):
        assert main([*command, "-i", str(inventory), "--json"]) == 3, command
        captured = capsys.readouterr()
        line = captured.err.strip()
        assert "\n" not in line
        assert line.startswith(f"ddtree-ops: error: {config}: ssh_config of host {host}: cannot read it: ")
        assert reason in line
        # nothing ran: the one document is the error, with no per-host results
        assert json.loads(captured.out) == {"command": command[0] if command[0] != "hosts" else "hosts check",
                                            "exit_code": 3, "error": line.removeprefix("ddtree-ops: error: ")}
    assert not (tmp_path / "runs").exists()  # smoke recorded no run
    assert not (tmp_path / "wd").exists()


def test_a_missing_ssh_config_is_still_fine(tmp_path):
    """Not there at all is allowed (the test fleet names one that does not exist): the
    connection proceeds without it, so only reading failures are config errors."""
    from ddtree_ops.transport.factory import check_connection_config

    inventory = write_inventory(tmp_path, tmp_path / "absent", per_host=False)
    check_connection_config(list(load_inventory(inventory).hosts.values()))


def test_opening_a_transport_reports_the_same_config_error(tmp_path):
    from ddtree_ops.transport.factory import open_transport

    config, _ = broken_config(tmp_path, "folder")
    host = load_inventory(write_inventory(tmp_path, config, per_host=False)).hosts["gpu-a"]
    with pytest.raises(ConfigError, match=f"{config}: ssh_config of host gpu-a: cannot read it"):
        open_transport(host)


def test_a_malformed_proxyjump_port_is_a_config_error_before_any_host_is_contacted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    config = tmp_path / "ssh_config-jump"
    config.write_text("Host 127.0.0.1\n  ProxyJump root@127.0.0.1:abc\n")
    inventory = write_inventory(tmp_path, config, per_host=True)
    for command in (["hosts", "check"], ["push"], ["smoke", "--stages", "env"]):
        assert main([*command, "-i", str(inventory), "--json"]) == 3, command
        captured = capsys.readouterr()
        message = f"{config}: ssh_config of host gpu-b: ProxyJump 'root@127.0.0.1:abc': port 'abc' is not a number"
        assert captured.err.strip() == f"ddtree-ops: error: {message}"
        assert json.loads(captured.out)["error"] == message and "hosts" not in json.loads(captured.out)
    assert not (tmp_path / "runs").exists()
