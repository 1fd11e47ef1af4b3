"""Inventories that stay quick and whose limits are clear errors: a 100k-host range, group
chains up to the depth limit and past it (exit 3 naming the chain, never a RecursionError),
diamonds of children (each group walked once), cycles. How fast: benchmarks/inventory_scale.py
(no timed asserts here; the unmemoised code took 64 s on the diamond below and 88 s on the
range, so a regression shows as a suite that crawls)."""
from __future__ import annotations

import json

import pytest

from ddtree_ops.ansible_inventory import MAX_GROUP_DEPTH
from ddtree_ops.cli.app import main
from ddtree_ops.cli.hosts import RICH_TABLE_MAX_ROWS
from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import load_inventory


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def chain_ini(depth: int) -> str:
    """g1 > g2 > ... > g<depth>, the one host in the deepest; each level sets `ddtree_workdir`."""
    lines = [f"[g{depth}]", "h ansible_host=10.0.0.1"]
    for level in range(1, depth):
        lines += [f"[g{level}:children]", f"g{level + 1}"]
    for level in range(1, depth + 1):
        lines += [f"[g{level}:vars]", f"ddtree_workdir=/w{level}"]
    return "\n".join(lines) + "\n"


def diamond_ini(levels: int) -> str:
    """Two groups a level, each with both groups of the next level as children (2^levels paths)."""
    lines = []
    for level in range(levels - 1):
        for side in "ab":
            lines += [f"[{side}{level}:children]", f"a{level + 1}", f"b{level + 1}"]
    lines += [f"[a{levels - 1}]", "h1", f"[b{levels - 1}]", "h2"]
    return "\n".join(lines) + "\n"


def test_a_100k_host_range_on_one_line_lists_every_host(tmp_path, capsys):
    path = write(tmp_path, "big.ini", "[g]\nh[0:99999]\n")
    assert main(["hosts", "list", "-i", str(path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2 + 100_000 > RICH_TABLE_MAX_ROWS  # the title, the header, a line a host
    assert lines[1].split() == ["host", "transport", "target", "python", "workdir", "groups", "timeouts"]
    assert lines[2].split() == ["h0", "ssh", "h0", "python3", "~/.ddtree-ops", "g", "10s/600s"]
    assert lines[-1].split()[0] == "h99999" and len({line.split()[0] for line in lines[2:]}) == 100_000
    assert "100000 host(s)" in err


def test_a_group_chain_to_the_depth_limit_loads_with_the_deepest_vars(tmp_path):
    inventory = load_inventory(write(tmp_path, "chain.ini", chain_ini(MAX_GROUP_DEPTH)))
    host = inventory.hosts["h"]
    assert host.workdir == f"/w{MAX_GROUP_DEPTH}"  # the deepest group's value wins
    assert len(host.groups) == MAX_GROUP_DEPTH


def test_a_chain_of_500_groups_is_exit_3_naming_the_chain(tmp_path, capsys):
    path = write(tmp_path, "chain.ini", chain_ini(500))
    assert main(["hosts", "list", "-i", str(path)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unexpected" not in err, err
    assert f"group g{MAX_GROUP_DEPTH + 1}: children nested {MAX_GROUP_DEPTH + 1} deep, more than " \
           f"{MAX_GROUP_DEPTH} (g1 -> g2 -> g3 -> ... -> g{MAX_GROUP_DEPTH - 1} -> g{MAX_GROUP_DEPTH} -> " \
           f"g{MAX_GROUP_DEPTH + 1})" in err, err


def test_yaml_children_nested_past_the_limit_are_exit_3(tmp_path, capsys):
    """A YAML chain of groups, each declared once under `all.children` (flat, as Ansible's own
    inventories write long chains): the group walk's limit names the chain."""
    lines = ["all:", "  children:"]
    for level in range(1, MAX_GROUP_DEPTH + 5):
        lines += [f"    g{level}:", "      children:", f"        g{level + 1}:"]
    path = write(tmp_path, "chain.yml", "\n".join(lines) + "\n")
    assert main(["hosts", "list", "-i", str(path)]) == 3
    err = capsys.readouterr().err
    assert f"children nested {MAX_GROUP_DEPTH + 1} deep, more than {MAX_GROUP_DEPTH}" in err, err
    assert "unexpected" not in err and len(err.strip().splitlines()) == 1, err


def test_a_yaml_file_nested_past_the_readers_limit_is_exit_3_naming_it(tmp_path, capsys):
    """The same chain written nested (each group inside its parent) is refused by the bounded
    YAML reader before any group is walked: one line naming the file."""
    body = "null"
    for level in range(MAX_GROUP_DEPTH + 5, 0, -1):
        body = f'{{"children": {{"g{level}": {body}}}}}'
    path = write(tmp_path, "deep.yml", f'{{"all": {body}}}\n')
    assert main(["hosts", "list", "-i", str(path)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ddtree-ops: error: {path}: line 1: values nested deeper than") and "\n" not in err, err


def test_a_diamond_of_23_levels_gives_each_host_every_group_above_it(tmp_path):
    inventory = load_inventory(write(tmp_path, "diamond.ini", diamond_ini(23)))
    above = {f"{side}{level}" for level in range(22) for side in "ab"}
    assert set(inventory.hosts["h1"].groups) == above | {"a22"}
    assert set(inventory.hosts["h2"].groups) == above | {"b22"}


def test_a_cycle_of_children_is_exit_3_naming_it(tmp_path):
    # `a0` hangs below the cycle: it is never placed either, and has no child to walk down to
    path = write(tmp_path, "cycle.ini", "[b:children]\nc\na0\n[c:children]\nd\n[d:children]\nb\n[d]\nh\n"
                                        "[top:children]\nb\n")
    with pytest.raises(ConfigError, match=r"cycle.ini: group (b|c|d): its children include itself "
                                          r"\((b -> c -> d -> b|c -> d -> b -> c|d -> b -> c -> d)\)"):
        load_inventory(path)


def test_hosts_list_json_of_a_big_range_is_complete(tmp_path, capsys):
    path = write(tmp_path, "big.ini", "[g]\nh[0:4999]\n")
    assert main(["hosts", "list", "-i", str(path), "--json", "-H", "g,!h[0:9]"]) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert len(hosts) == 4990 and "h9" not in hosts and hosts["h10"]["groups"] == ["g"]
