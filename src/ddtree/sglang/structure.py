"""What the worker's code assumes about SGLang, checked against an installation's files.

The manifest names what the hooks and the worker call by name; this module reads the worker's
own source (`worker.py`, never imported: it needs torch and CUDA-only SGLang modules) and
checks the facts its glue depends on, in the installed SGLang files:

- every name it imports from sglang exists (following re-exports);
- every keyword it passes to an SGLang function, class, inherited method or object method
  is a parameter (or dataclass field) there, and every method it calls on an SGLang object
  is defined;
- every attribute it reads from `self` that DFlashWorkerV2 provides is still set by
  DFlashWorkerV2 or its base class, and DFlashWorkerV2 itself sets the ones it relies on;
- every attribute it reads from an SGLang object (the TP group's `world_size`) is set there;
- the TP sync sites it names exist; `HeadShard`'s fields (in `tree_round.py`) are fields of
  SGLang's vocab shard indices;
- `eagle_sample` still does not apply custom logit processors (the worker applies them), and
  still broadcasts its sampled decisions from rank 0 (the worker syncs only the greedy one).

Stdlib only, `ast` only: runs on any host, before anything is installed.
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ddtree.sglang.manifest import SourceSnapshot, class_fields, find_definition, parse_text

WORKER_MODULE = "ddtree.sglang.worker"
WORKER_CLASS = "DDTreeWorkerV2"
TREE_ROUND_MODULE = "ddtree.sglang.tree_round"
# HeadShard copies these fields, by name, from SGLang's shard indices of a vocab-parallel lm_head.
HEAD_SHARD = "HeadShard"
SHARD_INDICES = ("srt/layers/vocab_parallel_embedding.py", "VocabParallelEmbeddingShardIndices")
DFLASH = ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2")
DFLASH_BASE = ("srt/speculative/base_spec_worker.py", "BaseSpecWorker")
# Calls on objects the worker gets from SGLang: method name -> (file, qualname) of the method.
FOREIGN_METHODS: dict[str, tuple[str, str]] = {
    "plan": ("srt/mem_cache/kv_index_translator.py", "KVIndexTranslator.plan"),
    "prepare_for_verify": ("srt/speculative/dflash_info.py", "DFlashVerifyInput.prepare_for_verify"),
    "forward_batch_generation": ("srt/managers/tp_worker.py", "TpModelWorker.forward_batch_generation"),
    "finish_deferred_gather": ("srt/layers/logits_processor.py", "LogitsProcessor.finish_deferred_gather"),
    "is_deferred_shard": ("srt/layers/logits_processor.py", "LogitsProcessor.is_deferred_shard"),
    "all_gather": ("srt/distributed/parallel_state.py", "GroupCoordinator.all_gather"),
    "sync": ("srt/speculative/spec_tp_sync.py", "SpecTpSync.sync"),
    "bind": ("srt/mem_cache/kv_loc_plan.py", "KVLocPlan.bind"),
    "broadcast": ("srt/distributed/parallel_state.py", "GroupCoordinator.broadcast"),
}
# Attributes the worker reads from objects it gets from SGLang: name -> (file, class that sets it).
FOREIGN_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "world_size": ("srt/distributed/parallel_state.py", "GroupCoordinator"),
}
TP_SYNC = ("srt/speculative/spec_tp_sync.py", "SpecTpSyncSite")
EAGLE_SAMPLE = ("srt/speculative/eagle_utils.py", "eagle_sample")
# What the worker relies on DFlashWorkerV2 itself (not its base class) to set: attribute -> why.
DFLASH_SETS = {
    "_tp_sync": "TP > 1 syncs the greedy decision through it",
    "draft_parallel_layout": "TP > 1 runs the draft head in it",
    "draft_model_runner": "the draft forward runs on it",
    "_draft_block_ids_buf": "the draft block is written into it",
    "_mask_token_id": "the draft block is filled with it",
    "_target_logits_processor": "the verify finishes its deferred gather with it",
}
# eagle_sample's sampled path: after the sampling kernel, these are broadcast from rank 0.
EAGLE_SAMPLING_KERNEL = "sampling_fn"
EAGLE_BROADCASTS = ("predict", "accept_index", "num_correct_drafts")


@dataclass(frozen=True)
class Fact:
    """One broken fact: the SGLang file, the name there (the hook it breaks) and what is wrong."""

    file: str  # relative to the sglang package
    name: str  # qualname in SGLang, e.g. "DFlashVerifyInput.prepare_for_verify"
    detail: str


@dataclass
class StructureReport:
    broken: list[Fact] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # fact family -> how many were checked
    files_read: set[str] = field(default_factory=set)


def plugin_source(module: str) -> str | None:
    """A plugin module's source as the import system would load it (without importing it)."""
    spec = importlib.util.find_spec(module)
    loader = getattr(spec, "loader", None) if spec else None
    get_source = getattr(loader, "get_source", None)
    return get_source(module) if get_source else None


