"""The pure tensor steps the SGLang worker runs between SGLang's forwards (CPU).

The tree walk here is the core's torch port of SGLang's verify_tree_greedy kernel
(ddtree.verify.walk_retrieve_arrays); predict is filled the way the kernel fills it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.batched import build_ddtree_trees
from ddtree.topk import merge_top_k
from ddtree.verify import follow_verified_tree, walk_retrieve_arrays
from ddtree.sglang.round_metrics import RoundMetrics
from ddtree.sglang.tree_round import (
    HeadShard,
    TreeVerifyView,
    VocabSegment,
    accepted_rows_first,
    build_round_trees,
    committed_tokens_and_bonus,
    draft_kv_rewrite,
    draft_logits_from_hidden,
    head_vocab_segments,
    local_draft_top_k,
    pack_for_gather,
    pack_round_inputs,
    pack_trees,
    trees_from_top_k,
    unpack_gathered,
    unpack_trees,
)
from sglang_plugin.host_reads import HostReads
from sglang_plugin.round_case import ROUND_SHAPES, round_between_forwards, round_case, sglang_like_head_shards


def _kernel_predict(target_predict: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """verify_tree_greedy writes the target's token at every accepted row, nothing elsewhere."""
    predict = torch.zeros(target_predict.numel(), dtype=torch.int32)
    rows = accept_index[accept_index >= 0]
    predict[rows] = target_predict.reshape(-1)[rows].to(torch.int32)
    return predict


def _one_round(seed: int, bs: int, depth: int, vocab: int, budget: int, width: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 3
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    prefix = torch.randint(1, 9, (bs,), generator=gen)
    trees = build_round_trees(logits, budget, budget)
    inputs, mask = pack_round_inputs(trees, bonus, prefix, width, int(prefix.sum()))  # exact size
    # A target that often agrees with the draft's best child, sometimes not.
    target = torch.where(torch.rand(bs, width, generator=gen) < 0.7,
                         torch.roll(inputs.input_ids, -1, dims=1),
                         torch.randint(0, vocab, (bs, width), generator=gen))
    accept_index, drafts, walk_bonus = walk_retrieve_arrays(
        inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token,
        inputs.retrieve_next_sibling, target)
    return trees, inputs, mask, target, accept_index, drafts + 1, walk_bonus, prefix


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bs=st.integers(1, 4), depth=st.integers(1, 5),
       budget=st.integers(1, 12), extra=st.integers(0, 3))
def test_committed_tokens_match_the_spec_walk(seed, bs, depth, budget, extra):
    width = budget + 1 + extra  # verify width may exceed budget + 1 (padded, detached nodes)
    trees, inputs, _, target, accept_index, accept_lens, walk_bonus, _ = _one_round(seed, bs, depth, 16, budget, width)
    predict = _kernel_predict(target, accept_index)
    out_tokens, bonus = committed_tokens_and_bonus(predict, accept_index.to(torch.int32), accept_lens.to(torch.int32))
    assert torch.equal(bonus, walk_bonus)
    for b in range(bs):
        tree = trees.tree(b)
        accepted, spec_bonus = follow_verified_tree(tree.child_maps, target[b, : len(tree.parents)])
        n = len(accepted)
        assert int(accept_lens[b]) == n
        flat = accept_index[b, :n].tolist()
        assert flat == [b * width + i for i in accepted]
        # Committed: the accepted drafts' tokens, then the bonus; the bonus starts the next round.
        expected = [int(inputs.input_ids[b, i]) for i in accepted[1:]] + [spec_bonus]
        assert out_tokens[b, :n].tolist() == expected
        assert int(bonus[b]) == spec_bonus


def test_rejected_first_draft_commits_only_the_bonus():
    trees, inputs, _, _, _, _, _, _ = _one_round(3, 2, 3, 10, 5, 6)
    target = torch.full_like(inputs.input_ids, 10_000)  # matches no draft token
    accept_index, drafts, _ = walk_retrieve_arrays(inputs.input_ids, inputs.retrieve_index,
                                                   inputs.retrieve_next_token, inputs.retrieve_next_sibling, target)
    predict = _kernel_predict(target, accept_index)
    out_tokens, bonus = committed_tokens_and_bonus(predict, accept_index, drafts + 1)
    assert (drafts + 1).tolist() == [1, 1]
    assert out_tokens[:, 0].tolist() == [10_000, 10_000] and bonus.tolist() == [10_000, 10_000]


