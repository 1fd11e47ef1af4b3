"""The three places DDTree hooks into SGLang 0.5.23 (see docs/sglang-plugin.md)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class HookId(Enum):
    H1_HANDLE_DFLASH = "H1"
    H2_CREATE_WORKER = "H2"
    H3_VERIFY_MASK_POLICY = "H3"


class HookKind(Enum):
    """Mirrors sglang.srt.plugins.hook_registry.HookType by member name."""

    AFTER = "AFTER"
    AROUND = "AROUND"


@dataclass(frozen=True)
class HookSpec:
    hook_id: HookId
    target: str  # dotted path handed to HookRegistry.register
    kind: HookKind
    hook_function: str  # attribute of ddtree.sglang.hooks
    purpose: str


HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        HookId.H1_HANDLE_DFLASH,
        "sglang.srt.arg_groups.speculative_hook._handle_dflash",
        HookKind.AFTER,
        "after_handle_dflash",
        "verify width N = budget + 1 instead of the drafter block size; refuse unsupported setups",
    ),
    HookSpec(
        HookId.H2_CREATE_WORKER,
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
        HookKind.AROUND,
        "around_create_worker",
        "DFLASH builds DDTreeWorkerV2 instead of DFlashWorkerV2",
    ),
    HookSpec(
        HookId.H3_VERIFY_MASK_POLICY,
        "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy",
        HookKind.AROUND,
        "around_verify_mask_policy",
        "capture the target-verify CUDA graph with a custom (tree) mask; refuse other backends",
    ),
)
