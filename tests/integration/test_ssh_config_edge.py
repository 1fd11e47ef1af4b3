"""ssh_config and known_hosts edge cases, checked against what OpenSSH 9.2 does: each mistake is
a one-line ConfigError (exit 3) before any host is contacted, and what OpenSSH honours
(several IdentityFile lines, bracketed and ssh:// ProxyJump hops, a jump host's own ProxyJump)
works against real sshd processes on 127.0.0.1."""
from __future__ import annotations

import getpass
import json
import shutil
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.errors import AuthenticationFailed, HostKeyRejected, HostUnreachable
from ddtree_ops.transport.factory import open_transport
from sshd_fleet import free_port

ED25519_BLOB = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def config_error(tmp_path: Path, capsys, config_text: str, *, known_hosts: str = "", hostname: str = "gpu") -> str:
    """Run `hosts check` on one host whose ssh_config is `config_text`; it must stop with exit 3
    (nothing contacted) and one line; returns that line."""
    config = tmp_path / "ssh_config"
    config.write_text(config_text)
    (tmp_path / "known_hosts").write_text(known_hosts)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu-a": {
        "hostname": hostname, "ssh_config": str(config), "known_hosts": str(tmp_path / "known_hosts"),
        "workdir": str(tmp_path / "wd")}}}))
    code = main(["hosts", "check", "-i", str(inventory), "--json"])
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert code == 3, (code, captured.err, captured.out)
    assert "\n" not in line and "unexpected" not in line and "internal error" not in line
    assert json.loads(captured.out)["exit_code"] == 3
    return line.removeprefix("ddtree-ops: error: ")


def without_identity_file(host):
    """The fleet's inventory defaults set identity_file; drop it so ssh_config's IdentityFile counts."""
    return type(host)(**{**host.__dict__, "identity_file": None})


# ----------------------------------------------------------------- 1: crashes -> exit 3

def test_match_exec_is_refused_not_a_crash(tmp_path, capsys):
    line = config_error(tmp_path, capsys, 'Match exec "true"\n  User x\nHost gpu\n  HostName 127.0.0.1\n')
    assert line.startswith(f"{tmp_path / 'ssh_config'}: ssh_config of host gpu-a: `Match exec` is not supported")


def test_a_non_numeric_port_is_a_config_error(tmp_path, capsys):
    line = config_error(tmp_path, capsys, "Host gpu\n  Port abc\n")
    assert line == f"{tmp_path / 'ssh_config'}: ssh_config of host gpu-a: Port (for 'gpu'): port 'abc' is not a number"


@pytest.mark.parametrize("marker_line", [f"@cert-authority *.example.com ssh-ed25519 {ED25519_BLOB}",
                                         f"@revoked * ssh-ed25519 {ED25519_BLOB}"])
def test_known_hosts_marker_lines_are_understood(tmp_path, marker_line):
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.transport.factory import check_connection_config

    (tmp_path / "known_hosts").write_text(f"{marker_line}\n127.0.0.1 ssh-ed25519 {ED25519_BLOB}\n")
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"gpu-a": {
        "hostname": "127.0.0.1", "known_hosts": str(tmp_path / "known_hosts"), "ssh_config": str(tmp_path / "none"),
        "workdir": str(tmp_path / "wd")}}}))
    check_connection_config(list(load_inventory(tmp_path / "hosts.yaml").hosts.values()))


def test_a_malformed_known_hosts_line_names_file_and_line(tmp_path, capsys):
    line = config_error(tmp_path, capsys, "", known_hosts=f"# c\n@bogus * ssh-ed25519 {ED25519_BLOB}\n")
    assert line.startswith(f"{tmp_path / 'known_hosts'}:2: known_hosts of host gpu-a: unknown marker '@bogus'")


