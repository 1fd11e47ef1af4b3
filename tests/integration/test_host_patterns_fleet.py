"""-H patterns against a real sshd fleet: a real push reaches exactly the hosts the pattern
selects, and a host it excludes is never touched (its workdir is never made). A term that
names nothing, in any position, is exit 2 before any host is contacted."""
from __future__ import annotations

import json
import shutil

import pytest

from ddtree_ops.cli.app import main
from fixtures.checkout import make_checkout
from sshd_fleet import SshdFleet, sshd_available

pytestmark = pytest.mark.sshd

# h0, h1 in group `a`; h2, h3 in group `b`; all four in `fleet`
GROUPS = {"h0": ["fleet", "a"], "h1": ["fleet", "a"], "h2": ["fleet", "b"], "h3": ["fleet", "b"]}


@pytest.fixture(scope="module")
def fleet_and_release(tmp_path_factory):
    if not sshd_available():
        pytest.skip("OpenSSH sshd/ssh-keygen not installed (scripts/bootstrap.sh installs them)")
    fleet = SshdFleet(tmp_path_factory.mktemp("fleet")).start(4)
    try:
        inventory = fleet.write_inventory(host_overrides={h: {"groups": g} for h, g in GROUPS.items()})
        yield fleet, inventory, make_checkout(tmp_path_factory.mktemp("src") / "a", version="a")
    finally:
        fleet.stop()


def push(capsys, fleet, inventory, source, pattern):
    for host in fleet.hosts:  # every form starts from hosts that have nothing of ours
        shutil.rmtree(host.workdir, ignore_errors=True)
    code = main(["push", "-i", str(inventory), "--source", str(source), "--json", "-H", pattern])
    out, err = capsys.readouterr()
    touched = {h.name for h in fleet.hosts if h.workdir.exists()}
    return code, out, err, touched


@pytest.mark.parametrize("pattern, selected", [
    ("all,!h1", {"h0", "h2", "h3"}),
    ("!h1,all", {"h0", "h2", "h3"}),  # the exclusion first: still applied after the union
    ("all:!h1", {"h0", "h2", "h3"}),  # ':' separates when there is no comma
    ("!h1", {"h0", "h2", "h3"}),  # only exclusions: from all hosts, as in Ansible
    ("fleet,&b", {"h2", "h3"}),
    ("&b,fleet", {"h2", "h3"}),  # the intersection first
    ("a:b:&fleet:!h[0:2]", {"h3"}),  # range after '!', union, intersection, exclusion
    ("h*,!a", {"h2", "h3"}),  # a wildcard, a group excluded
])
def test_a_pattern_reaches_exactly_its_hosts_and_leaves_the_excluded_untouched(
        fleet_and_release, capsys, pattern, selected):
    fleet, inventory, source = fleet_and_release
    code, out, err, touched = push(capsys, fleet, inventory, source, pattern)
    assert code == 0, err
    assert set(json.loads(out)["hosts"]) == selected
    assert touched == selected  # the excluded hosts: not even a workdir made


@pytest.mark.parametrize("pattern, named", [
    ("all,nosuchhost", "nosuchhost"),
    ("all,!h9", "h9"),  # a typo in an exclusion would otherwise hit the host meant to be left
    ("!h1x,all", "h1x"),
    ("fleet,&nosuchgroup", "nosuchgroup"),
    ("all:!h[1:9]", "h4"),
    ("a,!tpu-*", "tpu-*"),
])
def test_a_term_that_names_nothing_is_exit_2_naming_it_and_touches_no_host(
        fleet_and_release, capsys, pattern, named):
    fleet, inventory, source = fleet_and_release
    code, out, err, touched = push(capsys, fleet, inventory, source, pattern)
    assert code == 2, (out, err)
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert touched == set()


def test_a_pattern_that_leaves_no_host_is_exit_2(fleet_and_release, capsys):
    fleet, inventory, source = fleet_and_release
    code, out, err, touched = push(capsys, fleet, inventory, source, "a,&b")
    assert code == 2 and "selects no host" in err and touched == set()
