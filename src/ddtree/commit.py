"""Committing a verified round: tokens, the next bonus, and which KV rows survive.

The verify pass appends the N tree rows to every cache tensor after `past_length` committed
rows. The accepted path's rows (in path order) must become the first rows of that appended
window; the rest of the window is dropped by the caller (crop / sequence length).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ddtree.host_tensors import long_tensor
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


def check_keep_rows(
    keep_indices: Sequence[int] | torch.Tensor,  # [k] int64 window-relative rows, in order
    past_length: int,
    cache_rows: int,
) -> list[int]:
    """Validate keep rows against a cache of `cache_rows` rows whose appended window starts at
    `past_length`; return them as host ints (one sync at most, for a device tensor)."""
    if not 0 <= past_length <= cache_rows:
        raise ValueError(f"past_length {past_length} outside a cache of {cache_rows} rows")
    keep = keep_indices.tolist() if isinstance(keep_indices, torch.Tensor) else [int(i) for i in keep_indices]
    window = cache_rows - past_length
    if len(keep) > window:
        raise ValueError(f"{len(keep)} rows to keep but the appended window holds {window}")
    bad = [i for i in keep if not 0 <= i < window]
    if bad:
        raise ValueError(f"keep_indices {keep} must lie in [0, {window})")
    return keep


def move_rows_(cache: torch.Tensor, rows: torch.Tensor, to: int, seq_dim: int) -> None:
    """The move itself, with no checks and no host sync: cache row rows[j] (absolute, on
    cache.device) goes to to + j. The rows are gathered before anything is written, so
    overlapping moves are safe."""
    cache.narrow(seq_dim, to, rows.numel()).copy_(cache.index_select(seq_dim, rows))


def compact_appended_window_(
    cache: torch.Tensor,  # [..., T, ...] with the sequence on `dim`
    past_length: int,
    keep_indices: Sequence[int] | torch.Tensor,  # [k] int64 window-relative rows, in order
    dim: int = -2,
) -> int:
    """Move rows past_length + keep_indices[j] to past_length + j, in place. Returns the new
    valid length past_length + k (rows after it are stale)."""
    seq_dim = dim % cache.dim()
    keep = check_keep_rows(keep_indices, past_length, cache.shape[seq_dim])
    if keep != list(range(len(keep))):  # else already in place
        rows = long_tensor([past_length + row for row in keep], cache.device)
        move_rows_(cache, rows, past_length, seq_dim)
    return past_length + len(keep)


def keep_indices_batch(
    accept_index: torch.Tensor,  # [bs, S] int64 flat indices b*N + i from the verify walk, -1 padded
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request window-relative keep rows ([bs, S] int64, -1 padded) and counts ([bs])."""
    bs = accept_index.shape[0]
    base = torch.arange(bs, device=accept_index.device).unsqueeze(1) * width
    valid = accept_index >= 0
    return torch.where(valid, accept_index - base, -1), valid.sum(dim=1)
