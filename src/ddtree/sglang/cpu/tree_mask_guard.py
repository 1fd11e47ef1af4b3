"""The CPU test server's guard against a DDTree verify that arrives without its tree mask.

SGLang's attention backends treat a target verify without a custom mask as a chain and attend
causally (triton_backend.py:1051 takes spec_info.custom_mask as it is; the kernels then run
causal). For DFlash's linear verify that is right; for a DDTree tree it lets each node see
its siblings, so a plugin that loses its mask would be served silently. The `ddtree_cpu`
backend (ddtree.sglang.cpu.attention) calls require_tree_mask on every target verify.
"""
from __future__ import annotations

import torch


class MissingTreeMaskError(RuntimeError):
    """A target verify reached the backend without the tree mask the DDTree plugin must send."""


def require_tree_mask(
    custom_mask: torch.Tensor | None, *, causal: bool, trees_expected: bool, layer_id: int, width: int
) -> None:
    """Refuse a DDTree verify without its mask. Attending causally over a tree instead would let
    each node see its siblings: the plugin's fault would show only as lower acceptance, or as
    tokens that differ, never as an error. DFlash's linear verify (a chain: causal is its mask)
    and the drafter's block (ENCODER_ONLY: it sees itself whole) legitimately carry none."""
    if custom_mask is None and causal and trees_expected:
        raise MissingTreeMaskError(
            f"ddtree_cpu: a target-verify batch ({width} tokens per request, layer {layer_id}) arrived "
            f"without a tree mask while the DDTree plugin is enabled; refusing to attend causally over a tree"
        )


def ddtree_trees_expected() -> bool:
    """Whether this server runs the DDTree plugin (every target verify is then a tree)."""
    from ddtree.sglang.hooks import active_config

    return active_config().enabled
