"""The hook functions registered with SGLang's HookRegistry (see targets.HOOKS).

Each imports sglang lazily, inside the call: they run only in processes where SGLang has
already imported the hooked module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from enum import Enum
from typing import Any, Iterator

from ddtree.sglang.config import ENV_DRAFT_BLOCK_SIZE, DDTreeConfig, load_config
from ddtree.sglang.errors import UnsupportedSetupError
from ddtree.sglang.support import (
    ServerSetup,
    check_attention_backend_class,
    check_server_setup,
    plan_verify_width,
)

logger = logging.getLogger("ddtree.sglang")

_CONFIG: DDTreeConfig | None = None


def active_config() -> DDTreeConfig:
    """The process's config, parsed once from DDTREE_* (register() parses it first)."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = load_config()
    return _CONFIG


def set_active_config(config: DDTreeConfig | None) -> None:
    global _CONFIG
    _CONFIG = config


class WorkerChoice(Enum):
    ORIGINAL = "original"  # not DFLASH, or DDTree disabled: SGLang's own choice
    DDTREE = "ddtree"


def choose_worker(config: DDTreeConfig, *, is_dflash: bool, has_platform_worker: bool) -> WorkerChoice:
    """Pure decision behind H2."""
    if not (config.enabled and is_dflash):
        return WorkerChoice.ORIGINAL
    if has_platform_worker:
        raise UnsupportedSetupError(
            "DDTree: an out-of-tree platform replaces the DFLASH worker; DDTree needs the built-in one"
        )
    return WorkerChoice.DDTREE


def choose_mask_policy(
    config: DDTreeConfig, *, algorithm: str, backend_name: str, build_custom_mask: bool
) -> tuple[str, bool]:
    """Pure decision behind H3 for the target runner: its verify always needs the custom (tree) mask."""
    if not (config.enabled and algorithm.upper() == "DFLASH"):
        return backend_name, build_custom_mask
    check_attention_backend_class(backend_name)
    return backend_name, True


_DRAFTER_SCOPE_DEPTH = 0


@contextlib.contextmanager
def drafter_scope() -> Iterator[None]:
    """Marks what runs for the drafter (DDTreeWorkerV2 builds and captures it in here): the
    mask policy H3 is then the drafter's, and SGLang discards it. The target worker is built
    before ours (scheduler.py:1113-1126), outside this scope."""
    global _DRAFTER_SCOPE_DEPTH
    _DRAFTER_SCOPE_DEPTH += 1
    try:
        yield
    finally:
        _DRAFTER_SCOPE_DEPTH -= 1


def plan_after_handle_dflash(config: DDTreeConfig, *, block_size: int, setup: ServerSetup) -> int | None:
    """Pure decision behind H1: the verify width to declare, or None to leave DFlash alone."""
    if not config.enabled:
        return None
    check_server_setup(setup)
    return plan_verify_width(block_size=block_size, budget=config.budget)


def after_handle_dflash(result: Any, server_args: Any) -> None:
    """H1 (AFTER _handle_dflash): N = budget + 1 verify tokens; validate the setup."""
    config = active_config()
    if not config.enabled:
        return None
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.runtime_context import attn_dp_enabled_of

    cfg = resolving_view(server_args)
    block_size = int(cfg.speculative_num_draft_tokens)  # B, as _handle_dflash resolved it
    setup = ServerSetup(
        attention_backend=getattr(cfg, "attention_backend", None),
        decode_attention_backend=getattr(cfg, "decode_attention_backend", None),
        prefill_attention_backend=getattr(cfg, "prefill_attention_backend", None),
        page_size=getattr(cfg, "page_size", None),
        pp_size=int(getattr(cfg, "pp_size", 1) or 1),
        attn_dp=bool(attn_dp_enabled_of(cfg)),
    )
    width = plan_after_handle_dflash(config, block_size=block_size, setup=setup)
    declare_resolution(server_args, "ddtree.after_handle_dflash", speculative_num_draft_tokens=width)
    # The scheduler processes spawned later inherit it; the worker drafts at this width.
    os.environ[ENV_DRAFT_BLOCK_SIZE] = str(block_size)
    set_active_config(dataclasses.replace(config, draft_block_size=block_size))
    logger.info(
        "DDTree enabled: drafter block size %d, budget %d, top-K %d, verify width %d",
        block_size, config.budget, config.topk, width,
    )
    return None


def around_create_worker(original: Any, algorithm: Any, server_args: Any) -> Any:
    """H2 (AROUND SpeculativeAlgorithm.create_worker): DFLASH -> DDTreeWorkerV2."""
    config = active_config()
    is_dflash = bool(algorithm.is_dflash())
    has_platform_worker = is_dflash and config.enabled and algorithm.get_platform_worker_cls() is not None
    choice = choose_worker(config, is_dflash=is_dflash, has_platform_worker=has_platform_worker)
    if choice is WorkerChoice.ORIGINAL:
        return original(algorithm, server_args)
    from ddtree.sglang.worker import DDTreeWorkerV2  # heavy: imported only here

    return DDTreeWorkerV2


def around_verify_mask_policy(original: Any, attn_backend: Any) -> tuple[str, bool]:
    """H3 (AROUND resolve_dflash_verify_mask_policy): the target always builds the custom (tree)
    mask. A draft runner's graph capture asks too, but SGLang ignores the answer there (no mask
    for draft workers, decode_cuda_graph_runner.py:2114-2125), so inside drafter_scope() its
    backend (fa3, fa4, trtllm_mha via --speculative-draft-attention-backend) is left alone."""
    backend_name, build_custom_mask = original(attn_backend)
    config = active_config()
    if not config.enabled or _DRAFTER_SCOPE_DEPTH:
        return backend_name, build_custom_mask
    from sglang.srt.runtime_context import get_spec

    algorithm = str(getattr(get_spec(), "speculative_algorithm", "") or "")
    return choose_mask_policy(
        config, algorithm=algorithm, backend_name=backend_name, build_custom_mask=build_custom_mask
    )
