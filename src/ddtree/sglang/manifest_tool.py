"""Write the manifest module for one SGLang version from its real files.

    python -m ddtree.sglang.manifest_tool SGLANG_PACKAGE_DIR > src/ddtree/sglang/manifests/v0_5_23.py

The lists below say WHAT we rely on; the tool reads the version, the hashes and the
signatures from the files themselves. Review the diff before committing a new manifest.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from ddtree.sglang.gate import read_installed_version
from ddtree.sglang.manifest import (
    NameKind,
    RequiredName,
    describe_static,
    find_definition,
    sha256_file,
    signature_from_ast,
)

# Every file we hook, subclass or whose behaviour the worker depends on.
PINNED_FILES: tuple[str, ...] = (
    "srt/plugins/__init__.py",
    "srt/plugins/hook_registry.py",
    "srt/arg_groups/speculative_hook.py",
    "srt/speculative/spec_info.py",
    "srt/speculative/dflash_utils.py",
    "srt/speculative/dflash_worker_v2.py",
    "srt/speculative/dflash_info.py",
    "srt/speculative/dflash_info_v2.py",
    "srt/speculative/eagle_utils.py",
    "srt/speculative/eagle_worker_common.py",
    "srt/speculative/spec_utils.py",
    "kernels/ops/speculative/reconstruct_tree.py",
    "srt/model_executor/runner/decode_cuda_graph_runner.py",
    "srt/layers/attention/flashinfer_backend.py",
    "srt/layers/attention/triton_backend.py",
)

F, M, C = NameKind.FUNCTION, NameKind.METHOD, NameKind.CLASSMETHOD
# (file, qualname, kind, fields-or-None, why)
REQUIRED: tuple[tuple[str, str, NameKind, tuple[str, ...], str], ...] = (
    ("srt/plugins/__init__.py", "GENERAL_PLUGINS_GROUP", NameKind.CONSTANT, (), "our entry-point group"),
    ("srt/plugins/__init__.py", "load_plugins", F, (), "runs register() then apply_hooks()"),
    ("srt/plugins/hook_registry.py", "HookRegistry.register", C, (), "registers H1-H3"),
    ("srt/plugins/hook_registry.py", "HookRegistry.apply_hooks", C, (), "self-check runs right after it"),
    ("srt/plugins/hook_registry.py", "HookRegistry", NameKind.FIELDS, ("_hooks", "_patched"), "self-check reads them"),
    ("srt/plugins/hook_registry.py", "HookType", NameKind.FIELDS, ("AFTER", "AROUND"), "hook kinds we use"),
    ("srt/arg_groups/speculative_hook.py", "_handle_dflash", F, (), "H1 target"),
    ("srt/arg_groups/overrides.py", "declare_resolution", F, (), "H1 sets the verify width"),
    ("srt/arg_groups/model_override_base.py", "resolving_view", F, (), "H1 reads resolved args"),
    ("srt/runtime_context.py", "get_spec", F, (), "spec config bag (scoped override for the draft)"),
    ("srt/runtime_context.py", "get_schedule", F, (), "page size check"),
    ("srt/runtime_context.py", "get_parallel", F, (), "DP attention check"),
    ("srt/runtime_context.py", "attn_dp_enabled_of", F, (), "H1 DP attention check"),
    ("srt/runtime_context.py", "_ConfigBag.override", M, (), "scoped verify-width override"),
    ("srt/speculative/spec_info.py", "SpeculativeAlgorithm.create_worker", M, (), "H2 target"),
    ("srt/speculative/spec_info.py", "SpeculativeAlgorithm.is_dflash", M, (), "H2 dispatch"),
    ("srt/speculative/spec_info.py", "SpeculativeAlgorithm.get_platform_worker_cls", M, (), "H2 refuses platform workers"),
    ("srt/speculative/dflash_utils.py", "resolve_dflash_verify_mask_policy", F, (), "H3 target"),
    ("srt/speculative/dflash_utils.py", "parse_dflash_draft_config", F, (), "drafter block size"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.__init__", M, (), "subclassed"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.forward_batch_generation", M, (), "overridden"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.alloc_memory_pool", M, (), "draft-width scope"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.init_attention_backends", M, (), "draft-width scope"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.init_cuda_graphs", M, (), "draft-width scope"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.prewarm_sampling", M, (), "overridden: rehearsed at N"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._prewarm_batch_size", M, (), "sampling rehearsal batch"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc", M, (), "draft KV of the accepted path"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._draft_write_ids", M, (), "draft KV write ids"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._ensure_draft_block_buffers", M, (), "draft block buffers"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._make_next_draft_input_decode", M, (), "carries the bonus"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._maybe_build_draft_sampler", M, (), "disabled: DDTree needs logits"),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._validate_phase1_sampling_support", M, (), "sampling warnings"),
    ("srt/speculative/dflash_worker_v2.py", "_resolve_dflash_embedding_module", F, (), "drafter input embedding"),
    ("kernels/ops/speculative/cache_locs.py", "assign_extend_cache_locs_func", F, (), "verify window slots"),
    ("srt/mem_cache/kv_index_translator.py", "KVIndexTranslator.plan", M, (), "the round's one KV plan"),
    ("srt/mem_cache/kv_loc_plan.py", "KVLocPlan.bind", M, (), "the draft binds the window's first B columns"),
    ("srt/speculative/spec_sampling_mask.py", "SpeculativeSamplingMaskCapture.from_logits", C, (), "sampling masks"),
    ("srt/speculative/spec_sampling_mask.py", "SpeculativeSamplingMaskCapture.build_output", M, (), "sampling masks"),
    ("srt/speculative/spec_utils.py", "GrammarTree.from_device", C, (), "grammar over the tree (async copy)"),
    ("srt/speculative/spec_utils.py", "build_grammar_vocab_mask", F, (), "grammar over the tree"),
    ("srt/layers/logprob_processor.py", "compute_spec_logprobs", F, (), "logprobs of accepted rows"),
    ("srt/layers/sampler.py", "apply_custom_logit_processor", F, (), "custom logit processors on the verify rows"),
    ("srt/sampling/sampling_batch_info.py", "SamplingBatchInfo", NameKind.FIELDS,
     ("has_custom_logit_processor", "custom_params", "custom_logit_processor"), "custom logit processors"),
    ("srt/speculative/dflash_info.py", "DFlashVerifyInput", NameKind.FIELDS,
     ("draft_token", "positions", "draft_token_num", "custom_mask", "capture_hidden_mode", "kv_loc_plan"), "verify input"),
    ("srt/speculative/dflash_info.py", "DFlashVerifyInput.prepare_for_verify", M, (), "verify forward batch"),
    ("srt/speculative/dflash_info_v2.py", "DFlashDraftInputV2", NameKind.FIELDS, ("bonus_tokens", "new_seq_lens"), "bonus relay"),
    ("srt/speculative/dflash_info_v2.py", "DFlashDraftInputV2.prepare_for_decode", M, (), "reserves 2N slots"),
    ("srt/speculative/eagle_utils.py", "eagle_sample", F, (), "tree verify"),
    ("srt/speculative/spec_utils.py", "move_accept_tokens_to_target_kvcache", F, (), "accepted KV to the front"),
    ("srt/speculative/spec_utils.py", "draft_tp_context", F, (), "draft head scope, as DFlash's greedy head"),
    ("srt/layers/vocab_parallel_embedding.py", "VocabParallelEmbeddingShardIndices", NameKind.FIELDS,
     ("org_vocab_start_index", "org_vocab_end_index", "padded_org_vocab_start_index", "padded_org_vocab_end_index",
      "added_vocab_start_index", "added_vocab_end_index"), "token ids of the local lm_head rows (HeadShard)"),
    ("srt/distributed/parallel_state.py", "GroupCoordinator.all_gather", M, (), "TP > 1: gathers per-rank top-K"),
    ("srt/distributed/parallel_state.py", "GroupCoordinator.broadcast", M, (), "rank 0's trees to every TP rank"),
    ("srt/speculative/spec_tp_sync.py", "SpecTpSync.sync", M, (), "TP > 1: rank 0's accept decision"),
    ("srt/speculative/spec_tp_sync.py", "SpecTpSyncSite", NameKind.FIELDS,
     ("DFLASH_ACCEPT_GREEDY",), "TP sync site of the greedy accept step"),
    ("srt/speculative/dflash_worker_v2.py", "_is_all_greedy", F, (), "picks the TP sync site"),
)


def build_required(package_dir: Path) -> list[RequiredName]:
    out: list[RequiredName] = []
    for file, qualname, kind, fields, why in REQUIRED:
        tree = ast.parse((package_dir / file).read_text(encoding="utf-8"))
        node = find_definition(tree, qualname)
        if node is None:
            raise SystemExit(f"{file}: {qualname} not found")
        signature = value = None
        if kind in (F, M, C):
            signature = signature_from_ast(node, drop_first=kind is not F)  # type: ignore[arg-type]
        elif kind is NameKind.CONSTANT:
            value = repr(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        required = RequiredName(file, qualname, kind, signature, tuple(fields), value, why)
        ok, detail = describe_static(tree, required)
        if not ok:
            raise SystemExit(f"{file}: {qualname}: {detail}")
        out.append(required)
    return out


def render(package_dir: Path) -> str:
    version = read_installed_version(package_dir)
    hashes = {rel: sha256_file(package_dir / rel) for rel in PINNED_FILES}
    lines = [
        f'"""Generated by ddtree.sglang.manifest_tool from the real sglang=={version} files."""',
        "from ddtree.sglang.manifest import Manifest, NameKind, RequiredName",
        "",
        "MANIFEST = Manifest(",
        f"    sglang_version={version!r},",
        "    file_sha256={",
        *[f"        {rel!r}: {digest!r}," for rel, digest in hashes.items()],
        "    },",
        "    names=(",
    ]
    for r in build_required(package_dir):
        lines.append(
            f"        RequiredName({r.file!r}, {r.qualname!r}, NameKind.{r.kind.name}, "
            f"{r.signature!r}, {r.fields!r}, {r.value!r}, {r.why!r}),"
        )
    lines += ["    ),", ")", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", type=Path, help="the installed `sglang` package directory")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.package_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
