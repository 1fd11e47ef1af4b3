"""Ansible inventories (INI and YAML) as `-i`: groups, children, variable precedence, ranges,
variables reported or refused; `-H` ranges and wildcards; `hosts list --format ansible` read
back gives the same hosts."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.app import main
from ddtree_ops.errors import ConfigError, ExitCode, UsageError
from ddtree_ops.host_patterns import RangeError, expand
from ddtree_ops.inventory import load_inventory

INI = """\
# the fleet
[h200]
gpu-[01:03] ansible_user=ops
gpu-09:2201 ansible_host=10.0.0.9 ansible_become=true ansible_python_interpreter=/usr/bin/python3.11

[a100]
old-1 ansible_host=10.1.0.1  # the old box

[gpus:children]
h200
a100

[gpus:vars]
ansible_python_interpreter=/opt/gpus/bin/python3
ansible_user=gpuops

[h200:vars]
ansible_python_interpreter="/opt/venv/bin/python3"
cuda=12.4

[all:vars]
ansible_ssh_private_key_file=keys/fleet
ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/etc/fleet/known_hosts'
ddtree_workdir=/scratch/ddtree
ddtree_command_timeout=900
"""

YAML = """\
all:
  vars:
    ansible_ssh_private_key_file: keys/fleet
    ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/etc/fleet/known_hosts
    ddtree_workdir: /scratch/ddtree
    ddtree_command_timeout: 900
  children:
    gpus:
      vars:
        ansible_python_interpreter: /opt/gpus/bin/python3
        ansible_user: gpuops
      children:
        h200:
          vars:
            ansible_python_interpreter: /opt/venv/bin/python3
            cuda: "12.4"
          hosts:
            gpu-[01:03]:
              ansible_user: ops
            gpu-09:
              ansible_host: 10.0.0.9
              ansible_port: 2201
              ansible_become: true
              ansible_python_interpreter: /usr/bin/python3.11
        a100:
          hosts:
            old-1:
              ansible_host: 10.1.0.1
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name,text", [("inventory.ini", INI), ("inventory.yml", YAML)])
def test_groups_children_ranges_and_variable_precedence(tmp_path, name, text):
    inventory = load_inventory(write(tmp_path, name, text))
    hosts = inventory.hosts
    assert list(hosts) == ["gpu-01", "gpu-02", "gpu-03", "gpu-09", "old-1"]
    gpu1, gpu9, old = hosts["gpu-01"], hosts["gpu-09"], hosts["old-1"]
    assert (gpu1.hostname, gpu1.user, gpu1.port) == ("gpu-01", "ops", None)  # host var over group var
    assert gpu1.python == "/opt/venv/bin/python3"  # the child group h200 over its parent gpus
    assert gpu9.python == "/usr/bin/python3.11" and gpu9.user == "gpuops"  # host var; gpus' user
    assert (gpu9.hostname, gpu9.port) == ("10.0.0.9", 2201)
    assert (old.hostname, old.user, old.python) == ("10.1.0.1", "gpuops", "/opt/gpus/bin/python3")
    for host in hosts.values():
        assert host.identity_file == str(tmp_path / "keys" / "fleet")  # relative to the inventory file
        assert host.known_hosts == "/etc/fleet/known_hosts" and host.workdir == "/scratch/ddtree"
        assert host.command_timeout == 900
    assert sorted(gpu1.groups) == ["gpus", "h200"] and sorted(old.groups) == ["a100", "gpus"]
    assert [h.name for h in inventory.select(["h200"])] == ["gpu-01", "gpu-02", "gpu-03", "gpu-09"]
    notes = "\n".join(inventory.notes)
    assert len(inventory.notes) == 3, notes  # once per variable name
    assert f"{tmp_path / name}: ansible_become: not used by ddtree-ops (hosts: gpu-09)" in notes
    assert "cuda: not used by ddtree-ops (hosts: gpu-01, gpu-02, gpu-03 and 1 more)" in notes
    assert "-o StrictHostKeyChecking: the host-key policy stays strict" in notes


def test_ini_and_yaml_give_the_same_hosts(tmp_path):
    ini = load_inventory(write(tmp_path, "a.ini", INI)).hosts
    yml = load_inventory(write(tmp_path, "a.yml", YAML)).hosts
    strip = lambda h: {**dataclasses.asdict(h), "source": None, "groups": sorted(h.groups)}  # noqa: E731
    assert {n: strip(h) for n, h in ini.items()} == {n: strip(h) for n, h in yml.items()}


@pytest.mark.parametrize("variable,value,why", [
    ("ansible_ssh_common_args", "-o ProxyCommand='ssh -W %h:%p bastion'", "-o ProxyCommand is not supported"),
    ("ansible_ssh_extra_args", "-J bastion", "ssh option '-J' is not supported"),
    ("ansible_ssh_common_args", "-o ProxyJump=bastion", "-o ProxyJump is not supported"),
    ("ansible_password", "hunter2", "password logins are not supported"),
    ("ansible_connection", "docker", "ddtree-ops connects over SSH"),
])
def test_a_variable_that_changes_how_we_connect_and_we_cannot_honour_is_refused(tmp_path, variable, value, why):
    path = write(tmp_path, "fleet.yml", yaml.safe_dump(
        {"all": {"children": {"h200": {"hosts": {"gpu-01": None, "gpu-02": None}, "vars": {variable: value}}}}}))
    with pytest.raises(ConfigError) as err:
        load_inventory(path)
    message = str(err.value)
    assert message.startswith(f"{path}: host gpu-01: {variable}={value!r} (group h200): "), message
    assert why in message and "\n" not in message and err.value.exit_code is ExitCode.CONFIG


