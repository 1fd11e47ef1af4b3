"""Write the manifest (JSON data) for one SGLang version from its real files.

    python -m ddtree.sglang.manifest_tool --qualified sglang-qualified.json SGLANG_PACKAGE_DIR \
        > src/ddtree/sglang/manifests/sglang-X.Y.Z.json

The lists below say WHAT we rely on; the tool reads the version, the hashes, the signatures
and the definitions' syntax-tree digests from the files themselves. A version we do not ship
yet must be qualified (`ddtree-ops sglang qualify`: an entry of the qualification file with
these exact hashes) and keep the structure of the newest shipped manifest; then shipping it
is a reviewed data change. Stdlib only.

exit 0: written; 1: refused (not qualified, structure differs); 2: bad arguments or files.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from ddtree.sglang.gate import Evidence, read_installed_version, run_gate
from ddtree.sglang.manifest import (
    Manifest,
    NameKind,
    RequiredName,
    definition_digest,
    describe_static,
    find_definition,
    module_digest,
    parse_file,
    sha256_file,
    signature_from_ast,
)
from ddtree.sglang.qualification import QualificationError
from ddtree.sglang.qualification import load as load_qualifications

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
        required = RequiredName(file, qualname, kind, signature, tuple(fields), value, why, definition_digest(node))
        ok, detail = describe_static(tree, required)
        if not ok:
            raise SystemExit(f"{file}: {qualname}: {detail}")
        out.append(required)
    return out


def build_manifest(package_dir: Path) -> Manifest:
    version = read_installed_version(package_dir)
    if version is None:
        raise SystemExit(f"{package_dir}: the sglang version cannot be read (no dist-info, no _version.py)")
    hashes = {rel: sha256_file(package_dir / rel) for rel in PINNED_FILES}
    code = {rel: module_digest(parse_file(package_dir / rel)) for rel in PINNED_FILES}
    return Manifest(sglang_version=version, file_sha256=hashes, names=tuple(build_required(package_dir)),
                    file_ast_sha256=code)


def render(package_dir: Path) -> str:
    return build_manifest(package_dir).to_json()


class Refused(Exception):
    """The installation may not become a shipped manifest (one line: why)."""


def check_shippable(package_dir: Path, qualified: Path | None) -> None:
    """A shipped version may be regenerated; a new one needs the structure of the newest
    manifest and a qualification entry with its exact hashes."""
    from ddtree.sglang.manifests import SUPPORTED

    report = run_gate(package_dir, qualifications=load_qualifications(qualified) if qualified else [])
    if not report.structure_ok:
        raise Refused(f"sglang {report.version} at {package_dir}: structure differs from sglang "
                      f"{report.manifest_version}: {', '.join(report.broken_hooks)} (the plugin needs a code change first)")
    if report.version in SUPPORTED or report.qualified_by is not None:
        return
    where = f"in {qualified}" if qualified else "(give --qualified FILE)"
    raise Refused(f"sglang {report.version} at {package_dir} is not qualified {where}: no entry with these "
                  f"file hashes (run `ddtree-ops sglang qualify` on a host with it)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.sglang.manifest_tool", description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", type=Path, help="the installed `sglang` package directory")
    parser.add_argument("--qualified", type=Path, metavar="FILE", help="the qualification file listing this version")
    args = parser.parse_args(argv)
    if not (args.package_dir / "srt").is_dir():
        print(f"{args.package_dir}: not an sglang package directory (no srt/)", file=sys.stderr)
        return 2
    try:
        check_shippable(args.package_dir, args.qualified)
        text = render(args.package_dir)
    except QualificationError as err:
        print(err, file=sys.stderr)
        return 2
    except Refused as err:
        print(err, file=sys.stderr)
        return 1
    except (OSError, ValueError, SyntaxError, RecursionError) as err:  # a file it cannot read as one
        detail = str(err).splitlines()[0] if str(err) else ""
        print(f"{args.package_dir}: cannot read this sglang: {type(err).__name__}: {detail}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
