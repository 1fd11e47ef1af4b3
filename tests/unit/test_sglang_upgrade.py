"""SGLang upgrades: structure and pins judged separately, qualification, diff and new
manifests, against the real sglang 0.5.22 and 0.5.23 packages (pip install --no-deps)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddtree.sglang import gate, manifest_tool, structure
from ddtree.sglang.diff import Change, diff_installations, hooked_files
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
    "LogitsProcessor.is_deferred_shard": ("srt/layers/logits_processor.py", "def is_deferred_shard("),
    "LogitsProcessor.finish_deferred_gather": ("srt/layers/logits_processor.py", "def finish_deferred_gather("),
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


def qualification_for(report: gate.GateReport, run: str = "20261201-220000-abcd", **stages: str) -> Qualification:
    """An entry for the report's files; `stages` as recorded (default: plugin and sglang-e2e passed)."""
    return Qualification(sglang=report.version or "", files=report.file_sha256, run=run, host="h0",
                         stages=stages or {"plugin": "pass", "sglang-e2e": "pass"})


def test_the_upstream_evidence_for_each_differing_hook(old_package, new_package):
    for name, (rel, text) in DIFFERING_HOOKS.items():
        assert text in (new_package / rel).read_text(), name
        assert text not in (old_package / rel).read_text(), name


@pytest.mark.slow
def test_structure_on_0_5_22_names_exactly_the_hooks_that_differ(old_package):
    report = run_gate(old_package)
    assert report.version == PREVIOUS_SGLANG_VERSION and report.manifest_version == SGLANG_VERSION
    assert not report.structure_ok and not report.ok
    assert sorted(report.broken_hooks) == sorted(DIFFERING_HOOKS)
    kinds = {f.name: f.kind for f in report.of(Evidence.STRUCTURE)}
    assert kinds["draft_tp_context"] is FindingKind.NAME_MISMATCH
    assert kinds["DFlashWorkerV2.draft_parallel_layout"] is FindingKind.WORKER_FACT
    refusal = gate_refusal(report.to_dict())
    assert refusal.startswith(f"sglang 0.5.22: structure differs from sglang 0.5.23 in {len(DIFFERING_HOOKS)} hook(s): ")
    assert all(name in refusal for name in DIFFERING_HOOKS) and "\n" not in refusal


# The least each fact family checks on the real 0.5.23 (fewer: a check went blind).
WORKER_FACT_MINIMUMS = {
    "imports": 15, "keywords to imported names": 6, "keywords to inherited methods": 8,
    "calls to SGLang objects": len(structure.FOREIGN_METHODS), "attributes inherited": 10,
    "attributes of SGLang objects": len(structure.FOREIGN_ATTRIBUTES), "TP sync sites": 1, "head shard fields": 6,
    "eagle_sample": 1, "eagle_sample broadcasts": len(structure.EAGLE_BROADCASTS),
}

# One break per fact family, planted in a copy of 0.5.23: (file, text, replacement, the fact named).
PLANTED_BREAKS = {
    "imports": ("srt/layers/logprob_processor.py", "def compute_spec_logprobs(", "def compute_spec_logprobs_v2(",
                "compute_spec_logprobs"),
    "keywords to imported names": ("srt/layers/sampler.py", "    num_tokens_in_batch: int = 1,\n):",
                                   "    num_tokens: int = 1,\n):", "apply_custom_logit_processor"),
    "keywords to inherited methods": ("srt/speculative/dflash_worker_v2.py",
                                      "        on_publish=None,\n        grammar_barrier=None,\n",
                                      "        on_publish=None,\n        barrier=None,\n",
                                      "DFlashWorkerV2.forward_batch_generation"),
    "keywords to SGLang objects": ("srt/mem_cache/kv_loc_plan.py", "reader: KVIndexTranslator, *, cols: Optional",
                                   "reader: KVIndexTranslator, *, columns: Optional", "KVLocPlan.bind"),
    "keywords to the TP group": ("srt/distributed/parallel_state.py", "input_: torch.Tensor, src: int = 0)",
                                 "input_: torch.Tensor, root: int = 0)", "GroupCoordinator.broadcast"),
    "methods of SGLang objects": ("srt/layers/logits_processor.py", "def is_deferred_shard(",
                                  "def is_deferred_shard_v2(", "LogitsProcessor.is_deferred_shard"),
    "attributes inherited": ("srt/speculative/dflash_worker_v2.py", "self._mask_token_id = self._resolve",
                             "self._mask_token = self._resolve", "DFlashWorkerV2._mask_token_id"),
    "attributes of SGLang objects": ("srt/distributed/parallel_state.py", "self.world_size = len(ranks)",
                                     "self.size = len(ranks)", "GroupCoordinator.world_size"),
    "TP sync sites": ("srt/speculative/spec_tp_sync.py", "    DFLASH_ACCEPT_GREEDY = 15", "    DFLASH_ACCEPT_ARGMAX = 15",
                      "SpecTpSyncSite.DFLASH_ACCEPT_GREEDY"),
    "head shard fields": ("srt/layers/vocab_parallel_embedding.py", "    added_vocab_end_index: int\n",
                          "    added_vocab_stop_index: int\n",
                          "VocabParallelEmbeddingShardIndices.added_vocab_end_index"),
    "eagle_sample": ("srt/speculative/eagle_utils.py", "    (which contains spec decoding information).\n    \"\"\"\n",
                     "    (which contains spec decoding information).\n    \"\"\"\n    apply_custom_logit_processor("
                     "logits_output.next_token_logits, batch.sampling_info)\n", "eagle_sample"),
    "eagle_sample broadcasts": ("srt/speculative/eagle_utils.py",
                                "            tp_group.broadcast(accept_index, src=0)\n"
                                "            tp_group.broadcast(num_correct_drafts, src=0)\n\n    if SIMULATE_ACC_LEN",
                                "            tp_group.broadcast(num_correct_drafts, src=0)\n\n    if SIMULATE_ACC_LEN",
                                "eagle_sample"),
}


