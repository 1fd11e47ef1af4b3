"""Stage `lossless`: the decode loops are lossless on real attention, on this host's device.

A tiny random 2-layer Llama (built from a config, no download; float64 so argmax ties cannot
flip between the tree forward and the one-token forward) and a noisy copy of its own
distributions as the drafter. Passes when, at temperature 0, DFlash and DDTree at budgets
1/4/16/64 emit exactly the autoregressive tokens on every prompt, mean acceptance does not
drop as the budget grows, and at temperature 1 the (2nd, 3rd) new tokens of DDTree follow the
target's exact distribution (chi-square p > 0.001). Needs `transformers` on the host.
Knobs (`options.extra`): `lossless_samples` (800 sampled runs), `lossless_tokens` (32 per prompt).
"""
from __future__ import annotations

from typing import Any

from smoke.protocol import StageContext, StageResult

NAME = "lossless"
DESCRIPTION = "DDTree/DFlash emit exactly the autoregressive tokens on a tiny real transformer"

BUDGETS = [1, 4, 16, 64]
MIN_P_VALUE = 1e-3


def _dflash_adapter_problems(ctx: StageContext, seed: int, device: str, rows: list[dict[str, Any]]) -> list[str]:
    """The DFlash drafter adapter end to end: a tiny random z-lab-layout drafter saved to disk,
    loaded back and driven by DFlash and DDTree (its drafts are poor; its tokens must be AR's)."""
    import tempfile
    from pathlib import Path

    from ddtree.decode import DecodeConfig, generate_autoregressive, generate_dflash, generate_ddtree
    from ddtree.dflash_drafter import load_dflash_drafter
    from ddtree.lossless import build_tiny_target, prompt_set, save_tiny_dflash_drafter, tiny_dflash_config

    target = build_tiny_target(seed=seed, device=device)
    with tempfile.TemporaryDirectory(prefix="ddtree-lossless-") as folder:
        drafter = load_dflash_drafter(str(save_tiny_dflash_drafter(Path(folder) / "drafter", tiny_dflash_config())),
                                      target)
    problems = []
    config = DecodeConfig(max_new_tokens=16)
    for index, prompt in enumerate(prompt_set(2, 6, target.vocab_size, seed=200 + seed)):
        expected = generate_autoregressive(target, prompt, config).new_token_ids
        for method, result in (("dflash", generate_dflash(target, drafter, prompt, config)),
                               ("ddtree_tb16", generate_ddtree(target, drafter, prompt, config, budget=16))):
            same = result.new_token_ids == expected
            rows.append({"model_seed": seed, "block_size": drafter.block_size, "method": f"{method}+dflash-adapter",
                         "tau": round(sum(result.acceptance_lengths) / max(len(result.acceptance_lengths), 1), 4),
                         "identical_to_ar": same})
            if not same:
                problems.append(f"{method} with the DFlash adapter differs from AR on prompt {index}")
    ctx.log(f"DFlash adapter: {'lossless' if not problems else 'MISMATCH'} on 2 prompts")
    return problems


def run(ctx: StageContext) -> StageResult:
    import torch

    # The tiny model is all per-op overhead: on CPU, extra threads only add contention
    # (measured: 0.4 ms per forward with one thread, several ms with two on a busy host).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(ctx)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: StageContext) -> StageResult:
    try:
        import transformers
    except ImportError as err:
        return StageResult.skipped(f"transformers is not importable in the host Python ({err})")
    from ddtree.decode import generate_ddtree
    from ddtree.drafters import NoisyTargetDrafter
    from ddtree.lossless import (
        build_tiny_target,
        check_lossless,
        chi_square_test,
        exact_pair_distribution,
        prompt_set,
        sample_pairs,
    )

    extra = ctx.options.extra
    seed = ctx.options.seed
    samples = int(extra.get("lossless_samples", 800))
    new_tokens = int(extra.get("lossless_tokens", 32))
    device = ctx.device if ctx.device in ("cuda", "cpu") else "cpu"
    metrics: dict[str, Any] = {"device": device, "transformers": transformers.__version__, "budgets": BUDGETS}
    rows: list[dict[str, Any]] = []
    problems: list[str] = []

    for model_seed, block_size in ((seed, 8), (seed + 1, 16)):
        target = build_tiny_target(seed=model_seed, device=device)
        prompts = prompt_set(3, 6, target.vocab_size, seed=100 + model_seed)
        report = check_lossless(target, prompts, BUDGETS, max_new_tokens=new_tokens, block_size=block_size,
                                noise=0.3, seed=model_seed)
        for key in report.acceptance:
            rows.append({"model_seed": model_seed, "block_size": block_size, "method": key,
                         "tau": round(report.tau(key), 4),
                         "identical_to_ar": sum(m.method == key for m in report.mismatches) == 0})
        for mismatch in report.mismatches[:3]:
            problems.append(f"{mismatch.method} differs from AR on prompt {mismatch.prompt_index} "
                            f"(model seed {model_seed}) at new token {mismatch.position}")
        taus = [round(t, 3) for t in report.ddtree_taus()]
        metrics[f"tau.seed{model_seed}.bs{block_size}"] = taus
        if not report.monotone_in_budget():
            problems.append(f"mean acceptance drops with the budget (model seed {model_seed}): {taus}")
        ctx.log(f"model seed {model_seed}, block {block_size}: DDTree tau by budget {taus}, "
                f"{len(report.mismatches)} mismatches")

    problems += _dflash_adapter_problems(ctx, seed, device, rows)

    vocab = 48
    target = build_tiny_target(seed=seed + 1, vocab_size=vocab, device=device)
    prompt = prompt_set(1, 6, vocab, seed=1)[0]
    exact = exact_pair_distribution(target, prompt, temperature=1.0).flatten()
    drafter = NoisyTargetDrafter(target, block_size=4, noise=0.3, seed=seed)
    counts = sample_pairs(lambda config: generate_ddtree(target, drafter, prompt, config, budget=8),
                          samples=samples, temperature=1.0, seed=seed, vocab_size=vocab,
                          device=device).flatten()
    fit = chi_square_test(counts, exact)
    metrics.update({"sampling_chi2": round(fit.chi2, 3), "sampling_dof": fit.dof,
                    "sampling_p_value": fit.p_value, "sampling_samples": fit.samples})
    ctx.log(f"temperature 1: chi2 {fit.chi2:.1f} on {fit.dof} dof, p = {fit.p_value:.3g}")
    if fit.p_value <= MIN_P_VALUE:
        problems.append(f"temperature-1 samples do not follow the target (chi2 {fit.chi2:.1f}, "
                        f"{fit.dof} dof, p = {fit.p_value:.2g})")
    metrics["mismatch_count"] = sum(not row["identical_to_ar"] for row in rows)
    tables = {"lossless": rows}
    if problems:
        return StageResult.failed("; ".join(problems), metrics=metrics, tables=tables)
    return StageResult.passed(f"lossless at T=0 on {len(rows)} method runs; T=1 p = {fit.p_value:.3g}",
                              metrics=metrics, tables=tables)