def test_revoked_host_key_is_refused_even_when_listed_or_trusting_new(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    kind_blob = fleet.hosts[0].known_hosts_line().split(None, 1)[1].strip()
    listed = fleet.known_hosts.read_text()
    fleet.known_hosts.write_text(f"@cert-authority *.example.com ssh-ed25519 {ED25519_BLOB}\n{listed}")
    with open_transport(fleet.inventory().hosts["h0"]) as transport:  # the CA line is skipped
        assert transport.run(["true"]).exit_status == 0
    fleet.known_hosts.write_text(f"{listed}@revoked * {kind_blob}\n")
    for accept in (False, True):
        with pytest.raises(HostKeyRejected, match=r"h0: host key refused: .* is marked @revoked in .*known_hosts"):
            open_transport(fleet.inventory().hosts["h0"], accept_new_host_keys=accept)
    assert fleet.known_hosts.read_text() == f"{listed}@revoked * {kind_blob}\n"


# ----------------------------------------------------------------- 2: unsupported directives

@pytest.mark.parametrize("directive, expect", [
    ("Include other.conf", "Include other.conf (for 'gpu') is not supported"),
    ("ProxyCommand nc gpu 22", "ProxyCommand nc gpu 22 (for 'gpu') is not supported: use ProxyJump"),
    ("UserKnownHostsFile /dev/null", "UserKnownHostsFile /dev/null (for 'gpu') is not supported: host keys are "
                                     "checked only against the inventory's known_hosts; set `known_hosts:`"),
    ("CanonicalizeHostname yes", "CanonicalizeHostname yes (for 'gpu') is not supported"),
])
def test_unsupported_directives_for_the_host_are_refused(tmp_path, capsys, directive, expect):
    line = config_error(tmp_path, capsys, f"Host other\n  {directive}\nHost gpu\n  {directive}\n")
    assert line.startswith(f"{tmp_path / 'ssh_config'}: ssh_config of host gpu-a: {expect}")


def test_directives_for_other_hosts_and_harmless_values_are_fine(tmp_path):
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.transport.ssh_config import resolve_target

    config = tmp_path / "ssh_config"
    config.write_text("Host other\n  ProxyCommand nc %h %p\n  Include x\n"
                      "Host gpu\n  StrictHostKeyChecking yes\n  CanonicalizeHostname no\n  ProxyCommand none\n"
                      "Host *\n  StrictHostKeyChecking accept-new\n")  # common; ignored, checks stay strict
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"gpu-a": {
        "hostname": "gpu", "ssh_config": str(config), "workdir": str(tmp_path / "wd")}}}))
    assert resolve_target(load_inventory(tmp_path / "hosts.yaml").hosts["gpu-a"]).hostname == "gpu"


def test_an_unknown_match_criterion_is_refused_not_treated_as_matching(tmp_path, capsys):
    line = config_error(tmp_path, capsys, "Match localnetwork 10.0.0.0/8\n  HostName 10.1.1.1\n")
    assert "`Match localnetwork` is not supported" in line and "ssh_config of host gpu-a" in line


def test_a_jump_hosts_own_proxyjump_is_followed(sshd_fleet, tmp_path):
    """gpu -> ProxyJump inner; inner -> ProxyJump outer: OpenSSH goes outer, inner, gpu."""
    fleet = sshd_fleet(3)
    outer, inner, gpu = (h.port for h in fleet.hosts)
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host outer\n  HostName 127.0.0.1\n  Port {outer}\n  IdentityFile {fleet.client_key}\n"
        f"Host inner\n  HostName 127.0.0.1\n  Port {inner}\n  IdentityFile {fleet.client_key}\n  ProxyJump outer\n"
        f"Host gpu\n  HostName 127.0.0.1\n  Port {gpu}\n  ProxyJump inner\n")
    host = fleet.inventory(host_overrides={"h2": {"hostname": "gpu", "ssh_config": str(config), "port": None}}).hosts["h2"]
    with open_transport(host) as transport:
        assert [c.get_transport().getpeername()[1] for c in transport._clients[:1]] == [outer]
        assert len(transport._clients) == 3 and transport.run(["echo", "ok"]).stdout == "ok\n"


