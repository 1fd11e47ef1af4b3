"""`sglang qualify` against a hostile host (issue 40), over a real loopback sshd fleet with two
real environments holding sglang==0.5.23: h0's `python` forges its `plugin` stage, whose
metrics carry `file_sha256` for ONE file; h1's `spec_info.py` was tampered with code that runs
at import. A qualification entry holds only hashes ddtree-ops computed itself, over every file
the manifest pins, so it never vouches for h1's tampered file, and the deploy on h1 is refused
before any SGLang code is imported there."""
from __future__ import annotations

import hashlib
import json
import shutil
import stat
from pathlib import Path

import pytest

from ddtree.sglang.manifests import SUPPORTED, newest
from ddtree_ops.cli.app import main
from ddtree_ops.release import BUNDLE_DIRS, BUNDLE_FILES
from sglang_plugin.dist import site_dir

pytestmark = [pytest.mark.sshd, pytest.mark.slow]
SPEC_INFO = "srt/speculative/spec_info.py"
ONE_FILE = "srt/plugins/__init__.py"

# h0's python: the runner's `run` answers with a passing `plugin` stage of its own making;
# everything else (agent, installer, probe, the file reader) runs the real interpreter.
FORGER = '''#!{real}
import json, os, sys
argv = sys.argv[1:]
if len(argv) > 1 and argv[0].endswith("runner.py") and argv[1] == "run":
    run_id, host = argv[argv.index("--run-id") + 1], argv[argv.index("--host") + 1]
    metrics = {{"structure_ok": True, "pinned": False, "sglang": "0.5.23", "file_sha256": {forged!r}}}
    for record in ({{"event": "run_start", "stages": ["plugin"]}},
                   {{"event": "stage_end", "stage": "plugin", "index": 0, "status": "pass", "reason": "forged",
                     "duration_s": 0.1, "metrics": metrics, "tables": {{}}}},
                   {{"event": "run_end", "status": "pass", "counts": {{"pass": 1}}, "duration_s": 0.1, "exit_code": 0}}):
        record.update(v=1, run_id=run_id, host=host, time=1.0)
        print(json.dumps(record), flush=True)
    sys.exit(0)
os.execv({real!r}, [{real!r}, *argv])
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    from sglang_plugin.dist import make_sglang_venv

    repo = Path(__file__).resolve().parents[2]
    root = tmp_path_factory.mktemp("hostile-qualify")
    pythons = [make_sglang_venv(root / f"env{i}") for i in range(2)]
    snapshot = root / "checkout"
    for rel in BUNDLE_DIRS:
        shutil.copytree(repo / rel, snapshot / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in BUNDLE_FILES:
        shutil.copy(repo / rel, snapshot / rel)
    return pythons, snapshot


@pytest.fixture
def fleet(sshd_fleet, envs, tmp_path):
    """h0: a drifted (benignly patched) SGLang behind a forging python; h1: the same patch plus
    code at import in spec_info.py, which leaves a marker file when it runs."""
    pythons, snapshot = envs
    sglang = [site_dir(p) / "sglang" for p in pythons]
    originals = [(s / SPEC_INFO).read_bytes() for s in sglang]
    marker = tmp_path / "tampered-code-ran"
    patched = originals[0] + b"\n# a local patch release\n"
    (sglang[0] / SPEC_INFO).write_bytes(patched)
    (sglang[1] / SPEC_INFO).write_bytes(f"open({str(marker)!r}, 'w').write('ran')\n".encode() + patched)
    forged = {ONE_FILE: hashlib.sha256((sglang[0] / ONE_FILE).read_bytes()).hexdigest()}
    forger = tmp_path / "forger"
    forger.write_text(FORGER.format(real=str(pythons[0]), forged=forged))
    forger.chmod(forger.stat().st_mode | stat.S_IXUSR)
    hosts = sshd_fleet(2, command_timeout=180)
    inventory = hosts.write_inventory(host_overrides={"h0": {"python": str(forger)}, "h1": {"python": str(pythons[1])}})
    try:
        yield inventory, snapshot, sglang, marker, forger
    finally:
        for python in pythons:
            main(["rollback", "-i", str(inventory), "--source", str(snapshot), "--force"])
        for package, original in zip(sglang, originals):
            (package / SPEC_INFO).write_bytes(original)


def test_a_forged_plugin_stage_never_becomes_a_qualification_for_a_tampered_host(fleet, tmp_path, capsys):
    inventory, snapshot, sglang, marker, _ = fleet
    qualified = tmp_path / "sglang-qualified.json"
    code = main(["sglang", "qualify", "-i", str(inventory), "-H", "h0", "--source", str(snapshot),
                 "--stages", "plugin", "--qualified", str(qualified), "--runs-dir", str(tmp_path / "runs")])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    (entry,) = json.loads(qualified.read_text())["qualified"]
    pinned = newest(SUPPORTED).file_sha256
    # every pinned file, hashed by us from h0's bytes: not the one number the host sent
    assert sorted(entry["files"]) == sorted(pinned) and len(pinned) > 1
    assert entry["files"] == {rel: hashlib.sha256((sglang[0] / rel).read_bytes()).hexdigest() for rel in pinned}

    marker.unlink(missing_ok=True)
    code = main(["deploy", "-i", str(inventory), "-H", "h1", "--source", str(snapshot), "--qualified", str(qualified),
                 "--json"])
    doc = json.loads(capsys.readouterr().out)
    error = doc["hosts"]["h1"]["error"]
    assert code == 5 and "hashes drifted, not qualified" in error and "spec_info.py" in error, doc
    assert not marker.exists()  # the tampered file was never imported: not by the gate, not by a probe


def test_hashes_a_host_reports_that_differ_from_its_files_are_never_recorded(fleet, tmp_path, capsys):
    inventory, snapshot, sglang, _, forger = fleet
    forger.write_text(forger.read_text().replace(
        hashlib.sha256((sglang[0] / ONE_FILE).read_bytes()).hexdigest(), "0" * 64))
    qualified = tmp_path / "sglang-qualified.json"
    code = main(["sglang", "qualify", "-i", str(inventory), "-H", "h0", "--source", str(snapshot),
                 "--stages", "plugin", "--qualified", str(qualified), "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 5, err
    assert f"qualify: h0: not recorded: the host's plugin stage reported other hashes for {ONE_FILE} than " \
           "ddtree-ops read from its files" in err
    assert json.loads(qualified.read_text() if qualified.exists() else '{"qualified": []}')["qualified"] == []



def test_a_host_missing_a_pinned_file_is_refused_naming_it_and_nothing_is_recorded(fleet, tmp_path, capsys):
    """The qualifying deploy's gate (ours, on the host) refuses first; a file that vanishes
    after it is caught where ddtree-ops hashes the files (tests/unit/test_qualification_entry.py)."""
    inventory, snapshot, sglang, _, _ = fleet
    gone = sorted(rel for rel in newest(SUPPORTED).file_sha256 if rel not in (SPEC_INFO, ONE_FILE))[0]
    original = (sglang[0] / gone).read_bytes()
    (sglang[0] / gone).unlink()
    try:
        qualified = tmp_path / "sglang-qualified.json"
        code = main(["sglang", "qualify", "-i", str(inventory), "-H", "h0", "--source", str(snapshot),
                     "--stages", "plugin", "--qualified", str(qualified), "--runs-dir", str(tmp_path / "runs")])
        err = capsys.readouterr().err
    finally:
        (sglang[0] / gone).write_bytes(original)
    assert code == 5, err
    assert f"{sglang[0] / gone}: missing-file: not found" in err and "nothing recorded" in err, err
    assert not qualified.exists() or json.loads(qualified.read_text())["qualified"] == []


EAGLE_UTILS = "srt/speculative/eagle_utils.py"
# One line of eagle_sample (the tree verify the worker calls), changed so accept lengths break.
ACCEPT_INDEX = b"(bs, verify_input.max_tree_depth), -1, dtype=torch.int32, device=device"
BROKEN_ACCEPT_INDEX = b"(bs, verify_input.max_tree_depth - 1), -1, dtype=torch.int32, device=device"


def test_a_changed_hooked_eagle_sample_is_never_qualified_by_a_static_check(fleet, tmp_path, capsys):
    """#49 item 9: h0's eagle_sample has a one-line change (its structure holds). `qualify
    --stages plugin` (the form for a host without a GPU) used to record it as qualified from a
    static check, and deploy then said "qualified". Changed pinned code needs sglang-e2e to
    have passed: qualify refuses to record without it, and the gate on the host refuses an
    entry without it (one an older ddtree-ops recorded), naming the file; with it, it deploys.
    h0's other drift, a comment in spec_info.py, needs no end-to-end pass (its code is pinned)."""
    from ddtree.sglang.qualification import Qualification, render

    inventory, snapshot, sglang, _, _ = fleet
    eagle = sglang[0] / EAGLE_UTILS
    original = eagle.read_bytes()
    assert original.count(ACCEPT_INDEX) == 1
    eagle.write_bytes(original.replace(ACCEPT_INDEX, BROKEN_ACCEPT_INDEX))
    try:
        qualified = tmp_path / "sglang-qualified.json"
        code = main(["sglang", "qualify", "-i", str(inventory), "-H", "h0", "--source", str(snapshot),
                     "--stages", "plugin", "--qualified", str(qualified), "--runs-dir", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert code == 5, err
        assert (f"qualify: h0: not recorded: code changed in 1 pinned file(s) ({eagle}: hooked definitions changed: "
                "eagle_sample), and a static check cannot vouch for changed code: run `--stages plugin,sglang-e2e`") \
            in err, err
        assert not qualified.exists() or json.loads(qualified.read_text())["qualified"] == []

        pinned = newest(SUPPORTED).file_sha256
        files = {rel: hashlib.sha256((sglang[0] / rel).read_bytes()).hexdigest() for rel in pinned}

        def entry(**stages: str) -> str:
            return render([Qualification(sglang="0.5.23", files=files, run="20261201-220000-abcdef", host="h0",
                                         stages=stages)])

        qualified.write_text(entry(plugin="pass"))  # as a static-only qualification was recorded before
        code = main(["deploy", "-i", str(inventory), "-H", "h0", "--source", str(snapshot), "--qualified",
                     str(qualified), "--json"])
        error = json.loads(capsys.readouterr().out)["hosts"]["h0"]["error"]
        assert code == 5 and "structure ok, hashes drifted, not qualified" in error, error
        assert ("the qualification by run 20261201-220000-abcdef (plugin pass) does not vouch for it: code changed in "
                f"{EAGLE_UTILS}, which needs sglang-e2e to have passed") in error, error

        qualified.write_text(entry(plugin="pass", **{"sglang-e2e": "pass"}))
        code = main(["deploy", "-i", str(inventory), "-H", "h0", "--source", str(snapshot), "--qualified",
                     str(qualified), "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert code == 0, doc
        assert doc["hosts"]["h0"]["result"]["evidence"] == \
            "structure ok, hashes drifted, qualified (run 20261201-220000-abcdef)"
    finally:
        eagle.write_bytes(original)
