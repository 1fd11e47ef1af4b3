"""DDTree speculative decoding core: draft trees, verify inputs, commit helpers, metrics.

Pure torch; imports nothing from the operator side. The stable API keeps the seed's names.

The names below load on first use (PEP 562), so `import ddtree.sglang.gate` and the other
stdlib-only tools (gate, manifest, manifest_tool, structure) run on a host without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule that defines it
_EXPORTS: dict[str, str] = {
    "TreeBatch": "batched",
    "build_ddtree_trees": "batched",
    "build_trees_from_top_log_probs": "batched",
    "BuildMethod": "build",
    "build_ddtree_tree_from_logits": "build",
    "RoundCommit": "commit",
    "commit_round": "commit",
    "compact_appended_window_": "commit",
    "keep_indices_batch": "commit",
    "GraphedTreeBuilder": "graphed",
    "TreeInvariantError": "invariants",
    "assert_prefix_closed": "invariants",
    "validate_tree": "invariants",
    "TreeSummary": "metrics",
    "acceptance_histogram": "metrics",
    "acceptance_length": "metrics",
    "mean_acceptance_length": "metrics",
    "summarize_ddtree": "metrics",
    "DraftTree": "tree",
    "MaskLayout": "verify",
    "VerifyInputs": "verify",
    "build_verify_inputs": "verify",
    "follow_verified_tree": "verify",
    "pack_custom_mask": "verify",
    "walk_retrieve_arrays": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ddtree.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