def test_a_proxyjump_loop_is_a_config_error(tmp_path, capsys):
    line = config_error(tmp_path, capsys, "Host gpu\n  ProxyJump a\nHost a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    assert "ssh_config of host gpu-a: ProxyJump loop through 'a'" in line


# ----------------------------------------------------------------- 3: port range

@pytest.mark.parametrize("text, bad", [("Host gpu\n  Port 70000\n", "Port (for 'gpu'): port '70000'"),
                                       ("Host gpu\n  Port 0\n", "Port (for 'gpu'): port '0'"),
                                       ("Host gpu\n  ProxyJump j:65536\n", "ProxyJump 'j:65536': port '65536'")])
def test_ports_out_of_range_are_config_errors(tmp_path, capsys, text, bad):
    line = config_error(tmp_path, capsys, text)
    assert line == f"{tmp_path / 'ssh_config'}: ssh_config of host gpu-a: {bad} is out of range 1-65535"


# ----------------------------------------------------------------- 4: ProxyJump forms

@pytest.mark.parametrize("jump", ["[127.0.0.1]:{port}", "ssh://{user}@127.0.0.1:{port}", "ssh://[127.0.0.1]:{port}/"])
def test_bracketed_and_uri_proxyjump_hops(sshd_fleet, tmp_path, jump):
    fleet = sshd_fleet(2)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host 127.0.0.1\n  IdentityFile {fleet.client_key}\n"
                      f"Host gpu\n  HostName 127.0.0.1\n  ProxyJump {jump.format(port=fleet.hosts[0].port, user=getpass.getuser())}\n")
    host = fleet.inventory(host_overrides={"h1": {"hostname": "gpu", "ssh_config": str(config)}}).hosts["h1"]
    with open_transport(host) as transport:
        first = transport._clients[0].get_transport()
        assert first.getpeername()[1] == fleet.hosts[0].port and first.get_username() == getpass.getuser()
        assert transport.run(["echo", "hop"]).stdout == "hop\n"


@pytest.mark.parametrize("jump, reason", [("root@", "hop 'root@' names no host"), ("j0,", "empty hop"),
                                          ("@j0", "empty user in hop '@j0'"), ("[::1", "malformed bracketed address")])
def test_empty_or_malformed_hops_are_refused(tmp_path, capsys, jump, reason):
    line = config_error(tmp_path, capsys, f"Host gpu\n  ProxyJump {jump}\n")
    assert "ssh_config of host gpu-a: ProxyJump" in line and reason in line


# ----------------------------------------------------------------- 5, 6: identity files

def test_missing_identity_files_are_skipped_while_one_exists(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu\n  HostName 127.0.0.1\n  IdentityFile {tmp_path}/absent\n"
                      f"  IdentityFile {fleet.client_key}.pub\n  IdentityFile {fleet.client_key}\n")
    host = without_identity_file(fleet.inventory(host_overrides={"h0": {"hostname": "gpu", "ssh_config": str(config)}}).hosts["h0"])
    with open_transport(host) as transport:
        assert transport.run(["true"]).exit_status == 0
    config.write_text(f"Host gpu\n  HostName 127.0.0.1\n  IdentityFile {tmp_path}/absent\n"
                      f"  IdentityFile {fleet.client_key}.pub\n")
    with pytest.raises(AuthenticationFailed, match=rf"no usable key: identity_file {tmp_path}/absent does not exist; "
                                                   rf"identity_file {fleet.client_key}.pub is not a private key"):
        open_transport(host)


