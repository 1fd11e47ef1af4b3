"""The shipped stages, each made to pass and made to fail: `import` against a real extracted
release (tampered file, wrong release id, foreign ddtree on sys.path, ddtree from elsewhere),
`golden` and `invariants` against a deliberately broken builder, `env`, `tree-bench`."""
from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the runner and its stages run for real in subprocesses: not in `make test-quick`
pytestmark = pytest.mark.slow
sys.path.insert(0, str(REPO))

from ddtree_ops.release import build_bundle  # noqa: E402
from ddtree_ops.hostside.protocol import SmokeOptions, StageContext, Status  # noqa: E402


def make_ctx(tmp_path: Path, stage: str, release_root: Path = REPO, expected: str | None = None,
             **options) -> StageContext:
    logged: list[str] = []
    metrics: dict = {}
    return StageContext(stage=stage, device="cpu", options=SmokeOptions.from_dict(options),
                        host={"name": "test"}, run_dir=tmp_path / "run",
                        release_root=release_root, expected_release=expected,
                        log=logged.append, emit_metric=metrics.__setitem__)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, str]:
    """<workdir>/releases/<id>/ extracted from a real bundle of this checkout; current -> it."""
    root = tmp_path_factory.mktemp("workdir")
    bundle = build_bundle(REPO)
    target = root / "releases" / bundle.release_id
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(bundle.archive()), mode="r:gz") as tar:
        tar.extractall(target)
    (root / "current").symlink_to(target)
    return root, bundle.release_id


def run_import_stage(workdir: Path, *extra: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, str(workdir / "current" / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id",
         "t", "--workdir", str(workdir), "--stages", "import", *extra],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]  # blank: keepalive
    ends = [record for record in records if record["event"] == "stage_end"]
    return ends[0]


def test_import_passes_on_an_intact_release(workdir):
    root, release_id = workdir
    record = run_import_stage(root, "--expected-release", release_id)
    assert record["status"] == "pass", record["reason"]
    assert record["metrics"]["release"] == release_id
    assert record["metrics"]["ddtree_file"].startswith(str(root / "releases" / release_id))


def test_import_fails_when_the_operator_pushed_another_release(workdir):
    root, release_id = workdir
    record = run_import_stage(root, "--expected-release", "0123456789abcdef")
    assert record["status"] == "fail"
    assert record["reason"] == f"host runs release {release_id}, operator pushed 0123456789abcdef"


def test_import_fails_with_a_foreign_ddtree_on_sys_path(workdir, tmp_path):
    root, _ = workdir
    (tmp_path / "ddtree").mkdir()
    (tmp_path / "ddtree" / "__init__.py").write_text("STALE = True\n")
    record = run_import_stage(root, env={"PYTHONPATH": str(tmp_path)})
    assert record["status"] == "fail"
    assert record["reason"] == f"another ddtree is on sys.path: {tmp_path / 'ddtree'}"


def test_a_copy_identical_to_the_release_on_sys_path_is_not_foreign(workdir, tmp_path):
    """The `local` host after `pip install ddtree-ops` (not editable): the operator's own Python
    has the very ddtree the release was bundled from in its site-packages. One changed byte in
    that copy and it is foreign again."""
    import shutil

    root, release_id = workdir
    site = tmp_path / "site-packages"
    shutil.copytree(root / "releases" / release_id / "src" / "ddtree", site / "ddtree")
    (site / "ddtree" / "__pycache__").mkdir(exist_ok=True)  # what Python leaves there: not a release file
    (site / "ddtree" / "__pycache__" / "tree.cpython-311.pyc").write_bytes(b"bytecode")
    record = run_import_stage(root, "--expected-release", release_id, env={"PYTHONPATH": str(site)})
    assert record["status"] == "pass", record["reason"]
    with (site / "ddtree" / "__init__.py").open("a") as stale:
        stale.write("# an older install\n")
    record = run_import_stage(root, env={"PYTHONPATH": str(site)})
    assert record["reason"] == f"another ddtree is on sys.path: {site / 'ddtree'}"


def release_copy(workdir: Path, factory) -> tuple[Path, Path]:
    """A fresh workdir holding a copy of the release (current -> it): (workdir, release)."""
    import shutil

    root, release_id = workdir
    copy = factory.mktemp("copy")
    (copy / "releases").mkdir()
    shutil.copytree(root / "releases" / release_id, copy / "releases" / release_id, symlinks=True)
    (copy / "current").symlink_to(copy / "releases" / release_id)
    return copy, copy / "releases" / release_id


def run_runner(workdir: Path, stages: str, *extra: str) -> tuple[int, list[dict], str]:
    proc = subprocess.run(
        [sys.executable, str(workdir / "current" / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id",
         "t", "--workdir", str(workdir), "--stages", stages, *extra],
        capture_output=True, text=True, timeout=120)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], proc.stderr


