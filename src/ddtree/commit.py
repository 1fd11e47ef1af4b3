"""Committing a verified round: tokens, the next bonus, and which KV rows survive.

The verify pass appends the N tree rows to every cache tensor after `past_length` committed
rows. The accepted path's rows (in path order) must become the first rows of that appended
window; the rest of the window is dropped by the caller (crop / sequence length).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ddtree.inputs import check_accepted_path


@dataclass(frozen=True)
class RoundCommit:
    tokens: list[int]  # tokens to commit: the tree tokens at the accepted indices (root first)
    bonus_token: int  # the target's token after the last accepted index: next round's root
    keep_indices: list[int]  # window rows to keep, in order (= the accepted tree indices)

    @property
    def acceptance_length(self) -> int:
        return len(self.keep_indices)


def commit_round(
    verify_tokens: Sequence[int] | torch.Tensor,  # [N+1] the tree tokens fed to verify (root first)
    accepted: Sequence[int],  # tree indices from follow_verified_tree, starting with 0
    bonus_token: int,
) -> RoundCommit:
    tokens = verify_tokens.tolist() if isinstance(verify_tokens, torch.Tensor) else list(verify_tokens)
    accepted = check_accepted_path(accepted)
    bad = [i for i in accepted if not 0 <= i < len(tokens)]
    if bad:
        raise ValueError(f"accepted index {bad[0]} is outside the {len(tokens)} verify tokens")
    return RoundCommit([int(tokens[i]) for i in accepted], int(bonus_token), accepted)


def compact_appended_window_(
    cache: torch.Tensor,  # [..., T, ...] with the sequence on `dim`
    past_length: int,
    keep_indices: Sequence[int] | torch.Tensor,  # [k] int64 window-relative rows, in order
    dim: int = -2,
) -> int:
    """Move rows past_length + keep_indices[j] to past_length + j, in place. Returns the new
    valid length past_length + k (rows after it are stale). Overlapping moves are safe: the
    kept rows are gathered before anything is written."""
    seq_dim = dim % cache.dim()
    window = cache.shape[seq_dim] - past_length
    if not 0 <= past_length <= cache.shape[seq_dim]:
        raise ValueError(f"past_length {past_length} outside a cache of {cache.shape[seq_dim]} rows on dim {dim}")
    keep = torch.as_tensor(keep_indices, dtype=torch.int64).to(cache.device)
    count = keep.numel()
    if count > window:
        raise ValueError(f"{count} rows to keep but the appended window holds {window}")
    if count and not bool(((keep >= 0) & (keep < window)).all()):
        raise ValueError(f"keep_indices {keep.tolist()} must lie in [0, {window})")
    if count == 0 or torch.equal(keep, torch.arange(count, device=cache.device)):
        return past_length + count  # already in place
    kept = cache.narrow(seq_dim, past_length, window).index_select(seq_dim, keep)
    cache.narrow(seq_dim, past_length, count).copy_(kept)
    return past_length + count


def keep_indices_batch(
    accept_index: torch.Tensor,  # [bs, S] int64 flat indices b*N + i from the verify walk, -1 padded
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request window-relative keep rows ([bs, S] int64, -1 padded) and counts ([bs])."""
    bs = accept_index.shape[0]
    base = torch.arange(bs, device=accept_index.device).unsqueeze(1) * width
    valid = accept_index >= 0
    return torch.where(valid, accept_index - base, -1), valid.sum(dim=1)
