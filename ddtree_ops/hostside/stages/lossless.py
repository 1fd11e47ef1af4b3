"""Stage `lossless`: the decode loops are lossless on real attention, on this host's device.

One tiny random 2-layer Llama (built once from a config, no download; float64 so argmax ties
cannot flip between the tree forward and the one-token forward) and a noisy copy of its own
distributions as the drafter. Passes when, at temperature 0, DFlash and DDTree at every
budget of the profile emit exactly the autoregressive tokens on every prompt, mean acceptance
does not drop as the budget grows, the DFlash drafter adapter (a tiny random z-lab-layout
drafter saved to disk and loaded back) is lossless too, and at temperature 1 the (2nd, 3rd) new
tokens of DDTree follow the target's exact distribution (chi-square p > 0.001).

Two profiles: the default (`QUICK`, a few seconds on one CPU core: 2 prompts x 16 tokens,
budgets 4 and 32, 200 sampled runs) and `FULL` (two models, 3 prompts x 32 tokens, budgets
1/4/16/64, 800 sampled runs) with `options.extra.lossless_full: true` or the `lossless-full`
stage. The exhaustive sweep (many seeds, block sizes and noise levels, deliberately broken
masks) is the unit test suite's job (`tests/unit/test_decode_lossless.py`).
Other knobs (`options.extra`): `lossless_samples`, `lossless_tokens` override the profile.
Needs `transformers` on the host (reached through `ddtree.lossless`, never imported here).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ddtree_ops.hostside.protocol import StageContext, StageResult

NAME = "lossless"
DESCRIPTION = "DDTree/DFlash emit exactly the autoregressive tokens on a tiny real transformer"

MIN_P_VALUE = 1e-3
VOCAB = 48  # small enough for the exact (2nd, 3rd)-token distribution: one [V*V, n+2] forward


class Profile(NamedTuple):
    name: str
    models: tuple[tuple[int, int], ...]  # (model seed offset, drafter block size) per T=0 check
    prompts: int  # prompts per model
    new_tokens: int  # new tokens per prompt at T=0
    budgets: tuple[int, ...]  # DDTree budgets compared with AR
    adapter_prompts: int  # prompts through the DFlash drafter adapter
    samples: int  # sampled runs for the temperature-1 test


QUICK = Profile("quick", models=((0, 8),), prompts=2, new_tokens=16, budgets=(4, 32), adapter_prompts=1,
                samples=200)
FULL = Profile("full", models=((0, 8), (1, 16)), prompts=3, new_tokens=32, budgets=(1, 4, 16, 64),
               adapter_prompts=2, samples=800)


def select_profile(extra: dict[str, Any]) -> Profile:
    """The profile `options.extra` asks for, with `lossless_tokens` / `lossless_samples` applied."""
    profile = FULL if extra.get("lossless_full") else QUICK
    if "lossless_tokens" in extra:
        profile = profile._replace(new_tokens=int(extra["lossless_tokens"]))
    if "lossless_samples" in extra:
        profile = profile._replace(samples=int(extra["lossless_samples"]))
    return profile


def run(ctx: StageContext) -> StageResult:
    return run_profile(ctx, select_profile(ctx.options.extra))


def run_profile(ctx: StageContext, profile: Profile) -> StageResult:
    import torch

    # The tiny model is all per-op overhead: on CPU, extra threads only add contention
    # (measured: 0.4 ms per forward with one thread, several ms with two on a busy host).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(ctx, profile)
    finally:
        torch.set_num_threads(threads)


def _token_identity(ctx: StageContext, target: Any, model_seed: int, block_size: int, profile: Profile,
                    rows: list[dict[str, Any]], metrics: dict[str, Any]) -> list[str]:
    """AR vs DFlash vs DDTree at every budget of the profile, temperature 0."""
    from ddtree.lossless import check_lossless, prompt_set

    prompts = prompt_set(profile.prompts, 6, target.vocab_size, seed=100 + model_seed)
    report = check_lossless(target, prompts, list(profile.budgets), max_new_tokens=profile.new_tokens,
                            block_size=block_size, noise=0.3, seed=model_seed)
    for key in report.acceptance:
        rows.append({"model_seed": model_seed, "block_size": block_size, "method": key,
                     "tau": round(report.tau(key), 4),
                     "identical_to_ar": not any(m.method == key for m in report.mismatches)})
    problems = [f"{m.method} differs from AR on prompt {m.prompt_index} (model seed {model_seed}) "
                f"at new token {m.position}" for m in report.mismatches[:3]]
    taus = [round(t, 3) for t in report.ddtree_taus()]
    metrics[f"tau.seed{model_seed}.bs{block_size}"] = taus
    if not report.monotone_in_budget():
        problems.append(f"mean acceptance drops with the budget (model seed {model_seed}): {taus}")
    ctx.log(f"model seed {model_seed}, block {block_size}: DDTree tau at budgets {list(profile.budgets)} "
            f"{taus}, {len(report.mismatches)} mismatches")
    return problems


def _dflash_adapter(ctx: StageContext, target: Any, seed: int, profile: Profile,
                    rows: list[dict[str, Any]]) -> list[str]:
    """The DFlash drafter adapter end to end: a tiny random z-lab-layout drafter saved to disk,
    loaded back and driven by DFlash and DDTree (its drafts are poor; its tokens must be AR's)."""
    import tempfile
    from pathlib import Path

    from ddtree.decode import DecodeConfig, generate_autoregressive, generate_dflash, generate_ddtree
    from ddtree.dflash_drafter import load_dflash_drafter
    from ddtree.lossless import prompt_set, save_tiny_dflash_drafter, tiny_dflash_config

    with tempfile.TemporaryDirectory(prefix="ddtree-lossless-") as folder:
        saved = save_tiny_dflash_drafter(Path(folder) / "drafter", tiny_dflash_config(vocab_size=target.vocab_size))
        drafter = load_dflash_drafter(str(saved), target)
    problems = []
    config = DecodeConfig(max_new_tokens=12)
    budget = profile.budgets[-1]
    for index, prompt in enumerate(prompt_set(profile.adapter_prompts, 6, target.vocab_size, seed=200 + seed)):
        expected = generate_autoregressive(target, prompt, config).new_token_ids
        for method, result in (("dflash", generate_dflash(target, drafter, prompt, config)),
                               (f"ddtree_tb{budget}", generate_ddtree(target, drafter, prompt, config, budget=budget))):
            same = result.new_token_ids == expected
            rows.append({"model_seed": seed, "block_size": drafter.block_size, "method": f"{method}+dflash-adapter",
                         "tau": round(sum(result.acceptance_lengths) / max(len(result.acceptance_lengths), 1), 4),
                         "identical_to_ar": same})
            if not same:
                problems.append(f"{method} with the DFlash adapter differs from AR on prompt {index}")
    ctx.log(f"DFlash adapter: {'lossless' if not problems else 'MISMATCH'} on {profile.adapter_prompts} prompt(s)")
    return problems


def _sampling(ctx: StageContext, target: Any, seed: int, profile: Profile, device: str,
              metrics: dict[str, Any]) -> list[str]:
    """Temperature 1: DDTree's (2nd, 3rd) new tokens against the target's exact distribution."""
    from ddtree.decode import generate_ddtree
    from ddtree.drafters import NoisyTargetDrafter
    from ddtree.lossless import chi_square_test, exact_pair_distribution, prompt_set, sample_pairs

    prompt = prompt_set(1, 6, target.vocab_size, seed=1)[0]
    exact = exact_pair_distribution(target, prompt, temperature=1.0).flatten()
    drafter = NoisyTargetDrafter(target, block_size=4, noise=0.3, seed=seed)
    counts = sample_pairs(lambda config: generate_ddtree(target, drafter, prompt, config, budget=8),
                          samples=profile.samples, temperature=1.0, seed=seed, vocab_size=target.vocab_size,
                          device=device).flatten()
    fit = chi_square_test(counts, exact)
    metrics.update({"sampling_chi2": round(fit.chi2, 3), "sampling_dof": fit.dof,
                    "sampling_p_value": fit.p_value, "sampling_samples": fit.samples})
    ctx.log(f"temperature 1: chi2 {fit.chi2:.1f} on {fit.dof} dof, p = {fit.p_value:.3g}")
    if fit.p_value <= MIN_P_VALUE:
        return [f"temperature-1 samples do not follow the target (chi2 {fit.chi2:.1f}, "
                f"{fit.dof} dof, p = {fit.p_value:.2g})"]
    return []


def _run(ctx: StageContext, profile: Profile) -> StageResult:
    from ddtree.hf_target import transformers_version

    version = transformers_version()
    if version is None:
        return StageResult.skipped("transformers is not importable in the host Python")
    from ddtree.lossless import build_tiny_target

    seed = ctx.options.seed
    device = ctx.device if ctx.device in ("cuda", "cpu") else "cpu"
    metrics: dict[str, Any] = {"device": device, "transformers": version, "profile": profile.name,
                               "budgets": list(profile.budgets), "new_tokens": profile.new_tokens}
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    targets = {offset: build_tiny_target(seed=seed + offset, vocab_size=VOCAB, device=device)
               for offset in sorted({offset for offset, _ in profile.models})}
    for offset, block_size in profile.models:
        problems += _token_identity(ctx, targets[offset], seed + offset, block_size, profile, rows, metrics)
    first = targets[profile.models[0][0]]
    problems += _dflash_adapter(ctx, first, seed, profile, rows)
    problems += _sampling(ctx, first, seed, profile, device, metrics)
    metrics["mismatch_count"] = sum(not row["identical_to_ar"] for row in rows)
    tables = {"lossless": rows}
    if problems:
        return StageResult.failed("; ".join(problems), metrics=metrics, tables=tables)
    return StageResult.passed(
        f"lossless at T=0 on {len(rows)} method runs (budgets {', '.join(map(str, profile.budgets))}); "
        f"T=1 p = {metrics['sampling_p_value']:.3g}", metrics=metrics, tables=tables)
