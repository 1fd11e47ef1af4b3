"""`deploy` / `rollback` when things go wrong: a failed upgrade, a full disk, a damaged
payload, a killed deploy, a lost record, two workdirs sharing one environment.

Real SSH (sshd on 127.0.0.1) into a real virtual environment with the real sglang==0.5.23
installed by pip --no-deps. "A full disk" is RLIMIT_FSIZE on the installer's process: the
kernel then fails every write past the limit (EFBIG), as a full filesystem fails it (ENOSPC),
and Python ignores the SIGXFSZ that comes with it."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.deploy import installer_stdin
from ddtree_ops.release import build_bundle
from ddtree_ops.remote_layout import BOOTSTRAP
from sglang_plugin.dist import make_sglang_venv, release_snapshot, site_dir, site_listing

pytestmark = [pytest.mark.sshd, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "ddtree_ops" / "hostside" / "sglang_install.py"
LOAD_PLUGIN = """
import json, sys, types, importlib.util
spec = importlib.util.find_spec("sglang")
pkg = types.ModuleType("sglang"); pkg.__path__ = list(spec.submodule_search_locations); sys.modules["sglang"] = pkg
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
import ddtree
print(json.dumps({"ddtree": ddtree.__file__, "hooked": len(HookRegistry._hooks)}))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(venv python, its site-packages, a frozen snapshot of the checkout)."""
    root = tmp_path_factory.mktemp("sglang-lifecycle")
    python = make_sglang_venv(root)
    site = site_dir(python)
    snapshot = release_snapshot(root)
    return python, site, snapshot


@pytest.fixture
def host(sshd_fleet, env):
    python, _, _ = env
    fleet = sshd_fleet(1, python=str(python), command_timeout=120)
    return fleet.write_inventory(), fleet.hosts[0]


@pytest.fixture
def clean_env(env):
    """The environment's listing before the test; any deployment a test leaves is removed by pip's rule
    (the dist-info RECORD), so one failing test does not fail the next."""
    python, site, _ = env
    before = site_listing(python)
    yield before
    for dist_info in site.glob("ddtree_sglang_plugin-*.dist-info"):
        shutil.rmtree(dist_info)
    (site / "ddtree_sglang_plugin.pth").unlink(missing_ok=True)


def variant(snapshot: Path, where: Path, tag: str, plugin_tail: str = "") -> Path:
    """A copy of the snapshot that is a different release (and, with plugin_tail, a broken one)."""
    shutil.copytree(snapshot, where)
    (where / "ddtree_ops" / "hostside" / f"release-{tag}.txt").write_text(f"release {tag}\n")
    if plugin_tail:
        plugin = where / "src" / "ddtree" / "sglang" / "plugin.py"
        plugin.write_text(plugin.read_text() + plugin_tail)
    return where


def cli(capsys, inventory: Path, source: Path, *args: str) -> tuple[int, dict]:
    code = main([args[0], "-i", str(inventory), "--source", str(source), "--json", *args[1:]])
    return code, json.loads(capsys.readouterr().out)


def deployed_once(capsys, inventory: Path, source: Path) -> dict:
    """`deploy` that must succeed: its JSON document."""
    code, doc = cli(capsys, inventory, source, "deploy")
    assert code == 0, doc
    return doc


def plugin_loads(python: Path) -> dict:
    done = subprocess.run([str(python), "-c", LOAD_PLUGIN], capture_output=True, text=True, cwd="/", timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "DDTREE_ENABLE": "1",
                               "DDTREE_STRICT": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def direct_install(python: Path, workdir: Path, source: Path, *, fsize: int | None = None,
                   fault: str | None = None) -> subprocess.CompletedProcess:
    """The installer as deploy runs it (BOOTSTRAP + stdin), without the agent, so the test can
    limit its file size or kill it half-way."""
    bundle = build_bundle(source)
    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))) if fsize else None
    return subprocess.run([str(python), "-c", BOOTSTRAP, "install", str(workdir), bundle.release_id, "0"],
                          input=installer_stdin(bundle, "install"), capture_output=True, cwd="/", timeout=120,
                          env={"PATH": "/usr/bin:/bin", **({"DDTREE_DEPLOY_FAULT": fault} if fault else {})},
                          preexec_fn=limit)


# ---------------------------------------------------------------- 1. a failed upgrade


def test_a_failed_upgrade_restores_the_old_release_even_after_its_release_was_pruned(
        host, env, clean_env, capsys, tmp_path):
    inventory, h0 = host
    python, _, snapshot = env
    before = clean_env
    first = deployed_once(capsys, inventory, snapshot)
    deployed = site_listing(python)
    other = variant(snapshot, tmp_path / "other", "other")
    assert main(["push", "-i", str(inventory), "--source", str(other), "--keep", "1"]) == 0
    capsys.readouterr()
    assert not (h0.workdir / "releases" / first["release"]).exists()  # pruned

    broken = variant(snapshot, tmp_path / "broken", "broken",
                     "\n\ndef register():\n    raise RuntimeError('broken on purpose')\n")
    code, doc = cli(capsys, inventory, broken, "deploy")
    assert code == 5, doc
    error = doc["hosts"]["h0"]["error"]
    assert "installed plugin failed its check" in error and "\n" not in error
    assert error.endswith(f"removed again; previous release {first['release']} restored"), error
    assert site_listing(python) == deployed
    assert plugin_loads(python)["hooked"] == 3
    code, doc = cli(capsys, inventory, snapshot, "rollback")
    assert code == 0 and doc["hosts"]["h0"]["result"]["release"] == first["release"]
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())


def test_a_full_disk_while_copying_the_new_payload_keeps_the_old_deployment(host, env, clean_env, capsys, tmp_path):
    inventory, h0 = host
    python, site, snapshot = env
    before = clean_env
    first = deployed_once(capsys, inventory, snapshot)
    deployed = site_listing(python)
    other = variant(snapshot, tmp_path / "other", "other")
    assert main(["push", "-i", str(inventory), "--source", str(other)]) == 0
    capsys.readouterr()
    # Small enough that the payload's larger modules cannot be written, large enough for the
    # journal (it lists every payload file: about 20 kB with today's payload).
    largest = max(p.stat().st_size for p in (other / "src" / "ddtree").rglob("*.py"))
    assert largest > 48_000
    done = direct_install(python, h0.workdir, other, fsize=40_000)
    reply = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert done.returncode == 1 and reply["kind"] == "os-error", reply
    error = reply["error"]
    payload = h0.workdir / "deployments"
    assert error.startswith(str(payload)) and ": File too large; removed again" in error, error
    assert error.endswith(f"previous release {first['release']} restored") and len(error) < 300, error
    assert site_listing(python) == deployed
    assert not [p for p in site.iterdir() if ".tmp-" in p.name]
    assert plugin_loads(python)["ddtree"].startswith(str(payload))
    code, doc = cli(capsys, inventory, snapshot, "rollback")
    assert code == 0 and doc["hosts"]["h0"]["result"]["release"] == first["release"]
    assert site_listing(python) == before


# ---------------------------------------------------------------- 2, 3. redeploying the same release


def test_a_damaged_payload_is_repaired_by_the_next_deploy(host, env, clean_env, capsys):
    inventory, h0 = host
    python, _, snapshot = env
    before = clean_env
    first = deployed_once(capsys, inventory, snapshot)
    deployed = site_listing(python)
    record = json.loads(Path(first["hosts"]["h0"]["result"]["record"]).read_text())
    damaged = Path(record["payload_dir"]) / "ddtree" / "sglang" / "plugin.py"
    damaged.unlink()

    code, doc = cli(capsys, inventory, snapshot, "deploy", "--dry-run")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "would repair", doc
    code, doc = cli(capsys, inventory, snapshot, "deploy")
    assert code == 0, doc
    result = doc["hosts"]["h0"]["result"]
    assert (result["action"], result["verdict"]) == ("repaired", "static-only")
    assert set(site_listing(python)) == set(deployed)  # the same files (the .pth names the new payload)
    assert not Path(record["payload_dir"]).exists()
    assert plugin_loads(python)["hooked"] == 3
    code, doc = cli(capsys, inventory, snapshot, "deploy")
    assert (code, doc["hosts"]["h0"]["result"]["action"]) == (0, "unchanged")
    assert cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())


def test_forcing_the_deployed_release_is_recorded_and_a_failed_check_is_never_ok(host, env, clean_env, capsys):
    inventory, _ = host
    python, site, snapshot = env
    before = clean_env
    first = deployed_once(capsys, inventory, snapshot)
    record_path = Path(first["hosts"]["h0"]["result"]["record"])
    assert json.loads(record_path.read_text())["forced"] is False
    plugins = site / "sglang" / "srt" / "plugins" / "__init__.py"
    original = plugins.read_bytes()
    try:
        plugins.write_bytes(original + b"\n# reviewed locally\n")  # a gate finding, harmless
        code, doc = cli(capsys, inventory, snapshot, "deploy", "--force")
        assert code == 0, doc
        result = doc["hosts"]["h0"]["result"]
        assert (result["action"], result["forced"]) == ("unchanged", True)
        record = json.loads(record_path.read_text())
        assert record["forced"] is True and record["gate"]["findings"][0]["file"] == str(plugins)

        plugins.write_bytes(original + b"\nraise RuntimeError('plugins broken on purpose')\n")
        code, doc = cli(capsys, inventory, snapshot, "deploy", "--force")
        assert code == 5, doc
        assert "is deployed and intact but fails its check" in doc["hosts"]["h0"]["error"]
    finally:
        plugins.write_bytes(original)
    assert cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == before


# ---------------------------------------------------------------- 4, 7. environments shared by workdirs


def test_a_deploy_waits_for_the_environment_lock_another_workdir_holds(sshd_fleet, env, clean_env, capsys):
    python, site, snapshot = env
    before = clean_env
    fleet = sshd_fleet(1, python=str(python), command_timeout=12)  # lock wait: 6 s
    inventory = fleet.write_inventory()
    fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a deploy from another workdir holds it
        code, doc = cli(capsys, inventory, snapshot, "deploy")
    finally:
        os.close(fd)
    assert code == 5, doc
    assert "another deploy or rollback is changing this environment" in doc["hosts"]["h0"]["error"]
    assert site_listing(python) == before


def test_two_workdirs_deploying_into_one_environment_take_turns(sshd_fleet, env, clean_env, capsys):
    python, site, snapshot = env
    before = clean_env
    fleet = sshd_fleet(2, python=str(python), command_timeout=120)
    inventory = fleet.write_inventory()
    code, doc = cli(capsys, inventory, snapshot, "deploy", "--parallel", "2")
    assert code == 6, doc
    hosts = doc["hosts"]
    winner = next(name for name, h in hosts.items() if h.get("result"))
    loser = next(name for name in hosts if name != winner)
    assert hosts[winner]["result"]["action"] == "installed"
    owner = next(h.workdir for h in fleet.hosts if h.name == winner)
    assert f"is deployed here by ddtree-ops from workdir {owner};" in hosts[loser]["error"]
    assert "pip uninstall ddtree_sglang_plugin" in hosts[loser]["error"]
    assert len(list(site.glob("ddtree_sglang_plugin-*.dist-info"))) == 1

    code, doc = cli(capsys, inventory, snapshot, "rollback", "-H", loser)
    assert code == 5 and f"from workdir {owner}" in doc["hosts"][loser]["error"], doc
    code, doc = cli(capsys, inventory, snapshot, "rollback", "-H", winner)
    assert (code, doc["hosts"][winner]["result"]["action"]) == (0, "rolled-back")
    assert site_listing(python) == before


def test_a_deployment_whose_record_was_deleted_is_named_and_rolled_back(host, env, clean_env, capsys):
    inventory, h0 = host
    python, _, snapshot = env
    before = clean_env
    first = deployed_once(capsys, inventory, snapshot)
    record = Path(first["hosts"]["h0"]["result"]["record"])
    record.unlink()
    code, doc = cli(capsys, inventory, snapshot, "deploy")
    assert code == 5, doc
    error = doc["hosts"]["h0"]["error"]
    assert f"was deployed here from this workdir but its record {record} is gone; `ddtree-ops rollback` removes it" \
        in error, error
    assert "was not added by ddtree-ops" not in error
    code, doc = cli(capsys, inventory, snapshot, "rollback")
    assert code == 0, doc
    assert (doc["hosts"]["h0"]["result"]["action"], doc["hosts"]["h0"]["result"]["release"]) == \
        ("rolled-back", first["release"])
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())


# ---------------------------------------------------------------- 5, 6. full disk, killed deploy


def test_write_atomic_on_a_full_disk_leaves_no_temporary_and_names_the_file(tmp_path):
    target = tmp_path / "ddtree_sglang_plugin.pth"
    target.write_bytes(b"old\n")
    script = textwrap.dedent(f"""
        import importlib.util, json, resource
        spec = importlib.util.spec_from_file_location("installer", {str(INSTALLER)!r})
        installer = importlib.util.module_from_spec(spec); spec.loader.exec_module(installer)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
        try:
            installer.write_atomic({str(target)!r}, b"x" * 5000)
        except OSError as err:
            print(json.dumps({{"line": installer.os_error_line(err)}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["line"] == f"{target}: File too large"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    assert target.read_bytes() == b"old\n"


def test_a_dry_run_after_a_killed_deploy_predicts_the_recovery(host, env, clean_env, capsys):
    inventory, h0 = host
    python, _, snapshot = env
    before = clean_env
    assert main(["push", "-i", str(inventory), "--source", str(snapshot)]) == 0
    capsys.readouterr()
    assert direct_install(python, h0.workdir, snapshot, fault="after-pth").returncode == 137
    code, doc = cli(capsys, inventory, snapshot, "deploy", "--dry-run")
    assert code == 0, doc
    assert doc["hosts"]["h0"]["result"]["action"] == "would recover, then install"
    code, doc = cli(capsys, inventory, snapshot, "deploy")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "installed", doc
    assert cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == before


# ---------------------------------------------------------------- an older release's installer


def test_an_older_release_whose_installer_predates_the_environment_lock_still_deploys(
        host, env, clean_env, capsys, tmp_path):
    """Going back to an older checkout is a deploy of that checkout: its installer (sent from
    the bundle) may not take the environment lock's wait that today's agent passes."""
    inventory, _ = host
    python, _, snapshot = env
    older = variant(snapshot, tmp_path / "older", "older")
    # An older checkout kept its installer inside the core package.
    installer = older / "src" / "ddtree" / "sglang" / "install.py"
    (older / "ddtree_ops" / "hostside" / "sglang_install.py").rename(installer)
    source = installer.read_text()
    install_def = "def op_install(workdir, release_id, force, sources, lock_wait=None, allow_shared_env=False):"
    rollback_def = "def op_rollback(workdir, lock_wait=None, force=False):"
    assert install_def in source and rollback_def in source
    installer.write_text(source.replace(install_def, "def op_install(workdir, release_id, force, sources):\n"
                                                     "    lock_wait, allow_shared_env = None, False")
                         .replace(rollback_def, "def op_rollback(workdir):\n    lock_wait, force = None, False"))
    code, doc = cli(capsys, inventory, older, "deploy")
    assert code == 0, doc
    assert doc["hosts"]["h0"]["result"]["action"] == "installed"
    code, doc = cli(capsys, inventory, older, "rollback")
    assert code == 0, doc
    assert site_listing(python) == clean_env


# ---------------------------------------------------------------- rollback touches only its own, unchanged files


def test_a_file_changed_since_deploy_is_named_and_kept_unless_forced(host, env, clean_env, capsys):
    inventory, _ = host
    python, site, snapshot = env
    before = clean_env
    doc = deployed_once(capsys, inventory, snapshot)
    record = json.loads(Path(doc["hosts"]["h0"]["result"]["record"]).read_text())
    edited = Path(record["payload_dir"]) / "ddtree" / "sglang" / "config.py"
    edited.write_text(edited.read_text() + "\n# tuned by hand on this host\n")
    added = Path(record["payload_dir"]) / "ddtree" / "notes.txt"
    added.write_text("what I saw\n")
    (Path(record["payload_dir"]) / "ddtree" / "__pycache__").mkdir(exist_ok=True)
    (Path(record["payload_dir"]) / "ddtree" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    deployed = site_listing(python)
    code, doc = cli(capsys, inventory, snapshot, "rollback")
    assert code == 5, doc
    error = doc["hosts"]["h0"]["error"]
    assert "2 file(s) changed since deploy" in error and f"{edited} (edited)" in error and f"{added} (added)" in error
    assert "`rollback --force` removes them too" in error
    assert site_listing(python) == deployed and edited.read_text().endswith("# tuned by hand on this host\n")
    assert added.read_text() == "what I saw\n"
    code, doc = cli(capsys, inventory, snapshot, "rollback", "--force")
    assert code == 0, doc
    assert doc["hosts"]["h0"]["result"]["modified_since_deploy"] == [f"{added} (added)", f"{edited} (edited)"]
    assert site_listing(python) == before and not edited.exists()


def test_an_edited_site_file_is_named_and_kept_unless_forced(host, env, clean_env, capsys):
    inventory, _ = host
    python, site, snapshot = env
    before = clean_env
    deployed_once(capsys, inventory, snapshot)
    pth = site / "ddtree_sglang_plugin.pth"
    pth.write_text(pth.read_text() + "/opt/my/extra/path\n")
    deployed = site_listing(python)
    code, doc = cli(capsys, inventory, snapshot, "rollback")
    assert code == 5 and f"{pth} (edited)" in doc["hosts"]["h0"]["error"], doc
    assert site_listing(python) == deployed
    assert cli(capsys, inventory, snapshot, "rollback", "--force")[0] == 0
    assert site_listing(python) == before


def test_a_record_naming_paths_outside_the_footprint_is_refused(host, env, clean_env, capsys, tmp_path):
    inventory, _ = host
    python, site, snapshot = env
    doc = deployed_once(capsys, inventory, snapshot)
    record_path = Path(doc["hosts"]["h0"]["result"]["record"])
    honest = record_path.read_text()
    victim_dir = tmp_path / "home" / "alice"
    victim_dir.mkdir(parents=True)
    (victim_dir / "thesis.tex").write_text("years of work\n")
    victim = site / "sglang" / "__init__.py"
    victim_bytes = victim.read_bytes()
    deployed = site_listing(python)
    for tamper in (
        lambda r: r["files"].update({str(victim): hashlib.sha256(victim_bytes).hexdigest()}),
        lambda r: r["dirs"].append(str(victim_dir)),
        lambda r: r.update(payload_dir=str(victim_dir)),
        lambda r: r["dirs"].append(str(site / "ddtree_sglang_plugin-0.1.0+x.dist-info" / ".." / "sglang")),
    ):
        record = json.loads(honest)
        tamper(record)
        record_path.write_text(json.dumps(record))
        code, doc = cli(capsys, inventory, snapshot, "rollback", "--force")
        assert code == 5, doc
        assert "outside what deploy adds" in doc["hosts"]["h0"]["error"] and "nothing removed" in doc["hosts"]["h0"]["error"]
        assert (victim_dir / "thesis.tex").read_text() == "years of work\n" and victim.read_bytes() == victim_bytes
        assert site_listing(python) == deployed
        # A deploy that would replace (or repair) it reads the same record: refused as well.
        code, doc = cli(capsys, inventory, variant(snapshot, tmp_path / f"v{len(list(tmp_path.iterdir()))}", "v"), "deploy")
        assert code == 5 and "outside what deploy adds" in doc["hosts"]["h0"]["error"], doc
        assert (victim_dir / "thesis.tex").read_text() == "years of work\n" and victim.read_bytes() == victim_bytes
    record_path.write_text(honest)
    assert cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == clean_env


# ---------------------------------------------------------------- a site-packages another account can write


def test_a_site_packages_others_can_write_is_refused_unless_allowed(host, env, clean_env, capsys):
    inventory, _ = host
    python, site, snapshot = env
    mode = site.stat().st_mode & 0o7777
    try:
        os.chmod(site, 0o777)
        for dry in ((), ("--dry-run",)):
            code, doc = cli(capsys, inventory, snapshot, "deploy", *dry)
            assert code == 5, doc
            assert f"{site}: writable by group or others (mode 0777): another account could replace what deploy" \
                   " writes there; --allow-shared-env deploys anyway" in doc["hosts"]["h0"]["error"]
            assert site_listing(python) == clean_env
        code, doc = cli(capsys, inventory, snapshot, "deploy", "--allow-shared-env")
        assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "installed", doc
    finally:
        os.chmod(site, mode)
    assert cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == clean_env


def test_write_atomic_never_writes_through_a_planted_temporary(tmp_path):
    """The temporary file's name cannot be guessed: a link planted where the name was once
    predictable (`<file>.tmp-<pid>`) is not followed, and the result is checked."""
    target = tmp_path / "ddtree_sglang_plugin.pth"
    victim = tmp_path / "secret"
    victim.write_bytes(b"root only\n")
    os.chmod(victim, 0o600)
    script = textwrap.dedent(f"""
        import importlib.util, json, os
        spec = importlib.util.spec_from_file_location("installer", {str(INSTALLER)!r})
        installer = importlib.util.module_from_spec(spec); spec.loader.exec_module(installer)
        os.symlink({str(victim)!r}, {str(target)!r} + ".tmp-%d" % os.getpid())  # a racing account's guess
        installer.write_atomic({str(target)!r}, b"/payload\\n")
        print(json.dumps(sorted(os.listdir({str(tmp_path)!r}))))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = json.loads(done.stdout)
    assert victim.read_bytes() == b"root only\n" and target.read_bytes() == b"/payload\n"
    assert [n for n in names if n not in ("secret", target.name) and not n.startswith(target.name + ".tmp-")] == []
    assert not target.is_symlink() and target.stat().st_mode & 0o777 == 0o644


def test_a_site_file_swapped_while_the_deploy_runs_is_caught_before_ok(host, env, clean_env, capsys, tmp_path,
                                                                         other_account):
    """Another account replaces the live .pth with its own link while the deploy verifies the
    plugin (here: from the probe the deploy runs). Deploy checks type, owner and hash of what it
    wrote before it says ok: it fails, removes what it added and never reports the link as ours."""
    inventory, _ = host
    python, site, snapshot = env
    racer = variant(snapshot, tmp_path / "racer", "racer")
    probe = racer / "src" / "ddtree" / "sglang" / "probe.py"
    pth = site / "ddtree_sglang_plugin.pth"
    future = "from __future__ import annotations\n"
    head, _, rest = probe.read_text().partition(future)
    probe.write_text(head + future + textwrap.dedent(f"""
        import os
        _pth = {str(pth)!r}
        _copy = _pth + ".theirs"
        with open(_pth, "rb") as _src, open(_copy, "wb") as _dst:
            _dst.write(_src.read())
        os.unlink(_pth)
        os.symlink(_copy, _pth)
        os.lchown(_pth, {other_account.pw_uid}, {other_account.pw_gid})
    """) + rest)
    code, doc = cli(capsys, inventory, racer, "deploy")
    assert code == 5, doc
    error = doc["hosts"]["h0"]["error"]
    assert f"{pth}: not a plain file, not what deploy wrote: another account is changing this environment" in error
    assert "removed again" in error
    assert not pth.is_symlink()
    Path(str(pth) + ".theirs").unlink()
    assert site_listing(python) == clean_env
