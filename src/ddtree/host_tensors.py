"""Small host tensors from Python lists, without `torch.tensor`'s per-element parsing.

A decode round makes a handful of int64 tensors of ~N+1 values (token ids, positions, kept
rows); `torch.tensor(list)` spends ~75 ns per element checking types, a typed `array` copied
in C and wrapped by `torch.frombuffer` about a third of that (measured on a 2-core CPU).
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch


def long_tensor(values: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[len(values)] int64 on `device` (the host by default). Values must be ints in int64 range."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    tensor = torch.frombuffer(array("q", values), dtype=torch.int64)  # owns its array: no aliasing
    return tensor if device is None else tensor.to(device)


def double_tensor(values: Sequence[float]) -> torch.Tensor:
    """[len(values)] float64 on the host."""
    if not values:
        return torch.empty(0, dtype=torch.float64)
    return torch.frombuffer(array("d", values), dtype=torch.float64)
