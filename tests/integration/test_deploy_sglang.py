"""`deploy` / `rollback` over real SSH into a real virtual environment that has the real
sglang==0.5.23 installed with pip --no-deps (torch borrowed, as a GPU host has it).

Every assertion about the environment is made on its site-packages listing with sha256 of
every file (bytecode included): rollback must restore it byte for byte."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.deploy import installer_stdin
from ddtree_ops.release import build_bundle
from ddtree_ops.remote_layout import BOOTSTRAP
from sglang_plugin.dist import site_dir, site_listing, venv_and_snapshot, wrapped_python

pytestmark = [pytest.mark.sshd, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TARGETS = (
    "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
    "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy",
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(venv python, a frozen snapshot of the checkout to deploy from)."""
    return venv_and_snapshot(tmp_path_factory.mktemp("sglang-env"))


@pytest.fixture
def host(sshd_fleet, env):
    python, _ = env
    fleet = sshd_fleet(1, python=str(python), command_timeout=120)
    return fleet, fleet.write_inventory(), fleet.hosts[0]


def run_cli(capsys, inventory: Path, snapshot: Path, *args: str) -> tuple[int, dict]:
    command = args[0]
    code = main([command, "-i", str(inventory), "--source", str(snapshot), "--json", *args[1:]])
    out = capsys.readouterr().out
    return code, json.loads(out)