MARKER_CODE = "open({marker!r}, 'w').write('ran')\n"


def test_a_tampered_release_is_refused_before_any_of_it_runs(workdir, tmp_path_factory):
    root, release_id = workdir
    copy, release = release_copy(workdir, tmp_path_factory)
    marker = copy / "tampered-code-ran"
    victim = release / "src" / "ddtree" / "metrics.py"
    victim.write_text(MARKER_CODE.format(marker=str(marker)) + victim.read_text())
    code, records, stderr = run_runner(copy, "import,golden", "--expected-release", release_id)
    assert code == 5 and not marker.exists()
    start, end = records[0], records[-1]
    assert start["error"].startswith(f"release {release_id} at {release} is not intact: "
                                     "hash mismatch in src/ddtree/metrics.py")
    assert end["status"] == "fail" and end["exit_code"] == 5
    stages = {r["stage"]: r for r in records if r["event"] == "stage_end"}
    assert {s: r["status"] for s, r in stages.items()} == {"import": "not_run", "golden": "not_run"}
    assert stages["import"]["reason"] == f"not run: {start['error']}"
    assert "is not intact" in stderr


def test_a_linked_folder_in_the_release_is_refused(workdir, tmp_path_factory):
    """A link could stand in for any module, even torch: the release leads sys.path."""
    copy, release = release_copy(workdir, tmp_path_factory)
    fake = copy / "fake_torch"
    fake.mkdir()
    marker = copy / "fake-torch-ran"
    (fake / "__init__.py").write_text(MARKER_CODE.format(marker=str(marker)))
    (release / "src" / "torch").symlink_to(fake)
    code, records, _ = run_runner(copy, "env,import")
    assert code == 5 and not marker.exists()
    assert records[0]["error"].endswith("is not intact: unexpected link src/torch")


def test_current_pointing_outside_the_workdirs_releases_is_refused(workdir, tmp_path_factory):
    copy, release = release_copy(workdir, tmp_path_factory)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "releases"
    elsewhere.mkdir()
    release.rename(elsewhere / release.name)
    (copy / "current").unlink()
    (copy / "current").symlink_to(elsewhere / release.name)
    code, records, _ = run_runner(copy, "import")
    assert code == 5
    assert records[0]["error"] == (f"{copy / 'current'} leads to {elsewhere / release.name}, not to a "
                                   f"release in {copy / 'releases'}")


