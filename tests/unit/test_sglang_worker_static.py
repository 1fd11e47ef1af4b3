"""DDTreeWorkerV2 cannot run without a GPU: check its glue statically against the real
sglang==0.5.23 sources. Every name it imports from sglang exists; every keyword it passes
to an SGLang function, method or dataclass is a parameter or field there; every attribute
it reads from DFlashWorkerV2 is set by DFlashWorkerV2 (or its base class)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddtree.sglang.manifest import class_fields, find_definition
from sglang_plugin.dist import sglang_site

WORKER = Path(__file__).resolve().parents[2] / "src" / "ddtree" / "sglang" / "worker.py"
WORKER_TREE = ast.parse(WORKER.read_text())


def _module_file(site: Path, module: str) -> Path:
    base = site.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def _parse(site: Path, module: str) -> ast.Module:
    return ast.parse(_module_file(site, module).read_text())


def _resolve(site: Path, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """Where `module.name` is defined, following `from X import name` re-exports."""
    tree = _parse(site, module)
    node = find_definition(tree, name)
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        return module, node
    if depth < 3:
        for stmt in ast.walk(tree):
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        return _resolve(site, stmt.module, alias.name, depth + 1)
    return (module, node) if node is not None else None


def _sglang_imports() -> dict[str, str]:
    names = {}
    for stmt in WORKER_TREE.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("sglang"):
            for alias in stmt.names:
                names[alias.asname or alias.name] = stmt.module
    return names


def _params(node: ast.FunctionDef) -> tuple[set[str], bool]:
    args = node.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return names, args.kwarg is not None


def _class_init_names(site: Path, module: str, node: ast.ClassDef) -> tuple[set[str], bool]:
    init = find_definition(ast.Module(body=node.body, type_ignores=[]), "__init__")
    if isinstance(init, ast.FunctionDef):
        return _params(init)
    return class_fields(node), False  # a dataclass: its fields


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


def test_every_sglang_import_exists(site):
    imports = _sglang_imports()
    assert len(imports) >= 15
    missing = [f"{module}.{name}" for name, module in imports.items() if _resolve(site, module, name) is None]
    assert missing == []


def test_every_keyword_passed_to_sglang_exists(site):
    imports = _sglang_imports()
    checked, wrong = 0, []
    for call in ast.walk(WORKER_TREE):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in imports):
            continue
        keywords = {k.arg for k in call.keywords if k.arg}
        if not keywords:
            continue
        module, node = _resolve(site, imports[call.func.id], call.func.id)
        if isinstance(node, ast.ClassDef):
            allowed, open_kwargs = _class_init_names(site, module, node)
        else:
            allowed, open_kwargs = _params(node)
        checked += 1
        if not open_kwargs and not keywords <= allowed:
            wrong.append(f"{call.func.id}: {sorted(keywords - allowed)}")
    assert checked >= 6
    assert wrong == []


def _dflash_class(site: Path) -> ast.ClassDef:
    return find_definition(_parse(site, "sglang.srt.speculative.dflash_worker_v2"), "DFlashWorkerV2")


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in node.body if isinstance(s, ast.FunctionDef)}


def test_keywords_passed_to_inherited_methods_exist(site):
    parent = _methods(_dflash_class(site))
    ours = _methods(find_definition(WORKER_TREE, "DDTreeWorkerV2"))
    wrong, checked = [], 0
    for call in ast.walk(WORKER_TREE):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        owner = call.func.value
        is_self = isinstance(owner, ast.Name) and owner.id == "self"
        is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
        name = call.func.attr
        if not (is_super or (is_self and name in parent and name not in ours)):
            continue
        allowed, open_kwargs = _params(parent[name])
        keywords = {k.arg for k in call.keywords if k.arg}
        checked += 1
        if not open_kwargs and not keywords <= allowed:
            wrong.append(f"{name}: {sorted(keywords - allowed)}")
    assert checked >= 8
    assert wrong == []


def test_attributes_read_from_dflash_are_set_by_dflash(site):
    dflash = _dflash_class(site)
    base = find_definition(_parse(site, "sglang.srt.speculative.base_spec_worker"), "BaseSpecWorker")

    def provided(cls: ast.ClassDef) -> set[str]:
        names = set(_methods(cls)) | class_fields(cls)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        return names

    ours_cls = find_definition(WORKER_TREE, "DDTreeWorkerV2")
    ours = provided(ours_cls)
    available = provided(dflash) | provided(base)
    read = {
        node.attr for node in ast.walk(ours_cls)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        and isinstance(node.ctx, ast.Load)
    }
    inherited = read - ours
    assert {"_draft_block_ids_buf", "_mask_token_id", "draft_model_runner", "_target_logits_processor"} <= inherited
    assert sorted(inherited - available) == []


# Calls on objects the worker gets from SGLang: attribute name -> where that method lives.
FOREIGN_METHODS = {
    "plan": ("sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator.plan"),
    "prepare_for_verify": ("sglang.srt.speculative.dflash_info", "DFlashVerifyInput.prepare_for_verify"),
    "forward_batch_generation": ("sglang.srt.managers.tp_worker", "TpModelWorker.forward_batch_generation"),
    "finish_deferred_gather": ("sglang.srt.layers.logits_processor", "LogitsProcessor.finish_deferred_gather"),
    "is_deferred_shard": ("sglang.srt.layers.logits_processor", "LogitsProcessor.is_deferred_shard"),
    "all_gather": ("sglang.srt.distributed.parallel_state", "GroupCoordinator.all_gather"),
    "sync": ("sglang.srt.speculative.spec_tp_sync", "SpecTpSync.sync"),
    "bind": ("sglang.srt.mem_cache.kv_loc_plan", "KVLocPlan.bind"),
    "broadcast": ("sglang.srt.distributed.parallel_state", "GroupCoordinator.broadcast"),
}


def test_keywords_passed_to_sglang_objects_exist(site):
    wrong, seen = [], set()
    for call in ast.walk(WORKER_TREE):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        owner = call.func.value
        if isinstance(owner, ast.Call) or (isinstance(owner, ast.Name) and owner.id == "self"):
            continue  # super()/self calls: checked above
        if call.func.attr not in FOREIGN_METHODS:
            continue
        module, qualname = FOREIGN_METHODS[call.func.attr]
        node = find_definition(_parse(site, module), qualname)
        assert isinstance(node, ast.FunctionDef), f"{module}.{qualname} not found"
        allowed, open_kwargs = _params(node)
        keywords = {k.arg for k in call.keywords if k.arg}
        seen.add(call.func.attr)
        if not open_kwargs and not keywords <= allowed:
            wrong.append(f"{qualname}: {sorted(keywords - allowed)}")
    assert seen == set(FOREIGN_METHODS)
    assert wrong == []


def test_tensor_parallel_names_exist(site):
    """The TP top-K path: HeadShard copies VocabParallelEmbeddingShardIndices fields by name;
    the TP group has world_size; the sync sites the worker names are SpecTpSyncSite members;
    DFlashWorkerV2 sets the _tp_sync and draft_parallel_layout the worker uses."""
    from ddtree.sglang.tree_round import HeadShard

    indices = find_definition(_parse(site, "sglang.srt.layers.vocab_parallel_embedding"),
                              "VocabParallelEmbeddingShardIndices")
    assert set(HeadShard._fields) <= class_fields(indices)

    coordinator = find_definition(_parse(site, "sglang.srt.distributed.parallel_state"), "GroupCoordinator")
    stored = {node.attr for node in ast.walk(coordinator)
              if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
    assert "world_size" in stored

    sites = class_fields(find_definition(_parse(site, "sglang.srt.speculative.spec_tp_sync"), "SpecTpSyncSite"))
    used = {node.attr for node in ast.walk(WORKER_TREE)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "SpecTpSyncSite"}
    assert used == {"DFLASH_ACCEPT_GREEDY"} and used <= sites
    # The sampled path is not synced again: eagle_sample broadcasts its decisions from rank 0
    # after the sampling kernel (and its CUDA greedy path does not, hence the greedy sync).
    sample = ast.unparse(find_definition(_parse(site, "sglang.srt.speculative.eagle_utils"), "eagle_sample"))
    after_sampling = sample[sample.index("sampling_fn(predicts=predict"):]
    for decision in ("predict", "accept_index", "num_correct_drafts"):
        assert f"tp_group.broadcast({decision}, src=0)" in after_sampling

    dflash_stores = {node.attr for node in ast.walk(_dflash_class(site))
                     if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
    assert {"_tp_sync", "draft_parallel_layout"} <= dflash_stores


def test_custom_logit_processors_are_applied_once_before_eagle_sample(site):
    """eagle_sample applies penalties, bias and grammar but not custom logit processors
    (DFlash's linear verify applies them itself): the worker must apply them to all N rows of
    each request before eagle_sample, exactly once."""
    eagle = find_definition(_parse(site, "sglang.srt.speculative.eagle_utils"), "eagle_sample")
    assert "custom_logit_processor" not in ast.unparse(eagle)  # else we would apply them twice

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