def worker_source() -> str | None:
    return plugin_source(WORKER_MODULE)


def module_file(module: str) -> str:
    """'sglang.srt.layers.sampler' -> 'srt/layers/sampler.py' (a package: its __init__.py)."""
    return "/".join(module.split(".")[1:]) + ".py"


class _Files:
    """Parsed SGLang files, each read once (from the gate run's snapshot, when it passes one);
    a missing or unparsable file is None."""

    def __init__(self, package_dir: Path, report: StructureReport, snapshot: SourceSnapshot | None = None):
        self.package_dir, self.report, self.cache = package_dir, report, {}
        self.snapshot = snapshot or SourceSnapshot(package_dir)

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self.cache:
            if not self.snapshot.is_file(rel) and rel.endswith(".py"):
                package_init = rel[: -len(".py")] + "/__init__.py"
                if self.snapshot.is_file(package_init):
                    return self.tree(package_init)
            try:
                self.cache[rel] = self.snapshot.tree(rel)
                self.report.files_read.add(rel)
            except (OSError, SyntaxError, UnicodeDecodeError):
                self.cache[rel] = None
        return self.cache[rel]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(file, node) where `module.name` is defined, following `from X import name`."""
        rel = module_file(module)
        tree = self.tree(rel)
        if tree is None:
            return None
        rel = rel if rel in self.cache and self.cache[rel] is tree else rel[: -len(".py")] + "/__init__.py"
        node = find_definition(tree, name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return rel, node
        if depth < 3:
            for stmt in ast.walk(tree):
                if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0 \
                        and stmt.module.startswith("sglang"):
                    for alias in stmt.names:
                        if (alias.asname or alias.name) == name:  # re-exported, maybe renamed
                            return self.resolve(stmt.module, alias.name, depth + 1)
        return (rel, node) if node is not None else None


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    args = node.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}, args.kwarg is not None


def _accepted(node: ast.AST) -> tuple[set[str], bool]:
    """Keywords a callable accepts: a function's parameters, a class's __init__ or fields."""
    if isinstance(node, ast.ClassDef):
        init = find_definition(ast.Module(body=node.body, type_ignores=[]), "__init__")
        if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _params(init)
        return class_fields(node), False
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _params(node)
    return set(), True  # not a def (an alias, a partial): nothing to check


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in node.body if isinstance(s, ast.FunctionDef)}


@lru_cache(maxsize=64)  # by node: the parsed trees are shared (`parse_text`), so is this walk
def _self_stores(node: ast.AST) -> frozenset[str]:
    return frozenset(n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self")


def sglang_imports(worker: ast.Module) -> dict[str, str]:
    """{local name: sglang module} of the worker's module-level `from sglang... import`."""
    names = {}
    for stmt in worker.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("sglang"):
            for alias in stmt.names:
                names[alias.asname or alias.name] = stmt.module
    return names