@pytest.mark.slow
def test_the_real_0_5_23_keeps_every_worker_fact(new_package):
    facts = check_worker(new_package, worker_source())
    assert facts.broken == []
    assert set(facts.checked) == set(WORKER_FACT_MINIMUMS)
    assert {family: n for family, n in facts.checked.items() if n < WORKER_FACT_MINIMUMS[family]} == {}


@pytest.mark.slow
@pytest.mark.parametrize("family", PLANTED_BREAKS)
def test_each_worker_fact_that_breaks_is_named_with_its_file(family, tmp_path):
    rel, text, replacement, name = PLANTED_BREAKS[family]
    package = copy_gate_files(tmp_path / "site-packages")
    planted = package / rel
    original = planted.read_text()
    assert original.count(text) == 1, text
    planted.write_text(original.replace(text, replacement))
    facts = check_worker(package, worker_source())
    assert {(fact.file, fact.name) for fact in facts.broken} == {(rel, name)}


# Breaks planted on the plugin's side, against the real 0.5.23: (module, text, replacement, the fact named).
PLUGIN_SIDE_BREAKS = {
    "attributes the worker reads": (structure.WORKER_MODULE, "self._draft_block_ids_buf[:bs]",
                                    "self._draft_block_ids_buffer[:bs]", ("srt/speculative/dflash_worker_v2.py",
                                                                          "DFlashWorkerV2._draft_block_ids_buffer")),
    "head shard fields": (structure.TREE_ROUND_MODULE, "    added_vocab_end_index: int\n",
                          "    added_vocab_end_index: int\n    lora_vocab_end_index: int\n",
                          ("srt/layers/vocab_parallel_embedding.py",
                           "VocabParallelEmbeddingShardIndices.lora_vocab_end_index")),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", PLUGIN_SIDE_BREAKS)
def test_a_plugin_side_break_of_a_worker_fact_is_named(family, new_package):
    module, text, replacement, fact = PLUGIN_SIDE_BREAKS[family]
    sources = {m: structure.plugin_source(m) for m in (structure.WORKER_MODULE, structure.TREE_ROUND_MODULE)}
    assert sources[module].count(text) == 1, text
    sources[module] = sources[module].replace(text, replacement)
    facts = check_worker(new_package, sources[structure.WORKER_MODULE], sources[structure.TREE_ROUND_MODULE])
    assert [(f.file, f.name) for f in facts.broken] == [fact]


@pytest.mark.slow
def test_a_comment_in_a_hooked_file_is_structure_ok_hashes_drifted_not_qualified(commented_copy):
    package, hooked = commented_copy
    report = run_gate(package)
    assert (report.structure_ok, report.pinned, report.qualified_by, report.ok) == (True, False, None, False)
    assert report.verdict() == "structure ok, hashes drifted, not qualified"
    (finding,) = report.findings
    assert (finding.kind, finding.file) == (FindingKind.HASH_MISMATCH, str(hooked))
    assert finding.detail.endswith("; comments or formatting only (its code is the pinned code)")
    refusal = gate_refusal(report.to_dict())
    assert refusal == (f"sglang 0.5.23: structure ok, hashes drifted, not qualified: 1 pinned file(s) differ from "
                       f"sglang 0.5.23: {hooked}: comments or formatting only (its code is the pinned code); qualify it with "
                       f"`ddtree-ops sglang qualify`, or --force deploys anyway (recorded)")


@pytest.mark.slow
def test_a_code_change_in_a_hooked_body_is_named(commented_copy):
    package, hooked = commented_copy
    hooked.write_text(hooked.read_text().replace("    # reviewed locally\n", "    attn_backend = attn_backend\n"))
    (finding,) = run_gate(package).findings
    assert finding.detail.endswith("; hooked definitions changed: resolve_dflash_verify_mask_policy")


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_static_qualification_vouches_only_for_unchanged_code(commented_copy):
    """#49 item 9: an entry whose run passed only `plugin` (a static check) vouches for a build
    whose pinned files differ in comments alone; once code changed, only an entry whose
    sglang-e2e passed does, and the refusal says why."""
    package, hooked = commented_copy
    static = qualification_for(run_gate(package), plugin="pass")
    assert run_gate(package, qualifications=[static]).ok  # a comment: the code is the pinned code
    hooked.write_text(hooked.read_text().replace("    # reviewed locally\n", "    attn_backend = attn_backend\n"))
    report = run_gate(package)
    assert report.code_changed == ["srt/speculative/dflash_utils.py"]
    static = qualification_for(report, plugin="pass")
    refused = run_gate(package, qualifications=[static])
    assert refused.qualified_by is None and not refused.ok
    assert refused.qualification_note == (
        f"the qualification by run {static.run} (plugin pass) does not vouch for it: code changed in "
        "srt/speculative/dflash_utils.py, which needs sglang-e2e to have passed (a GPU host, or the CPU test server)")
    assert refused.qualification_note in gate_refusal(refused.to_dict())
    assert run_gate(package, qualifications=[qualification_for(report)]).ok


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # #49 item 10: every file the gate checks is covered, not only the pinned and named ones:
    # logits_processor.py is read by the worker's facts (LogitsProcessor.is_deferred_shard, ...)
    states = {f.file: (f.state, f.checked_as.value) for f in result.files}
    assert states["srt/layers/logits_processor.py"] == ("changed", "worker facts")
    checked = set(run_gate(old_package).checked_sha256) | set(run_gate(new_package).checked_sha256)
    assert checked <= set(states)


@pytest.mark.slow
def test_diff_of_a_comment_touches_no_hook(commented_copy, new_package):
    package, hooked = commented_copy
    result = diff_installations(new_package, package, newest(SUPPORTED))
    changed = [f for f in result.files if f.state == "changed"]
    assert [f.file for f in changed] == ["srt/speculative/dflash_utils.py"]
    assert changed[0].hooks_touched == [] and changed[0].elsewhere == [] and result.hooks_touched == []


@pytest.mark.slow
def test_diff_names_a_changed_file_that_only_the_worker_facts_read(tmp_path, new_package, capsys):
    """A file neither pinned nor named (tp_worker.py, whose forward_batch_generation the worker
    calls with keywords) changes: `sglang diff` names it and what changed in it."""
    from ddtree_ops.cli.app import main

    package = copy_gate_files(tmp_path / "site-packages")
    changed = package / "srt/managers/tp_worker.py"
    assert "srt/managers/tp_worker.py" not in hooked_files(newest(SUPPORTED))
    changed.write_text(changed.read_text() + "\n\ndef added_by_a_patch():\n    return 1\n")
    assert main(["sglang", "diff", str(new_package), str(package)]) == 0
    out = capsys.readouterr().out
    assert "  srt/managers/tp_worker.py (worker facts): changed: 0 of 0 hooked definitions, 1 other definitions" in out
    assert "    elsewhere: added_by_a_patch" in out


def test_diff_reads_a_fifo_or_a_huge_file_as_unreadable_never_hangs(tmp_path, new_package):
    import os
    import threading

    package = copy_gate_files(tmp_path / "site-packages")
    pinned = package / "srt/speculative/spec_info.py"
    pinned.unlink()
    os.mkfifo(pinned)
    results: list = []
    worker = threading.Thread(target=lambda: results.append(diff_installations(new_package, package,
                                                                                newest(SUPPORTED))), daemon=True)
    worker.start()
    worker.join(timeout=120)  # wide: a diff takes a few seconds
    assert results, "sglang diff blocked on a FIFO"
    states = {f.file: f.state for f in results[0].files}
    assert states["srt/speculative/spec_info.py"] == "unreadable in B: not a plain file"