def test_percent_r_in_identity_file_is_the_inventory_user(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    keys = tmp_path / f"keys-{fleet.login_user}"
    keys.mkdir()
    shutil.copy(fleet.client_key, keys / "id")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu\n  HostName 127.0.0.1\n  User someone-else\n  IdentityFile {tmp_path}/keys-%r/id\n")
    host = without_identity_file(fleet.inventory(host_overrides={"h0": {"hostname": "gpu", "ssh_config": str(config)}}).hosts["h0"])
    with open_transport(host) as transport:
        assert transport.target.identity_files == (str(keys / "id"),)
        assert transport.run(["true"]).exit_status == 0


# ----------------------------------------------------------------- 7, 8: classification

@pytest.mark.parametrize("name", ["a..b", "x" * 64 + ".example"])
def test_a_badly_formed_hostname_is_unreachable(tmp_path, name):
    from ddtree_ops.inventory import load_inventory

    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"gpu-a": {
        "hostname": name, "port": free_port(), "ssh_config": str(tmp_path / "none"), "workdir": str(tmp_path / "wd")}}}))
    with pytest.raises(HostUnreachable, match=rf"gpu-a: .*cannot resolve '{name}': "):
        open_transport(load_inventory(tmp_path / "hosts.yaml").hosts["gpu-a"])


def test_no_key_and_no_agent_is_an_authentication_failure(sshd_fleet, tmp_path, monkeypatch):
    fleet = sshd_fleet(1)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/id_* to fall back on
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    host = without_identity_file(fleet.inventory().hosts["h0"])
    with pytest.raises(AuthenticationFailed, match="h0: authentication failed: .*no key and no agent"):
        open_transport(host)


def test_a_public_key_as_identity_file_is_an_authentication_failure(sshd_fleet):
    fleet = sshd_fleet(1)
    host = fleet.inventory(host_overrides={"h0": {"identity_file": f"{fleet.client_key}.pub"}}).hosts["h0"]
    with pytest.raises(AuthenticationFailed, match=r"\.pub is not a private key \(a public key"):
        open_transport(host)


# ----------------------------------------------------------------- 9: TOFU append

def test_trust_on_first_use_never_glues_lines(sshd_fleet):
    fleet = sshd_fleet(2)
    fleet.known_hosts.write_text(fleet.hosts[1].known_hosts_line().rstrip("\n"))  # no final newline
    with open_transport(fleet.inventory().hosts["h0"], accept_new_host_keys=True):
        pass
    lines = fleet.known_hosts.read_text().splitlines()
    assert lines == [fleet.hosts[1].known_hosts_line().strip(), lines[1]] and lines[1].startswith(
        f"[127.0.0.1]:{fleet.hosts[0].port} ssh-ed25519 ")
    with open_transport(fleet.inventory().hosts["h1"]) as transport:  # its line still reads
        assert transport.run(["true"]).exit_status == 0


def test_userknownhostsfile_naming_the_inventorys_known_hosts_is_accepted(sshd_fleet, tmp_path, capsys):
    """The same file (also through a link) is nothing to refuse: keys are still checked against
    it; another file, or several, stay refused (exit 3)."""
    from ddtree_ops.cli.app import main

    fleet = sshd_fleet(1)
    link = tmp_path / "kh-link"
    link.symlink_to(fleet.known_hosts)
    for named in (fleet.known_hosts, link):
        config = tmp_path / "ssh_config"
        config.write_text(f"Host *\n  UserKnownHostsFile {named}\n")
        inventory = fleet.write_inventory(host_overrides={"h0": {"ssh_config": str(config)}})
        assert main(["hosts", "check", "-i", str(inventory)]) == 0, capsys.readouterr().err
        capsys.readouterr()
    for other in (f"{tmp_path / 'other_known_hosts'}", f"{fleet.known_hosts} {tmp_path / 'second'}"):
        config.write_text(f"Host *\n  UserKnownHostsFile {other}\n")
        inventory = fleet.write_inventory(host_overrides={"h0": {"ssh_config": str(config)}})
        assert main(["hosts", "check", "-i", str(inventory)]) == 3
        assert f"UserKnownHostsFile {other} (for '127.0.0.1') is not supported" in capsys.readouterr().err
