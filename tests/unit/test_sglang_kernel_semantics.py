"""Our verify inputs mean what sglang==0.5.23's kernels expect, checked on CPU.

The CUDA kernels cannot run here, so each is replaced by a small oracle in plain Python that
follows what the kernel computes (read from the 0.5.23 sources named below):
  reconstruct  tree links and positions from a QLEN mask  kernels/jit/include/sgl_kernel/speculative/ngram.cuh
  greedy walk  VerifyTreeGreedy over the retrieve arrays   kernels/jit/include/sgl_kernel/speculative/eagle.cuh
  accept_lens  = accepted drafts + 1 (root included)       srt/speculative/eagle_utils.py (eagle_sample)
  bonus        at accept_tokens[b * S + len - 1]           kernels/ops/speculative/eagle.py (fill_bonus_tokens)
  FULL mask    per request [N, prefix + N] row-major, True = may attend, offsets cumsum(N * (prefix + N))
               (kernels/ops/attention/extend_attention.py, srt/layers/attention/triton_backend.py)
  KV move      accepted rows gathered, then scattered to the window front
               (srt/speculative/spec_utils.py move_accept_tokens_to_target_kvcache)
  contiguity   the retrieve arrays go through a TensorMatcher without strides, which requires
               contiguous tensors (kernels/jit/include/sgl_kernel/tensor.h)
"""
from __future__ import annotations

import pytest
import torch

from ddtree.batched import TreeBatch
from ddtree.sglang.tree_round import (
    TreeVerifyView,
    accepted_rows_first,
    build_round_trees,
    committed_tokens_and_bonus,
    mask_prefix_bound,
    pack_round_inputs,
)
from ddtree.verify import MaskLayout, build_verify_inputs, follow_verified_tree, pack_custom_mask, walk_retrieve_arrays


def reconstruct_from_qlen_mask(mask: torch.Tensor, prefix_lens: torch.Tensor, width: int) -> list[torch.Tensor]:
    """positions, retrieve_index, next_token, next_sibling as SGLang derives them from a flat
    QLEN mask [bs * N * N] (row = query node, column = node it may attend to)."""
    bs = prefix_lens.numel()
    allowed = mask.view(bs, width, width).tolist()
    positions, index, next_token, next_sibling = ([[0] * width for _ in range(bs)] for _ in range(4))
    for b in range(bs):
        rows = allowed[b]
        for node in range(width):
            ancestors = [i for i in range(node - 1, -1, -1) if rows[node][i]]
            parent = ancestors[0] if ancestors else -1  # the nearest ancestor
            index[b][node] = b * width + node
            positions[b][node] = len(ancestors) + int(prefix_lens[b])
            next_token[b][node] = next((i for i in range(node + 1, width) if rows[i][node]), -1)
            sibling = -1
            if parent != -1:
                for i in range(node + 1, width):
                    # a later child of the same parent: sees the parent and nothing between
                    if rows[i][parent] and not any(rows[i][j] for j in range(parent + 1, i)):
                        sibling = i
                        break
            next_sibling[b][node] = sibling
    return [torch.tensor(x) for x in (positions, index, next_token, next_sibling)]


def greedy_tree_walk(candidates, retrieve_index, next_token, next_sibling, target, max_depth):
    """VerifyTreeGreedy: (predicts [bs*N], accept_index [bs, S], accepted drafts [bs])."""
    bs, width = candidates.shape
    cand, index, first, sibling, want = (x.reshape(-1).tolist() for x in
                                         (candidates, retrieve_index, next_token, next_sibling, target))
    predicts = [0] * (bs * width)
    accept_index = [[-1] * max_depth for _ in range(bs)]
    accepted = [0] * bs
    for b in range(bs):
        last = index[b * width]
        accept_index[b][0] = last
        node = 0
        for _ in range(1, max_depth):
            node = first[b * width + node]
            while node != -1:
                if cand[b * width + node] == want[last]:
                    predicts[last] = want[last]
                    accepted[b] += 1
                    last = index[b * width + node]
                    accept_index[b][accepted[b]] = last
                    break
                node = sibling[b * width + node]
            if node == -1:
                break
        predicts[last] = want[last]  # the bonus
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_int32(predicts), as_int32(accept_index), as_int32(accepted)


