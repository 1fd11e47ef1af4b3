"""The decode loops on a real (tiny, random) transformer: lossless at T=0, exact in
distribution at T>0, acceptance growing with the budget, and caught when the mask or the
positions are deliberately broken."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import decode  # noqa: E402
from ddtree.decode import DecodeConfig, generate_ddtree  # noqa: E402
from ddtree.drafters import NoisyTargetDrafter  # noqa: E402
from ddtree.lossless import (  # noqa: E402
    TINY_VOCAB,
    build_tiny_target,
    check_lossless,
    chi_square_test,
    exact_pair_distribution,
    prompt_set,
    sample_pairs,
)

BUDGETS = [1, 4, 16, 64]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "model_seed, block_size, noise",
    [(0, 16, 0.3), (1, 8, 0.3), (2, 4, 0.3), (3, 8, 1.0), (4, 16, 0.0), (5, 6, 0.6), (6, 8, 2.0), (7, 3, 0.3)],
)
@pytest.mark.slow
def test_dflash_and_ddtree_emit_exactly_the_autoregressive_tokens(model_seed, block_size, noise):
    target = build_tiny_target(seed=model_seed)
    prompts = prompt_set(3, 5 + model_seed, TINY_VOCAB, seed=100 + model_seed)
    report = check_lossless(target, prompts, BUDGETS, max_new_tokens=24, block_size=block_size, noise=noise,
                            seed=model_seed)
    assert report.lossless, report.mismatches[:2]
    # The runs did speculate: with a good drafter some round accepted more than the root.
    if noise <= 0.6:
        assert max(max(r.acceptance_lengths) for r in report.results["ddtree_tb64"]) > 1
    for results in report.results.values():
        assert all(r.num_output_tokens == 24 for r in results)


@pytest.mark.slow
def test_mean_acceptance_is_non_decreasing_in_the_budget():
    target = build_tiny_target(seed=11)
    prompts = prompt_set(4, 6, TINY_VOCAB, seed=7)
    report = check_lossless(target, prompts, BUDGETS, max_new_tokens=32, block_size=8, noise=0.4, seed=3)
    taus = report.ddtree_taus()
    assert report.lossless
    assert report.monotone_in_budget(), taus
    assert taus[-1] > taus[0] + 1.0, taus  # the budget matters, not just ties
    assert taus[0] <= 2.0  # budget 1: the root plus at most one node per round


def _shift_node_positions(compile_fn):
    def broken(*args, **kwargs):
        inputs = compile_fn(*args, **kwargs)
        shifted = inputs.position_ids.clone()
        shifted[0, 1:] += 1  # every draft node one position too far
        return inputs._replace(position_ids=shifted)

    return broken


def _see_everything(compile_fn):
    def broken(*args, **kwargs):
        inputs = compile_fn(*args, **kwargs)
        return inputs._replace(attention_mask=torch.zeros_like(inputs.attention_mask))  # no tree mask

    return broken


def _causal_instead_of_tree(compile_fn):
    def broken(*args, **kwargs):
        inputs = compile_fn(*args, **kwargs)
        mask = inputs.attention_mask.clone()
        n = mask.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        block = mask[0, 0, :, -n:]
        block.copy_(torch.zeros_like(block).masked_fill_(~causal, torch.finfo(mask.dtype).min))
        return inputs._replace(attention_mask=mask)  # siblings see each other: a chain mask

    return broken


@pytest.mark.slow
@pytest.mark.parametrize("bug", [_shift_node_positions, _see_everything, _causal_instead_of_tree])
def test_a_broken_mask_or_position_offset_is_caught(monkeypatch, bug):
    target = build_tiny_target(seed=0)
    prompts = prompt_set(2, 6, TINY_VOCAB, seed=100)
    healthy = check_lossless(target, prompts, [16], max_new_tokens=24, block_size=8, noise=0.3)
    assert healthy.lossless
    monkeypatch.setattr(decode, "compile_tree_inputs", bug(decode.compile_tree_inputs))
    broken = check_lossless(target, prompts, [16], max_new_tokens=24, block_size=8, noise=0.3)
    assert not broken.lossless
    assert {m.method for m in broken.mismatches} == {"ddtree_tb16"}  # AR and DFlash never use it


@pytest.mark.slow
def test_sampling_at_temperature_one_matches_the_target_distribution(monkeypatch):
    """(2nd, 3rd) new tokens: the root's sample and, when drafted, a depth-1 node's sample."""
    vocab = 48  # fewer cells: the exact pair distribution is one batched forward over vocab^2 rows
    target = build_tiny_target(seed=1, vocab_size=vocab)
    prompt = prompt_set(1, 6, vocab, seed=1)[0]
    exact = exact_pair_distribution(target, prompt, temperature=1.0).flatten()
    drafter = NoisyTargetDrafter(target, block_size=4, noise=0.3, seed=0)

    def run(config):
        return generate_ddtree(target, drafter, prompt, config, budget=8)

    counts = sample_pairs(run, samples=800, temperature=1.0, seed=0, vocab_size=vocab).flatten()
    fit = chi_square_test(counts, exact)
    assert fit.dof >= 20  # enough populated cells for the test to have power
    assert fit.p_value > 1e-3, fit
    drafted = sum(max(r.acceptance_lengths) > 1 for r in [run(DecodeConfig(max_new_tokens=3, temperature=1.0, generator=torch.Generator().manual_seed(s))) for s in range(50)])
    assert drafted > 10  # the 3rd token often came from a tree node, so the walk was tested

    monkeypatch.setattr(decode, "compile_tree_inputs", _shift_node_positions(decode.compile_tree_inputs))
    counts = sample_pairs(run, samples=400, temperature=1.0, seed=0, vocab_size=vocab).flatten()
    broken = chi_square_test(counts, exact)
    assert broken.p_value < 1e-6, broken
