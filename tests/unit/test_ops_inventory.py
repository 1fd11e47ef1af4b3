"""hosts.yaml parsing: defaults, precedence, selection, and every error message."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddtree_ops.errors import ConfigError, ExitCode, UsageError
from ddtree_ops.inventory import EMBEDDED_INVENTORY_NAME, TransportKind, load_inventory


def write(tmp_path: Path, text: str, name: str = "hosts.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_embedded_inventory_when_no_file(isolated_cwd):
    inventory = load_inventory()
    assert inventory.source == EMBEDDED_INVENTORY_NAME
    assert list(inventory.hosts) == ["local"]
    local = inventory.hosts["local"]
    assert local.transport is TransportKind.LOCAL
    assert local.python == sys.executable
    assert local.workdir == "~/.ddtree-ops"


def test_resolution_order_flag_then_env_then_cwd(isolated_cwd, monkeypatch):
    write(isolated_cwd, "hosts: {from-cwd: {transport: local}}\n")
    flag = write(isolated_cwd, "hosts: {from-flag: {transport: local}}\n", "flag.yaml")
    env = write(isolated_cwd, "hosts: {from-env: {transport: local}}\n", "env.yaml")
    assert list(load_inventory().hosts) == ["from-cwd"]
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(env))
    assert list(load_inventory().hosts) == ["from-env"]
    assert list(load_inventory(flag).hosts) == ["from-flag"]


def test_named_file_must_exist(isolated_cwd, monkeypatch):
    with pytest.raises(ConfigError, match=r"nope.yaml: inventory file not found \(from -i/--inventory\)"):
        load_inventory("nope.yaml")
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", "gone.yaml")
    with pytest.raises(ConfigError, match=r"gone.yaml: inventory file not found \(from \$DDTREE_OPS_INVENTORY\)"):
        load_inventory()


def test_defaults_and_precedence(tmp_path):
    path = write(
        tmp_path,
        """
defaults:
  user: root
  port: 2200
  identity_file: keys/id
  known_hosts: ~/kh
  python: /opt/env/bin/python3
  connect_timeout: 3
hosts:
  a: {hostname: a.example.internal, groups: [h200, big]}
  b: {port: 22, user: eval, python: /usr/bin/python3, workdir: /srv/dd}
  here: {transport: local}
