"""Input checks shared by the core's entry points: one-line errors that carry the bad value."""
from __future__ import annotations

import operator
from typing import Sequence

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_budget(budget: object) -> int:
    """Any integer (a numpy or 0-d torch integer too, via `__index__`); never a bool or float."""
    try:
        if isinstance(budget, bool):
            raise TypeError
        budget = operator.index(budget)
    except TypeError:
        raise TypeError(f"budget must be an int, got {budget!r} ({type(budget).__name__})") from None
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return budget


def check_accepted_path(accepted: Sequence[int]) -> list[int]:
    """Tree indices from `follow_verified_tree` as ints; they must start with the root 0."""
    accepted = [int(i) for i in accepted]
    if not accepted or accepted[0] != 0:
        raise ValueError(f"accepted indices must start with the root 0, got {accepted}")
    return accepted


def check_logits_shape(logits: object, rank: int, name: str = "logits") -> torch.Tensor:
    """Rank, float dtype and a non-empty vocabulary; `rank` 2 is [D, V], 3 is [bs, D, V]."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    layout = "[D, V]" if rank == 2 else "[bs, D, V]"
    if logits.dim() != rank:
        raise ValueError(
            f"{name} must have rank {rank} {layout}, got rank {logits.dim()} with shape {tuple(logits.shape)}"
        )
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary: shape {tuple(logits.shape)}")
    return logits


def raise_bad_row(row: int, row_values: torch.Tensor, name: str = "logits") -> None:
    """Raise for a row that holds NaN or +inf (a zero-probability -inf is allowed), as the
    builders see it: in float32, so a float64 logit beyond float32's range is +inf too."""
    values = row_values.float()
    if bool(torch.isnan(values).any()):
        bad = int(torch.isnan(values).nonzero()[0, 0])
        raise ValueError(f"{name} row {row} (depth {row + 1}) contains NaN (first at token {bad})")
    if bool(torch.isposinf(values).any()):
        bad = int(torch.isposinf(values).nonzero()[0, 0])
        what = "+inf" if bool(torch.isposinf(row_values[bad])) else f"{float(row_values[bad])!r}, +inf in float32"
        raise ValueError(f"{name} row {row} (depth {row + 1}) contains {what} (first at token {bad})")


def check_rows_finite(logits: torch.Tensor, name: str = "logits", first_row: int = 0) -> None:
    """Every row free of NaN and +inf. One cheap sum pass; rows whose sum is not finite are
    inspected closely (a -inf logit or an overflowing sum is fine). `first_row`: the index of
    `logits[0]` in the caller's input, for the message."""
    sums = logits.sum(dim=-1, dtype=torch.float32)  # [D] a NaN or +inf makes its row's sum non-finite
    suspect = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    for row in suspect:
        raise_bad_row(first_row + row, logits[row], name)
