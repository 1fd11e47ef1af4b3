"""Lossless drafting faults for the CPU test server only: the kind of integration bug that
keeps every token right and only accepts less (a drafter/target mismatch, sglang#27924), so
that the checks meant to catch one can be shown to catch one.

`SGLANG_CPU_DDTREE_FAULT` (read by the CPU server's own plugin, `server_plugin.register`, which
does nothing outside a CPU test server; not a DDTREE_* name, so the production plugin's config
never sees it):
- `topk1`: every depth keeps only the drafter's top-1 candidate, so each tree is the drafter's
  greedy chain (what DFlash verifies), whatever the budget;
- `shift-depth`: the candidates of depth d are those the drafter gave for depth d + 1 (the
  draft rows shifted by one depth; the last depth repeats), so trees are built from the wrong
  position's guesses.
Either way the target verifies whatever it is shown, so the output stays the target's.
"""
from __future__ import annotations

import os
from typing import Any, Callable

ENV_FAULT = "SGLANG_CPU_DDTREE_FAULT"
TREES_FROM_TOP_K = "ddtree.sglang.tree_round.trees_from_top_k"


def _topk1(top: Any) -> Any:
    return type(top)(top.values[..., :1], top.token_ids[..., :1], top.lse)


def _shift_depth(top: Any) -> Any:
    import torch

    def shifted(field: torch.Tensor) -> torch.Tensor:  # [bs, D, ...] -> depth d takes d + 1's
        return torch.cat([field[:, 1:], field[:, -1:]], dim=1)

    return type(top)(shifted(top.values), shifted(top.token_ids), shifted(top.lse))


FAULTS: dict[str, Callable[[Any], Any]] = {"topk1": _topk1, "shift-depth": _shift_depth}


def configured_fault(env: dict[str, str] | None = None) -> Callable[[Any], Any] | None:
    """The fault the environment asks for (None: none); an unknown name is an error."""
    name = (os.environ if env is None else env).get(ENV_FAULT, "").strip()
    if not name:
        return None
    if name not in FAULTS:
        raise ValueError(f"{ENV_FAULT}: unknown fault {name!r} (known: {', '.join(sorted(FAULTS))})")
    return FAULTS[name]


def register(registry: Any, hook_type: Any) -> str | None:
    """Hook the fault (if one is configured) around the tree builder the worker calls; returns its name."""
    fault = configured_fault()
    if fault is None:
        return None

    def around(original: Callable[..., Any], top: Any, budget: int) -> Any:
        return original(fault(top), budget)

    registry.register(TREES_FROM_TOP_K, around, hook_type.AROUND)
    return os.environ[ENV_FAULT].strip()