""",
    )
    inv = load_inventory(path)
    a, b, here = inv.hosts["a"], inv.hosts["b"], inv.hosts["here"]
    assert (a.hostname, a.user, a.port, a.python, a.connect_timeout) == (
        "a.example.internal", "root", 2200, "/opt/env/bin/python3", 3.0)
    assert a.identity_file == str(tmp_path / "keys" / "id")  # relative to the inventory's directory
    assert a.known_hosts == str(Path("~/kh").expanduser())
    assert a.workdir == "~/.ddtree-ops"  # host path: `~` stays for the host to resolve
    assert (b.hostname, b.user, b.port, b.python, b.workdir) == ("b", "eval", 22, "/usr/bin/python3", "/srv/dd")
    assert here.python == sys.executable  # defaults.python is for the remote fleet
    assert a.target() == "root@a.example.internal:2200"


def test_models_section(tmp_path):
    path = write(tmp_path, "hosts:\n  g: {models: {target: t/x, drafter: d/y}}\n")
    models = load_inventory(path).hosts["g"].models
    assert (models.target, models.drafter, models.block_size, models.prompts) == ("t/x", "d/y", 16, None)


def test_selection_by_name_and_group(tmp_path):
    path = write(tmp_path, "hosts:\n  a: {groups: [h200]}\n  b: {groups: [h200]}\n  c: {}\n  local: {transport: local}\n")
    inv = load_inventory(path)
    names = lambda sel: [h.name for h in inv.select(sel)]  # noqa: E731
    assert names(None) == ["a", "b", "c", "local"]
    assert names("all") == ["a", "b", "c", "local"]
    assert names("h200") == ["a", "b"]
    assert names("local,a") == ["a", "local"]  # inventory order, no duplicates
    assert names(["c", "h200,a"]) == ["a", "b", "c"]
    with pytest.raises(UsageError, match=r"no host or group named 'h100' \(known: a, b, c, h200, local\)"):
        inv.select("h100")
    assert names(["c", "h200"]) == names("c,h200") == ["a", "b", "c"]  # repeated -H values add up
    assert names([]) == names(None) == ["a", "b", "c", "local"]  # -H not given: every host
    for empty in ("", ",", " , ", ["", ","]):  # given but empty (an unset variable): never the fleet
        with pytest.raises(UsageError, match=r"-H/--hosts: empty host selection"):
            inv.select(empty)



def test_selection_follows_ansible_pattern_order_and_refuses_unknown_terms_anywhere(tmp_path):
    path = write(tmp_path, "hosts:\n  a: {groups: [g1]}\n  b: {groups: [g1, g2]}\n  c: {groups: [g2]}\n  d: {}\n")
    inv = load_inventory(path)
    names = lambda sel: [h.name for h in inv.select(sel)]  # noqa: E731
    assert names("all,!b") == names("!b,all") == names("!b") == names("all:!b") == ["a", "c", "d"]
    assert names("g1,&g2") == names("&g2,g1") == names("g1:&g2") == ["b"]
    assert names(["g1", "g2", "!a", "&g2"]) == ["b", "c"]  # several -H values are one pattern
    assert names("*,!g1,!d") == ["c"]
    for pattern, term in [("all,nosuch", "nosuch"), ("all,!nosuch", "nosuch"), ("g1,&nosuch", "nosuch"),
                          ("!nosuch,all", "nosuch"), ("a,b:c", "b:c")]:  # with a comma, ':' is no separator
        with pytest.raises(UsageError, match=f"no host or group named '{term}'"):
            inv.select(pattern)
    with pytest.raises(UsageError, match="selects no host"):
        inv.select("g1,&g2,!b")


BAD_INVENTORIES = [
    ("hosts:\n  gpu-a: {port: x}\n", "hosts.yaml: hosts.gpu-a.port: expected an integer, got 'x'"),
    ("hosts:\n  gpu-a: {prot: 22}\n", "hosts.yaml: hosts.gpu-a.prot: unknown key (check the spelling)"),
    ("defaults: {pyhton: /x}\nhosts: {a: {}}\n", "hosts.yaml: defaults.pyhton: unknown key (check the spelling)"),
    ("hosts:\n  a: {transport: telnet}\n", "hosts.yaml: hosts.a.transport: expected one of 'ssh', 'local', got 'telnet'"),
    ("hosts:\n  a: {port: 70000}\n", "hosts.yaml: hosts.a.port: input should be less than or equal to 65535, got 70000"),
    ("hosts:\n  a: {connect_timeout: 0}\n", "hosts.yaml: hosts.a.connect_timeout: input should be greater than 0, got 0"),
    ("hosts:\n  a: {groups: h200}\n", "hosts.yaml: hosts.a.groups: expected a list, got 'h200'"),
    ("hosts:\n  a: {models: {target: t}}\n", "hosts.yaml: hosts.a.models.drafter: required key is missing"),
    ("hosts:\n  a: {models: {target: t, drafter: d, block_size: big}}\n",
     "hosts.yaml: hosts.a.models.block_size: expected an integer, got 'big'"),
    ("hosts:\n  a: nothing\n", "hosts.yaml: hosts.a: expected a mapping, got 'nothing'"),
    ("defaults: {}\n", "hosts.yaml: hosts: required key is missing"),
    ("hosts: {}\n", "hosts.yaml: hosts: at least one host is required"),
    ("", "hosts.yaml: the file is empty (expected a mapping with `hosts:`)"),
    ("- a\n- b\n", "hosts.yaml: expected a mapping with `hosts:`, got list"),
    ("hosts:\n  a: {port: 22\n", "hosts.yaml: line 3: invalid YAML: "),
    ("hosts:\n  a: {groups: [a]}\n", "hosts.yaml: hosts.a: a group has the same name as this host"),
    ("hosts:\n  'a,b': {}\n", "hosts.yaml: hosts.'a,b': invalid host name"),
    ("hosts:\n  '../evil': {}\n", "hosts.yaml: hosts.'../evil': invalid host name"),
    ("hosts:\n  '..': {}\n", "hosts.yaml: hosts.'..': invalid host name"),
    ("hosts:\n  a: {groups: [all]}\n", "hosts.yaml: hosts.a.groups: invalid group name 'all'"),
    # the later of two entries would silently win
    ("hosts:\n  a: {hostname: x}\n  a: {hostname: y}\n", "hosts.yaml: line 3: 'a': duplicate key"),
    ("hosts:\n  a: {port: 22, port: 23}\n", "hosts.yaml: line 2: 'port': duplicate key"),
    # an empty value would silently fall back to the default
    ("hosts:\n  a: {workdir: ''}\n", "hosts.yaml: hosts.a.workdir: expected a non-empty string, got ''"),
    ("defaults: {python: ''}\nhosts: {a: {}}\n", "hosts.yaml: defaults.python: expected a non-empty string, got ''"),
    ("hosts:\n  a: {hostname: ''}\n", "hosts.yaml: hosts.a.hostname: expected a non-empty string, got ''"),
    ("hosts:\n  a: {port: true}\n", "hosts.yaml: hosts.a.port: expected an integer, got True"),
    ("hosts:\n  a: {sglang_port: http}\n", "hosts.yaml: hosts.a.sglang_port: expected an integer, got 'http'"),
    ("defaults: {sglang_port: 0}\nhosts: {a: {}}\n",
     "hosts.yaml: defaults.sglang_port: input should be greater than or equal to 1, got 0"),
    # every phase is bounded
    ("hosts:\n  a: {connect_timeout: .inf}\n", "hosts.yaml: hosts.a.connect_timeout: expected a finite number, got inf"),
    ("hosts:\n  a: {command_timeout: .nan}\n", "hosts.yaml: hosts.a.command_timeout: expected a finite number, got nan"),
]


@pytest.mark.parametrize("text,message", BAD_INVENTORIES)
def test_bad_inventory_messages(isolated_cwd, text, message):
    write(isolated_cwd, text)
    with pytest.raises(ConfigError) as caught:
        load_inventory()
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.exit_code is ExitCode.CONFIG


def _alias_bomb(levels: int) -> str:
    """A host whose `port` is nested lists where each level repeats the one below ten times."""
    ladder = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels + 1):
        ladder.append(f"&a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    return "hosts:\n  h:\n    port: [" + ", ".join(ladder) + "]\n"


def test_an_alias_bomb_is_refused_and_the_error_stays_short(isolated_cwd):
    # 10^6 strings once expanded (kept small so that, unrefused, it costs megabytes, not gigabytes)
    path = write(isolated_cwd, _alias_bomb(5))
    with pytest.raises(ConfigError) as caught:
        load_inventory(str(path))
    message = str(caught.value)
    assert message == f"{path}: YAML aliases expand to 1234550 more values, past the limit of 10000 " \
                      "(write the values out, or alias fewer)"
    assert caught.value.exit_code == ExitCode.CONFIG


def test_a_few_aliases_are_fine_and_a_self_referring_one_is_refused(isolated_cwd):
    fine = write(isolated_cwd, "hosts: {a: &d {transport: local, groups: &g [x, y]}, b: *d, c: {groups: *g}}\n")
    assert sorted(load_inventory(str(fine)).hosts) == ["a", "b", "c"]
    loop = write(isolated_cwd, "hosts:\n  h:\n    groups: &g [a, *g]\n", name="loop.yaml")
    with pytest.raises(ConfigError, match=r"loop.yaml: line 3: an alias refers to the value that contains it"):
        load_inventory(str(loop))


@pytest.mark.slow
def test_a_huge_bad_value_is_quoted_short(isolated_cwd):
    path = write(isolated_cwd, "hosts:\n  h:\n    port: [" + ", ".join(["'" + "p" * 1000 + "'"] * 1000) + "]\n")
    with pytest.raises(ConfigError, match=r"hosts.h.port: expected an integer, got \['ppp") as caught:
        load_inventory(str(path))
    assert len(str(caught.value).replace(str(path), "")) < 500  # the value is a megabyte


def test_the_shipped_inventory_is_local_only_and_the_example_is_valid():
    """A fresh clone's `smoke` / `bench` reach every host of ./hosts.yaml: only `local`. The
    placeholders live in hosts.example.yaml, which must stay a valid inventory."""
    from ddtree_ops.inventory import load_inventory

    repo = Path(__file__).resolve().parents[2]
    assert list(load_inventory(repo / "hosts.yaml").hosts) == ["local"]
    example = load_inventory(repo / "hosts.example.yaml").hosts
    assert "local" in example and all(h.hostname.endswith(".example.internal") for n, h in example.items() if n != "local")
