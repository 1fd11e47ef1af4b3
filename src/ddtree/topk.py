"""Per-row top-K log-probs from a vocabulary split into shards (tensor-parallel heads).

A vocab-parallel lm_head gives each rank the logits of one slice of the vocabulary. Each rank
keeps its local top-K raw logits and its local logsumexp (`shard_top_k`); after a gather,
`merge_top_k` picks the global top-K and the global logsumexp (the logsumexp of the local
ones), so `ShardTopK.log_probs` equals `logits - logsumexp(full row)` without any rank ever holding
a full row. Everything stays on the device: no host synchronisation, static shapes.

Exactness: with one shard the result is bit-identical to `ddtree.batched.row_top_log_probs`.
With several shards the ids are the same (up to the order of exactly tied logits), but the
global logsumexp is a different float32 reduction of the same numbers (log/exp round trip per
shard), so log-probs agree to a few float32 ulps, not bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class ShardTopK(NamedTuple):
    """The top-K of one vocabulary shard, or of a merge of shards. A leading [R] dimension
    (stacked shards, as `stack_shards` or a gather produce) is allowed on every field."""

    values: torch.Tensor  # [bs, D, K] float32 raw logits, sorted descending; padding -inf
    token_ids: torch.Tensor  # [bs, D, K] int64 global token ids; padding 0
    lse: torch.Tensor  # [bs, D] float32 logsumexp of the logits this top-K covers

    def log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([bs, D, K] float32 log-probs sorted descending, [bs, D, K] int64 ids): the input of
        `ddtree.batched.build_trees_from_top_log_probs`. Padding and NaN rows come out
        non-finite, which the builder never places."""
        return self.values - self.lse.unsqueeze(-1), self.token_ids


def _check_k(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


# logsumexp reads a float32 copy of the logits (plus one temporary of the same size), made a
# few depths at a time so that the copy stays under this many bytes: a whole [bs, D, V] copy
# would be 146 MB at bs 16, D 15, V 151936. One depth is always allowed.
FLOAT_COPY_BYTES = 8 * 2**20


def depth_chunks(bs: int, depth_limit: int, vocab: int) -> list[tuple[int, int]]:
    """[start, stop) depth ranges for the float32 copies. A chunk never holds a lone row when
    there are two or more: torch sums a lone row thread-split but each row of several serially,
    and only the serial sums are bit-equal to the reference's per-request [D, V] logsumexp."""
    step = max(1, FLOAT_COPY_BYTES // max(1, bs * vocab * 4))
    if bs == 1:
        step = max(2, step)
    bounds = [(d, min(d + step, depth_limit)) for d in range(0, depth_limit, step)]
    if bs == 1 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], depth_limit)]  # fold a lone last row into the chunk before
    return bounds


def shard_top_k(
    logits: torch.Tensor,  # [bs, D, Vs] float32 / bfloat16 / float16, one vocabulary slice
    k: int,
    vocab_start: int = 0,  # global token id of the slice's first column
) -> ShardTopK:
    """Local top-k and local logsumexp, in float32. A slice narrower than k is padded with -inf
    (never placed in a tree) so every rank sends tensors of the same shape. The top-k reads the
    logits as they are (upcasting is exact and keeps the order); the logsumexp reads float32
    copies of a few depths at a time (`FLOAT_COPY_BYTES`). Few ops: each is a kernel launch."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [bs, D, Vs], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    _check_k(k)
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    bs, depth_limit, width = logits.shape
    device = logits.device
    kept = min(k, width)
    if kept > 0 and bs * depth_limit > 0:
        top_values, top_ids = torch.topk(logits, kept, dim=-1)
        values, ids = top_values.float(), top_ids + vocab_start
        if kept < k:
            values = torch.nn.functional.pad(values, (0, k - kept), value=float("-inf"))
            ids = torch.nn.functional.pad(ids, (0, k - kept), value=0)
    else:
        values = torch.full((bs, depth_limit, k), float("-inf"), dtype=torch.float32, device=device)
        ids = torch.zeros(bs, depth_limit, k, dtype=torch.int64, device=device)
    if width == 0 or depth_limit == 0:
        lse = torch.full((bs, depth_limit), float("-inf"), dtype=torch.float32, device=device)
    else:
        parts = [torch.logsumexp(logits[:, a:b].float(), dim=-1) for a, b in depth_chunks(bs, depth_limit, width)]
        lse = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return ShardTopK(values, ids, lse)


def stack_shards(parts: Sequence[ShardTopK]) -> ShardTopK:
    """[R, ...] stacked shards, in vocabulary order (the order a rank-major gather gives)."""
    if not parts:
        raise ValueError("stack_shards needs at least one shard")
    return ShardTopK(*(torch.stack([getattr(p, f) for p in parts]) for f in ShardTopK._fields))


def merge_top_k(shards: ShardTopK, k: int) -> ShardTopK:
    """Global top-k over stacked shards ([R, bs, D, K] values/ids, [R, bs, D] lse).

    Candidates are laid out shard-major and sorted stably, so exactly tied logits keep the
    order shard by shard (the same on every rank: all ranks build the same trees). The result
    is itself a ShardTopK, so merges compose (segments of one rank, then ranks)."""
    if shards.values.dim() != 4 or shards.token_ids.shape != shards.values.shape:
        raise ValueError(
            f"stacked values and token_ids must both be [R, bs, D, K], got "
            f"{tuple(shards.values.shape)} and {tuple(shards.token_ids.shape)}"
        )
    if shards.lse.shape != shards.values.shape[:3]:
        raise ValueError(f"stacked lse must be [R, bs, D], got {tuple(shards.lse.shape)}")
    _check_k(k)
    count, bs, depth_limit, width = shards.values.shape
    candidates = shards.values.movedim(0, 2).reshape(bs, depth_limit, count * width)  # [bs, D, R*K]
    candidate_ids = shards.token_ids.movedim(0, 2).reshape(bs, depth_limit, count * width)
    order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[..., :k]
    values = torch.gather(candidates, -1, order)  # [bs, D, min(k, R*K)]
    ids = torch.gather(candidate_ids, -1, order)
    if values.shape[-1] < k:  # fewer candidates than k: pad like a narrow shard
        pad = k - values.shape[-1]
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
        ids = torch.nn.functional.pad(ids, (0, pad), value=0)
    lse = torch.logsumexp(shards.lse, dim=0)  # [bs, D]
    return ShardTopK(values, ids, lse)