def test_accepted_hidden_rows_move_to_the_front_in_order():
    _, _, _, _, accept_index, accept_lens, _, prefix = _one_round(11, 3, 4, 12, 9, 10)
    width, hidden_size = 10, 5
    hidden = torch.arange(3 * width * hidden_size, dtype=torch.float32).view(3 * width, hidden_size)
    front = accepted_rows_first(hidden, accept_index, width).view(3, width, hidden_size)
    for b in range(3):
        for j in range(int(accept_lens[b])):
            assert torch.equal(front[b, j], hidden[int(accept_index[b, j])])
    block = 5  # depth 4 + the bonus position: accept_index needs only B columns
    assert (accept_index[:, block:] == -1).all()
    write_ids = torch.arange(3 * width) + 1000
    rewrite = draft_kv_rewrite(hidden, accept_index[:, :block], write_ids, prefix, width)
    assert torch.equal(rewrite.target_hidden.view(3, block, hidden_size), front[:, :block])
    assert torch.equal(rewrite.cache_loc_2d, write_ids.view(3, width)[:, :block]) and rewrite.cache_loc_2d.is_contiguous()
    assert torch.equal(rewrite.cache_loc, rewrite.cache_loc_2d.view(-1))
    for b in range(3):
        assert rewrite.positions.view(3, block)[b].tolist() == list(range(int(prefix[b]), int(prefix[b]) + block))
        assert int(accept_lens[b]) <= block  # every committed row is among the B rewritten


def test_full_mask_is_sglangs_layout():
    """FULL: per request, N rows of (prefix columns all true, then the tree row), as NGRAM
    builds it with torch.cat((ones(N, prefix), tree_mask), dim=1)."""
    trees, inputs, mask, _, _, _, _, prefix = _one_round(5, 3, 3, 9, 6, 8)
    expected = torch.cat([
        torch.cat([torch.ones(8, int(prefix[b]), dtype=torch.bool), inputs.tree_mask[b]], dim=1).reshape(-1)
        for b in range(3)
    ])
    assert torch.equal(mask, expected)
    view = TreeVerifyView.from_inputs(inputs, mask, accept_width=4)
    assert (view.max_tree_depth, view.tree_topk, view.draft_token_num) == (4, -1, 8)
    assert view.draft_token.shape == (24,) and view.positions.shape == (24,)
    assert torch.equal(view.positions.view(3, 8)[:, 0], prefix)


def test_draft_logits_skip_the_bonus_position():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 4, 6, generator=gen)
    weight = torch.randn(11, 6, generator=gen)
    logits = draft_logits_from_hidden(hidden, weight)
    assert logits.shape == (2, 3, 11)
    assert torch.allclose(logits[1, 2], weight @ hidden[1, 3])


def test_a_topk_cap_below_the_budget_keeps_top_k_per_depth():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 40, generator=gen)
    capped = build_round_trees(logits, 8, 2)
    top2 = torch.topk(logits, 2, dim=-1).indices
    assert capped.num_nodes.tolist() == [8, 8]  # 2 + 4 + 8 paths >= 8
    for b in range(2):
        for node in range(8):
            depth = int(capped.depths[b, node])
            assert int(capped.token_ids[b, node]) in top2[b, depth - 1].tolist()
    uncapped = build_round_trees(logits, 8, 8)
    reference = build_ddtree_trees(logits, 8)
    assert torch.equal(uncapped.token_ids, reference.token_ids) and torch.equal(uncapped.parents, reference.parents)


