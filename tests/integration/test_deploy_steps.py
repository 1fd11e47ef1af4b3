"""`deploy` / `rollback` step by step: killed at every point between two of their changes,
run two at a time, and raced by someone changing the environment between their checks and
their use of it.

Real SSH (sshd on 127.0.0.1) into a real virtual environment with the real sglang==0.5.23
installed by pip --no-deps. The host's `python` is a wrapper next to the venv's (so it is the
same environment) that exports DDTREE_DEPLOY_FAULT from a file the test writes: the installer
then exits hard (as a kill -9) at that point. The invariants: a deploy killed anywhere, then
one `rollback`, leaves the environment as that deploy found it; the same kill, then `deploy`
again, leaves it as one uninterrupted deploy does; a rollback killed anywhere, then another,
leaves it as one rollback does."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.hostside.sglang_install import INSTALL_FAULTS, ROLLBACK_FAULTS
from sglang_plugin.dist import site_dir, site_listing, venv_and_snapshot, wrapped_python

pytestmark = [pytest.mark.sshd, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
READ_CONFIG = """
import json
from ddtree.sglang.config import load_config
print(json.dumps({"enabled": load_config().enabled, "budget": load_config().budget}))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(venv python, a frozen snapshot of the checkout to deploy from)."""
    return venv_and_snapshot(tmp_path_factory.mktemp("sglang-steps"))


class Host:
    """The fleet's one host, its inventory, and the fault its next agent process dies at."""

    def __init__(self, fleet, python: Path, fault_file: Path):
        self.fleet, self.inventory, self.h0 = fleet, fleet.write_inventory(), fleet.hosts[0]
        self.python, self.fault_file = python, fault_file

    def kill_at(self, point: str | None) -> None:
        self.fault_file.write_text(point or "")


@pytest.fixture
def host(sshd_fleet, env, tmp_path):
    python, snapshot = env
    fault_file = tmp_path / "fault"
    fault_file.write_text("")
    # the probe (`python -m ddtree.sglang.probe`, started through sys.executable) runs without it, as deploy starts it
    wrapper = wrapped_python(python, "python-faulty",
                             f'fault=$(cat {fault_file})\n'
                             f'[ -n "$fault" ] && [ "$2" != ddtree.sglang.probe ] && export DDTREE_DEPLOY_FAULT="$fault"\n')
    before = site_listing(python)
    fleet = sshd_fleet(1, python=str(wrapper), command_timeout=120)
    yield Host(fleet, python, fault_file)
    fault_file.write_text("")
    # leave the module's environment as it was: whatever a failing test left is rolled back
    for _ in range(3):
        if site_listing(python) == before:
            break
        main(["rollback", "-i", str(fleet.write_inventory()), "--source", str(snapshot), "--force"])


def cli(capsys, host: Host, source: Path, *args: str) -> tuple[int, dict]:
    code = main([args[0], "-i", str(host.inventory), "--source", str(source), "--json", *args[1:]])
    return code, json.loads(capsys.readouterr().out)