def test_refused_through_the_cli_is_one_line_exit_3(tmp_path, capsys):
    path = write(tmp_path, "fleet.ini", "[gpu]\ngpu-01 ansible_ssh_common_args='-o ProxyCommand=nc %h %p'\n")
    assert main(["push", "-i", str(path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fleet.ini: host gpu-01: ansible_ssh_common_args=" in err and "ProxyCommand" in err


def test_notes_go_to_stderr_once_and_json_stays_one_document(tmp_path, capsys):
    path = write(tmp_path, "fleet.ini", "gpu-01 ansible_host=10.0.0.1 ansible_become=true\n"
                                        "gpu-02 ansible_host=10.0.0.2 ansible_become=true\n")
    assert main(["hosts", "list", "-i", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert list(json.loads(captured.out)["hosts"]) == ["gpu-01", "gpu-02"]
    assert captured.err.count("ansible_become") == 1 and "(hosts: gpu-01, gpu-02)" in captured.err


def test_our_own_inventory_is_still_ours_and_a_typo_is_not_taken_for_ansible(tmp_path):
    ours = write(tmp_path, "hosts.yaml", "defaults: {user: ops}\nhosts:\n  gpu-a: {port: 2222}\n")
    assert load_inventory(ours).hosts["gpu-a"].port == 2222 and load_inventory(ours).notes == []
    typo = write(tmp_path, "typo.yaml", "hostz:\n  gpu-a: {port: 2222}\n")
    with pytest.raises(ConfigError, match="hosts: required key is missing"):
        load_inventory(typo)


def test_host_patterns_in_the_selection(tmp_path):
    inventory = load_inventory(write(tmp_path, "a.ini", INI))
    names = lambda sel: [h.name for h in inventory.select(sel)]  # noqa: E731
    assert names(["gpu-[02:03]"]) == ["gpu-02", "gpu-03"]
    assert names(["gpu-0*,a100"]) == ["gpu-01", "gpu-02", "gpu-03", "gpu-09", "old-1"]
    assert names(["h[200:200]"]) == ["gpu-01", "gpu-02", "gpu-03", "gpu-09"]  # a range may name groups
    with pytest.raises(UsageError, match=r"-H 'gpu-\[01:05\]': no host or group named gpu-04, gpu-05"):
        inventory.select(["gpu-[01:05]"])
    with pytest.raises(UsageError, match="matches no host or group"):
        inventory.select(["tpu-*"])
    with pytest.raises(UsageError, match="the end 01 is before the start 03"):
        inventory.select(["gpu-[03:01]"])


def test_ranges_as_ansible_writes_them():
    assert expand("gpu-[01:03]") == ["gpu-01", "gpu-02", "gpu-03"]
    assert expand("gpu-[8:10]") == ["gpu-8", "gpu-9", "gpu-10"]
    assert expand("n[a:c]-[0:4:2]") == ["na-0", "na-2", "na-4", "nb-0", "nb-2", "nb-4", "nc-0", "nc-2", "nc-4"]
    assert expand("plain") == ["plain"]
    for bad in ("x[1:b]", "x[0:9:0]", "x[0:99999999]"):
        with pytest.raises(RangeError):
            expand(bad)


def test_hosts_list_format_ansible_reads_back_as_the_same_hosts(tmp_path, capsys):
    ours = write(tmp_path, "hosts.yaml", textwrap.dedent("""\
        defaults: {user: ops, identity_file: keys/id, known_hosts: kh, python: /opt/venv/bin/python3,
                   workdir: /scratch/d, connect_timeout: 7, command_timeout: 900}
        hosts:
          gpu-a: {hostname: 10.0.0.1, port: 2222, groups: [h200, canary]}
          gpu-b: {hostname: 10.0.0.2, groups: [h200], sglang_port: 8000,
                  models: {target: Qwen/Qwen3-8B, drafter: z-lab/Qwen3-8B-DFlash-b16, block_size: 16}}
          here: {transport: local}
        """))
    assert main(["hosts", "list", "-i", str(ours), "--format", "ansible"]) == 0
    exported = write(tmp_path, "exported.yml", capsys.readouterr().out)
    document = yaml.safe_load(exported.read_text())
    gpu_a = document["all"]["hosts"]["gpu-a"]
    assert gpu_a["ansible_host"] == "10.0.0.1" and gpu_a["ansible_port"] == 2222 and gpu_a["ansible_user"] == "ops"
    assert "StrictHostKeyChecking=yes" in gpu_a["ansible_ssh_common_args"]
    assert document["all"]["hosts"]["here"]["ansible_connection"] == "local"
    assert document["all"]["hosts"]["gpu-b"]["ddtree_sglang_port"] == 8000 and "ddtree_sglang_port" not in gpu_a
    before, after = load_inventory(ours), load_inventory(exported)
    assert (before.hosts["gpu-a"].sglang_port, before.hosts["gpu-b"].sglang_port) == (30000, 8000)
    assert after.notes == []
    strip = lambda h: {**dataclasses.asdict(h), "source": None, "groups": sorted(h.groups)}  # noqa: E731
    assert {n: strip(h) for n, h in after.hosts.items()} == {n: strip(h) for n, h in before.hosts.items()}
