"""The CPU test server's own SGLang plugin: lifts the one guard that refuses DFLASH on an
in-tree CPU device, for `_handle_dflash` only.

SGLang 0.5.23 refuses DFLASH unless the device is cuda/npu/xpu or an out-of-tree platform
says it supports it (srt/arg_groups/speculative_hook.py:291-301). Inside _handle_dflash the
platform is asked only that and, for the drafter's attention backend, the in-tree rule
(speculative_hook.py:896-927), which the stand-in platform answers the same way. Everything else DFLASH does on CPU is SGLang's own
code. Inert (no hook registered) unless this process runs in an environment prepared by
ddtree.sglang.cpu.environment with SGLANG_USE_CPU_ENGINE=1, i.e. never on a GPU host. There
it also injects the test-only drafting fault `SGLANG_CPU_DDTREE_FAULT` names (ddtree.sglang.cpu.drafting_faults).
"""
from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("ddtree.sglang.cpu")

HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
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
    _register_attention_backend()
    logger.warning("DDTree CPU test server: DFLASH allowed on device cpu (speculative_hook.py:291-301 guard lifted)")
    from ddtree.sglang.cpu import drafting_faults as faults

    fault = faults.register(HookRegistry, HookType)
    if fault is not None:
        logger.warning("DDTree CPU test server: drafting fault %r injected (%s)", fault, faults.ENV_FAULT)