def tree_listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def deployed_config(python: Path) -> dict:
    done = subprocess.run([str(python), "-c", READ_CONFIG], capture_output=True, text=True, cwd="/", timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rollback_after_a_killed_reconfigure_undoes_only_that_and_says_so(host, env, capsys):
    """#49 item 2: budget 8 deployed, then budget 16 killed right after its .pth: one
    rollback puts budget 8 back and stops there (it used to go on and remove budget 8 too,
    saying only `rolled-back`); the next one removes budget 8."""
    python, snapshot = env
    before = site_listing(python)
    code, first = cli(capsys, host, snapshot, "deploy", "--budget", "8")
    assert code == 0, first
    release = first["release"]
    with_8, deployments_8 = site_listing(python), tree_listing(host.h0.workdir / "deployments")
    assert deployed_config(python)["budget"] == 8

    host.kill_at("after-pth")
    code, killed = cli(capsys, host, snapshot, "deploy", "--budget", "16")
    assert code == 5, killed
    assert site_listing(python) != with_8  # the .pth names the new payload; its dist-info is not there
    host.kill_at(None)

    code, doc = cli(capsys, host, snapshot, "rollback")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and site_listing(python) == with_8, doc  # budget 8 is there, and only budget 8
    assert (result["action"], result["interrupted"], result["restored"]) == ("recovered", True, release)
    assert result["step"] == (f"undid the interrupted deploy of release {release} (DDTREE_BUDGET=16, DDTREE_ENABLE=1):"
                              f" release {release} (DDTREE_BUDGET=8, DDTREE_ENABLE=1) is deployed again, as before"
                              " that deploy")
    assert tree_listing(host.h0.workdir / "deployments") == deployments_8
    assert deployed_config(python)["budget"] == 8

    code = main(["rollback", "-i", str(host.inventory), "--source", str(snapshot)])  # as a person reads it
    out = capsys.readouterr().out
    assert code == 0 and "rolled back release" in out and "the plugin is removed" in out, out
    assert site_listing(python) == before


def payload_listing(workdir: Path) -> dict[str, str]:
    """The deployment folder without its records (they hold timestamps)."""
    return {k: v for k, v in tree_listing(workdir / "deployments").items() if not k.endswith("/record.json")}


def test_a_deploy_killed_at_any_point_is_undone_by_one_rollback_or_completed_by_the_next_deploy(host, env, capsys):
    """Budget 8 deployed; budget 16 killed at each point of the install in turn. One rollback
    then leaves budget 8 exactly (the step undone named: the killed deploy, or, killed after
    its record, that complete deploy); a deploy instead leaves what an uninterrupted one does."""
    python, snapshot = env
    assert cli(capsys, host, snapshot, "deploy", "--budget", "8")[0] == 0
    with_8, deployments_8 = site_listing(python), tree_listing(host.h0.workdir / "deployments")
    code, clean = cli(capsys, host, snapshot, "deploy", "--budget", "16")
    assert code == 0, clean
    release = clean["release"]
    with_16, payloads_16 = site_listing(python), payload_listing(host.h0.workdir)
    assert cli(capsys, host, snapshot, "rollback")[0] == 0 and site_listing(python) == with_8

    for point in INSTALL_FAULTS:
        host.kill_at(point)
        code, doc = cli(capsys, host, snapshot, "deploy", "--budget", "16")
        host.kill_at(None)
        assert code == 5, (point, doc)
        code, doc = cli(capsys, host, snapshot, "rollback")
        result = doc["hosts"]["h0"]["result"]
        assert code == 0 and site_listing(python) == with_8, (point, doc)
        assert tree_listing(host.h0.workdir / "deployments") == deployments_8, point
        went_through = INSTALL_FAULTS.index(point) >= INSTALL_FAULTS.index("after-record")
        assert (result["action"], result["release"], result["restored"]) == (
            "rolled-back" if went_through else "recovered", release, release), (point, result)
        assert result["step"].startswith("rolled back release" if went_through else "undid the interrupted deploy"), point

        if point not in ("after-pth", "after-record"):
            continue  # a deploy recovers as rollback does (the same code): two points show it, each costs a probe
        host.kill_at(point)
        assert cli(capsys, host, snapshot, "deploy", "--budget", "16")[0] == 5, point
        host.kill_at(None)
        code, doc = cli(capsys, host, snapshot, "deploy", "--budget", "16")
        assert code == 0, (point, doc)
        assert doc["hosts"]["h0"]["result"]["action"] == ("unchanged" if went_through else "reconfigured"), point
        assert site_listing(python) == with_16 and payload_listing(host.h0.workdir) == payloads_16, point
        assert deployed_config(python)["budget"] == 16, point
        assert cli(capsys, host, snapshot, "rollback")[0] == 0 and site_listing(python) == with_8, point


def test_a_rollback_killed_at_any_point_is_finished_once_by_the_next_rollback_or_deploy(host, env, capsys):
    """Budget 16 over budget 8; the rollback killed at each point in turn. The next rollback
    finishes it and stops (budget 8 exactly, the step named); a deploy instead finishes it,
    then deploys as it would have."""
    python, snapshot = env
    assert cli(capsys, host, snapshot, "deploy", "--budget", "8")[0] == 0
    with_8, deployments_8 = site_listing(python), tree_listing(host.h0.workdir / "deployments")
    code, doc = cli(capsys, host, snapshot, "deploy", "--budget", "16")
    assert code == 0, doc
    release = doc["release"]
    with_16 = site_listing(python)

    for point in ROLLBACK_FAULTS:
        host.kill_at(point)
        code, doc = cli(capsys, host, snapshot, "rollback")
        host.kill_at(None)
        assert code == 5, (point, doc)
        code, doc = cli(capsys, host, snapshot, "rollback")
        result = doc["hosts"]["h0"]["result"]
        assert code == 0 and site_listing(python) == with_8, (point, doc)
        assert tree_listing(host.h0.workdir / "deployments") == deployments_8, point
        assert (result["action"], result["interrupted"], result["restored"]) == ("rolled-back", True, release), point
        assert result["step"] == (f"finished the interrupted rollback of release {release} (DDTREE_BUDGET=16, "
                                  f"DDTREE_ENABLE=1): release {release} (DDTREE_BUDGET=8, DDTREE_ENABLE=1) is deployed"
                                  " again"), point

        assert cli(capsys, host, snapshot, "deploy", "--budget", "16")[0] == 0, point
        if point not in ("rollback-after-journal", "rollback-after-pth"):
            continue  # a deploy finishes a rollback as rollback does (the same code): two points show it
        host.kill_at(point)
        assert cli(capsys, host, snapshot, "rollback")[0] == 5, point
        host.kill_at(None)
        code, doc = cli(capsys, host, snapshot, "deploy", "--budget", "16")
        result = doc["hosts"]["h0"]["result"]
        assert code == 0 and result["action"] == "reconfigured", (point, doc)
        assert result["recovered"]["rollback_of"] == release, point
        assert site_listing(python) == with_16, point
    assert cli(capsys, host, snapshot, "rollback")[0] == 0 and site_listing(python) == with_8


def release_b(snapshot: Path, where: Path) -> Path:
    """A copy of the snapshot that is another release."""
    shutil.copytree(snapshot, where)
    (where / "ddtree_ops" / "hostside" / "release-b.txt").write_text("a different release\n")
    return where


def waiting_on(path: Path, timeout_s: float = 60.0) -> int:
    """The pid of another process that has `path` open (the agent waiting for the lock)."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process opened {path} within {timeout_s}s")


@pytest.mark.parametrize("first_op, first_action, second_action", [
    ("install", "replaced", "unchanged"),  # two deploys of B at once
    ("rollback", "rolled-back", "installed"),  # a deploy of B during a rollback of A
])
def test_a_deploy_that_waited_for_the_lock_reads_the_environment_as_the_other_left_it(
        host, env, capsys, tmp_path, first_op, first_action, second_action):
    """#49 item 5: A deployed; a deploy of B reads site-packages (whose .pth names A's payload)
    at its start, then waits for the lock while another step holds it: a deploy of B (which
    keeps A's payload for rollback) or a rollback of A. Once it holds the lock it must see the
    environment as that step left it (B `unchanged`; B `installed` on a clean environment),
    never refuse A's payload as "another `ddtree` package". The other step is the installer
    run directly while the test holds the host lock, so the order is certain."""
    import fcntl

    from ddtree_ops.deploy import installer_stdin
    from ddtree_ops.release import build_bundle
    from ddtree_ops.remote_layout import BOOTSTRAP

    python, snapshot = env
    other = release_b(snapshot, tmp_path / "checkout-b")
    assert cli(capsys, host, snapshot, "deploy")[0] == 0
    bundle = build_bundle(other)
    assert main(["push", "-i", str(host.inventory), "--source", str(other)]) == 0  # B on the host, for the installer
    capsys.readouterr()
    cli_path = REPO / ".venv" / "bin" / "ddtree-ops"
    lock = host.h0.workdir / "lock"
    argv = [str(python), "-c", BOOTSTRAP, first_op, str(host.h0.workdir)] + \
        ([bundle.release_id, "0"] if first_op == "install" else [])
    with open(lock, "r+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        second = subprocess.Popen([str(cli_path) if cli_path.exists() else "ddtree-ops", "deploy", "-i",
                                   str(host.inventory), "--source", str(other), "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            waiting_on(lock)  # the deploy's agent is up, past its start, waiting for the lock
            first = subprocess.run(argv, input=installer_stdin(bundle, first_op), capture_output=True, cwd="/",
                                   env={"PATH": "/usr/bin:/bin"}, timeout=300)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, err = second.communicate(timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    reply = json.loads(first.stdout.decode().strip().splitlines()[-1])
    assert (reply.get("action") or reply.get("rollback", {}).get("action")) == first_action, reply
    doc = json.loads(out)
    assert second.returncode == 0, (doc, err[-2000:])
    assert doc["hosts"]["h0"]["result"]["action"] == second_action


@pytest.mark.parametrize("pinned", ["srt/plugins/hook_registry.py", "srt/plugins/__init__.py"])
def test_a_pinned_file_changed_between_the_gate_and_the_probe_is_never_imported(sshd_fleet, env, capsys, pinned):
    """#49 item 6: the host's `python` changes a pinned SGLang file (one that load_plugins()
    imports) just as deploy starts the probe, after the gate hashed it: the deploy used to say
    "installed, structure ok, pinned". The probe imports the gate's files only from the bytes
    the gate read, so it refuses the changed file, names it, and the deploy is undone."""
    python, snapshot = env
    target = site_dir(python) / "sglang" / pinned
    original = target.read_bytes()
    racing = wrapped_python(python, "python-racing",
                            f'if [ "$2" = ddtree.sglang.probe ]; then\n'
                            f'  printf "\\nCHANGED_AFTER_THE_GATE = True\\n" >> {target}\nfi\n')
    before = site_listing(python)
    fleet = sshd_fleet(1, python=str(racing), command_timeout=120)
    try:
        code = main(["deploy", "-i", str(fleet.write_inventory()), "--source", str(snapshot), "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert target.read_bytes() != original  # the race happened
        assert code == 5, doc
        error = doc["hosts"]["h0"]["error"]
        assert f"{target}: changed since the gate checked it" in error and "not imported" in error, error
        assert "removed again" in error
        target.write_bytes(original)
        assert site_listing(python) == before
    finally:
        target.write_bytes(original)
        if site_listing(python) != before:  # leave the module's environment as it was
            main(["rollback", "-i", str(fleet.write_inventory()), "--source", str(snapshot), "--force"])
        racing.unlink()


LOAD_PLUGINS = """
import json, sys, types, importlib.util
spec = importlib.util.find_spec("sglang")
pkg = types.ModuleType("sglang"); pkg.__path__ = list(spec.submodule_search_locations); sys.modules["sglang"] = pkg
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print("SERVING", json.dumps(sorted(HookRegistry._hooks)))
"""


@pytest.mark.parametrize("depth", [20_000, 100_000])
def test_a_deployed_defaults_file_nested_deep_stops_a_strict_server(host, env, capsys, depth):
    """#49 item 7: the payload's server-defaults file nested `depth` deep. register() let
    RecursionError out, SGLang's load_plugins() logged and swallowed it, and a server with
    DDTREE_ENABLE=1 DDTREE_STRICT=1 served plain DFlash. Now SGLang's own loader, in a fresh
    interpreter of the deployed environment, stops with one line naming the file."""
    python, snapshot = env
    code, doc = cli(capsys, host, snapshot, "deploy", "--budget", "8")
    assert code == 0, doc
    defaults = Path(json.loads(Path(doc["hosts"]["h0"]["result"]["record"]).read_text())["payload_dir"]) \
        / "ddtree_server_defaults.json"
    original = defaults.read_bytes()
    defaults.write_text("[" * depth + "]" * depth)
    try:
        done = subprocess.run([str(python), "-c", LOAD_PLUGINS], capture_output=True, text=True, cwd="/", timeout=120,
                              env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "DDTREE_ENABLE": "1",
                                   "DDTREE_STRICT": "1"})
    finally:
        defaults.write_bytes(original)
    assert done.returncode != 0 and "SERVING" not in done.stdout, done.stdout + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    why = "nested too deep" if depth == 20_000 else "larger than 65536 bytes"
    assert last == f"ddtree.sglang.errors.PluginConfigError: {defaults}: unreadable server defaults: {why}", last
    assert cli(capsys, host, snapshot, "rollback")[0] == 0


@pytest.mark.parametrize("record", [b"not json", b"[" * 20_000 + b"]" * 20_000, b'{"release": "x", "files": 5}',
                                    b'{"release": "x", "files": {}, "dirs": [], "previous": 7}'])
def test_a_record_deploy_did_not_write_is_refused_naming_it_and_nothing_changes(host, env, capsys, record):
    """A hostile or broken record.json (not JSON, nested past the stack, fields of other types)
    is refused with one line naming it, by rollback and by deploy; the environment stays."""
    python, snapshot = env
    assert cli(capsys, host, snapshot, "deploy")[0] == 0
    with_plugin = site_listing(python)
    path = next((host.h0.workdir / "deployments").glob("*/record.json"))
    original = path.read_bytes()
    path.write_bytes(record)
    try:
        for verb in ("rollback", "deploy"):
            code, doc = cli(capsys, host, snapshot, verb)
            error = doc["hosts"]["h0"]["error"]
            assert code == 5 and f"{path}: " in error, (verb, error)
            assert "not a record deploy wrote" in error or "not JSON deploy wrote" in error, (verb, error)
            assert "\n" not in error and site_listing(python) == with_plugin, verb
    finally:
        path.write_bytes(original)
    assert cli(capsys, host, snapshot, "rollback")[0] == 0