def tree_listing(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (bytecode included)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def fresh_python(python: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", **env}, timeout=120)


LOAD_PLUGINS = """
import json, sys, types, importlib.util
spec = importlib.util.find_spec("sglang")
pkg = types.ModuleType("sglang"); pkg.__path__ = list(spec.submodule_search_locations); sys.modules["sglang"] = pkg
from importlib.metadata import entry_points
eps = [(ep.value, ep.dist.name) for ep in entry_points(group="sglang.srt.plugins")]
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
hooks = {t: [(h.__module__, s.plugin_name, s.dist_name) for _, h, s in hs] for t, hs in HookRegistry._hooks.items()}
import ddtree
print(json.dumps({"eps": eps, "hooks": hooks, "ddtree": ddtree.__file__}))
"""


PLUGIN_STAGE = """
import json, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/src"]
from ddtree_ops.hostside.protocol import SmokeOptions, StageContext
from ddtree_ops.hostside.stages.plugin import run
ctx = StageContext(stage="plugin", device="cpu", options=SmokeOptions(), host={}, run_dir=Path("/tmp"),
                   release_root=Path(sys.argv[1]), expected_release=None, log=print, emit_metric=lambda n, v: None)
result = run(ctx)
print(json.dumps({"status": result.status.value, "reason": result.reason, "metrics": result.metrics}))
"""


def plugin_stage(python: Path, snapshot: Path) -> dict:
    done = subprocess.run([str(python), "-c", PLUGIN_STAGE, str(snapshot)], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deploy_verify_redeploy_and_rollback_restore_the_listing(host, env, capsys):
    fleet, inventory, h0 = host
    python, snapshot = env
    before = site_listing(python)
    stage = plugin_stage(python, snapshot)
    assert stage["status"] == "skip" and "the plugin is not deployed in" in stage["reason"]
    assert stage["metrics"]["gate_ok"] is True

    code, doc = run_cli(capsys, inventory, snapshot, "deploy")
    assert code == 0, doc
    result = doc["hosts"]["h0"]["result"]
    assert (result["action"], result["verdict"], result["forced"]) == ("installed", "static-only", False)
    assert result["sglang"].startswith("0.5.23 at ")
    after = site_listing(python)
    added = sorted(set(after) - set(before))
    release = doc["release"]
    assert added == sorted([
        "ddtree_sglang_plugin.pth",
        *(f"ddtree_sglang_plugin-0.1.0+{release}.dist-info/{n}" for n in ("INSTALLER", "METADATA", "RECORD", "entry_points.txt")),
    ])
    assert {k: v for k, v in after.items() if k in before} == before  # nothing else changed

    # A fresh interpreter of that environment: the entry point is there and SGLang's own
    # load_plugins() runs our register(), which registers the three hooks.
    seen = fresh_python(python, LOAD_PLUGINS, DDTREE_ENABLE="1", DDTREE_STRICT="0")
    assert seen.returncode == 0, seen.stderr[-2000:]
    facts = json.loads(seen.stdout.strip().splitlines()[-1])
    assert facts["eps"] == [["ddtree.sglang.plugin:register", "ddtree_sglang_plugin"]]
    for target in TARGETS:
        assert facts["hooks"][target] == [["ddtree.sglang.hooks", "ddtree", "ddtree_sglang_plugin"]]
    assert facts["ddtree"].startswith(str(h0.workdir / "deployments"))
    record = json.loads(Path(result["record"]).read_text())
    assert record["release"] == release and set(record["files"]) == {str(Path(result["adds"][0]).parent / a) for a in added}

    # The `plugin` smoke stage sees the deployment (static-only on this CPU host).
    stage = plugin_stage(python, snapshot)
    assert stage["status"] == "pass", stage
    assert stage["reason"].startswith("SGLang's speculative modules cannot import here (missing: msgspec, psutil)")
    assert stage["metrics"]["deployed_release"] == release
    assert stage["metrics"]["hooks"] == {"H1": "unresolvable", "H2": "unresolvable", "H3": "unresolvable"}

    # Same release again: nothing changes.
    code, doc = run_cli(capsys, inventory, snapshot, "deploy")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "unchanged"
    assert site_listing(python) == after

    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    assert code == 0
    assert doc["hosts"]["h0"]["result"]["action"] == "rolled-back"
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())
    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    assert (code, doc["hosts"]["h0"]["result"]["action"]) == (0, "nothing-deployed")


def test_dry_run_changes_nothing(host, env, capsys):
    _, inventory, h0 = host
    python, snapshot = env
    before = site_listing(python)
    code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--dry-run")
    assert code == 0, doc
    result = doc["hosts"]["h0"]["result"]
    assert result["action"] == "would install" and len(result["adds"]) == 5
    assert site_listing(python) == before
    assert not h0.workdir.exists()  # no release pushed, no lock taken, no record


def test_a_tampered_hooked_file_is_refused_unless_forced(host, env, capsys):
    _, inventory, h0 = host
    python, snapshot = env
    hooked = site_dir(python) / "sglang" / "srt" / "speculative" / "spec_info.py"
    original = hooked.read_bytes()
    hooked.write_bytes(original + b"\n# patched by someone\n")
    try:
        before = site_listing(python)
        code, doc = run_cli(capsys, inventory, snapshot, "deploy")
        assert code == 5
        error = doc["hosts"]["h0"]["error"]
        assert "sglang 0.5.23: structure ok, hashes drifted, not qualified: 1 pinned file(s) differ from sglang " \
               f"0.5.23: {hooked}: comments or formatting only (its code is the pinned code); qualify it with" in error
        assert site_listing(python) == before

        code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--force")
        assert code == 0, doc
        result = doc["hosts"]["h0"]["result"]
        assert result["forced"] is True and result["gate_findings"][0].startswith(f"{hooked}: hash-mismatch")
        assert json.loads(Path(result["record"]).read_text())["forced"] is True
        assert run_cli(capsys, inventory, snapshot, "rollback")[0] == 0
        assert site_listing(python) == before
    finally:
        hooked.write_bytes(original)


def test_tampered_bytecode_of_a_hooked_module_is_refused_unless_forced(host, env, capsys):
    """The source still hashes right; its cached .pyc (header matching the source's mtime and
    size, so Python would run it and never read the source) holds other code."""
    import importlib.util
    import marshal

    _, inventory, _ = host
    python, snapshot = env
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    hooked = site / "sglang" / "srt" / "speculative" / "spec_info.py"
    cache = Path(importlib.util.cache_from_source(str(hooked)))
    original = cache.read_bytes() if cache.exists() else None
    stat = hooked.stat()
    tampered = compile(hooked.read_bytes() + b"\nTAMPERED = True\n", str(hooked), "exec", dont_inherit=True)
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(importlib.util.MAGIC_NUMBER + b"\0\0\0\0" + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                      + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(tampered))
    try:
        ran = fresh_python(python, f"import importlib.machinery as m; print('TAMPERED' in m.SourceFileLoader('x', {str(hooked)!r}).get_code('x').co_names)")
        assert ran.stdout.strip() == "True"  # this environment's Python would run the tampered code
        before = site_listing(python)
        code, doc = run_cli(capsys, inventory, snapshot, "deploy")
        assert code == 5, doc
        assert f"{cache}: bytecode-mismatch: cached bytecode that would run instead of srt/speculative/spec_info.py" \
            in doc["hosts"]["h0"]["error"]
        assert site_listing(python) == before
        code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--force")
        assert code == 0 and doc["hosts"]["h0"]["result"]["forced"] is True, doc
        assert run_cli(capsys, inventory, snapshot, "rollback")[0] == 0
        assert site_listing(python) == before
    finally:
        if original is None:
            cache.unlink()
        else:
            cache.write_bytes(original)


def test_an_unknown_sglang_version_is_refused(host, env, capsys):
    _, inventory, _ = host
    python, snapshot = env
    metadata = next(Path(p) for p in Path(python).parents[1].glob("lib/python*/site-packages/sglang-0.5.23.dist-info/METADATA"))
    original = metadata.read_bytes()
    metadata.write_bytes(original.replace(b"Version: 0.5.23", b"Version: 0.5.24", 1))
    try:
        before = site_listing(python)
        code, doc = run_cli(capsys, inventory, snapshot, "deploy")
        assert code == 5
        error = doc["hosts"]["h0"]["error"]
        assert ("deploy: refused: sglang 0.5.24: structure ok, version not pinned, not qualified: its pinned files"
                " match sglang 0.5.23; qualify it with `ddtree-ops sglang qualify`, or --force deploys anyway") in error
        assert site_listing(python) == before
    finally:
        metadata.write_bytes(original)


def test_a_deploy_killed_half_way_is_undone_by_rollback_and_by_the_next_deploy(host, env, capsys):
    _, inventory, h0 = host
    python, snapshot = env
    before = site_listing(python)
    assert main(["push", "-i", str(inventory), "--source", str(snapshot)]) == 0
    capsys.readouterr()
    bundle = build_bundle(snapshot)

    def killed_install() -> None:
        done = subprocess.run([str(python), "-c", BOOTSTRAP, "install", str(h0.workdir), bundle.release_id, "0"],
                              input=installer_stdin(bundle, "install"), capture_output=True,
                              env={"PATH": "/usr/bin:/bin", "DDTREE_DEPLOY_FAULT": "after-pth"}, cwd="/", timeout=120)
        assert done.returncode == 137, done.stderr
        assert site_listing(python) != before  # the .pth is there, the record is not

    killed_install()
    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "recovered"
    assert site_listing(python) == before

    killed_install()
    code, doc = run_cli(capsys, inventory, snapshot, "deploy")
    assert code == 0, doc
    result = doc["hosts"]["h0"]["result"]
    assert result["action"] == "installed" and result["recovered"]["removed"]
    assert run_cli(capsys, inventory, snapshot, "rollback")[0] == 0
    assert site_listing(python) == before


def test_concurrent_deploys_are_serialised_by_the_host_lock(host, env):
    _, inventory, _ = host
    python, snapshot = env
    before = site_listing(python)
    cli = [str(REPO / ".venv" / "bin" / "ddtree-ops")] if (REPO / ".venv" / "bin" / "ddtree-ops").exists() \
        else ["ddtree-ops"]
    outcomes: list[dict] = []

    def deploy() -> None:
        done = subprocess.run([*cli, "deploy", "-i", str(inventory), "--source", str(snapshot), "--json"],
                              capture_output=True, text=True, timeout=300)
        outcomes.append({"code": done.returncode, **json.loads(done.stdout)})

    threads = [threading.Thread(target=deploy) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [o["code"] for o in outcomes] == [0, 0]
    assert sorted(o["hosts"]["h0"]["result"]["action"] for o in outcomes) == ["installed", "unchanged"]
    assert main(["rollback", "-i", str(inventory), "--source", str(snapshot)]) == 0
    assert site_listing(python) == before


def release_b(snapshot: Path, tmp_path: Path) -> Path:
    """A copy of the snapshot that is another release (B)."""
    other = tmp_path / "checkout-b"
    shutil.copytree(snapshot, other)
    (other / "ddtree_ops" / "hostside" / "release-b.txt").write_text("a different release\n")
    return other


def deployed(capsys, inventory: Path, source: Path) -> dict:
    """`deploy` that must succeed: its JSON document."""
    code, doc = run_cli(capsys, inventory, source, "deploy")
    assert code == 0, doc
    return doc


def test_a_new_release_replaces_the_old_one_file_for_file(host, env, capsys, tmp_path):
    _, inventory, _ = host
    python, snapshot = env
    other = release_b(snapshot, tmp_path)
    before = site_listing(python)
    first = deployed(capsys, inventory, snapshot)
    second = deployed(capsys, inventory, other)
    assert second["release"] != first["release"]
    assert second["hosts"]["h0"]["result"]["action"] == "replaced"
    added = sorted(set(site_listing(python)) - set(before))
    assert [p for p in added if p.endswith("/METADATA")] == [
        f"ddtree_sglang_plugin-0.1.0+{second['release']}.dist-info/METADATA"]
    assert len(added) == 5
    for release in (second["release"], first["release"]):  # each rollback undoes one deploy
        code, doc = run_cli(capsys, inventory, other, "rollback")
        assert code == 0 and doc["hosts"]["h0"]["result"]["release"] == release
    assert site_listing(python) == before


def release_a_deployed(capsys, host, env, tmp_path: Path) -> tuple[Path, dict, dict, dict, dict]:
    """Release A (the snapshot) deployed on a clean environment: (release B's checkout, the
    listing before, A's deploy document, the listing with A, the deployment folder with A)."""
    _, inventory, h0 = host
    python, snapshot = env
    other = release_b(snapshot, tmp_path)
    before = site_listing(python)
    first = deployed(capsys, inventory, snapshot)
    return other, before, first, site_listing(python), tree_listing(h0.workdir / "deployments")


def test_a_rollback_after_an_upgrade_puts_the_old_release_back_byte_for_byte(host, env, capsys, tmp_path):
    """Release A deployed, then B over it: rollback leaves the environment and the deployment
    folder as A left them (every file's bytes), A's plugin loads again; a second rollback
    removes A as the rollback of a fresh install does."""
    _, inventory, h0 = host
    python, snapshot = env
    other, before, first, with_a, deployments_a = release_a_deployed(capsys, host, env, tmp_path)
    record_a = json.loads(Path(first["hosts"]["h0"]["result"]["record"]).read_text())
    assert first["hosts"]["h0"]["result"]["rollback_restores"] is None  # a fresh install
    second = deployed(capsys, inventory, other)
    assert second["hosts"]["h0"]["result"]["action"] == "replaced"
    assert second["hosts"]["h0"]["result"]["rollback_restores"] == first["release"]
    assert site_listing(python) != with_a

    code, doc = run_cli(capsys, inventory, other, "rollback")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and (result["release"], result["restored"]) == (second["release"], first["release"]), doc
    assert site_listing(python) == with_a
    assert tree_listing(h0.workdir / "deployments") == deployments_a
    assert json.loads(Path(first["hosts"]["h0"]["result"]["record"]).read_text()) == record_a
    seen = fresh_python(python, LOAD_PLUGINS, DDTREE_ENABLE="1", DDTREE_STRICT="0")
    assert seen.returncode == 0 and json.loads(seen.stdout.strip().splitlines()[-1])["ddtree"].startswith(
        record_a["payload_dir"]), seen.stderr[-2000:]

    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and (result["release"], result["restored"]) == (first["release"], None), doc
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())


def killed_rollback(python: Path, workdir: Path, source: Path) -> None:
    """The installer's rollback as the agent runs it, killed right after it wrote the
    previous release's .pth (which the two releases share) and before its dist-info."""
    bundle = build_bundle(source)
    done = subprocess.run([str(python), "-c", BOOTSTRAP, "rollback", str(workdir)],
                          input=installer_stdin(bundle, "rollback"), capture_output=True, cwd="/", timeout=120,
                          env={"PATH": "/usr/bin:/bin", "DDTREE_DEPLOY_FAULT": "rollback-after-pth"})
    assert done.returncode == 137, done.stderr[-2000:]


def test_a_rollback_killed_half_way_is_finished_once_by_the_next_rollback_or_deploy(host, env, capsys, tmp_path):
    """B over A, then a rollback killed mid-way leaves A's .pth beside B's gone dist-info. The
    next rollback finishes that rollback (A back byte for byte), and only that one; a deploy
    instead finishes it first, then installs over A as it would have."""
    _, inventory, h0 = host
    python, snapshot = env
    other, before, first, with_a, deployments_a = release_a_deployed(capsys, host, env, tmp_path)
    second = deployed(capsys, inventory, other)
    with_b = site_listing(python)

    killed_rollback(python, h0.workdir, other)
    assert site_listing(python) not in (with_a, with_b)
    code, doc = run_cli(capsys, inventory, other, "rollback")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and (result["release"], result["restored"]) == (second["release"], first["release"]), doc
    assert site_listing(python) == with_a
    assert tree_listing(h0.workdir / "deployments") == deployments_a

    deployed(capsys, inventory, other)
    killed_rollback(python, h0.workdir, other)
    code, doc = run_cli(capsys, inventory, other, "deploy")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and result["action"] == "replaced", doc
    assert result["recovered"]["rollback_of"] == second["release"], result
    assert site_listing(python) == with_b

    for release in (second["release"], first["release"]):  # B back to A, then A's fresh install removed
        code, doc = run_cli(capsys, inventory, other, "rollback")
        assert code == 0 and doc["hosts"]["h0"]["result"]["release"] == release, doc
    assert site_listing(python) == before
    assert not list((h0.workdir / "deployments").iterdir())


def test_a_replaced_release_changed_since_is_never_put_back(host, env, capsys, tmp_path):
    """B over A, then A's kept payload edited: rollback keeps B and names the file; --force
    removes B and A's payload, putting nothing back."""
    _, inventory, h0 = host
    python, snapshot = env
    other = release_b(snapshot, tmp_path)
    before = site_listing(python)
    first = deployed(capsys, inventory, snapshot)
    payload_a = Path(json.loads(Path(first["hosts"]["h0"]["result"]["record"]).read_text())["payload_dir"])
    deployed(capsys, inventory, other)
    with_b = site_listing(python)
    tampered = payload_a / "ddtree" / "sglang" / "plugin.py"
    tampered.write_text(tampered.read_text() + "\nimport os  # planted\n")
    code, doc = run_cli(capsys, inventory, other, "rollback")
    error = doc["hosts"]["h0"]["error"]
    assert code == 5 and f"{tampered} (edited)" in error and "\n" not in error, doc
    assert "cannot be put back byte for byte" in error and site_listing(python) == with_b
    code, doc = run_cli(capsys, inventory, other, "rollback", "--force")
    assert code == 0 and doc["hosts"]["h0"]["result"]["restored"] is None, doc
    assert site_listing(python) == before and not payload_a.exists()


def test_a_replacement_that_fails_its_check_restores_the_previous_release(host, env, capsys, tmp_path):
    _, inventory, _ = host
    python, snapshot = env
    broken = tmp_path / "checkout-broken"
    shutil.copytree(snapshot, broken)
    plugin = broken / "src" / "ddtree" / "sglang" / "plugin.py"
    plugin.write_text(plugin.read_text() + "\n\ndef register():\n    raise RuntimeError('broken on purpose')\n")
    before = site_listing(python)
    code, first = run_cli(capsys, inventory, snapshot, "deploy")
    assert code == 0, first
    deployed = site_listing(python)
    code, second = run_cli(capsys, inventory, broken, "deploy")
    assert code == 5, second
    assert f"previous release {first['release']} restored" in second["hosts"]["h0"]["error"]
    assert site_listing(python) == deployed
    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    assert code == 0 and doc["hosts"]["h0"]["result"]["release"] == first["release"]
    assert site_listing(python) == before


def test_deploy_starts_the_hosts_python_twice_rollback_and_dry_run_once(sshd_fleet, env, tmp_path, capsys):
    """Counted by a `python` on the host that logs each start: a deploy is one agent process
    (lock + push + gate + install + record) plus the installer's check in a FRESH interpreter,
    which must be fresh (it loads the plugin as SGLang would). `exec -a` keeps the wrapper as
    sys.executable, so that fresh interpreter is started through it too and counted."""
    python, snapshot = env
    log = tmp_path / "python-starts.log"
    counted = wrapped_python(python, "python-counted", f'echo "start $*" >> {log}\n')
    before = site_listing(python)

    def starts() -> list[str]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return lines

    fleet = sshd_fleet(1, python=str(counted), command_timeout=120)
    inventory = fleet.write_inventory()
    try:
        code, doc = run_cli(capsys, inventory, snapshot, "deploy")
        assert code == 0, doc
        assert doc["hosts"]["h0"]["result"]["action"] == "installed"
        lines = starts()
        assert len(lines) == 2, lines
        assert " deploy " in lines[0] and lines[1] == "start -m ddtree.sglang.probe --gate-report - --require-gate-ok"

        code, doc = run_cli(capsys, inventory, snapshot, "deploy")  # unchanged: still verified
        assert (code, doc["hosts"]["h0"]["result"]["action"]) == (0, "unchanged")
        assert [" deploy " in s for s in starts()] == [True, False]

        code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--dry-run")
        assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "would stay unchanged"
        assert [" plan " in s for s in starts()] == [True]

        code, doc = run_cli(capsys, inventory, snapshot, "rollback")
        assert (code, doc["hosts"]["h0"]["result"]["action"]) == (0, "rolled-back")
        assert [" rollback " in s for s in starts()] == [True]
        assert site_listing(python) == before
    finally:
        if site_listing(python) != before:  # leave the module's environment as it was
            main(["rollback", "-i", str(inventory), "--source", str(snapshot)])
        counted.unlink()


def test_an_upgrade_is_refused_until_a_host_qualifies_it_then_deploys(host, env, capsys, tmp_path):
    """The operator's path for an SGLang whose hooked files drifted: deploy refuses and names
    the drift; `sglang qualify` deploys for qualification, runs the `plugin` stage and records
    the version, hashes and run id next to the inventory; deploy then accepts exactly that."""
    _, inventory, h0 = host
    python, snapshot = env
    hooked = site_dir(python) / "sglang" / "srt" / "speculative" / "spec_info.py"
    original = hooked.read_bytes()
    hooked.write_bytes(original + b"\n# a local patch release\n")
    qualified = tmp_path / "sglang-qualified.json"
    try:
        before = site_listing(python)
        code = main(["deploy", "-i", str(inventory), "--source", str(snapshot), "--qualified", str(qualified)])
        assert code == 3 and capsys.readouterr().err.strip().endswith(f"{qualified}: qualification file not found")
        code, doc = run_cli(capsys, inventory, snapshot, "deploy")  # the default file, next to the inventory: none
        assert code == 5 and "structure ok, hashes drifted, not qualified" in doc["hosts"]["h0"]["error"]
        assert site_listing(python) == before

        code = main(["sglang", "qualify", "-i", str(inventory), "--source", str(snapshot), "--stages", "plugin",
                     "--qualified", str(qualified), "--runs-dir", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert code == 0, err
        (entry,) = json.loads(qualified.read_text())["qualified"]
        assert (entry["sglang"], entry["host"], entry["stages"]) == ("0.5.23", "h0", {"plugin": "pass"})
        assert (tmp_path / "runs" / entry["run"] / "h0").is_dir()
        assert f"qualify: h0: sglang 0.5.23 qualified by run {entry['run']} (plugin pass); recorded in {qualified}" in err
        assert json.loads(Path(next((h0.workdir / "deployments").glob("*/record.json"))).read_text())["qualifying"] is True

        code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--qualified", str(qualified))
        assert code == 0, doc
        result = doc["hosts"]["h0"]["result"]
        assert result["evidence"] == f"structure ok, hashes drifted, qualified (run {entry['run']})"
        record = json.loads(Path(result["record"]).read_text())
        assert record["qualified_by"]["run"] == entry["run"] and record["forced"] is False

        hooked.write_bytes(original + b"\n# a different patch\n")  # not the files that were qualified
        code, doc = run_cli(capsys, inventory, snapshot, "deploy", "--qualified", str(qualified))
        assert code == 5 and "not qualified" in doc["hosts"]["h0"]["error"]

        qualified.write_text('{"qualified": [{"sglang": "0.5.23"}]}')
        code = main(["deploy", "-i", str(inventory), "--source", str(snapshot), "--qualified", str(qualified)])
        assert code == 3
        assert capsys.readouterr().err.strip().endswith(f"{qualified}: qualified[0].files: expected an object of "
                                                        "file -> sha256, got None")
        assert run_cli(capsys, inventory, snapshot, "rollback")[0] == 0
    finally:
        hooked.write_bytes(original)


READ_CONFIG = """
import json
from ddtree.sglang.config import DEFAULTS_PATH, load_config
config = load_config()
print(json.dumps({"enabled": config.enabled, "budget": config.budget, "defaults": str(DEFAULTS_PATH)}))
"""


def deployed_config(python: Path, **env: str) -> dict:
    seen = fresh_python(python, READ_CONFIG, **env)
    assert seen.returncode == 0, seen.stderr[-2000:]
    return json.loads(seen.stdout.strip().splitlines()[-1])


def test_budget_auto_writes_the_recommended_defaults_into_the_payload(host, env, capsys, tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "tests" / "cli"))
    from test_report_recommend_cli import QUIET, load_rows, write_run

    _, inventory, _ = host
    python, snapshot = env
    runs = tmp_path / "runs"
    write_run(runs, {"h0": (load_rows(1, 100.0, 200.0, 300.0) + load_rows(8, 400.0, 600.0, 380.0), QUIET)})
    before = site_listing(python)
    auto = ("--runs-dir", str(runs), "--budget", "auto", "--for-concurrency")

    code, doc = run_cli(capsys, inventory, snapshot, "deploy", *auto, "1")
    assert code == 0, doc
    result = doc["hosts"]["h0"]["result"]
    assert result["action"] == "installed"
    record = json.loads(Path(result["record"]).read_text())
    written = Path(record["payload_dir"]) / "ddtree_server_defaults.json"
    assert json.loads(written.read_text()) == result["server_defaults"] == {
        "variables": {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "64"},
        "provenance": {"source": "--budget auto", "run": "r1", "concurrency": 1, "choice": "ddtree"}}
    assert "ddtree_server_defaults.json" in record["payload_files"]
    # `status` reads the record and the defaults back (no server runs: DDTree as deployed)
    from sshd_fleet import free_port

    assert main(["status", "-i", str(inventory), "--port", str(free_port()), "--json"]) == 0
    seen = json.loads(capsys.readouterr().out)["hosts"]["h0"]["result"]
    assert (seen["deployed"]["release"], seen["deployed"]["record"]) == (result["release"], result["record"])
    assert seen["ddtree"] == {"enabled": True, "budget": 64, "from": "deploy --budget"}
    assert seen["sglang"] == "0.5.23" and seen["server"]["state"] == "not-running"
    # The plugin's config in a fresh interpreter of that environment: the file's budget, the
    # environment's where it sets one.
    seen = deployed_config(python)
    assert (seen["enabled"], seen["budget"], seen["defaults"]) == (True, 64, str(written))
    assert deployed_config(python, DDTREE_BUDGET="16")["budget"] == 16
    assert deployed_config(python, DDTREE_ENABLE="0")["enabled"] is False

    # DFlash wins at 8 concurrent: the same release, other defaults: not `unchanged`.
    code, doc = run_cli(capsys, inventory, snapshot, "deploy", *auto, "8")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "reconfigured", doc
    assert deployed_config(python)["enabled"] is False
    code, doc = run_cli(capsys, inventory, snapshot, "deploy", *auto, "8")
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "unchanged", doc
    code, doc = run_cli(capsys, inventory, snapshot, "deploy")  # no --budget: the file goes
    assert code == 0 and doc["hosts"]["h0"]["result"]["action"] == "reconfigured", doc
    assert deployed_config(python)["budget"] == 32 and not Path(deployed_config(python)["defaults"]).exists()

    # a rollback undoes one deploy: first the reconfiguration (the defaults of 8 come back), then the rest
    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    result = doc["hosts"]["h0"]["result"]
    assert code == 0 and result["restored"] == result["release"], doc
    assert deployed_config(python)["enabled"] is False
    code, doc = run_cli(capsys, inventory, snapshot, "rollback")
    assert code == 0 and doc["hosts"]["h0"]["result"]["restored"] is None, doc
    assert site_listing(python) == before


def test_an_installer_that_ignores_the_defaults_fails_the_host(host, env, capsys, tmp_path):
    _, inventory, _ = host
    python, snapshot = env
    older = tmp_path / "checkout-older"
    shutil.copytree(snapshot, older)
    installer = older / "ddtree_ops" / "hostside" / "sglang_install.py"
    text = installer.read_text()
    start = text.index("\ndef install_locked(")
    body = text.index("\n", text.index("):", start)) + 1
    # The installer as it was before server defaults: it never sees them.
    installer.write_text(text[:body] + '    sources = dict(sources, server_defaults=None)\n' + text[body:])
    code, doc = run_cli(capsys, inventory, older, "deploy", "--budget", "64")
    assert code == 5, doc
    assert "did not apply the server defaults (--budget)" in doc["hosts"]["h0"]["error"]
    assert run_cli(capsys, inventory, older, "rollback")[0] == 0