def test_planted_bytecode_in_the_release_is_never_run(workdir, tmp_path_factory):
    """A .pyc in the release's __pycache__ whose header matches its source (mtime, size) is
    what plain Python would run; the runner compiles the release from its verified sources."""
    import importlib.util
    import py_compile

    root, release_id = workdir
    copy, release = release_copy(workdir, tmp_path_factory)
    marker = copy / "planted-bytecode-ran"
    victim = release / "src" / "ddtree" / "metrics.py"
    size, mtime = victim.stat().st_size, victim.stat().st_mtime
    evil = tmp_path_factory.mktemp("evil") / "metrics.py"
    code_text = MARKER_CODE.format(marker=str(marker)) + "from ddtree.metrics_real import *\n"
    evil.write_text(code_text + "#" * (size - len(code_text.encode()) - 1) + "\n")
    assert evil.stat().st_size == size
    os.utime(evil, (mtime, mtime))
    py_compile.compile(str(evil), cfile=importlib.util.cache_from_source(str(victim)), dfile=str(victim),
                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    # the plant works on plain Python ...
    plain = subprocess.run([sys.executable, "-c", "import ddtree.metrics"], cwd=release / "src",
                           capture_output=True, text=True, timeout=120)
    assert marker.exists(), plain.stderr
    marker.unlink()
    # ... and not in a smoke run, which passes on the verified sources
    code, records, _ = run_runner(copy, "import,golden", "--expected-release", release_id)
    stages = {r["stage"]: r for r in records if r["event"] == "stage_end"}
    assert code == 0, stages
    assert not marker.exists()
    assert stages["import"]["reason"] == f"release {release_id} intact, ddtree from it"


def test_check_release_names_every_kind_of_damage(workdir, tmp_path_factory):
    from ddtree_ops.hostside.release_check import check_release

    root, release_id = workdir
    assert check_release(root / "current") == (release_id, [])
    copy, release = release_copy(workdir, tmp_path_factory)
    (release / "src" / "ddtree" / "tree.py").write_text("edited")
    (release / "src" / "ddtree" / "extra.py").write_text("stray")
    (release / "src" / "ddtree" / "inputs.py").unlink()
    (release / "ddtree_ops" / "hostside" / "linked.py").symlink_to(release / "ddtree_ops" / "hostside" / "protocol.py")
    (release / "src" / "ddtree" / "__pycache__").mkdir(exist_ok=True)
    (release / "src" / "ddtree" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"ignored")
    renamed = release.parent / "0000000000000000"
    release.rename(renamed)
    got_id, problems = check_release(renamed)
    assert got_id == release_id
    assert sorted(problems) == sorted([  # the agent's own check: one rule for push, prune and smoke
        "hash mismatch in src/ddtree/tree.py",
        "missing file src/ddtree/inputs.py",
        "unexpected file src/ddtree/extra.py",
        "unexpected link ddtree_ops/hostside/linked.py",
        f"release directory 0000000000000000 holds manifest {release_id}",
    ])


def test_import_in_process_sees_ddtree_from_elsewhere(workdir, tmp_path):
    """This test process imported ddtree from the checkout, not from the release."""
    from ddtree_ops.hostside.stages import env as _  # noqa: F401
    import importlib

    stage = importlib.import_module("ddtree_ops.hostside.stages.import")
    root, release_id = workdir
    result = stage.run(make_ctx(tmp_path, "import", root / "current", release_id))
    assert result.status is Status.FAIL
    assert "was imported from" in result.reason and "not from the release" in result.reason


def test_golden_passes_and_carries_the_seed_output(tmp_path):
    from ddtree_ops.hostside.stages import golden

    result = golden.run(make_ctx(tmp_path, "golden"))
    assert result.status is Status.PASS, result.reason
    assert result.metrics["seed_output"] == golden.SEED_OUTPUT
    seed = Path("/work/shared/seeds/000_44c6339df762f231.txt")
    if seed.is_file():  # the copy the stage carries is the seed's own text
        text = seed.read_text()
        for line in golden.SEED_OUTPUT:
            assert line in text
        for line in golden.SEED_SCRIPT.splitlines()[2:]:
            assert line in text


def test_golden_fails_on_a_broken_builder(tmp_path, monkeypatch):
    import ddtree
    from ddtree_ops.hostside.stages import golden

    real = ddtree.build_ddtree_tree_from_logits
    monkeypatch.setattr(ddtree, "build_ddtree_tree_from_logits",
                        lambda logits, budget, **kw: real(logits, max(0, budget - 1), **kw))
    result = golden.run(make_ctx(tmp_path, "golden"))
    assert result.status is Status.FAIL
    assert result.reason.startswith("parents: got [-1, 0, 1, 2, 0], expected [-1, 0, 1, 2, 0, 1]")
    assert result.metrics["seed_output_matches"] is False


def test_invariants_fail_when_the_batched_builder_drifts(tmp_path, monkeypatch):
    import ddtree
    from ddtree_ops.hostside.stages import invariants

    real = ddtree.build_ddtree_trees
    monkeypatch.setattr(ddtree, "build_ddtree_trees",
                        lambda logits, budget: real(logits.flip(-1), budget))
    result = invariants.run(make_ctx(tmp_path, "invariants"))
    assert result.status is Status.FAIL
    assert "batched" in result.reason


def test_env_reports_the_interpreter(tmp_path):
    from ddtree_ops.hostside.stages import env

    result = env.run(make_ctx(tmp_path, "env"))
    assert result.status is Status.PASS
    import torch

    assert result.metrics["torch"] == torch.__version__
    assert result.metrics["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert env._version_tuple("2.3.1+cu121") < env.MIN_TORCH <= env._version_tuple("2.13.0+cpu")


def test_tree_bench_small_sweep_has_every_point(tmp_path):
    from ddtree_ops.hostside.stages import tree_bench

    ctx = make_ctx(tmp_path, "tree-bench", budgets=[0, 8], batch_sizes=[1, 3], repeat=1,
                   extra={"vocab": 500})
    result = tree_bench.run(ctx)
    assert result.status is Status.PASS
    points = {(r["builder"], r["batch_size"], r["budget"]) for r in result.tables["sweep"]}
    assert points == {(b, 1, k) for b in ("heap", "public", "batched", "floor") for k in (0, 8)} | \
        {(b, 3, k) for b in ("batched", "floor") for k in (0, 8)}
    nodes = {r["budget"]: r["nodes"] for r in result.tables["sweep"] if r["builder"] == "heap"}
    assert nodes == {0: 0, 8: 8}
    assert result.metrics["build_ms.batched.bs3.b8"] > 0
    assert "speedup.public_vs_heap.b8" in result.metrics


class SteppingClock:
    """A perf_counter that moves `step` seconds per reading: a host so busy that every call is slow."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("seconds, calls", [(0.5, 1), (0, 4)])
def test_tree_bench_time_budget_cuts_calls_never_points(tmp_path, monkeypatch, seconds, calls):
    """Past its time budget the sweep still times every point, once each (and skips the
    warm-ups); with no budget (0) every point gets `repeat` calls."""
    from ddtree_ops.hostside.stages import tree_bench

    monkeypatch.setattr(tree_bench.time, "perf_counter", SteppingClock(1.0))
    ctx = make_ctx(tmp_path, "tree-bench", budgets=[4, 8], batch_sizes=[1, 2], repeat=4,
                   extra={"vocab": 300, "tree_bench_seconds": seconds})
    result = tree_bench.run(ctx)
    assert result.status is Status.PASS
    assert len(result.tables["sweep"]) == 2 * (4 + 2)
    cells = [t for t in result.tables["timings"] if t["cell"].startswith("build_ms.")]
    assert len(cells) == 12 and {t["samples"] for t in cells} == {calls}
    assert result.metrics["time_budget_s"] == seconds


def test_tree_bench_time_budget_knob_is_checked():
    from ddtree_ops.hostside.protocol import check_knobs

    assert check_knobs({"tree_bench_seconds": 0}) == {"tree_bench_seconds": 0}
    with pytest.raises(ValueError, match="tree_bench_seconds: expected a number >= 0"):
        check_knobs({"tree_bench_seconds": -1})


def test_pacer_spreads_the_budget_over_the_points(monkeypatch):
    from ddtree_ops.hostside.stages import tree_bench

    monkeypatch.setattr(tree_bench.time, "perf_counter", lambda: 100.0)
    pacer = tree_bench.Pacer(2.0, 4)
    assert [pacer.next_deadline() for _ in range(4)] == [100.5, 101.0, 101.5, 102.0]
    assert tree_bench.Pacer(0, 4).next_deadline() is None


def test_the_runner_keeps_torch_threads_from_spinning(monkeypatch):
    """The runner sets OMP_WAIT_POLICY=PASSIVE before it imports torch, unless the operator
    chose a policy."""
    from ddtree_ops.hostside import runner

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    try:
        runner._preload()
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        runner._preload()
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    finally:
        # _preload freezes the heap (for the runner's forked worker): this test process's
        # objects go back to the collector, or cycles made before stay until exit
        gc.unfreeze()


def install_release(workdir: Path, checkout: Path) -> Path:
    bundle = build_bundle(checkout)
    target = workdir / "releases" / bundle.release_id
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(bundle.archive()), mode="r:gz") as tar:
        tar.extractall(target)
    return target


SWITCH_STAGE = """
import os
from pathlib import Path
NAME = "switch"
DESCRIPTION = "re-points current, as a push during the run would"
def run(ctx):
    from ddtree_ops.hostside.protocol import StageResult
    current = Path(ctx.run_dir).parents[1] / "current"
    os.unlink(current)
    os.symlink(ctx.host["switch_to"], current)
    return StageResult.passed("switched")
"""


def test_a_push_during_a_run_does_not_change_the_release_the_run_executes(tmp_path):
    from fixtures.checkout import copy_release_files

    whoami = 'NAME = "whoami"\nDESCRIPTION = "says which release"\n' \
             'def run(ctx):\n    from ddtree_ops.hostside.protocol import StageResult\n    return StageResult.passed({!r})\n'
    first = install_release(tmp_path, copy_release_files(tmp_path / "a", {"switch": SWITCH_STAGE,
                                                                           "whoami": whoami.format("first")}))
    second = install_release(tmp_path, copy_release_files(tmp_path / "b", {"switch": SWITCH_STAGE,
                                                                            "whoami": whoami.format("second")}))
    (tmp_path / "current").symlink_to(f"releases/{first.name}")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "current" / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "t",
         "--workdir", str(tmp_path), "--stages", "switch,whoami,import",
         "--host-entry", json.dumps({"switch_to": f"releases/{second.name}"})],
        capture_output=True, text=True, timeout=120)
    stages = {r["stage"]: r for r in map(json.loads, filter(str.strip, proc.stdout.splitlines())) if r["event"] == "stage_end"}
    assert os.readlink(tmp_path / "current") == f"releases/{second.name}"  # switched mid-run
    assert stages["whoami"]["reason"] == "first"
    assert stages["import"]["status"] == "pass" and first.name in stages["import"]["reason"]


def test_a_manifest_line_with_a_nul_byte_is_damage_not_a_crash(workdir, tmp_path_factory):
    copy, release = release_copy(workdir, tmp_path_factory)
    with open(release / "MANIFEST.sha256", "ab") as manifest:
        manifest.write(b"0" * 64 + b"  src/a\x00b\n")
    code, records, _ = run_runner(copy, "env")
    assert code == 5
    assert "is not intact: unsafe path in manifest: 'src/a\\x00b'" in records[0]["error"]
    assert records[-1]["event"] == "run_end" and records[-1]["status"] == "fail"
