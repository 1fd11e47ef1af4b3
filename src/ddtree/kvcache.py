"""KV-cache surgery for Hugging Face caches: crop to a length, keep the accepted tree rows.

Works on the `DynamicCache` of transformers 4.5x and 5.x: both expose per-layer tensors
`[batch, kv_heads, T, head_dim]` (5.x: `cache.layers[i].keys/values`; 4.5x also
`cache.key_cache[i]/value_cache[i]`). `crop` takes "tokens to remove" as a negative count in
5.x (a positive count raises) and reads a negative value the same way in 4.5x, so we always
pass a negative count and never call it with zero (4.5x would read 0 as "keep nothing").
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from ddtree.commit import check_keep_rows, move_rows_
from ddtree.host_tensors import long_tensor


class UnsupportedCacheError(TypeError):
    """The cache object has neither layout we know how to compact."""


def cache_length(cache: Any) -> int:
    """Rows currently held by the cache (0 for a fresh one)."""
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` rows of every layer."""
    current = cache_length(cache)
    if length < 0 or length > current:
        raise ValueError(f"crop_cache: length must be in [0, {current}], got {length}")
    if length < current:
        cache.crop(-(current - length))


def _layer_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every non-empty key and value tensor `[B, H, T, Dh]` of the cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                    yield tensor
        return
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        for tensor in list(cache.key_cache) + list(cache.value_cache):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                yield tensor
        return
    raise UnsupportedCacheError(f"cannot compact a {type(cache).__name__}: no per-layer key/value tensors")


def keep_cache_rows(cache: Any, past_length: int, keep: Sequence[int] | torch.Tensor) -> None:
    """After a tree verify appended N+1 rows at `past_length`, keep only rows `keep`.

    keep: [K] int64 tree indices (root first, increasing); the cache ends `past_length + K`
    rows long, in the order of `keep`. Checked once on the host; each layer's move is then
    a gather and a copy with no host sync.
    """
    tensors = list(_layer_tensors(cache))  # refuses a cache layout we cannot compact
    rows = check_keep_rows(keep, past_length, cache_length(cache))
    if rows != list(range(len(rows))):  # else the kept rows are already a prefix
        absolute = [past_length + row for row in rows]
        index_by_device: dict[torch.device, torch.Tensor] = {}
        for tensor in tensors:
            index = index_by_device.get(tensor.device)
            if index is None:
                index = index_by_device[tensor.device] = long_tensor(absolute, tensor.device)
            move_rows_(tensor, index, past_length, seq_dim=tensor.dim() - 2)
    crop_cache(cache, past_length + len(rows))