def _keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg}


def _class(files: _Files, rel: str, name: str) -> ast.ClassDef | None:
    tree = files.tree(rel)
    node = find_definition(tree, name) if tree else None
    return node if isinstance(node, ast.ClassDef) else None


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0


def _broadcast_from_rank_zero(call: ast.Call) -> str | None:
    """`x` for a call `<group>.broadcast(x, src=0)` (or `(x, 0)`), else None."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "broadcast" and call.args
            and isinstance(call.args[0], ast.Name)):
        return None
    src = [k.value for k in call.keywords if k.arg == "src"] + call.args[1:2]
    return call.args[0].id if src and _is_zero(src[0]) else None


def check_worker(package_dir: Path, source: str, tree_round: str | None = None,
                 snapshot: SourceSnapshot | None = None) -> StructureReport:
    """The worker's facts in the SGLang package at `package_dir`. `source`: the worker's
    source; `tree_round`: tree_round.py's (None: found as the import system would);
    `snapshot`: the gate run's files (None: read them here)."""
    report = StructureReport()
    files = _Files(package_dir, report, snapshot)
    worker = parse_text(source)
    ours = find_definition(worker, WORKER_CLASS)
    if not isinstance(ours, ast.ClassDef):
        report.broken.append(Fact("-", WORKER_CLASS, "the worker source defines no such class"))
        return report

    def broken(file: str, name: str, detail: str) -> None:
        report.broken.append(Fact(file, name, detail))

    def count(family: str) -> None:
        report.checked[family] = report.checked.get(family, 0) + 1

    imports = sglang_imports(worker)
    resolved: dict[str, tuple[str, ast.AST]] = {}
    for name, module in imports.items():
        count("imports")
        found = files.resolve(module, name)
        if found is None:
            broken(module_file(module), name, f"the worker imports {module}.{name}, which is not defined")
        else:
            resolved[name] = found

    for call in ast.walk(worker):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in resolved \
                and _keywords(call):
            count("keywords to imported names")
            rel, node = resolved[call.func.id]
            allowed, open_kwargs = _accepted(node)
            extra = sorted(_keywords(call) - allowed)
            if extra and not open_kwargs:
                broken(rel, call.func.id, f"the worker passes {', '.join(extra)}, which it does not take")

    dflash = _class(files, *DFLASH)
    if dflash is None:
        broken(DFLASH[0], DFLASH[1], "the class the worker subclasses is not defined")
        return report
    parent, own = _methods(dflash), _methods(ours)
    for call in ast.walk(ours):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        owner, name = call.func.value, call.func.attr
        is_self = isinstance(owner, ast.Name) and owner.id == "self"
        is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
        if is_super or (is_self and name not in own):
            if name not in parent:
                if is_super:
                    broken(DFLASH[0], f"{DFLASH[1]}.{name}", "the worker calls super().%s, which is not defined" % name)
                continue
            count("keywords to inherited methods")
            allowed, open_kwargs = _params(parent[name])
            extra = sorted(_keywords(call) - allowed)
            if extra and not open_kwargs:
                broken(DFLASH[0], f"{DFLASH[1]}.{name}", f"the worker passes {', '.join(extra)}, which it does not take")
        elif name in FOREIGN_METHODS and not is_self and not isinstance(owner, ast.Call):
            count("calls to SGLang objects")
            rel, qualname = FOREIGN_METHODS[name]
            tree = files.tree(rel)
            node = find_definition(tree, qualname) if tree else None
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                broken(rel, qualname, "the worker calls it, and it is not defined")
                continue
            allowed, open_kwargs = _params(node)
            extra = sorted(_keywords(call) - allowed)
            if extra and not open_kwargs:
                broken(rel, qualname, f"the worker passes {', '.join(extra)}, which it does not take")

    base = _class(files, *DFLASH_BASE)
    provided_by_dflash = set(parent) | class_fields(dflash) | _self_stores(dflash)
    available = provided_by_dflash | (set(_methods(base)) | class_fields(base) | _self_stores(base)
                                      if base is not None else set())
    provided_by_us = set(own) | class_fields(ours) | _self_stores(ours)
    read = {n.attr for n in ast.walk(ours) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for attr in sorted(read - provided_by_us - set(DFLASH_SETS)):  # those: below, with why
        count("attributes inherited")
        if attr not in available:
            broken(DFLASH[0], f"{DFLASH[1]}.{attr}", "the worker reads it from self, and DFlashWorkerV2 does not set it")
    for attr, why in DFLASH_SETS.items():
        count("attributes inherited")
        if attr not in provided_by_dflash:
            broken(DFLASH[0], f"{DFLASH[1]}.{attr}", f"{why}, and DFlashWorkerV2 does not set it")

    foreign_reads = {n.attr for n in ast.walk(ours) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                     and n.attr in FOREIGN_ATTRIBUTES and not (isinstance(n.value, ast.Name) and n.value.id == "self")}
    for attr in sorted(foreign_reads):
        count("attributes of SGLang objects")
        rel, owner_name = FOREIGN_ATTRIBUTES[attr]
        owner_class = _class(files, rel, owner_name)
        # stored on self or a property (a bare class annotation, as GroupCoordinator has, sets nothing)
        if owner_class is None or attr not in _self_stores(owner_class) | set(_methods(owner_class)):
            broken(rel, f"{owner_name}.{attr}", "the worker reads it, and it is not set there")

    sites = _class(files, *TP_SYNC)
    used = {n.attr for n in ast.walk(worker) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == TP_SYNC[1]}
    present = class_fields(sites) if sites is not None else set()
    for member in sorted(used):
        count("TP sync sites")
        if member not in present:
            broken(TP_SYNC[0], f"{TP_SYNC[1]}.{member}", "the worker syncs at this site, which is not defined")

    shard_source = tree_round if tree_round is not None else plugin_source(TREE_ROUND_MODULE)
    shard = find_definition(parse_text(shard_source), HEAD_SHARD) if shard_source is not None else None
    if not isinstance(shard, ast.ClassDef):
        broken("-", HEAD_SHARD, f"{TREE_ROUND_MODULE} is not available or defines no such class")
    else:
        indices = _class(files, *SHARD_INDICES)
        indices_fields = class_fields(indices) if indices is not None else set()
        for name in sorted(class_fields(shard)):
            count("head shard fields")
            if name not in indices_fields:
                broken(SHARD_INDICES[0], f"{SHARD_INDICES[1]}.{name}",
                       f"{HEAD_SHARD} copies this field, which is not defined")

    eagle_tree = files.tree(EAGLE_SAMPLE[0])
    eagle = find_definition(eagle_tree, EAGLE_SAMPLE[1]) if eagle_tree else None
    count("eagle_sample")
    if eagle is not None and "custom_logit_processor" in ast.unparse(eagle):
        broken(EAGLE_SAMPLE[0], EAGLE_SAMPLE[1], "now applies custom logit processors, which the worker "
                                                  "applies itself before it (they would apply twice)")
    if eagle is not None:
        kernels = [n for n in ast.walk(eagle) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id == EAGLE_SAMPLING_KERNEL]
        after = max((k.end_lineno or k.lineno for k in kernels), default=None)
        broadcast = {_broadcast_from_rank_zero(n) for n in ast.walk(eagle)
                     if isinstance(n, ast.Call) and after is not None and n.lineno > after}
        for decision in EAGLE_BROADCASTS:
            count("eagle_sample broadcasts")
            if decision not in broadcast:
                broken(EAGLE_SAMPLE[0], EAGLE_SAMPLE[1], f"no longer broadcasts {decision} from rank 0 after "
                       f"{EAGLE_SAMPLING_KERNEL}(...), on which TP > 1 relies (the worker syncs only greedy)")
    return report
