"""The drafter protocol the decode loops speak, and a synthetic drafter for tests.

A drafter is stateful per request. Each round the loop hands it the tokens committed since
its previous call (the prompt on the first call, then the previous round's accepted path,
root included) and, for drafters that read the target's features (DFlash), the target's
hidden states of those same tokens; it returns logits `[D, V]` for the D positions after the
bonus token (row d-1 scores position start + d).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ddtree.hf_target import HFTarget
from ddtree.kvcache import crop_cache


class DrafterMismatchError(ValueError):
    """The drafter cannot serve this target or this block size; the message names both values."""


class DraftRequest(NamedTuple):
    new_token_ids: torch.Tensor  # [1, n_new] int64: committed tokens the drafter has not seen
    new_target_hidden: torch.Tensor | None  # [1, n_new, L*H] target features of those tokens
    bonus_token: int  # the round's root: the target's last choice, not yet in any cache
    start: int  # position of the bonus token; new_token_ids sit at start - n_new .. start - 1


@runtime_checkable
class Drafter(Protocol):
    block_size: int  # D = block_size - 1 draft positions per round
    vocab_size: int
    target_layer_ids: tuple[int, ...]  # target layers whose hidden states the drafter reads; () for none

    def begin(self, target: HFTarget) -> None:
        """Forget the previous request (caches, counters)."""

    def draft(self, request: DraftRequest) -> torch.Tensor:
        """Logits `[block_size - 1, V]` for the positions after the bonus token."""


def check_drafter(drafter: Drafter, target: HFTarget, block_size: int | None = None) -> int:
    """Refuse a drafter that cannot serve `target`; return the block size to use."""
    if drafter.vocab_size != target.vocab_size:
        raise DrafterMismatchError(
            f"drafter vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size})"
        )
    supported = int(drafter.block_size)
    chosen = supported if block_size is None else int(block_size)
    if chosen != supported:
        raise DrafterMismatchError(f"block size {chosen} is not supported by the drafter (it drafts blocks of {supported})")
    if chosen < 2:
        raise DrafterMismatchError(f"block size must be >= 2 to draft anything, got {chosen}")
    for layer in drafter.target_layer_ids:
        if not 0 <= layer < target.num_layers:
            raise DrafterMismatchError(
                f"drafter reads target layer {layer}, but the target has {target.num_layers} layers"
            )
    return chosen


class NoisyTargetDrafter:
    """A test drafter: the target's own next-token logits along its greedy path, plus noise.

    Row d-1 = target logits at position start + d given the committed context, the bonus and
    the target's greedy continuation, plus Gaussian noise of `noise` times that row's standard
    deviation. The noise is seeded by (`seed`, start), so the draft is a pure function of the
    context: every method and budget sees the same drafts at the same position, which makes
    acceptance comparable across budgets. noise=0 drafts the target's exact greedy path.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, target: HFTarget, block_size: int, noise: float, seed: int = 0):
        if block_size < 2:
            raise DrafterMismatchError(f"block size must be >= 2 to draft anything, got {block_size}")
        self.block_size = int(block_size)
        self.vocab_size = target.vocab_size
        self.noise = float(noise)
        self.seed = int(seed)
        self._target = target
        self._cache: Any = None

    def begin(self, target: HFTarget) -> None:
        self._target = target
        self._cache = target.new_cache()

    @torch.inference_mode()
    def draft(self, request: DraftRequest) -> torch.Tensor:
        target, start = self._target, request.start
        device = target.device
        n_new = int(request.new_token_ids.shape[1])
        bonus = torch.tensor([[request.bonus_token]], dtype=torch.long, device=device)
        ids = torch.cat([request.new_token_ids.to(device), bonus], dim=1)  # [1, n_new + 1]
        positions = torch.arange(start - n_new, start + 1, device=device).unsqueeze(0)
        rows = []
        for depth in range(self.block_size - 1):
            logits = target.forward(ids, positions, self._cache).logits[-1]  # [V]
            rows.append(logits)
            ids = logits.argmax().view(1, 1)
            positions = torch.tensor([[start + depth + 1]], device=device)
        crop_cache(self._cache, start)  # keep committed rows only; the bonus is re-sent as committed
        clean = torch.stack(rows).float()  # [D, V]
        if self.noise == 0.0:
            return clean
        generator = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + start)
        noise = torch.randn(clean.shape, generator=generator, dtype=torch.float32).to(clean.device)
        return clean + self.noise * clean.std(dim=-1, keepdim=True) * noise

