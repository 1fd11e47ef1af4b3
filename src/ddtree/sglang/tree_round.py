"""The pure tensor steps of one DDTree round inside SGLang (no sglang import, CPU-testable).

The worker (worker.py) is glue: it runs SGLang's forwards and kernels and calls these for
everything in between. Per-row top-K (sharded and merged), tree building, verify-input
packing and the keep-rows arithmetic come from the core (ddtree.topk / ddtree.batched /
ddtree.verify / ddtree.commit).

Index conventions (SGLang's, see eagle_utils.eagle_sample): the verify window of request b
is flat rows b*N .. b*N + N-1; tree index 0 is the root (the bonus token carried from the
previous round); `accept_index[b, j]` is the flat row of the j-th accepted tree index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ddtree.batched import TreeBatch, build_trees_from_top_log_probs
from ddtree.commit import keep_indices_batch
from ddtree.topk import ShardTopK, merge_top_k, shard_top_k, stack_shards
from ddtree.tree import ancestor_visibility
from ddtree.verify import MaskLayout, VerifyInputs, build_verify_inputs, pack_custom_mask


def draft_logits_from_hidden(
    draft_hidden: torch.Tensor,  # [bs, B, H] the drafter's last hidden states for the block
    head_weight: torch.Tensor,  # [Vs, H] rows of the target's lm_head (one vocabulary slice)
) -> torch.Tensor:
    """[bs, B-1, Vs] draft logits: block position 0 is the bonus token, positions 1..B-1
    score depths 1..D (D = B-1). Computed in the head's dtype, like SGLang's greedy head."""
    bs, block, hidden = draft_hidden.shape
    rows = draft_hidden[:, 1:, :].reshape(-1, hidden).to(head_weight.dtype)
    return torch.matmul(rows, head_weight.T).view(bs, block - 1, head_weight.shape[0])


class HeadShard(NamedTuple):
    """Where a vocab-parallel lm_head's local rows sit in the vocabulary: the fields of SGLang's
    VocabParallelEmbeddingShardIndices that the worker copies (ints, read once at startup).
    Local weight rows: [0, num_org) base vocab, padding up to num_org_padded, then the added
    (LoRA) vocab."""

    org_vocab_start_index: int
    org_vocab_end_index: int
    padded_org_vocab_start_index: int
    padded_org_vocab_end_index: int
    added_vocab_start_index: int
    added_vocab_end_index: int


class VocabSegment(NamedTuple):
    """A run of local head rows that maps to consecutive global token ids."""

    local_start: int  # first local weight row
    local_end: int  # one past the last local weight row
    global_start: int  # token id of local_start


def head_vocab_segments(shard: Optional[HeadShard], weight_rows: int) -> tuple[VocabSegment, ...]:
    """The real-vocabulary rows of a local head weight [weight_rows, H] (padding rows excluded);
    a head without shard indices is one unsharded segment."""
    if shard is None:
        return (VocabSegment(0, weight_rows, 0),)
    num_org = shard.org_vocab_end_index - shard.org_vocab_start_index
    num_org_padded = shard.padded_org_vocab_end_index - shard.padded_org_vocab_start_index
    num_added = shard.added_vocab_end_index - shard.added_vocab_start_index
    segments = []
    if num_org > 0:
        segments.append(VocabSegment(0, num_org, shard.org_vocab_start_index))
    if num_added > 0:
        segments.append(VocabSegment(num_org_padded, num_org_padded + num_added, shard.added_vocab_start_index))
    for segment in segments:
        if segment.local_end > weight_rows:
            raise ValueError(f"lm_head shard {shard} needs row {segment.local_end - 1}, weight has {weight_rows} rows")
    return tuple(segments)


def local_draft_top_k(
    draft_hidden: torch.Tensor,  # [bs, B, H] drafter hidden states of the block
    head_weight: torch.Tensor,  # [rows, H] this rank's lm_head weight (padding rows included)
    segments: tuple[VocabSegment, ...],  # head_vocab_segments(...) of that weight
    k: int,
) -> ShardTopK:
    """This rank's top-k raw logits and logsumexp per draft position ([bs, D, k], D = B-1),
    merged over its segments (base and added vocab). Logits exist one segment at a time."""
    bs, block, _hidden = draft_hidden.shape
    parts = [
        shard_top_k(draft_logits_from_hidden(draft_hidden, head_weight[s.local_start : s.local_end]), k, s.global_start)
        for s in segments
    ]
    if not parts:  # a rank that owns no real vocabulary still answers the gather
        return shard_top_k(head_weight.new_empty(bs, block - 1, 0), k)
    return parts[0] if len(parts) == 1 else merge_top_k(stack_shards(parts), k)


def pack_for_gather(top: ShardTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contiguous tensors for the TP all-gather: ([bs, D, K+1] float32 values with the
    logsumexp as the last column, [bs, D, K] int64 ids). Two collectives per round, not three."""
    floats = torch.cat([top.values, top.lse.unsqueeze(-1)], dim=-1).contiguous()
    return floats, top.token_ids.contiguous()