@pytest.mark.parametrize("world,added", [(1, 0), (2, 0), (2, 3), (4, 5)])
def test_tensor_parallel_draft_top_k_gathers_to_the_unsharded_trees(world, added):
    """The worker's TP path on CPU: per-rank local top-K over SGLang-like head shards, packed,
    all-gathered (concatenated rank-major along dim 0, as GroupCoordinator.all_gather(dim=0)),
    unpacked and merged: same trees as build_ddtree_trees on the full draft logits."""
    gen = torch.Generator().manual_seed(world * 10 + added)
    bs, block, hidden, org, budget = 3, 5, 16, 61, 12
    full, shards = sglang_like_head_shards(gen, world, org, added, hidden)
    draft_hidden = torch.randn(bs, block, hidden, generator=gen)
    packed = []
    for local, shard in shards:
        segments = head_vocab_segments(shard, local.shape[0])
        packed.append(pack_for_gather(local_draft_top_k(draft_hidden, local, segments, budget)))
    floats = torch.cat([f for f, _ in packed], dim=0)  # [R*bs, D, K+1]
    ids = torch.cat([i for _, i in packed], dim=0)  # [R*bs, D, K]
    merged = merge_top_k(unpack_gathered(floats, ids, world), budget)
    trees = trees_from_top_k(merged, budget)
    reference = build_ddtree_trees(draft_logits_from_hidden(draft_hidden, full), budget)
    for field in ("token_ids", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(trees, field), getattr(reference, field)), field
    assert int(merged.token_ids.max()) < org + added


def _gloo_rank(rank: int, world: int, port: int, added: int, results) -> None:
    """One TP rank: its own head shard, the real collective (gloo over loopback), the merge."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a dead peer fails, never hangs
    try:
        gen = torch.Generator().manual_seed(99)  # every rank draws the same full head and hidden
        full, shards = sglang_like_head_shards(gen, world, 61, added, 16)
        draft_hidden = torch.randn(2, 5, 16, generator=gen)
        local, shard = shards[rank]
        top = local_draft_top_k(draft_hidden, local, head_vocab_segments(shard, local.shape[0]), 12)
        gathered = []
        for part in pack_for_gather(top):
            # GroupCoordinator.all_gather(dim=0) on CPU: all_gather_single into [R*bs, ...].
            out = torch.empty((world * part.shape[0], *part.shape[1:]), dtype=part.dtype)
            dist.all_gather_single(out, part)
            gathered.append(out)
        trees = trees_from_top_k(merge_top_k(unpack_gathered(*gathered, world), 12), 12)
        reference = build_ddtree_trees(draft_logits_from_hidden(draft_hidden, full), 12)
        # Plain lists: a shared-memory tensor would die with this process.
        results.put((rank, *(t.tolist() for t in (trees.token_ids, trees.parents, reference.token_ids, reference.parents))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_real_collective_gives_every_rank_the_unsharded_trees():
    """Two processes, a real torch.distributed all-gather (gloo, loopback): every rank builds
    the same trees, equal to the unsharded ones (TP ranks must agree on the verify input)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_gloo_rank, args=(2, port, 3, results), nprocs=2, start_method="spawn")  # joins
    by_rank = dict((r[0], r[1:]) for r in (results.get(timeout=60) for _ in range(2)))
    assert sorted(by_rank) == [0, 1]
    for tokens, parents, ref_tokens, ref_parents in by_rank.values():
        assert (tokens, parents) == (ref_tokens, ref_parents)
    assert by_rank[0] == by_rank[1]


