"""Seeded families of drafter rows for the tree-build benchmark and the parity tests.

Each family turns (seed, D, V) into `[D, V]` float32 logits, deterministically. They stand for
the shapes real drafters produce, not one shape:
- `flat`: standard normal logits; the tree stays one level deep.
- `peaked`: one dominant token per row (p ~ 0.9) over a `randn * 2` tail; deep, thin trees.
- `few-peaks`: shaped like the smoke `tree-bench` stage's rows: four likely tokens (logits 9, 7.5, 6.5, 6)
  over a normal tail; a tree mostly one level deep with a few longer paths.
- `power-S` (S = 1.0, 1.5, 2.0, 2.5): heavy-tailed rows, log-probability falling like a power
  law of the rank (logit = -S * ln(rank + 1)) over a fresh random permutation of the vocabulary
  per row. S = 1 is a wide, shallow tree (top token p ~ 0.08 at V = 151936), S = 2.5 a deep one.
- `power-S-sharp`: the same with depth-dependent sharpening, as drafters are surer near the
  root: the exponent is 2S at the first row and falls linearly to S at the last.
- `name@T`: a temperature-scaled copy of family `name` (logits / T), T = 0.5 and 2.
- `mixed-depths`: rows whose shape changes with depth: peaked (first fifth), power-2.0 (next
  two fifths), few-peaks, then flat.
- `dflash-tiny`: a real DFlash drafter forward pass (seeded random weights) over the tiny Llama
  test target, and its copy at T = 0.5 (`benchmarks/dflash_rows.py`; needs transformers).
"""
from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

POWER_EXPONENTS = (1.0, 1.5, 2.0, 2.5)
TEMPERATURES = (0.5, 2.0)
TEMPERATURE_BASES = ("peaked", "power-1.5-sharp")


def _generator(seed: int, name: str) -> torch.Generator:
    # the family's name is part of the seed: two families never share a random stream
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _flat(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    return torch.randn(depth, vocab, generator=g)


def _peaked(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(depth, vocab, generator=g) * 2.0
    top = torch.randint(0, vocab, (depth, 1), generator=g)
    return logits.scatter_add_(1, top, torch.full((depth, 1), 16.0))


def _few_peaks(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(depth, vocab, generator=g)
    peaks = torch.randint(0, vocab, (depth, 4), generator=g)
    return logits.scatter_(1, peaks, torch.tensor([9.0, 7.5, 6.5, 6.0]).expand(depth, 4))


def _power_rows(g: torch.Generator, exponents: list[float], vocab: int) -> torch.Tensor:
    """Row d: token perm_d[r] gets logit -exponents[d] * ln(r + 1) (float64, then float32)."""
    log_rank = torch.log1p(torch.arange(vocab, dtype=torch.float64))  # [V]
    rows = torch.empty(len(exponents), vocab)
    for d, exponent in enumerate(exponents):
        rows[d, torch.randperm(vocab, generator=g)] = (-exponent * log_rank).float()
    return rows


def _power(exponent: float, sharpen: bool) -> Callable[[torch.Generator, int, int], torch.Tensor]:
    def make(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
        steps = max(1, depth - 1)
        scale = [1.0 + ((depth - 1 - d) / steps if sharpen else 0.0) for d in range(depth)]
        return _power_rows(g, [exponent * s for s in scale], vocab)

    return make


def _mixed(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    shapes = [_peaked, _power(2.0, False), _power(2.0, False), _few_peaks, _flat]
    rows = [shapes[min(len(shapes) - 1, d * len(shapes) // max(1, depth))](g, 1, vocab) for d in range(depth)]
    return torch.cat(rows) if rows else torch.empty(0, vocab)


def _base_families() -> dict[str, Callable[[torch.Generator, int, int], torch.Tensor]]:
    families = {"flat": _flat, "peaked": _peaked, "few-peaks": _few_peaks}
    for exponent in POWER_EXPONENTS:
        families[f"power-{exponent}"] = _power(exponent, False)
        families[f"power-{exponent}-sharp"] = _power(exponent, True)
    families["mixed-depths"] = _mixed
    families["dflash-tiny"] = _dflash_tiny
    return families


def _dflash_tiny(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    from dflash_rows import dflash_block_logits  # imports transformers: only when asked for

    return dflash_block_logits(g, depth, vocab)


BASE_FAMILIES = _base_families()
# the drafter's random rows are flatter than a trained drafter's: its T = 0.5 copy stands in
# for a confident one
EXTRA_TEMPERATURE_COPIES = ("dflash-tiny@T0.5",)
FAMILIES = (list(BASE_FAMILIES) + [f"{base}@T{t:g}" for base in TEMPERATURE_BASES for t in TEMPERATURES]
            + list(EXTRA_TEMPERATURE_COPIES))


def family_logits(name: str, seed: int, depth: int, vocab: int) -> torch.Tensor:
    """[depth, vocab] float32 logits of family `name`, the same for the same arguments."""
    base, _, temperature = name.partition("@T")
    if base not in BASE_FAMILIES or (temperature and name not in FAMILIES):
        raise ValueError(f"unknown row family {name!r}; families: {', '.join(FAMILIES)}")
    logits = BASE_FAMILIES[base](_generator(seed, base), depth, vocab)
    if temperature:
        t = float(temperature)
        assert math.isfinite(t) and t > 0
        logits = logits / t
    return logits.contiguous()