def unpack_gathered(
    floats: torch.Tensor,  # [R*bs, D, K+1] float32: pack_for_gather of every rank, rank-major
    ids: torch.Tensor,  # [R*bs, D, K] int64
    world_size: int,  # R
) -> ShardTopK:
    """Stacked [R, ...] shards from a dim-0 all-gather (SGLang's GroupCoordinator.all_gather
    concatenates rank-major along the gathered dimension)."""
    rows, depth_limit, width_plus = floats.shape
    if rows % world_size or ids.shape != (rows, depth_limit, width_plus - 1):
        raise ValueError(
            f"gathered shapes {tuple(floats.shape)} / {tuple(ids.shape)} do not fit world size {world_size}"
        )
    floats = floats.view(world_size, rows // world_size, depth_limit, width_plus)
    return ShardTopK(
        values=floats[..., :-1],
        token_ids=ids.view(world_size, rows // world_size, depth_limit, width_plus - 1),
        lse=floats[..., -1],
    )


def trees_from_top_k(top: ShardTopK, budget: int) -> TreeBatch:
    """Trees for a batch from (merged) top-K: exact when K >= min(budget, V); K < budget caps
    every depth at K candidates (DDTREE_TOPK)."""
    log_probs, ids = top.log_probs()
    return build_trees_from_top_log_probs(log_probs, ids, budget)


def pack_trees(trees: TreeBatch) -> torch.Tensor:
    """[bs, 4*budget + 2] int64, one contiguous tensor for one broadcast: token ids, depths,
    parents, node count, and the float64 scores' bits (visibility is rebuilt from parents)."""
    return torch.cat([
        trees.token_ids, trees.depths, trees.parents, trees.num_nodes.unsqueeze(1), trees.scores.view(torch.int64),
    ], dim=1).contiguous()


def unpack_trees(packed: torch.Tensor, budget: int, depth_limit: int) -> TreeBatch:
    """The TreeBatch of pack_trees (depth_limit D: no node is deeper; a static bound, no sync)."""
    token_ids, depths, parents, num_nodes, score_bits = torch.split(packed, [budget, budget, budget + 1, 1, budget], dim=1)
    return TreeBatch(
        token_ids=token_ids, depths=depths, parents=parents, num_nodes=num_nodes.squeeze(1),
        scores=score_bits.contiguous().view(torch.float64),
        visibility=ancestor_visibility(parents, depth_limit),
    )


def build_round_trees(draft_logits: torch.Tensor, budget: int, topk: int) -> TreeBatch:
    """Trees from unsharded draft logits [bs, D, V] with a top-K cap (topk <= budget)."""
    return trees_from_top_k(shard_top_k(draft_logits, topk), budget)


def mask_prefix_bound(reserved_kv_sum: Optional[int], bs: int, context_len: int) -> int:
    """A host-known upper bound of sum(prefix_lens), to size the FULL mask without reading the
    device prefix lengths. DFlash's prepare_for_decode reserves every request's window ahead
    (nxt_kv_lens >= prefix + N, summed on the host as nxt_kv_lens_sum); no request's prefix
    exceeds the context length, and bs * context_len also keeps the mask inside Triton's graph
    buffer (max_bs * N * (context_len + N) bytes) whenever the batch fits a captured graph."""
    cap = bs * context_len
    return cap if reserved_kv_sum is None else min(int(reserved_kv_sum), cap)


def pack_round_inputs(
    trees: TreeBatch,
    bonus_tokens: torch.Tensor,  # [bs] int64, each request's root
    prefix_lens: torch.Tensor,  # [bs] int64 committed tokens (the root's position)
    width: int,  # N
    prefix_bound: int,  # host upper bound of sum(prefix_lens): mask_prefix_bound(...)
) -> tuple[VerifyInputs, torch.Tensor]:
    """Verify inputs and SGLang's FULL-layout custom mask (flat bool, N * (prefix_bound + bs*N)),
    the layout FlashInfer and Triton read in TARGET_VERIFY: request b's rows start at
    sum_{c<b} N * (prefix_c + N) (their mask_indptr); the tail past the last request is True
    and never read. Sizing from a host bound keeps the round free of device reads."""
    inputs = build_verify_inputs(trees, bonus_tokens.to(torch.int64), prefix_lens.to(torch.int64), width=width)
    mask = pack_custom_mask(inputs.tree_mask, prefix_lens, MaskLayout.FULL, prefix_bound)
    return inputs, mask


@dataclass
class TreeVerifyView:
    """The attributes eagle_sample() reads from a verify input, for an irregular tree
    (as NgramVerifyInput provides them): tree_topk = -1, max_tree_depth = the accept width."""

    draft_token: torch.Tensor  # [bs*N] int64
    custom_mask: torch.Tensor  # flat bool, FULL layout
    positions: torch.Tensor  # [bs*N] int64
    retrieve_index: torch.Tensor  # [bs, N] int64
    retrieve_next_token: torch.Tensor  # [bs, N] int64
    retrieve_next_sibling: torch.Tensor  # [bs, N] int64
    draft_token_num: int  # N
    accept_width: int  # B: a path holds the root and at most B-1 drafted depths
    draft_probs: Optional[torch.Tensor] = None  # rejection sampling is refused at startup

    @property
    def max_tree_depth(self) -> int:
        # eagle_sample sizes accept_index [bs, max_tree_depth] and the greedy kernel walks that
        # many steps; logprob requests gather [bs * max_tree_depth, V]. No tree is deeper than
        # the drafter's B-1 positions, so B rows hold every accepted path (not N).
        return self.accept_width

    @property
    def tree_topk(self) -> int:
        return -1

    @classmethod
    def from_inputs(cls, inputs: VerifyInputs, custom_mask: torch.Tensor, accept_width: int) -> "TreeVerifyView":
        return cls(
            draft_token=inputs.draft_tokens(),
            custom_mask=custom_mask,
            positions=inputs.positions.reshape(-1),
            retrieve_index=inputs.retrieve_index,
            retrieve_next_token=inputs.retrieve_next_token,
            retrieve_next_sibling=inputs.retrieve_next_sibling,
            draft_token_num=inputs.width,
            accept_width=accept_width,
        )


def committed_tokens_and_bonus(
    predict: torch.Tensor,  # [bs*N] int: the target's token written at each accepted row
    accept_index: torch.Tensor,  # [bs, S] int flat rows, -1 padded (S = the accept width)
    accept_lens: torch.Tensor,  # [bs] int accepted tree indices, root included (>= 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_tokens [bs, S] int64, bonus [bs] int64). Row b's first accept_lens[b] entries are
    the tokens this round commits: the accepted drafts, then the target's token after the
    last accepted index, which is also next round's root (the bonus)."""
    index = accept_index.to(torch.int64)
    out_tokens = torch.where(index >= 0, predict.to(torch.int64)[index.clamp(min=0)], 0)
    last = (accept_lens.to(torch.int64) - 1).clamp(min=0).unsqueeze(1)  # [bs, 1]
    bonus = torch.gather(out_tokens, 1, last).squeeze(1)
    return out_tokens, bonus


def accepted_rows_first(
    hidden: torch.Tensor,  # [bs*N, H] target hidden states of the verify window
    accept_index: torch.Tensor,  # [bs, S] int flat rows, -1 padded
    width: int,  # N
) -> torch.Tensor:
    """[bs*S, H]: row j of request b is the hidden state of its j-th accepted tree index
    (rows past the accepted count repeat index 0 and are never committed)."""
    keep, _counts = keep_indices_batch(accept_index.to(torch.int64), width)  # [bs, S] local rows
    bs = keep.shape[0]
    base = torch.arange(bs, device=keep.device).unsqueeze(1) * width
    rows = (keep.clamp(min=0) + base).reshape(-1)
    return hidden.index_select(0, rows)


def front_positions(prefix_lens: torch.Tensor, rows: int) -> torch.Tensor:
    """[bs*rows] int64: the positions of the window's first `rows` rows (prefix + j)."""
    offsets = torch.arange(rows, device=prefix_lens.device, dtype=torch.int64)
    return (prefix_lens.to(torch.int64).unsqueeze(1) + offsets).reshape(-1)


class DraftKvRewrite(NamedTuple):
    """What DFlash's _append_target_hidden_to_draft_kv_by_loc takes for the committed rows."""

    target_hidden: torch.Tensor  # [bs*B, H] accepted rows first
    cache_loc: torch.Tensor  # [bs*B] draft-pool write ids of the window's first B slots
    cache_loc_2d: torch.Tensor  # [bs, B] the same ids, contiguous
    positions: torch.Tensor  # [bs*B] int64 prefix + j


def draft_kv_rewrite(
    hidden: torch.Tensor,  # [bs*N, H] target hidden states of the verify window (real rows)
    accept_index: torch.Tensor,  # [bs, B] int flat rows, -1 padded
    write_ids: torch.Tensor,  # [bs*N] draft-pool write ids of the window
    prefix_lens: torch.Tensor,  # [bs] int64
    width: int,  # N
) -> DraftKvRewrite:
    """The draft KV rewrite, B rows per request: a round commits at most B rows (root + B-1
    depths), and the writer (fused or not) projects and ropes every row it is given, with a
    RoPE table sized for context_len + B (DFlashWorkerV2's max_position_hint,
    dflash_worker_v2.py:1074-1075): N rows near the end of the context would read past it."""
    bs, block = accept_index.shape
    cache_loc_2d = write_ids.view(bs, width)[:, :block].contiguous()
    return DraftKvRewrite(
        target_hidden=accepted_rows_first(hidden, accept_index, width),
        cache_loc=cache_loc_2d.view(-1),
        cache_loc_2d=cache_loc_2d,
        positions=front_positions(prefix_lens, block),
    )
