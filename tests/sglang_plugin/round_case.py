"""One decode round's tensor steps between SGLang's forwards, shared by the CPU host-read test
and the CUDA sync test (torch only: the GPU machine has no hypothesis)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ddtree.sglang.config import MAX_BUDGET
from ddtree.sglang.tree_round import (
    HeadShard,
    TreeVerifyView,
    committed_tokens_and_bonus,
    draft_kv_rewrite,
    head_vocab_segments,
    local_draft_top_k,
    mask_prefix_bound,
    pack_for_gather,
    pack_round_inputs,
    pack_trees,
    trees_from_top_k,
    unpack_gathered,
    unpack_trees,
)
from ddtree.topk import merge_top_k

# (bs, B, budget, TP world): bs 1 and > 1, the budget at its maximum, TP 1/2/4.
ROUND_SHAPES = [(1, 16, MAX_BUDGET, 1), (3, 5, 12, 2), (4, 2, 1, 1), (4, 16, 256, 4)]


def sglang_like_head_shards(gen, world: int, org: int, added: int, hidden: int):
    """A vocab-parallel lm_head as SGLang lays it out per rank: base rows, padding rows (filled
    with huge weights: they must never be scored), then the rank's added-vocab rows.
    Returns (full weight [org + added, H] in token-id order, [(local weight, HeadShard)])."""
    full = torch.randn(org + added, hidden, generator=gen)
    org_per, added_per = -(-org // world), -(-added // world)  # padded per-rank widths
    shards = []
    for rank in range(world):
        o_lo, o_hi = min(rank * org_per, org), min((rank + 1) * org_per, org)
        a_lo, a_hi = org + min(rank * added_per, added), org + min((rank + 1) * added_per, added)
        local = torch.full((org_per + added_per, hidden), 50.0)
        local[: o_hi - o_lo] = full[o_lo:o_hi]
        local[org_per : org_per + a_hi - a_lo] = full[a_lo:a_hi]
        shard = HeadShard(o_lo, o_hi, rank * org_per, (rank + 1) * org_per, a_lo, a_hi)
        shards.append((local, shard))
    return full, shards


class RoundCase(NamedTuple):
    """One round's inputs, already on the device (host-to-device copies can sync)."""

    heads: list  # [(local head weight [rows, H], its vocab segments)] per TP rank
    draft_hidden: torch.Tensor  # [bs, B, H]
    prefix: torch.Tensor  # [bs] int64
    bonus: torch.Tensor  # [bs] int64
    predict: torch.Tensor  # [bs*N] int32
    verify_hidden: torch.Tensor  # [bs*N, H]
    write_ids: torch.Tensor  # [bs*N] int64
    reserved_kv_sum: int  # host int: sum of DFlash's reserved windows
    context_len: int
    block: int
    budget: int
    world: int


def round_case(device: str, bs: int, block: int, budget: int, world: int) -> RoundCase:
    gen = torch.Generator().manual_seed(bs * 100 + budget)
    vocab, hidden_size, context_len, width = 64, 8, 4096, budget + 1
    _full, shards = sglang_like_head_shards(gen, world, vocab, 0, hidden_size)
    prefix = [context_len - width, 17, 1000, 3][:bs]  # ragged; the first at the context's end
    return RoundCase(
        heads=[(local.to(device), head_vocab_segments(shard, local.shape[0])) for local, shard in shards],
        draft_hidden=torch.randn(bs, block, hidden_size, generator=gen).to(device),
        prefix=torch.tensor(prefix, device=device),
        bonus=torch.randint(0, vocab, (bs,), generator=gen).to(device),
        predict=torch.randint(0, vocab, (bs * width,), generator=gen, dtype=torch.int32).to(device),
        verify_hidden=torch.randn(bs * width, hidden_size, generator=gen).to(device),
        write_ids=torch.arange(bs * width, device=device),
        reserved_kv_sum=sum(prefix) + 2 * width * bs,
        context_len=context_len, block=block, budget=budget, world=world,
    )


def round_between_forwards(case: RoundCase) -> torch.Tensor:
    """Every tensor step of a round between SGLang's forwards. Returns the verify mask."""
    bs, width, budget, block = case.prefix.shape[0], case.budget + 1, case.budget, case.block
    parts = [pack_for_gather(local_draft_top_k(case.draft_hidden, local, segments, budget))
             for local, segments in case.heads]
    gathered = [torch.cat(column, dim=0) for column in zip(*parts)]  # all_gather(dim=0), rank-major
    trees = trees_from_top_k(merge_top_k(unpack_gathered(*gathered, case.world), budget), budget)
    trees = unpack_trees(pack_trees(trees), budget, block - 1)  # the TP > 1 broadcast's payload
    bound = mask_prefix_bound(case.reserved_kv_sum, bs, case.context_len)
    inputs, mask = pack_round_inputs(trees, case.bonus, case.prefix, width, bound)
    view = TreeVerifyView.from_inputs(inputs, mask, accept_width=block)
    accept_index = torch.full((bs, block), -1, dtype=torch.int32, device=mask.device)
    accept_index[:, 0] = view.retrieve_index[:, 0].to(torch.int32)
    accept_lens = torch.ones(bs, dtype=torch.int32, device=mask.device)
    committed_tokens_and_bonus(case.predict, accept_index, accept_lens)
    draft_kv_rewrite(case.verify_hidden, accept_index, case.write_ids, case.prefix, width)
    return mask
