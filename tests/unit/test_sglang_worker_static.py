"""DDTreeWorkerV2 cannot run without a GPU: check its own glue statically, against the real
sglang==0.5.23 sources where it relies on them. What the worker assumes of SGLang's names
(imports, keywords, inherited attributes, TP names, eagle_sample's behaviour) is checked by
`ddtree.sglang.structure`, on a host by the deploy gate and here by test_sglang_upgrade.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddtree.sglang.manifest import class_fields, find_definition
from ddtree.sglang.structure import module_file
from sglang_plugin.dist import sglang_site

WORKER = Path(__file__).resolve().parents[2] / "src" / "ddtree" / "sglang" / "worker.py"
WORKER_TREE = ast.parse(WORKER.read_text())


def _parse(site: Path, module: str) -> ast.Module:
    return ast.parse((site / "sglang" / module_file(module)).read_text())


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in node.body if isinstance(s, ast.FunctionDef)}


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


def test_only_the_greedy_accept_decision_is_synced():
    """eagle_sample broadcasts its sampled decisions from rank 0 itself (a structure fact):
    the worker syncs only the greedy one, whose CUDA path eagle_sample does not broadcast."""
    used = {node.attr for node in ast.walk(WORKER_TREE)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "SpecTpSyncSite"}
    assert used == {"DFLASH_ACCEPT_GREEDY"}


def test_custom_logit_processors_are_applied_once_before_eagle_sample():
    """eagle_sample applies penalties, bias and grammar but not custom logit processors (a
    structure fact; DFlash's linear verify applies them itself): the worker must apply them to
    all N rows of each request before eagle_sample, exactly once."""
    forward = _methods(find_definition(WORKER_TREE, "DDTreeWorkerV2"))["forward_batch_generation"]
    calls = [node for node in ast.walk(forward) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    by_name = {}
    for call in calls:
        by_name.setdefault(call.func.id, []).append(call)
    (apply,) = by_name["apply_custom_logit_processor"]
    (sample,) = by_name["eagle_sample"]
    assert (apply.lineno, apply.col_offset) < (sample.lineno, sample.col_offset)
    assert ast.unparse(apply.args[0]) == "logits_output.next_token_logits"
    assert {k.arg: ast.unparse(k.value) for k in apply.keywords} == {"num_tokens_in_batch": "width"}


# The methods a decode round runs, and the host values they may turn into Python numbers:
# DFlash's host-side lengths (*_cpu, nxt_kv_lens_sum), config read at startup and shapes.
ROUND_METHODS = ("forward_batch_generation", "_draft_top_k", "_draft_block_hidden", "_target_verify")
HOST_VALUE_MARKERS = ("_cpu", "nxt_kv_lens_sum", "_mask_token_id", "world_size")
READBACK_METHODS = frozenset({"cpu", "item", "tolist", "numpy", "from_host"})


def _worker_method(name: str) -> ast.FunctionDef:
    worker_class = find_definition(WORKER_TREE, "DDTreeWorkerV2")
    return find_definition(ast.Module(body=worker_class.body, type_ignores=[]), name)


def test_a_decode_round_reads_no_device_value_on_the_host():
    """Under the overlap scheduler a host read of a device value blocks the CPU behind the
    in-flight forward. The tensor steps are checked at run time on CPU (test_sglang_tree_round);
    here the worker's own glue: no .cpu()/.item()/.tolist() (GrammarTree.from_host included:
    from_device starts an async copy, spec_utils.py:713-729), and int()/bool()/float() only of
    host-side values."""
    found = []
    for method in ROUND_METHODS:
        for node in ast.walk(_worker_method(method)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in READBACK_METHODS:
                found.append(f"{method}: {ast.unparse(node)}")
            if isinstance(func, ast.Name) and func.id in ("int", "bool", "float") and node.args:
                text = ast.unparse(node.args[0])
                if not any(marker in text for marker in HOST_VALUE_MARKERS):
                    found.append(f"{method}: {ast.unparse(node)}")
    assert found == []


def test_the_verify_mask_is_sized_from_dflashs_host_reservation(site):
    """pack_round_inputs takes the mask bound from nxt_kv_lens_sum, which DFlash's
    prepare_for_decode sets on the host for every decode batch (and filter/merge keep)."""
    calls = [n for n in ast.walk(_worker_method("forward_batch_generation"))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "mask_prefix_bound"]
    assert [ast.unparse(c.args[0]) for c in calls] == ["draft_input.nxt_kv_lens_sum"]
    info = (site / "sglang" / "srt" / "speculative" / "dflash_info_v2.py").read_text()
    assert "self.nxt_kv_lens_sum = nxt_kv_lens_sum" in info  # prepare_for_decode
    assert "reserve = 2 * block_size" in info  # >= prefix + N: the window is reserved ahead


def _called_names(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_sampling_memory_is_rehearsed_at_the_verify_width(site):
    """DFlash rehearses its sampler on [bs*B, V] (dflash_worker_v2.py:799-882) and the scheduler
    sizes headroom and KV from it (scheduler.py:1166-1180). DDTree's sampled verify is
    eagle_sample's target-only path at N: the override must rehearse the probability tensors
    that path allocates (eagle_utils.py:720-750), at the verify width."""
    upstream = _parse(site, "sglang.srt.speculative.dflash_worker_v2")
    dflash_prewarm = find_definition(upstream, "DFlashWorkerV2.prewarm_sampling")
    assert "block_size = int(self.block_size)" in ast.unparse(dflash_prewarm)  # B: why we override
    eagle = find_definition(_parse(site, "sglang.srt.speculative.eagle_utils"), "eagle_sample")
    allocating = {"sampling_softmax", "top_k_renorm_prob", "top_p_renorm_prob", "zeros_like"}
    assert allocating <= _called_names(eagle)
    ours = _worker_method("prewarm_sampling")
    assert allocating <= _called_names(ours)
    text = ast.unparse(ours)
    assert "width = self.verify_width" in text and "bs = self._prewarm_batch_size(width)" in text
    assert "rows = bs * width" in text and "torch.zeros((rows, vocab_size)" in text
    assert "sampling_prewarm_result = result" in text  # where the scheduler reads it


def test_tensor_parallel_ranks_verify_rank_zeros_trees():
    """Trees go through _rank0_trees (a broadcast of the packed trees from rank 0 over the TP
    group, GroupCoordinator.broadcast(input_, src=0)) before anything is built from them."""
    text = ast.unparse(_worker_method("forward_batch_generation"))
    assert "trees = self._rank0_trees(trees_from_top_k(top, self.ddtree.budget))" in text
    rank0 = ast.unparse(_worker_method("_rank0_trees"))
    assert "tp_group.broadcast(packed, src=0)" in rank0 and "unpack_trees(packed, trees.budget, self.draft_block - 1)" in rank0


def test_the_accept_width_is_the_drafters_block(site):
    """accept_index is [bs, max_tree_depth] (eagle_utils.py:633-635) and a logprob request
    gathers accept_index.shape[1] rows per request (logprob_processor.py:401-404): B, not N.
    The scheduler reads next_token_ids with speculative_output_stride when it is given
    (batch_result_processor.py:86-93), so out_tokens [bs, B] is read with stride B."""
    text = ast.unparse(_worker_method("forward_batch_generation"))
    assert "TreeVerifyView.from_inputs(inputs, custom_mask, accept_width=self.draft_block)" in text
    assert "speculative_output_stride=self.draft_block" in text
    eagle = ast.unparse(find_definition(_parse(site, "sglang.srt.speculative.eagle_utils"), "eagle_sample"))
    assert "accept_index = torch.full((bs, verify_input.max_tree_depth), -1" in eagle
    logprobs = ast.unparse(find_definition(_parse(site, "sglang.srt.layers.logprob_processor"), "compute_spec_logprobs"))
    assert "max_accept = accept_index.shape[1]" in logprobs
    processor = _parse(site, "sglang.srt.managers.scheduler_components.batch_result_processor")
    stride = ast.unparse(find_definition(processor, "_get_speculative_output_stride"))
    assert "stride = result.speculative_output_stride" in stride
    assert "speculative_output_stride" in class_fields(find_definition(_parse(site, "sglang.srt.managers.utils"),
                                                                        "GenerationBatchResult"))


# Where SGLang 0.5.23 reads the spec bag's draft width in the code a draft forward runs through:
# every one is construction, capture or warm-up time (inside the worker's build scope), none
# is on the forward path. A new reader in a later version fails this list.
BAG_WIDTH_READERS = {
    ("srt/layers/attention/triton_backend.py", "__init__"),
    ("srt/model_executor/model_runner.py", "decode_num_tokens_per_req"),
    ("srt/model_executor/model_runner.py", "maybe_init_hisparse_coordinator"),
    ("srt/model_executor/runner/decode_cuda_graph_runner.py", "__init__"),
}
# Callers of decode_num_tokens_per_req() / max_speculative_num_draft_tokens() there: all
# build, capture, warm-up or autotune time.
DECODE_WIDTH_CALLERS = {
    ("srt/layers/attention/triton_backend.py", "__init__"),
    ("srt/model_executor/model_runner.py", "max_decode_logits_rows"),
    ("srt/model_executor/runner/eager_runner.py", "__init__"),
    ("srt/model_executor/runner/eager_runner.py", "_autotune_buffers"),
    ("srt/model_executor/runner/decode_cuda_graph_runner.py", "__init__"),
    ("srt/model_executor/runner/base_runner.py", "_widest_decode_rows"),
    ("srt/model_executor/runner/base_runner.py", "_dummy_run"),
}
FORWARD_FILES = (
    "srt/layers/attention/flashinfer_backend.py", "srt/layers/attention/triton_backend.py",
    "srt/model_executor/model_runner.py", "srt/model_executor/runner/eager_runner.py",
    "srt/model_executor/runner/decode_cuda_graph_runner.py", "srt/model_executor/runner/base_runner.py",
    "srt/model_executor/forward_batch_info.py", "srt/models/dflash.py",
)


def _innermost_functions_mentioning(site: Path, relative: str, needle: str) -> set[tuple[str, str]]:
    source = (site / "sglang" / relative).read_text()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and needle in ast.unparse(node):
            inner = [n for n in ast.walk(node) if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and needle in ast.unparse(n)]
            if not inner:
                found.add((relative, node.name))
    return found


@pytest.mark.slow
def test_the_draft_forward_runs_without_flipping_the_spec_bag(site):
    """The round's draft forward does not override the process-global spec bag (its leaves are
    traced by torch.compile): SGLang reads the draft width from the bag only while building
    runners, graphs and warm-up buffers, which the worker does inside its draft-width scope."""
    for method in ROUND_METHODS:
        text = ast.unparse(_worker_method(method))
        assert "_draft_width()" not in text and ".override(" not in text, method
    def mentioning(needle: str) -> set[tuple[str, str]]:
        return set().union(*(_innermost_functions_mentioning(site, f, needle) for f in FORWARD_FILES))

    assert mentioning("get_spec().speculative_num_draft_tokens") == BAG_WIDTH_READERS
    assert mentioning(".decode_num_tokens_per_req(") | mentioning("max_speculative_num_draft_tokens()") \
        == DECODE_WIDTH_CALLERS


def test_the_round_plans_its_window_once(site):
    """One KV plan per round, as DFlash plans its window once for the draft block, the verify
    and the hidden-KV writes (dflash_worker_v2.py:2586-2598): the draft binds its first B
    columns of it (KVLocPlan.bind(cols=...): 'a draft step ahead of the verify window it
    opens', kv_loc_plan.py:191-209)."""
    plans = [n for method in ROUND_METHODS for n in ast.walk(_worker_method(method))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "plan"]
    assert len(plans) == 1
    assert {k.arg: ast.unparse(k.value) for k in plans[0].keywords}["write_virtual"] == "window_locs"
    text = ast.unparse(_worker_method("_draft_block_hidden"))
    assert "plan.bind(forward_batch, self.draft_model_runner.kv_index_translator, cols=slice(0, block))" in text
    assert "kv_loc_plan=plan" in ast.unparse(_worker_method("_target_verify"))
    plan_source = (site / "sglang" / "srt" / "mem_cache" / "kv_loc_plan.py").read_text()
    assert "a slice of columns (a draft step ahead of the verify window it opens)" in plan_source


def test_sampling_masks_are_captured_along_the_accepted_path(site):
    """SpeculativeSamplingMaskCapture (dflash_worker_v2.py:2938-2949) builds target_probs per
    verify row ([bs, draft_token_num, V]) and pairs row j with out_tokens[:, j]; for a tree the
    worker builds it at N and keeps the accepted rows, so row j matches committed token j."""
    capture = find_definition(_parse(site, "sglang.srt.speculative.spec_sampling_mask"), "SpeculativeSamplingMaskCapture")
    assert "target_probs" in class_fields(capture)
    build = ast.unparse(find_definition(ast.Module(body=capture.body, type_ignores=[]), "build_output"))
    assert "target_probs.gather(-1, output_tokens.unsqueeze(-1))" in build  # row j <-> out_tokens[:, j]
    ours = ast.unparse(_worker_method("_capture_sampling_masks"))
    assert "draft_token_num=width" in ours and "accepted_rows_first(" in ours
    assert "capture.build_output(out_tokens=out_tokens, commit_lens=accept_lens)" in ours
    assert "self._capture_sampling_masks(" in ast.unparse(_worker_method("forward_batch_generation"))


def test_everything_built_for_the_drafter_sees_width_b(site):
    """The scheduler builds the draft worker, then calls its alloc_memory_pool,
    init_attention_backends and init_cuda_graphs (scheduler.py:1103-1126), outside __init__:
    each override runs DFlash's method inside the draft-width scope (the manifest pins them)."""
    scheduler = (site / "sglang" / "srt" / "managers" / "scheduler.py").read_text()
    for call in ("self.draft_worker.alloc_memory_pool(", "self.draft_worker.init_attention_backends()",
                 "self.draft_worker.init_cuda_graphs()"):
        assert call in scheduler
    for method in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs"):
        text = ast.unparse(_worker_method(method))
        assert "with self._draft_width():" in text and f"super().{method}(" in text, method
