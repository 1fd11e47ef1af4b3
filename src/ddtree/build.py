"""`build_ddtree_tree_from_logits`: one draft tree from one request's drafter logits.

Every method returns the same arrays as the reference heap for finite logits without exact
ties (tie order among exactly equal logits follows `torch.topk`, which itself depends on k).
"""
from __future__ import annotations

from enum import Enum

import torch

from ddtree.heap_build import build_heap_tree
from ddtree.inputs import check_budget, check_logits_shape
from ddtree.row_select import BLOCK_MIN_VOCAB
from ddtree.tree import DraftTree


class BuildMethod(str, Enum):
    HEAP = "heap"  # the plain best-first heap: the reference semantics, the oracle for tests
    FAST = "fast"  # rows read lazily to a floor; heap loop or enumeration
    AUTO = "auto"  # the fastest exact path for the input: `choose_method`


# Below these sizes the reference's full-row top-k is cheap and the fast path's extra reads
# and floor cost more than they save (benchmarks/tree_build.py on a 2-core CPU; see
# docs/dev/tree-builders.md). Below budget 1024 the lazy heap also serves every vocabulary
# read by full-row top-k (below `row_select.BLOCK_MIN_VOCAB`): at V = 32000 and 50257, budgets
# 128-512, the fast path's probes, floor and enumeration ran at 0.55-0.99x the heap's speed on
# 16 of 18 row families, the lazy heap at 1.06-2.4x (benchmarks/RESULTS.md). From 1024 on the
# fast path decides itself (`fast_build`: a likely deep tree switches to block maxima there).
HEAP_MAX_VOCAB = 511
HEAP_FULL_ROW_MAX_BUDGET = 1023
HEAP_FULL_ROW_MAX_VOCAB = BLOCK_MIN_VOCAB - 1


def choose_method(depth_limit: int, vocab: int, budget: int) -> BuildMethod:
    """The exact path AUTO takes for a [D, V] input: a few integer comparisons, no tensor work."""
    if depth_limit <= 1 and budget >= vocab:
        return BuildMethod.HEAP  # one row read whole either way
    if vocab <= HEAP_MAX_VOCAB or (budget <= HEAP_FULL_ROW_MAX_BUDGET and vocab <= HEAP_FULL_ROW_MAX_VOCAB):
        return BuildMethod.HEAP
    return BuildMethod.FAST


def build_ddtree_tree_from_logits(
    logits: torch.Tensor,  # [D, V] float32 / bfloat16 / float16, any device
    budget: int,
    method: BuildMethod | str = BuildMethod.AUTO,
) -> DraftTree:
    """The best-first DDTree of at most `budget` nodes (root excluded) over `D` depths.

    Raises ValueError on NaN / +inf logits (naming the row), a negative budget, a wrong rank
    or an empty vocabulary. A budget above the reachable tree gives the full reachable tree.
    The returned tree lives on the host.
    """
    check_logits_shape(logits, rank=2)
    budget = check_budget(budget)
    try:
        method = BuildMethod(method)
    except ValueError:
        choices = ", ".join(m.value for m in BuildMethod)
        raise ValueError(f"method must be one of {choices}, got {method!r}") from None
    if method is BuildMethod.AUTO:
        method = choose_method(logits.shape[0], logits.shape[1], budget)
        if method is BuildMethod.HEAP:  # the oracle's tree, rows read 16 ranks deep and further only as popped
            return build_heap_tree(logits, budget, lazy_rows=True)
    if method is BuildMethod.HEAP:
        return build_heap_tree(logits, budget)
    from ddtree.fast_build import build_fast_tree

    return build_fast_tree(logits, budget)
