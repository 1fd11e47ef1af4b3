"""The offline loop (`ddtree.decode`) on the prompts, methods and budgets a server was just
asked, at T=0, with the target's margins kept: what `ddtree_ops.hostside.acceptance` holds the
server's per-request acceptance against.

Loads the host's target and drafter as decode-bench does (float32 on CPU, bfloat16 on a GPU;
local folders or the local Hugging Face cache, never a download), once, and the drafter once
per block size (budgets below the drafter's block are served with a block of budget + 1, and
the offline loop drafts with the same block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ddtree_ops.hostside.acceptance import OfflineRequest


@dataclass(frozen=True)
class OfflineMethod:
    name: str  # the server variant it stands beside (dflash, ddtree-b16, ...)
    budget: int | None  # None: DFlash's linear verify
    block_size: int | None  # the drafter's block (None: its own)


def encode_text_prompts(models: dict[str, Any], prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids for every prompt, text ones through the target's tokenizer exactly as SGLang's
    /generate encodes `text` (no chat template; the tokenizer's own special tokens)."""
    if all(isinstance(p, list) for p in prompts):
        return [list(p) for p in prompts]
    from ddtree.dflash_drafter import resolve_model_dir
    from ddtree.hf_target import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(str(models["target"])))
    return [list(p) if isinstance(p, list) else list(tokenizer(p).input_ids) for p in prompts]


def run_offline(models: dict[str, Any], prompt_ids: Sequence[Sequence[int]], methods: Sequence[OfflineMethod],
                max_new_tokens: int, device: str, log: Callable[[str], None] = lambda line: None
                ) -> dict[str, list[OfflineRequest]]:
    """Per method name, one OfflineRequest per prompt (T=0, no stop tokens: the servers are
    asked with ignore_eos, so both sides make exactly max_new_tokens)."""
    import torch

    from ddtree.decode import DecodeConfig, generate_ddtree, generate_dflash
    from ddtree.dflash_drafter import load_dflash_drafter, load_target

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = load_target(str(models["target"]), device, dtype)
    drafters: dict[int | None, Any] = {}
    config = DecodeConfig(max_new_tokens=max_new_tokens, record_margins=True)
    found: dict[str, list[OfflineRequest]] = {}
    for method in methods:
        block = method.block_size or models.get("block_size")
        if block not in drafters:
            drafters[block] = load_dflash_drafter(str(models["drafter"]), target, block_size=block)
        drafter = drafters[block]
        results = []
        for ids in prompt_ids:
            prompt = torch.tensor([list(ids)], dtype=torch.long)
            if method.budget is None:
                result = generate_dflash(target, drafter, prompt, config)
            else:
                result = generate_ddtree(target, drafter, prompt, config, budget=method.budget)
            results.append(OfflineRequest.from_result(result))
        found[method.name] = results
        log(f"offline {method.name}: {len(results)} prompts decoded")
    del target, drafters
    if device == "cuda":
        torch.cuda.empty_cache()
    return found
