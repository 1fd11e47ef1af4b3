"""Stage `decode-bench`: AR, DFlash and DDTree on the host's configured target and drafter.

Reads the host's `models:` section (`target`, `drafter`, `block_size`, optional `prompts`),
loads both from local folders or the local Hugging Face cache (never downloads), and decodes
a small prompt set with each method: autoregressive, DFlash and DDTree at every budget in
`options.budgets`. Records per method tau, the acceptance histogram, time per output token,
the stage split, the speedup over AR and whether the tokens equal AR's (T=0), as the `methods`
table (the rows `ddtree-ops report --baseline` compares) plus flat metrics.

It then measures the target's verify cost (a few forwards at each concurrency level of
`sglang_concurrency`, default 1 and 8 on a GPU, 1 on a CPU, and at each width the methods
use) and, with tau, draft time and round overhead from the decodes above, predicts tokens/s
of AR, DFlash and DDTree at every budget run and the powers of two between them (the
`predictions` table, `ddtree.throughput_model`): what `report` sets beside sglang-e2e's
measurements under load. The draft cost is measured at one request and taken as it is at
every level.

Options (`options.extra`): `max_new_tokens` (256), `temperature` (0.0), `max_prompts` (all),
`strict` (false: a T=0 token mismatch is reported, true: it fails the stage; bf16 kernels may
flip near-tied argmaxes between a tree forward and a one-token forward). Skips when no models
are configured. The prompts file, if given, is JSONL: {"prompt": text} or {"input_ids": [..]}.
Hugging Face loading (target, drafter, tokenizer) goes through `ddtree` (`ddtree.hf_target`,
`ddtree.dflash_drafter`), so this file imports only ddtree, the standard library and torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddtree_ops.hostside.protocol import TIMINGS_TABLE, StageContext, StageResult, timing_row

NAME = "decode-bench"
DESCRIPTION = "AR vs DFlash vs DDTree budgets on the host's target + drafter: tau, speedup, stage split"
TIMED = True  # the runner samples the host's load around it

DATASET_NAME = "ddtree-ops-prompts"
# A small mixed prompt set (math, code, chat), shipped so every host measures the same thing.
PROMPTS: tuple[str, ...] = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\n"
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Find the sum of all positive integers n such that n^2 - 19n + 99 is a perfect square.\n"
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and non-alphanumeric "
    "characters, with a short docstring and three doctests.",
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    "def separate_paren_groups(paren_string: str) -> list[str]:\n"
    "    \"\"\"Split a string of balanced parenthesis groups into separate strings.\"\"\"\n```",
    "Explain in three short paragraphs how a hash map handles collisions, for a junior developer.",
    "Give me a packing list for a three-day hiking trip in early autumn, grouped by category.",
)


def _load_prompts(path: str | None) -> tuple[str, list[dict[str, Any]]]:
    if not path:
        return DATASET_NAME, [{"prompt": text} for text in PROMPTS]
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"prompts: no such file: {path}")
    items = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}:{number}: not JSON ({err.msg})") from None
        if not isinstance(item, dict) or not ({"prompt", "input_ids"} & set(item)):
            raise ValueError(f"{file}:{number}: expected an object with 'prompt' or 'input_ids'")
        items.append(item)
    if not items:
        raise ValueError(f"{file}: no prompts")
    return file.stem, items


def _encode(items: list[dict[str, Any]], target_dir: Path, torch: Any) -> tuple[list[Any], list[int]]:
    """Token ids [1, n] per prompt (chat template when the tokenizer has one) and stop ids."""
    from ddtree.hf_target import load_tokenizer

    needs_tokenizer = any("input_ids" not in item for item in items)
    tokenizer = load_tokenizer(target_dir) if needs_tokenizer else None
    encoded = []
    for item in items:
        if "input_ids" in item:
            encoded.append(torch.tensor([item["input_ids"]], dtype=torch.long))
            continue
        text = item["prompt"]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
        encoded.append(tokenizer(text, return_tensors="pt").input_ids)
    stops = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops = [int(tokenizer.eos_token_id)]
    return encoded, stops


def _predictions(target: Any, drafter: Any, records: dict[str, list[Any]], budgets: list[int],
                 levels: list[int], context_len: int) -> list[dict[str, Any]]:
    """The throughput model calibrated on this host: verify cost from forwards, the rest from
    the decodes just run (`records`: method key -> DecodeResults)."""
    from ddtree.cost_probe import measure_verify_costs, round_costs
    from ddtree.decode import DecodeMethod, method_key
    from ddtree.throughput_model import HostCosts, budgets_between, prediction_rows

    per_budget = {b: round_costs(records[method_key(DecodeMethod.DDTREE, b)]) for b in budgets}
    dflash_tau = round_costs(records[method_key(DecodeMethod.DFLASH)])[0]
    widths = sorted({1, drafter.block_size} | {b + 1 for b in budgets_between(budgets)})
    costs = HostCosts(
        verify_s=measure_verify_costs(target, levels, widths, context_len),
        draft_s={1: sum(c[1] for c in per_budget.values()) / len(per_budget)},
        build_s={b: c[2] for b, c in per_budget.items()},
    )
    return prediction_rows(costs, {b: c[0] for b, c in per_budget.items()}, levels, (dflash_tau, drafter.block_size))


def run(ctx: StageContext) -> StageResult:
    models = ctx.host.get("models") if isinstance(ctx.host, dict) else None
    host_name = ctx.host.get("name", "host") if isinstance(ctx.host, dict) else "host"
    if not models:
        inventory = ctx.host.get("inventory") if isinstance(ctx.host, dict) else None
        return StageResult.skipped(
            f"no models configured for this host ({inventory or 'the inventory'}: hosts.{host_name}.models)"
        )
    from ddtree.hf_target import transformers_version

    if transformers_version() is None:
        return StageResult.skipped("transformers is not importable in the host Python")
    import torch

    from ddtree_ops.hostside.offline_acceptance import prepare_transformers

    prepare_transformers()  # a CPU test server's environment serves as a host too

    from ddtree.decode import (
        DecodeConfig,
        DecodeMethod,
        generate_autoregressive,
        generate_dflash,
        generate_ddtree,
        method_key,
    )
    from ddtree.dflash_drafter import ModelPathError, load_dflash_drafter, load_target, resolve_model_dir
    from ddtree.dflash_model import DFlashConfigError
    from ddtree.drafters import DrafterMismatchError
    from ddtree.runsummary import summarize_methods

    where = f"hosts.{host_name}.models"
    extra = ctx.options.extra
    max_new_tokens = int(extra.get("max_new_tokens", 256))
    temperature = float(extra.get("temperature", 0.0))
    budgets = list(ctx.options.budgets)
    device = "cuda" if ctx.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        dataset, items = _load_prompts(models.get("prompts"))
        if extra.get("max_prompts"):
            items = items[: int(extra["max_prompts"])]
        target = load_target(str(models["target"]), device, dtype)
        drafter = load_dflash_drafter(str(models["drafter"]), target, block_size=models.get("block_size"))
        prompts, stops = _encode(items, resolve_model_dir(str(models["target"])), torch)
    except (ModelPathError, DrafterMismatchError, DFlashConfigError, ValueError, KeyError) as err:
        return StageResult.failed(f"{where}: {err}")

    model_name = str(models["target"]).rstrip("/").rsplit("/", 1)[-1]
    ctx.log(f"{model_name} + {models['drafter']} on {device}: {len(prompts)} prompts, "
            f"{max_new_tokens} new tokens, T={temperature}, budgets {budgets}")
    generator = torch.Generator(device=device).manual_seed(ctx.options.seed)

    def config(tokens: int = max_new_tokens) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=tokens, temperature=temperature, stop_token_ids=stops,
                            generator=generator)

    runners = {method_key(DecodeMethod.AUTOREGRESSIVE): lambda p, c: generate_autoregressive(target, p, c),
               method_key(DecodeMethod.DFLASH): lambda p, c: generate_dflash(target, drafter, p, c)}
    for budget in budgets:
        runners[method_key(DecodeMethod.DDTREE, budget)] = (
            lambda p, c, b=budget: generate_ddtree(target, drafter, p, c, budget=b))

    for run_method in runners.values():  # warm-up: kernels, allocator, lazy imports
        run_method(prompts[0], config(8))
    records: dict[str, list[Any]] = {key: [] for key in runners}
    for index, prompt in enumerate(prompts):
        for key, run_method in runners.items():
            records[key].append(run_method(prompt, config()))
        ctx.log(f"prompt {index + 1}/{len(prompts)} done")

    summaries = summarize_methods(records, dataset=dataset, model=model_name, temperature=temperature,
                                  source=f"decode-bench on {host_name}")
    rows = [summary.to_dict() for summary in summaries]
    metrics: dict[str, Any] = {"device": device, "model": model_name, "drafter": str(models["drafter"]),
                               "block_size": drafter.block_size, "prompts": len(prompts),
                               "max_new_tokens": max_new_tokens, "temperature": temperature}
    for summary in summaries:
        metrics[f"tau.{summary.method}"] = round(summary.tau, 4)
        metrics[f"speedup.{summary.method}"] = None if summary.speedup is None else round(summary.speedup, 4)
        metrics[f"tpot_ms.{summary.method}"] = round((summary.time_per_output_token or 0.0) * 1e3, 4)
        ctx.log(f"{summary.method}: tau {summary.tau:.2f}, speedup {summary.speedup or 0:.2f}x")
    differing = [s.method for s in summaries if s.identical_to_ar is not None and s.identical_to_ar < 1.0]
    # per method, the spread of its requests' time per output token (ms)
    timings = [timing_row(f"tpot_ms.{key}", [float(r.time_per_output_token) * 1e3 for r in found], "ms")
               for key, found in records.items() if found]
    reference = records[method_key(DecodeMethod.AUTOREGRESSIVE)]
    for key, found in records.items():  # speedup per prompt: AR's and the method's on the same prompt
        pairs = [float(ar.time_per_output_token) / float(r.time_per_output_token)
                 for ar, r in zip(reference, found) if float(r.time_per_output_token) > 0]
        if pairs:
            timings.append(timing_row(f"speedup.{key}", pairs, "x"))
    tables = {"methods": rows, TIMINGS_TABLE: timings}
    if budgets:
        levels = [int(c) for c in extra.get("sglang_concurrency", [1, 8] if device == "cuda" else [1])]
        context_len = sum(int(p.shape[1]) for p in prompts) // len(prompts) + max_new_tokens // 2
        tables["predictions"] = _predictions(target, drafter, records, budgets, levels, context_len)
        ctx.log(f"verify cost measured at {levels} concurrent; predictions for {len(tables['predictions'])} cells")
    if differing:
        reason = f"tokens differ from AR at T=0 for {', '.join(differing)} (see the methods table)"
        if extra.get("strict"):
            return StageResult.failed(reason, metrics=metrics, tables=tables)
        return StageResult.passed(f"{len(summaries)} methods measured; {reason}", metrics=metrics, tables=tables)
    best = max((s for s in summaries if s.budget is not None), key=lambda s: s.speedup or 0.0, default=None)
    note = f"; best DDTree budget {best.budget}: {best.speedup:.2f}x, tau {best.tau:.2f}" if best and best.speedup else ""
    return StageResult.passed(f"{len(summaries)} methods measured{note}", metrics=metrics, tables=tables)
