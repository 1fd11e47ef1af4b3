"""Plugin faults the CPU test server can inject on purpose, to show that a check catches them.

`CPU_TEST_SERVER_FAULT=<name>` in a CPU test server's environment makes its plugin
(ddtree.sglang.cpu.server_plugin) wrap one function of the DDTree plugin (an AROUND hook) with
the named fault. This lives with the CPU test server, which a GPU host never runs. (Not a
DDTREE_ variable: the plugin refuses DDTREE_ names it does not know.) The plugin logs the fault
it injected ("fault <name> injected"), which tests assert; an unknown name raises in the
plugin, and SGLang's load_plugins() logs that and serves with no fault.

- `verify-without-tree-mask`: the plugin "forgets" its tree mask; the CPU attention backend
  must refuse that verify (ddtree.sglang.cpu.tree_mask_guard).
- Lossless drafting faults, the kind of integration bug that keeps every token right and only
  accepts less (a drafter/target mismatch, sglang#27924), for the acceptance checks to catch:
  `topk1` (every depth keeps only the drafter's top-1 candidate: each tree is DFlash's greedy
  chain, whatever the budget) and `shift-depth` (depth d gets the candidates the drafter gave
  for depth d + 1; the last depth repeats). The target verifies whatever it is shown, so the
  output stays the target's.
"""
from __future__ import annotations

import os
from typing import Any, Callable

ENV_FAULT = "CPU_TEST_SERVER_FAULT"
TARGET_VERIFY = "ddtree.sglang.worker.DDTreeWorkerV2._target_verify"
TREES_FROM_TOP_K = "ddtree.sglang.tree_round.trees_from_top_k"


def verify_without_tree_mask(original: Callable[..., Any], worker: Any, batch: Any, draft_input: Any, inputs: Any,
                             custom_mask: Any, *rest: Any) -> Any:
    """The plugin "forgets" its tree mask: the verify batch reaches attention with none."""
    return original(worker, batch, draft_input, inputs, None, *rest)


def trees_from_top1(original: Callable[..., Any], top: Any, budget: int) -> Any:
    """Trees built from each depth's top-1 candidate only."""
    return original(type(top)(top.values[..., :1], top.token_ids[..., :1], top.lse), budget)


def trees_from_shifted_depths(original: Callable[..., Any], top: Any, budget: int) -> Any:
    """Trees built from the wrong depth's candidates: draft rows [bs, D, ...] shifted by one."""
    import torch

    def shifted(field: torch.Tensor) -> torch.Tensor:
        return torch.cat([field[:, 1:], field[:, -1:]], dim=1)

    return original(type(top)(shifted(top.values), shifted(top.token_ids), shifted(top.lse)), budget)


# name -> (the dotted target it wraps AROUND, the wrapper)
FAULTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "verify-without-tree-mask": (TARGET_VERIFY, verify_without_tree_mask),
    "topk1": (TREES_FROM_TOP_K, trees_from_top1),
    "shift-depth": (TREES_FROM_TOP_K, trees_from_shifted_depths),
}


def requested_fault(env: dict[str, str] | None = None) -> tuple[str, Callable[..., Any]] | None:
    """The (target, wrapper) asked for by CPU_TEST_SERVER_FAULT, None when unset."""
    name = (os.environ if env is None else env).get(ENV_FAULT, "").strip()
    if not name:
        return None
    if name not in FAULTS:
        raise ValueError(f"{ENV_FAULT}={name!r}: unknown fault (known: {', '.join(sorted(FAULTS))})")
    return FAULTS[name]
