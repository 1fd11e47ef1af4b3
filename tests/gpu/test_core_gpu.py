"""The core on CUDA: the batched builder without host syncs, and parity with the heap oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ddtree import (
    BuildMethod,
    GraphedTreeBuilder,
    build_ddtree_tree_from_logits,
    build_ddtree_trees,
    build_verify_inputs,
    validate_tree,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from row_families import family_logits  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]


def drafter_like(bs: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=generator) * 2.0
    top = torch.randint(0, vocab, (bs, depth, 1), generator=generator)
    return logits.scatter_add_(2, top, torch.full((bs, depth, 1), 12.0))


def test_batched_builder_makes_no_host_sync():
    logits = drafter_like(16, 15, 32000, 0).to("cuda", torch.bfloat16)
    build_ddtree_trees(logits, 256)  # warm-up: first-call allocations may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = build_ddtree_trees(logits, 256)
        inputs = build_verify_inputs(batch, torch.zeros(16, dtype=torch.int64, device="cuda"),
                                     torch.full((16,), 5, dtype=torch.int64, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.token_ids.device.type == "cuda" and inputs.tree_mask.device.type == "cuda"
    assert batch.token_ids.shape == (16, 256) and batch.visibility.shape == (16, 257, 257)


def test_cuda_batched_and_public_builders_match_the_heap():
    logits = drafter_like(6, 15, 4000, 1)
    logits[3] = torch.randn(15, 4000)  # a flat request in the batch
    cuda_logits = logits.to("cuda")
    batch = build_ddtree_trees(cuda_logits, 128)
    for b in range(6):
        heap = build_ddtree_tree_from_logits(logits[b], 128, method=BuildMethod.HEAP)
        for tree in (batch.tree(b), build_ddtree_tree_from_logits(cuda_logits[b], 128)):
            validate_tree(tree, budget=128, logits=logits[b])
            assert tree.parents == heap.parents
            assert tree.node_token_ids.tolist() == heap.node_token_ids.tolist()
            assert torch.allclose(tree.node_scores, heap.node_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [64, 1024])
def test_cuda_public_builder_reads_a_large_vocabulary_through_block_maxima_like_the_heap(budget):
    """At V = 151936 the public builder reads CUDA rows through block maxima (runs of 32
    neighbouring tokens, `ddtree.row_select`): the same tree as the heap on the same rows."""
    for logits in drafter_like(2, 15, 151936, 5).to("cuda"):
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        tree = build_ddtree_tree_from_logits(logits, budget)
        validate_tree(tree, budget=budget, logits=logits.cpu())
        assert tree.parents == heap.parents
        assert tree.node_token_ids.tolist() == heap.node_token_ids.tolist()
        assert torch.allclose(tree.node_scores, heap.node_scores, rtol=1e-5, atol=1e-5)


def test_cuda_bf16_trees_are_valid_and_score_like_the_heap():
    # bf16 rows tie a lot; the tie order among equal logits is torch.topk's, so compare scores
    logits = drafter_like(4, 15, 4000, 3).to(torch.bfloat16)
    batch = build_ddtree_trees(logits.to("cuda"), 64)
    for b in range(4):
        heap = build_ddtree_tree_from_logits(logits[b], 64, method=BuildMethod.HEAP)
        tree = batch.tree(b)
        validate_tree(tree, budget=64, logits=logits[b].float())
        assert torch.allclose(tree.node_scores.sort().values, heap.node_scores.sort().values, rtol=1e-5, atol=1e-5)


def test_peak_extra_memory_at_batch_16_budget_1024():
    logits = drafter_like(16, 15, 151936, 2).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    batch = build_ddtree_trees(logits, 1024)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert batch.num_nodes.min().item() == 1024
    assert extra < 64 * 2**20, f"peak extra memory {extra / 2**20:.1f} MiB"


def test_graph_replays_equal_eager_builds_without_a_host_sync():
    builder = GraphedTreeBuilder(16, 15, 32000, 256, dtype=torch.bfloat16, device="cuda")
    assert builder.captured
    for seed in (4, 5):  # two inputs: the replay reads the new logits, not the captured ones
        logits = drafter_like(16, 15, 32000, seed).to("cuda", torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replayed = builder(logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager = build_ddtree_trees(logits, 256)
        for field in ("token_ids", "depths", "parents", "num_nodes", "scores", "visibility"):
            assert torch.equal(getattr(replayed, field), getattr(eager, field)), (seed, field)


@pytest.mark.parametrize("family", ["peaked", "peaked@T0.5"])
def test_cuda_lazy_heap_enumeration_matches_the_heap(family):
    """Peaked CUDA rows at budget 1024 take the lazy heap through block maxima: the rows read
    down to the floor, then the tree enumerated on the host (peaked), or the loop kept where a
    greedy log-prob is exactly 0.0 (T = 0.5). The heap's tree, its scores as close as the other
    CUDA parity tests hold them (row sums on the device)."""
    logits = family_logits(family, 0, 15, 151936).to("cuda")
    heap = build_ddtree_tree_from_logits(logits, 1024, method=BuildMethod.HEAP)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    assert tree.parents == heap.parents
    assert tree.node_token_ids.tolist() == heap.node_token_ids.tolist()
    assert torch.allclose(tree.node_scores, heap.node_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cuda_bad_logit_in_a_row_never_normalised_is_reported(bad):
    """CUDA rows read through block maxima whose tree stops short of the last row: that row's
    NaN / +inf is found from the row maxima the bounds took (a device tensor read back)."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(15, 65536, generator=generator)
    logits[:4, 11] = 30.0  # a sure greedy start, then flat rows: the tree stays shallow
    logits[14, 5] = bad
    with pytest.raises(ValueError, match=r"row 14 \(depth 15\) contains (NaN|\+inf) \(first at token 5\)"):
        build_ddtree_tree_from_logits(logits.to("cuda"), 256, method=BuildMethod.FAST)