def cases() -> list[tuple[TreeBatch, int, torch.Generator]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for bs, depth, vocab, budget, topk, extra in [(1, 4, 50, 8, 8, 0), (3, 5, 40, 16, 4, 0), (4, 3, 3, 20, 3, 0),
                                                 (2, 6, 2, 12, 2, 3), (5, 8, 30, 32, 32, 0), (3, 1, 5, 4, 4, 2)]:
        for _ in range(4):
            trees = build_round_trees(torch.randn(bs, depth, vocab, generator=gen) * 3, budget, topk)
            out.append((trees, budget + 1 + extra, gen))
    # trees of different sizes padded to one width, root-only trees among them
    small = build_round_trees(torch.randn(1, 2, 2, generator=gen), 6, 2).tree(0)
    big = build_round_trees(torch.randn(1, 4, 9, generator=gen), 10, 9).tree(0)
    empty = build_round_trees(torch.full((1, 3, 5), float("-inf")), 5, 5).tree(0)
    for mix in ([small, big, empty], [empty, empty], [big, small], [empty]):
        out.append((TreeBatch.from_trees(mix, 10), 11, gen))
    return out


CASES = cases()


def target_that_mostly_follows_the_tree(inputs, gen) -> torch.Tensor:
    bs, width = inputs.input_ids.shape
    target = torch.randint(0, 50, (bs, width), generator=gen)
    for b in range(bs):
        for i in range(width):
            child = int(inputs.retrieve_next_token[b, i])
            if child >= 0 and torch.rand((), generator=gen) < 0.8:
                pick = child if torch.rand((), generator=gen) < 0.5 else max(child, int(inputs.retrieve_next_sibling[b, child]))
                target[b, i] = inputs.input_ids[b, pick]
    return target


@pytest.mark.parametrize("case", range(len(CASES)))
def test_inputs_walk_mask_and_commit_match_sglang(case):
    trees, width, gen = CASES[case]
    bs = trees.token_ids.shape[0]
    prefix = torch.randint(0, 9, (bs,), generator=gen)
    bonus = torch.randint(0, 50, (bs,), generator=gen)
    # The host bound the worker uses: DFlash's reserved window sums (prefix + 2N per request),
    # capped at bs * context_len; a short context makes the cap bite in some cases.
    context_len = int(prefix.max()) + width + case % 3
    bound = mask_prefix_bound(int((prefix + 2 * width).sum()), bs, context_len)
    if width == trees.budget + 1:
        inputs, full = pack_round_inputs(trees, bonus, prefix, width, bound)
    else:
        inputs = build_verify_inputs(trees, bonus, prefix, width=width)
        full = pack_custom_mask(inputs.tree_mask, prefix, MaskLayout.FULL, bound)
    qlen = pack_custom_mask(inputs.tree_mask, prefix, MaskLayout.QLEN)

    positions, index, next_token, next_sibling = reconstruct_from_qlen_mask(qlen, prefix, width)
    assert torch.equal(positions, inputs.positions) and torch.equal(index, inputs.retrieve_index)
    assert torch.equal(next_token, inputs.retrieve_next_token)
    assert torch.equal(next_sibling, inputs.retrieve_next_sibling)

    # FlashInfer and Triton find request b's rows through mask_indptr = cumsum(N * (seq_lens + N))
    # (triton_backend.py:1052-1056, dflash_info.py:198-218); what lies past the last request
    # is never read. Triton's graph replay copies the whole mask into its buffer of
    # bs * N * (context_len + N) cells (triton_backend.py:634-638, verify_mask.py:11-25).
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(width * (prefix + width), 0)])
    assert full.numel() == width * (bound + bs * width) >= int(offsets[-1])
    assert full.numel() <= bs * width * (context_len + width)
    assert full[int(offsets[-1]):].all()
    for b in range(bs):
        rows = full[offsets[b]:offsets[b + 1]].view(width, int(prefix[b]) + width)
        assert rows[:, :prefix[b]].all() and torch.equal(rows[:, prefix[b]:], inputs.tree_mask[b])

    target = target_that_mostly_follows_the_tree(inputs, gen)
    # The accept width is the drafter's block B (no node deeper than B-1), here as tight as the
    # trees allow; a walk over all N steps must never accept past it.
    block = int(trees.depths.max()) + 1 if trees.depths.numel() else 1
    view = TreeVerifyView.from_inputs(inputs, full, accept_width=block)
    depth = view.max_tree_depth
    assert depth == block
    predict, accept_index, accepted = greedy_tree_walk(view.draft_token.view(bs, width), view.retrieve_index,
                                                       view.retrieve_next_token, view.retrieve_next_sibling,
                                                       target, depth)
    accept_lens = accepted + 1
    our_index, our_accepted, our_bonus = walk_retrieve_arrays(
        inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token, inputs.retrieve_next_sibling, target)
    assert torch.equal(our_index[:, :block], accept_index.long()) and (our_index[:, block:] == -1).all()
    assert torch.equal(our_accepted, accepted.long())
    out_tokens, next_bonus = committed_tokens_and_bonus(predict, accept_index, accept_lens)
    assert torch.equal(our_bonus, next_bonus)
    for b in range(bs):
        child_maps = [dict() for _ in range(width)]
        for node, parent in enumerate(trees.parents[b].tolist()):
            if parent >= 0:
                child_maps[parent][int(inputs.input_ids[b, node])] = node
        path, walk_bonus = follow_verified_tree(child_maps, target[b])
        length = int(accept_lens[b])
        assert [int(x) - b * width for x in accept_index[b, :length]] == path and walk_bonus == int(next_bonus[b])
        drafts = [int(inputs.input_ids[b, i]) for i in path[1:]]
        assert out_tokens[b, :length].tolist() == drafts + [walk_bonus]  # drafts, then the bonus
        assert int(out_tokens.view(-1)[b * depth + length - 1]) == int(next_bonus[b])

    # the KV pool after SGLang's move equals our accepted-rows-first order
    slots = torch.randperm(1000, generator=gen)[: bs * width] + 1
    pool = torch.zeros(1002)
    pool[slots] = torch.arange(bs * width, dtype=torch.float) + 0.5
    front = torch.cat([slots.view(bs, width)[b, :int(accept_lens[b])] for b in range(bs)])
    flat = accept_index.view(-1)
    pool[front] = pool[slots[flat[flat >= 0].long()]].clone()
    hidden = (torch.arange(bs * width, dtype=torch.float) + 0.5).unsqueeze(1)
    ours = accepted_rows_first(hidden, accept_index, width).view(bs, block)
    for b in range(bs):
        length = int(accept_lens[b])
        assert torch.equal(pool[slots.view(bs, width)[b, :length]], ours[b, :length])


def test_retrieve_arrays_are_contiguous_for_the_cuda_kernels():
    trees = build_round_trees(torch.randn(2, 4, 50), 8, 8)
    inputs, _ = pack_round_inputs(trees, torch.tensor([1, 2]), torch.tensor([3, 4]), 9, 7)
    for name in ("input_ids", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert getattr(inputs, name).is_contiguous(), name
