"""The losslessness proof on a tiny real transformer, shared by the tests and the `lossless` stage.

A 2-layer Llama with random weights (transformers builds it from a config: no download) is the
target; `NoisyTargetDrafter` drafts. At temperature 0, DFlash and DDTree at every budget must
emit exactly the autoregressive tokens; at temperature > 0 the token chosen by the first
verify round must follow the target's own distribution (a chi-square goodness-of-fit test).
Needs `transformers` (imported lazily: the rest of ddtree does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Callable, NamedTuple, Sequence

import torch

from ddtree.decode import (
    DecodeConfig,
    DecodeMethod,
    DecodeResult,
    generate_autoregressive,
    generate_dflash,
    generate_ddtree,
    method_key,
)
from ddtree.drafters import NoisyTargetDrafter
from ddtree.hf_target import HFTarget

TINY_VOCAB = 96


def build_tiny_target(
    seed: int = 0,
    vocab_size: int = TINY_VOCAB,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    init_range: float = 0.5,
) -> HFTarget:
    """A 2-layer LlamaForCausalLM with seeded random weights.

    float64 keeps argmax ties between the tree forward and the one-token forward out of
    reach of rounding; `init_range` 0.5 makes next-token distributions peaked enough for a
    drafter to be right often and for sampling tests to have few effective bins.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=init_range, attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return HFTarget(model.to(device=device, dtype=dtype).eval())


def prompt_set(count: int, length: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """`count` prompts [1, length] int64 drawn from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (1, length), generator=generator) for _ in range(count)]


class Mismatch(NamedTuple):
    prompt_index: int
    method: str  # method key, e.g. "ddtree_tb16"
    position: int  # first new-token index where the method differs from autoregressive
    expected: list[int]
    got: list[int]


@dataclass
class LosslessReport:
    budgets: list[int]
    mismatches: list[Mismatch] = field(default_factory=list)
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # method key -> per-prompt mean
    results: dict[str, list[DecodeResult]] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return not self.mismatches

    def tau(self, key: str) -> float:
        """Mean over prompts of the per-prompt mean acceptance length (the paper's tau)."""
        return mean(self.acceptance[key])

    def ddtree_taus(self) -> list[float]:
        return [self.tau(method_key(DecodeMethod.DDTREE, b)) for b in self.budgets]

    def monotone_in_budget(self) -> bool:
        taus = self.ddtree_taus()
        return all(a <= b for a, b in zip(taus, taus[1:]))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_lossless(
    target: HFTarget,
    prompts: Sequence[torch.Tensor],
    budgets: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    noise: float,
    seed: int = 0,
) -> LosslessReport:
    """Run AR, DFlash and DDTree(budget) at T=0 on every prompt and compare tokens."""
    report = LosslessReport(budgets=list(budgets))
    config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=0.0)

    def record(key: str, index: int, result: DecodeResult, expected: list[int]) -> None:
        report.results.setdefault(key, []).append(result)
        report.acceptance.setdefault(key, []).append(mean(result.acceptance_lengths) if result.acceptance_lengths else 0.0)
        got = result.new_token_ids
        if got != expected:
            report.mismatches.append(Mismatch(index, key, _first_difference(expected, got), expected, got))

    for index, prompt in enumerate(prompts):
        reference = generate_autoregressive(target, prompt, config)
        expected = reference.new_token_ids
        record(method_key(DecodeMethod.AUTOREGRESSIVE), index, reference, expected)
        drafter = NoisyTargetDrafter(target, block_size=block_size, noise=noise, seed=seed + index)
        record(method_key(DecodeMethod.DFLASH), index, generate_dflash(target, drafter, prompt, config), expected)
        for budget in budgets:
            result = generate_ddtree(target, drafter, prompt, config, budget=budget)
            record(method_key(DecodeMethod.DDTREE, budget), index, result, expected)
    return report


def tiny_dflash_config(vocab_size: int = TINY_VOCAB, block_size: int = 6, **overrides: object) -> dict:
    """config.json of a tiny DFlash drafter for `build_tiny_target` (hidden 64, 2 layers)."""
    config: dict = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "block_size": block_size, "num_target_layers": 2,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": vocab_size - 1},
    }
    config.update(overrides)
    return config


def save_tiny_dflash_drafter(folder: Path, config: dict, target_hidden: int = 64, seed: int = 0) -> Path:
    """Write `config` and seeded random weights (safetensors) the way z-lab drafters ship."""
    import json

    from safetensors.torch import save_file

    from ddtree.dflash_model import DFlashConfig, DFlashDraftNet

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = DFlashDraftNet(DFlashConfig.from_dict(config, str(folder)), target_hidden_size=target_hidden)
    # Some checkpoints carry a "model." prefix; one layer's keys use it so both spellings load.
    state = {(f"model.{k}" if k.startswith("layers.0") else k): v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


# --------------------------------------------------------------------------- sampling (T > 0)


class GoodnessOfFit(NamedTuple):
    chi2: float
    dof: int
    p_value: float
    samples: int


def chi_square_test(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> GoodnessOfFit:
    """Pearson's test of counts [V] against probabilities [V]; bins with expected count below
    `min_expected` are pooled into one (the usual validity condition)."""
    total = float(observed.sum())
    expected = expected_probs.double() * total
    big = expected >= min_expected
    obs = torch.cat([observed.double()[big], observed.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(obs.numel()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    return GoodnessOfFit(chi2, dof, p_value, int(total))


@torch.inference_mode()
def exact_pair_distribution(target: HFTarget, prompt: torch.Tensor, temperature: float) -> torch.Tensor:
    """Exact P(2nd new token = y, 3rd = z) [V, V] under the target's own sampling.

    The 1st new token x comes from the prefill; the 2nd is the root's choice in the first
    verify round and the 3rd is, whenever the 2nd was drafted, the choice at a depth-1 tree
    node: the pair exercises the tree walk, the mask and the positions.
    P(y, z) = sum_x p(x) p(y | x) p(z | x, y), from one batched forward over all (x, y).
    """
    vocab, device = target.vocab_size, target.device
    prompt = prompt.to(device)
    n = prompt.shape[1]
    grid = torch.arange(vocab, device=device)
    pairs = torch.stack([grid.repeat_interleave(vocab), grid.repeat(vocab)], dim=1)  # [V*V, 2]: (x, y)
    batch = torch.cat([prompt.expand(vocab * vocab, n), pairs], dim=1)  # [V*V, n+2]
    logits = target.model(batch).logits.double()  # [V*V, n+2, V]
    p_x = torch.softmax(logits[0, n - 1] / temperature, dim=-1)  # [V]
    p_y = torch.softmax(logits[::vocab, n] / temperature, dim=-1)  # [V(x), V(y)]
    p_z = torch.softmax(logits[:, n + 1] / temperature, dim=-1).view(vocab, vocab, vocab)  # [x, y, z]
    return (p_x.view(vocab, 1, 1) * p_y.unsqueeze(2) * p_z).sum(dim=0).cpu()  # [y, z]


def sample_pairs(
    generate: Callable[[DecodeConfig], DecodeResult],
    samples: int,
    temperature: float,
    seed: int,
    vocab_size: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Counts [V, V] of (2nd, 3rd) new tokens over `samples` seeded runs of `generate`."""
    counts = torch.zeros(vocab_size, vocab_size, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(samples):
        result = generate(DecodeConfig(max_new_tokens=3, temperature=temperature, generator=generator))
        _, second, third = result.new_token_ids
        counts[second, third] += 1
    return counts
