"""The CPU test server's own SGLang plugin: lifts the one guard that refuses DFLASH on an
in-tree CPU device, for `_handle_dflash` only; registers the `ddtree_cpu` attention backend;
and puts a torch stand-in (ddtree.sglang.cpu.fused_rope) in place of the drafter's fused
Triton QK-norm + RoPE kernel, which Triton's interpreter runs too slowly to serve with.

SGLang 0.5.23 refuses DFLASH unless the device is cuda/npu/xpu or an out-of-tree platform
says it supports it (srt/arg_groups/speculative_hook.py:291-301). Inside _handle_dflash the
platform is asked only that and, for the drafter's attention backend, the in-tree rule
(speculative_hook.py:896-927), which the stand-in platform answers the same way. Everything else DFLASH does on CPU is SGLang's own
code. Inert (no hook registered) unless this process runs in an environment prepared by
ddtree.sglang.cpu.environment with SGLANG_USE_CPU_ENGINE=1, i.e. never on a GPU host. There
it also injects the test-only fault `CPU_TEST_SERVER_FAULT` names (ddtree.sglang.cpu.faults).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ddtree.sglang.cpu.faults import ENV_FAULT, requested_fault

logger = logging.getLogger("ddtree.sglang.cpu")

HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
TABLE_QK_NORM_ROPE = "sglang.kernels.ops.attention.table_qk_norm_rope.table_qk_norm_rope_"
_STARTUP_MODULE = "ddtree.sglang.cpu.startup"


def cpu_test_server_active() -> bool:
    return _STARTUP_MODULE in sys.modules


class _DFlashOnCpuPlatform:
    """current_platform as _handle_dflash's guard sees it: DFLASH supported; all else the real one."""

    def __init__(self, platform: Any):
        self._platform = platform

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    # Being "out of tree" routes the draft-backend choice through these two
    # (speculative_hook.py:896-927): answer as the in-tree rule does, with Triton as the
    # fallback (what in-tree XPU/ROCm get), since Triton runs interpreted on CPU.
    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        from sglang.srt.arg_groups.speculative_hook import DRAFT_ATTENTION_BACKEND_CHOICES

        return backend in DRAFT_ATTENTION_BACKEND_CHOICES

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "triton"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def around_handle_dflash(original: Any, server_args: Any) -> Any:
    from sglang.srt.arg_groups import speculative_hook

    device = str(getattr(server_args, "device", "") or "")
    if device != "cpu":
        return original(server_args)
    real = speculative_hook.current_platform
    speculative_hook.current_platform = _DFlashOnCpuPlatform(real)
    try:
        return original(server_args)
    finally:
        speculative_hook.current_platform = real


_rope_announced = False


def table_qk_norm_rope_standin(*args: Any, **kwargs: Any) -> None:
    """ddtree.sglang.cpu.fused_rope in the Triton kernel's place; says so in the log once."""
    global _rope_announced
    from ddtree.sglang.cpu.fused_rope import table_qk_norm_rope_cpu

    if not _rope_announced:
        _rope_announced = True
        logger.warning("DDTree CPU test server: the drafter's fused QK-norm + RoPE runs in torch "
                       "(ddtree.sglang.cpu.fused_rope, not the interpreted Triton kernel)")
    table_qk_norm_rope_cpu(*args, **kwargs)


def _register_attention_backend() -> None:
    """`--attention-backend ddtree_cpu` for the target and the drafter (ddtree.sglang.cpu.attention)."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices, add_draft_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from ddtree.sglang.cpu.attention import BACKEND_NAME, create_ddtree_cpu_backend

    register_attention_backend(BACKEND_NAME)(create_ddtree_cpu_backend)
    add_attention_backend_choices([BACKEND_NAME])
    add_draft_attention_backend_choices([BACKEND_NAME])


def register() -> None:
    if not cpu_test_server_active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HANDLE_DFLASH, around_handle_dflash, HookType.AROUND)
    # A NeoX-RoPE drafter's fused QK-norm + RoPE kernel (models/dflash.py:383-397), in torch.
    HookRegistry.register(TABLE_QK_NORM_ROPE, table_qk_norm_rope_standin, HookType.REPLACE)
    _register_attention_backend()
    fault = requested_fault()
    if fault is not None:
        HookRegistry.register(fault[0], fault[1], HookType.AROUND)
        logger.warning("DDTree CPU test server: fault %s injected into %s", os.environ[ENV_FAULT], fault[0])
    logger.warning("DDTree CPU test server: DFLASH allowed on device cpu (speculative_hook.py:291-301 guard lifted)")
