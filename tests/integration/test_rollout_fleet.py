"""Rollouts in batches on a real sshd fleet: a failing canary stops `push` and `deploy` before
any other host is touched; a gate stage that does not pass on a batch stops the deploy; the
printed rollback command undoes exactly the changed hosts, byte for byte.

Each deploy host has its own real virtual environment with sglang==0.5.23 (pip --no-deps), so
what a host's environment holds can be compared file by file before and after."""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.release import BUNDLE_DIRS, BUNDLE_FILES
from fixtures.checkout import make_checkout

pytestmark = pytest.mark.sshd
MISSING_PYTHON = "/nonexistent/bin/python3"


def cli_json(capsys, *args: str) -> tuple[int, dict]:
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_push_a_failing_canary_stops_the_rollout_and_leaves_the_other_hosts_untouched(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(4)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": MISSING_PYTHON}})
    source = make_checkout(tmp_path / "checkout")
    code, doc = cli_json(capsys, "push", "-i", str(inventory), "--source", str(source),
                         "--serial", "1,100%", "--max-fail-percent", "0")
    assert code == 5, doc
    assert doc["hosts"]["h0"]["state"] == "failed"
    for name in ("h1", "h2", "h3"):
        assert doc["hosts"][name]["state"] == "skipped"
        assert doc["hosts"][name]["error"] == "not started: the rollout stopped after batch 1"
    for host in fleet.hosts:
        assert not host.workdir.exists(), host.name  # nothing was made on any host
    rollout = doc["rollout"]
    assert rollout["batches"] == [{"batch": 1, "hosts": ["h0"], "failed": ["h0"], "ok": []}]
    assert rollout["not_started"] == ["h1", "h2", "h3"] and rollout["changed"] == []
    assert rollout["stopped"].startswith("batch 1 of 2: 1 of 1 host(s) so far failed")


def test_push_without_a_budget_runs_every_batch_and_reports_them(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(3)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": MISSING_PYTHON}})
    source = make_checkout(tmp_path / "checkout")
    code, doc = cli_json(capsys, "push", "-i", str(inventory), "--source", str(source), "--serial", "1,1")
    assert code == 6, doc
    assert [b["hosts"] for b in doc["rollout"]["batches"]] == [["h0"], ["h1"], ["h2"]]
    assert doc["rollout"]["stopped"] is None and doc["rollout"]["changed"] == ["h1", "h2"]
    assert all((h.workdir / "current").is_symlink() for h in fleet.hosts[1:])


def test_bad_serial_or_budget_touches_nothing(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    inventory = fleet.write_inventory()
    for args in (["--serial", "1,ten%"], ["--serial", "150%"], ["--max-fail-percent", "101"]):
        assert main(["push", "-i", str(inventory), *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and args[1] in err, err
    assert not fleet.hosts[0].workdir.exists()


# ---------------------------------------------------------------- deploy, gated


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """Two real environments with sglang and a snapshot of the checkout."""
    from sglang_plugin.dist import make_sglang_venv

    repo = Path(__file__).resolve().parents[2]
    root = tmp_path_factory.mktemp("rollout-envs")
    pythons = [make_sglang_venv(root / f"env{i}") for i in range(2)]
    snapshot = root / "checkout"  # what a release holds, frozen: the checkout may change under the suite
    for rel in BUNDLE_DIRS:
        shutil.copytree(repo / rel, snapshot / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in BUNDLE_FILES:
        shutil.copy(repo / rel, snapshot / rel)
    return pythons, snapshot


def site_listings(pythons):
    from sglang_plugin.dist import site_listing

    return [site_listing(p) for p in pythons]


@pytest.fixture
def clean(envs):
    """Whatever a failing test left deployed is removed by pip's rule, so the next test starts clean."""
    pythons, _ = envs
    yield
    for python in pythons:
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        for dist_info in site.glob("ddtree_sglang_plugin-*.dist-info"):
            shutil.rmtree(dist_info)
        (site / "ddtree_sglang_plugin.pth").unlink(missing_ok=True)


def run_printed(command: str, capsys) -> tuple[int, dict]:
    words = shlex.split(command)
    assert words[:2] == ["ddtree-ops", "rollback"], command
    return cli_json(capsys, *words[1:])


@pytest.mark.slow
def test_deploy_gated_batches_stop_at_the_failing_batch_and_the_printed_rollback_restores_the_changed(
        sshd_fleet, envs, clean, capsys):
    pythons, snapshot = envs
    fleet = sshd_fleet(3, command_timeout=180)
    # h1's Python has no sglang: its deploy is refused (a failed batch, nothing changed there)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(pythons[0])},
                                                      "h1": {"python": sys.executable},
                                                      "h2": {"python": str(pythons[1])}})
    before = site_listings(pythons)
    code, doc = cli_json(capsys, "deploy", "-i", str(inventory), "--source", str(snapshot), "--serial", "1")
    assert code == 6, doc
    assert doc["gate_stages"] == ["plugin"]
    assert doc["hosts"]["h0"]["state"] == "ok" and doc["hosts"]["h0"]["result"]["gate"]["plugin"]["status"] == "pass"
    assert doc["hosts"]["h1"]["state"] == "failed" and doc["hosts"]["h2"]["state"] == "skipped"
    rollout = doc["rollout"]
    assert [b["hosts"] for b in rollout["batches"]] == [["h0"], ["h1"]] and rollout["not_started"] == ["h2"]
    assert rollout["changed"] == ["h0"] and rollout["unchanged"] == ["h1", "h2"]
    after = site_listings(pythons)
    assert after[1] == before[1]  # h2 untouched
    assert not fleet.hosts[2].workdir.exists()
    added = set(after[0]) - set(before[0])
    assert any(p.endswith(".pth") for p in added), added  # h0 really changed
    code, undone = run_printed(rollout["rollback_command"], capsys)
    assert code == 0, undone and list(undone["hosts"]) == ["h0"]
    assert site_listings(pythons) == before  # byte for byte


@pytest.mark.slow
def test_deploy_a_canary_whose_gate_does_not_pass_stops_the_rollout(sshd_fleet, envs, clean, capsys):
    pythons, snapshot = envs
    fleet = sshd_fleet(2, command_timeout=180)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(pythons[0])},
                                                      "h1": {"python": str(pythons[1])}})
    before = site_listings(pythons)
    # sglang-e2e needs a GPU: here it skips, and a gate stage that did not pass is no proof of health
    code, doc = cli_json(capsys, "deploy", "-i", str(inventory), "--source", str(snapshot),
                         "--serial", "1,100%", "--gate-stages", "plugin,sglang-e2e")
    assert code == 5, doc
    h0 = doc["hosts"]["h0"]
    assert h0["state"] == "failed" and "gate: sglang-e2e skip" in h0["error"]
    assert h0["result"]["gate"]["plugin"]["status"] == "pass" and h0["result"]["action"] == "installed"
    assert doc["hosts"]["h1"]["state"] == "skipped"
    assert doc["rollout"]["changed"] == ["h0"] and doc["rollout"]["not_started"] == ["h1"]
    assert site_listings(pythons)[1] == before[1]
    code, _ = run_printed(doc["rollout"]["rollback_command"], capsys)
    assert code == 0
    assert site_listings(pythons) == before


@pytest.mark.slow
def test_the_printed_rollback_of_an_upgrade_rollout_puts_each_hosts_own_previous_state_back(
        sshd_fleet, envs, clean, capsys, tmp_path):
    """h0 had release A, h1 nothing: a rollout of B changes both; the printed rollback puts A
    back on h0 byte for byte and leaves h1 as it was before."""
    pythons, snapshot = envs
    fleet = sshd_fleet(2, command_timeout=180)
    inventory = str(fleet.write_inventory(host_overrides={"h0": {"python": str(pythons[0])},
                                                          "h1": {"python": str(pythons[1])}}))
    other = tmp_path / "checkout-b"
    shutil.copytree(snapshot, other)
    (other / "ddtree_ops" / "hostside" / "release-b.txt").write_text("release b\n")
    before = site_listings(pythons)
    code, first = cli_json(capsys, "deploy", "-i", inventory, "--source", str(snapshot), "-H", "h0")
    assert code == 0, first
    with_a = site_listings(pythons)
    code, doc = cli_json(capsys, "deploy", "-i", inventory, "--source", str(other), "--serial", "1")
    assert code == 0, doc
    rollout = doc["rollout"]
    assert rollout["changed"] == ["h0", "h1"]
    assert rollout["rollback_restores"] == {"h0": first["release"], "h1": None}
    code, undone = run_printed(rollout["rollback_command"], capsys)
    assert code == 0, undone
    assert [undone["hosts"][h]["result"]["restored"] for h in ("h0", "h1")] == [first["release"], None]
    assert site_listings(pythons) == [with_a[0], before[1]]  # byte for byte, each host its own
    assert main(["rollback", "-i", inventory, "--source", str(snapshot), "-H", "h0"]) == 0
    assert site_listings(pythons) == before


def test_smoke_a_canary_whose_stage_fails_stops_before_the_other_hosts(sshd_fleet, tmp_path, capsys, monkeypatch):
    from fixtures.checkout import copy_release_files

    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    checkout = copy_release_files(tmp_path / "checkout", {
        "picky": 'NAME = "picky"\nDESCRIPTION = "fails on h0 only"\nNEEDS_TORCH = False\nfrom ddtree_ops.hostside.protocol import StageResult\n'
                 'def run(ctx):\n    if ctx.host["name"] == "h0":\n        return StageResult.failed("canary says no")\n'
                 '    return StageResult.passed("fine")\n'})
    fleet = sshd_fleet(3)
    inventory = str(fleet.write_inventory())
    code, doc = cli_json(capsys, "smoke", "-i", inventory, "--source", str(checkout), "--stages", "picky",
                         "--serial", "1,100%", "--max-fail-percent", "0")
    assert code == 5, doc
    assert doc["hosts"]["h0"]["outcome"] == "fail"
    assert doc["rollout"]["batches"] == [{"batch": 1, "hosts": ["h0"], "failed": ["h0"], "ok": []}]
    assert doc["rollout"]["not_started"] == ["h1", "h2"]
    assert not fleet.hosts[1].workdir.exists() and not fleet.hosts[2].workdir.exists()
    # the same rollout with a budget that allows one failure in three runs every batch
    code, doc = cli_json(capsys, "smoke", "-i", inventory, "--source", str(checkout), "--stages", "picky",
                         "--serial", "1,100%", "--max-fail-percent", "100")
    assert code == 6 and doc["rollout"]["stopped"] is None
    assert {h: doc["hosts"][h]["outcome"] for h in ("h1", "h2")} == {"h1": "pass", "h2": "pass"}
