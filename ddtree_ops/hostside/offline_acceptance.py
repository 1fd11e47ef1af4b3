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


def prepare_transformers() -> None:
    """transformers' model classes import torchvision, which in a CPU test server's environment
    (a CUDA torchvision wheel beside a CPU torch) needs two schemas declared first; elsewhere
    a plain import (ddtree.sglang.cpu.torchvision_ops)."""
    from ddtree.sglang.cpu.torchvision_ops import import_torchvision

    import_torchvision()


def encode_text_prompts(models: dict[str, Any], prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids for every prompt, text ones through the target's tokenizer exactly as SGLang's
    /generate encodes `text` (no chat template; the tokenizer's own special tokens)."""
    if all(isinstance(p, list) for p in prompts):
        return [list(p) for p in prompts]
    from ddtree.dflash_drafter import resolve_model_dir
    from ddtree.hf_target import load_tokenizer

    prepare_transformers()

    tokenizer = load_tokenizer(resolve_model_dir(str(models["target"])))
    return [list(p) if isinstance(p, list) else list(tokenizer(p).input_ids) for p in prompts]


class OfflineLoop:
    """The host's target (and drafters, one per block size) loaded once for the offline loop."""

    def __init__(self, models: dict[str, Any], device: str):
        import torch

        from ddtree.dflash_drafter import load_target

        prepare_transformers()
        self.models, self.device = models, device
        self.target = load_target(str(models["target"]), device, torch.bfloat16 if device == "cuda" else torch.float32)
        self._drafters: dict[int | None, Any] = {}

    def drafter(self, block_size: int | None) -> Any:
        from ddtree.dflash_drafter import load_dflash_drafter

        block = block_size or self.models.get("block_size")
        if block not in self._drafters:
            self._drafters[block] = load_dflash_drafter(str(self.models["drafter"]), self.target, block_size=block)
        return self._drafters[block]

    def decode(self, methods: Sequence[OfflineMethod], prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
               log: Callable[[str], None] = lambda line: None,
               texts: dict[str, Sequence[Sequence[int]]] | None = None) -> dict[str, list[OfflineRequest]]:
        """Per method name, one OfflineRequest per prompt (T=0, no stop tokens: the servers are
        asked with ignore_eos, so both sides make exactly max_new_tokens). `texts[name][i]`: the
        tokens the server made for that method and prompt, which the loop then follows
        (DecodeConfig.forced_tokens), so that it accepts on the server's own text."""
        import torch

        from ddtree.decode import DecodeConfig, generate_ddtree, generate_dflash

        found: dict[str, list[OfflineRequest]] = {}
        for method in methods:
            drafter = self.drafter(method.block_size)
            results = []
            for index, ids in enumerate(prompt_ids):
                forced = None if texts is None else [int(t) for t in texts[method.name][index]]
                config = DecodeConfig(max_new_tokens=max_new_tokens, record_margins=True, forced_tokens=forced)
                prompt = torch.tensor([list(ids)], dtype=torch.long)
                if method.budget is None:
                    result = generate_dflash(self.target, drafter, prompt, config)
                else:
                    result = generate_ddtree(self.target, drafter, prompt, config, budget=method.budget)
                results.append(OfflineRequest.from_result(result, len(forced or ())))
            found[method.name] = results
            log(f"offline {method.name}: {len(results)} prompts decoded")
        return found

    def margin_noise(self, prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                     top2: Sequence[Sequence[tuple[int, int, float] | None]]) -> "MarginNoise":
        """How far the server's target and this loop's differ where it matters: at every output
        position of the no-speculation run, the server's top-1 minus top-2 logit (`top2`: its
        two token ids and that gap, from output_top_logprobs) against this target's logit
        difference of the same two tokens, given the same prefix (one forward per prompt)."""
        import torch

        differences, flips = [], 0
        with torch.inference_mode():
            for ids, out, pairs in zip(prompt_ids, outputs, top2):
                sequence = torch.tensor([list(ids) + list(out)], dtype=torch.long, device=self.target.device)
                logits = self.target.model(sequence).logits[0].float()  # [n, V]
                for position, pair in enumerate(pairs):
                    if pair is None:
                        continue
                    first, second, server_gap = pair
                    row = logits[len(ids) - 1 + position]
                    offline_gap = float(row[first] - row[second])
                    differences.append(abs(server_gap - offline_gap))
                    flips += offline_gap < 0
        return MarginNoise(sorted(differences), flips)

    def close(self) -> None:
        import torch

        del self.target, self._drafters
        if self.device == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class MarginNoise:
    differences: list[float]  # sorted |server gap - offline gap| per compared position
    flips: int  # positions where the two preferred the other token

    def summary(self) -> dict[str, Any]:
        found = self.differences
        pick = (lambda q: round(found[min(len(found) - 1, int(q * len(found)))], 4)) if found else (lambda q: None)
        return {"positions": len(found), "median": pick(0.5), "p99": pick(0.99),
                "max": round(found[-1], 4) if found else None, "flips": self.flips}


def run_offline(models: dict[str, Any], prompt_ids: Sequence[Sequence[int]], methods: Sequence[OfflineMethod],
                max_new_tokens: int, device: str, log: Callable[[str], None] = lambda line: None,
                texts: dict[str, Sequence[Sequence[int]]] | None = None) -> dict[str, list[OfflineRequest]]:
    """OfflineLoop(models, device).decode(...), the models let go after."""
    loop = OfflineLoop(models, device)
    try:
        return loop.decode(methods, prompt_ids, max_new_tokens, log, texts)
    finally:
        loop.close()
