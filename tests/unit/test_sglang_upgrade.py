"""SGLang upgrades: structure and pins judged separately, qualification, diff and new
manifests, against the real sglang 0.5.22 and 0.5.23 packages (pip install --no-deps)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddtree.sglang import gate, manifest_tool
from ddtree.sglang.diff import Change, diff_installations
from ddtree.sglang.gate import Evidence, FindingKind, run_gate
from ddtree_ops.hostside.sglang_install import gate_refusal
from ddtree.sglang.manifest import Manifest
from ddtree.sglang.manifests import SUPPORTED, newest
from ddtree.sglang.qualification import Qualification, QualificationError, parse, render
from ddtree.sglang.structure import check_worker, worker_source
from sglang_plugin.dist import PREVIOUS_SGLANG_VERSION, SGLANG_VERSION, copy_gate_files, sglang_package_dir

# What differs between 0.5.22 and what the plugin hooks in 0.5.23, each with the text of
# the upstream files that shows it (read below, so the list cannot drift from the files).
DIFFERING_HOOKS = {
    "SpeculativeAlgorithm.get_platform_worker_cls": ("srt/speculative/spec_info.py", "def get_platform_worker_cls("),
    "KVIndexTranslator.plan": ("srt/mem_cache/kv_index_translator.py", "translated_writes"),
    "DFlashVerifyInput.prepare_for_verify": ("srt/speculative/dflash_info.py", "defer_metadata_init"),
    "draft_tp_context": ("srt/speculative/spec_utils.py", "def draft_tp_context(layout"),
    "DFlashWorkerV2._target_logits_processor": ("srt/speculative/dflash_worker_v2.py", "self._target_logits_processor ="),
    "DFlashWorkerV2.draft_parallel_layout": ("srt/speculative/dflash_worker_v2.py", "self.draft_parallel_layout ="),
}


@pytest.fixture(scope="module")
def old_package() -> Path:
    return sglang_package_dir(PREVIOUS_SGLANG_VERSION)


@pytest.fixture(scope="module")
def new_package() -> Path:
    return sglang_package_dir()


@pytest.fixture
def commented_copy(tmp_path) -> tuple[Path, Path]:
    """A copy of 0.5.23 with a comment added inside a hooked function: (package, the file)."""
    package = copy_gate_files(tmp_path / "site-packages")
    hooked = package / "srt/speculative/dflash_utils.py"
    text = hooked.read_text()
    anchor = "def resolve_dflash_verify_mask_policy(attn_backend"
    start = text.index(anchor)
    body = text.index(":\n", text.index(")", start)) + 2
    hooked.write_text(text[:body] + "    # reviewed locally\n" + text[body:])
    return package, hooked


def qualification_for(report: gate.GateReport, run: str = "20261201-220000-abcd") -> Qualification:
    return Qualification(sglang=report.version or "", files=report.file_sha256, run=run, host="h0")


def test_the_upstream_evidence_for_each_differing_hook(old_package, new_package):
    for name, (rel, text) in DIFFERING_HOOKS.items():
        assert text in (new_package / rel).read_text(), name
        assert text not in (old_package / rel).read_text(), name


def test_structure_on_0_5_22_names_exactly_the_hooks_that_differ(old_package):
    report = run_gate(old_package)
    assert report.version == PREVIOUS_SGLANG_VERSION and report.manifest_version == SGLANG_VERSION
    assert not report.structure_ok and not report.ok
    assert sorted(report.broken_hooks) == sorted(DIFFERING_HOOKS)
    kinds = {f.name: f.kind for f in report.of(Evidence.STRUCTURE)}
    assert kinds["draft_tp_context"] is FindingKind.NAME_MISMATCH
    assert kinds["DFlashWorkerV2.draft_parallel_layout"] is FindingKind.WORKER_FACT
    refusal = gate_refusal(report.to_dict())
    assert refusal.startswith("sglang 0.5.22: structure differs from sglang 0.5.23 in 6 hook(s): ")
    assert all(name in refusal for name in DIFFERING_HOOKS) and "\n" not in refusal


def test_the_real_0_5_23_keeps_every_worker_fact(new_package):
    facts = check_worker(new_package, worker_source())
    assert facts.broken == []
    assert facts.checked["imports"] >= 15 and facts.checked["attributes inherited"] >= 10
    assert facts.checked["keywords to inherited methods"] >= 8 and facts.checked["keywords to SGLang objects"] >= 3


def test_a_worker_fact_that_breaks_is_named(tmp_path):
    package = copy_gate_files(tmp_path / "site-packages")
    sampler = package / "srt/speculative/eagle_utils.py"
    sampler.write_text(sampler.read_text().replace(
        "def eagle_sample(", "def eagle_sample(*_a, custom_logit_processor=None, **_k): pass\n\n\ndef _old_eagle_sample(", 1))
    report = run_gate(package)
    assert "eagle_sample" in report.broken_hooks and not report.structure_ok


def test_a_comment_in_a_hooked_file_is_structure_ok_hashes_drifted_not_qualified(commented_copy):
    package, hooked = commented_copy
    report = run_gate(package)
    assert (report.structure_ok, report.pinned, report.qualified_by, report.ok) == (True, False, None, False)
    assert report.verdict() == "structure ok, hashes drifted, not qualified"
    (finding,) = report.findings
    assert (finding.kind, finding.file) == (FindingKind.HASH_MISMATCH, str(hooked))
    assert finding.detail.endswith("; changed only outside the hooked definitions")
    refusal = gate_refusal(report.to_dict())
    assert refusal == (f"sglang 0.5.23: structure ok, hashes drifted, not qualified: 1 pinned file(s) differ from "
                       f"sglang 0.5.23: {hooked}: changed only outside the hooked definitions; qualify it with "
                       f"`ddtree-ops sglang qualify`, or --force deploys anyway (recorded)")


def test_a_code_change_in_a_hooked_body_is_named(commented_copy):
    package, hooked = commented_copy
    hooked.write_text(hooked.read_text().replace("    # reviewed locally\n", "    attn_backend = attn_backend\n"))
    (finding,) = run_gate(package).findings
    assert finding.detail.endswith("; hooked definitions changed: resolve_dflash_verify_mask_policy")


def test_a_qualification_with_the_same_hashes_vouches_for_the_drift(commented_copy):
    package, hooked = commented_copy
    entry = qualification_for(run_gate(package))
    report = run_gate(package, qualifications=[entry])
    assert report.ok and report.qualified_by["run"] == entry.run
    assert report.verdict() == f"structure ok, hashes drifted, qualified (run {entry.run})"
    other_version = Qualification("0.5.24", entry.files, entry.run, "h0")
    assert run_gate(package, qualifications=[other_version]).qualified_by is None
    hooked.write_text(hooked.read_text() + "# and one more line\n")  # not what was qualified
    assert run_gate(package, qualifications=[entry]).qualified_by is None


def test_qualification_never_passes_a_structure_that_differs(old_package):
    report = run_gate(old_package)
    vouched = run_gate(old_package, qualifications=[qualification_for(report)])
    assert vouched.qualified_by is not None and not vouched.ok


@pytest.mark.parametrize("text, message", [
    ("not json", "q.json: not JSON: "),
    ('{"entries": []}', "q.json: expected an object with a `qualified` list"),
    ('{"qualified": [{"sglang": "0.5.24", "run": "r", "host": "h"}]}', "q.json: qualified[0].files: expected an object"),
    ('{"qualified": [{"sglang": "0.5.24", "files": {"a.py": "xyz"}, "run": "r", "host": "h"}]}',
     "q.json: qualified[0].files['a.py']: expected a sha256 (64 hex digits), got 'xyz'"),
    ('{"qualified": [{"sglang": "", "files": {"a.py": "' + "0" * 64 + '"}, "run": "r", "host": "h"}]}',
     "q.json: qualified[0].sglang: expected a non-empty string, got ''"),
])
def test_a_malformed_qualification_file_is_one_line_naming_the_field(text, message):
    with pytest.raises(QualificationError) as err:
        parse(text, "q.json")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_gate_cli_reads_a_qualification_file(commented_copy, tmp_path, capsys):
    package, _ = commented_copy
    qualified = tmp_path / "sglang-qualified.json"
    assert gate.main(["--package-dir", str(package)]) == 1
    assert "structure ok, hashes drifted, not qualified: REFUSED" in capsys.readouterr().out
    qualified.write_text(render([qualification_for(run_gate(package))]))
    assert gate.main(["--package-dir", str(package), "--qualified", str(qualified)]) == 0
    assert "qualified (run 20261201-220000-abcd): passes" in capsys.readouterr().out
    qualified.write_text('{"qualified": 3}')
    assert gate.main(["--package-dir", str(package), "--qualified", str(qualified)]) == 2
    assert capsys.readouterr().out == f"{qualified}: expected an object with a `qualified` list\n"


def test_manifest_tool_writes_a_manifest_only_for_a_qualified_sound_version(commented_copy, old_package, tmp_path, capsys):
    package, _ = commented_copy
    metadata = package.parent / f"sglang-{SGLANG_VERSION}.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"Version: {SGLANG_VERSION}", "Version: 0.5.24", 1))
    assert manifest_tool.main([str(package)]) == 1
    assert "sglang 0.5.24 at" in capsys.readouterr().err
    qualified = tmp_path / "sglang-qualified.json"
    qualified.write_text(render([qualification_for(run_gate(package))]))
    assert manifest_tool.main([str(package), "--qualified", str(qualified)]) == 0
    manifest = Manifest.from_json(capsys.readouterr().out)
    assert manifest.sglang_version == "0.5.24" and manifest.file_sha256 == run_gate(package).file_sha256
    reference = newest(SUPPORTED)
    assert [(r.qualname, r.signature) for r in manifest.names] == [(r.qualname, r.signature) for r in reference.names]
    # dropped into the manifests folder, it pins 0.5.24: the gate passes with no qualification
    report = run_gate(package, {**SUPPORTED, "0.5.24": manifest})
    assert report.ok and report.pinned and report.findings == []

    assert manifest_tool.main([str(old_package), "--qualified", str(qualified)]) == 1
    err = capsys.readouterr().err
    assert "structure differs from sglang 0.5.23: " in err and "draft_tp_context" in err


def test_diff_by_hook_between_0_5_22_and_0_5_23(old_package, new_package):
    result = diff_installations(old_package, new_package, newest(SUPPORTED))
    by_name = {h.qualname: h for f in result.files for h in f.hooks}
    assert by_name["draft_tp_context"].change is Change.SIGNATURE
    assert by_name["draft_tp_context"].detail == "(owns_attention) -> (layout)"
    assert by_name["SpeculativeAlgorithm.get_platform_worker_cls"].change is Change.ADDED
    assert {f.file: f.state for f in result.files}["srt/plugins/__init__.py"] == "same"
    signature_changes = {h.qualname for h in by_name.values() if h.change is Change.SIGNATURE}
    assert signature_changes == {"draft_tp_context", "KVIndexTranslator.plan", "DFlashVerifyInput.prepare_for_verify"}
    assert json.loads(json.dumps(result.to_dict()))["version_b"] == SGLANG_VERSION


def test_diff_of_a_comment_touches_no_hook(commented_copy, new_package):
    package, hooked = commented_copy
    result = diff_installations(new_package, package, newest(SUPPORTED))
    changed = [f for f in result.files if f.state == "changed"]
    assert [f.file for f in changed] == ["srt/speculative/dflash_utils.py"]
    assert changed[0].hooks_touched == [] and changed[0].elsewhere == [] and result.hooks_touched == []