def _diverging_rank(rank: int, world: int, port: int, results) -> None:
    """One TP rank whose trees differ from rank 0's (as a tie order or another GPU could make
    them); the worker's broadcast of rank 0's packed trees must leave every rank with those."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        logits = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(5 + rank)) * 3  # rank-dependent
        trees = build_round_trees(logits, 12, 12)
        own = [t.tolist() for t in (trees.token_ids, trees.parents)]
        packed = pack_trees(trees)
        dist.broadcast(packed, src=0)  # GroupCoordinator.broadcast(src=0) on CPU
        agreed = unpack_trees(packed, 12, 4)
        results.put((rank, own, [getattr(agreed, f).tolist() for f in _TREE_FIELDS]))
    finally:
        dist.destroy_process_group()


_TREE_FIELDS = ("token_ids", "depths", "parents", "num_nodes", "scores", "visibility")


@pytest.mark.slow
def test_every_rank_verifies_rank_zeros_trees():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.start_processes(_diverging_rank, args=(2, port, results), nprocs=2, start_method="spawn")
    by_rank = dict((r[0], r[1:]) for r in (results.get(timeout=60) for _ in range(2)))
    assert by_rank[0][0] != by_rank[1][0]  # the ranks really built different trees
    rank0 = build_round_trees(torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(5)) * 3, 12, 12)
    for rank in (0, 1):
        assert by_rank[rank][1] == [getattr(rank0, f).tolist() for f in _TREE_FIELDS], rank


@pytest.mark.parametrize("bs, depth, budget", [(1, 1, 1), (3, 5, 12), (2, 15, 64)])
def test_packed_trees_round_trip_bit_for_bit(bs, depth, budget):
    logits = torch.randn(bs, depth, 30, generator=torch.Generator().manual_seed(budget)) * 3
    logits[0, 1:] = float("-inf") if depth > 1 else logits[0, 1:]  # a ragged, shallow request
    trees = build_round_trees(logits, budget, budget)
    packed = pack_trees(trees)
    assert packed.dtype == torch.int64 and packed.shape == (bs, 4 * budget + 2) and packed.is_contiguous()
    back = unpack_trees(packed, budget, depth)
    for field in _TREE_FIELDS:
        assert torch.equal(getattr(back, field), getattr(trees, field)), field


def test_head_segments_skip_padding_rows():
    shard = HeadShard(28, 50, 28, 56, 52, 53)  # rank 1 of 2: 22 base rows, 6 padding, 1 added
    assert head_vocab_segments(shard, 32) == (VocabSegment(0, 22, 28), VocabSegment(28, 29, 52))
    assert head_vocab_segments(None, 40) == (VocabSegment(0, 40, 0),)
    with pytest.raises(ValueError, match="needs row 28, weight has 28 rows"):
        head_vocab_segments(shard, 28)


def test_unpack_refuses_a_gather_that_does_not_fit_the_world_size():
    with pytest.raises(ValueError, match="do not fit world size 2"):
        unpack_gathered(torch.zeros(3, 2, 5), torch.zeros(3, 2, 4, dtype=torch.int64), 2)


def test_round_metrics_sync_once_per_interval():
    seen = []
    metrics = RoundMetrics(2, "cpu", seen.append)
    assert metrics.record(torch.tensor([1, 3]), torch.tensor([8, 8]), lambda: 2.0) is None
    snapshot = metrics.record(torch.tensor([2]), torch.tensor([5]), lambda: 4.0)
    assert seen == [snapshot]
    assert (snapshot.rounds, snapshot.requests) == (2, 3)
    assert snapshot.mean_acceptance_length == pytest.approx(2.0)
    assert snapshot.mean_tree_size == pytest.approx(7.0)
    assert snapshot.mean_build_ms == pytest.approx(3.0)
    assert "acceptance length 2.000" in snapshot.line()
    off = RoundMetrics(0, "cpu", seen.append)
    assert off.record(torch.tensor([1]), torch.tensor([1])) is None and len(seen) == 1


@pytest.mark.parametrize("bs, block, budget, world", ROUND_SHAPES)
def test_the_round_between_sglangs_forwards_reads_nothing_back_to_the_host(bs, block, budget, world):
    """Under the overlap scheduler the host must never wait for the device mid-round. Every
    tensor step between SGLang's forwards (local top-K per head shard, the TP merge and tree
    broadcast payload, trees, the verify inputs and mask sized from DFlash's host-side
    reservation, the commit, the draft-KV rewrite) runs under a detector of value reads and
    value-sized outputs: it must see none. Ragged prefixes, one at the end of the context."""
    case = round_case("cpu", bs, block, budget, world)
    with HostReads() as reads:
        mask = round_between_forwards(case)
    assert reads.seen == []
    width = budget + 1
    assert mask.numel() == width * (min(case.reserved_kv_sum, bs * case.context_len) + bs * width)


