"""The trained tiny pair (ddtree.sglang.cpu.trained_pair): how it was trained, whether its greedy
text is degenerate, and what DFlash and DDTree accept on it offline, per budget.

    .venv/bin/python benchmarks/trained_pair.py [--budgets 1,4,8,16,32,64] [--tokens 48] [--prompts 16] [--pair DIR]

Decodes the pair's held-out prompts at T=0 in float32 on CPU with the project's offline loops
(ddtree.decode): autoregressive, DFlash (the drafter's block, 16) and DDTree at each budget.
tau = accepted tokens per round, root included (mean over prompts of each prompt's mean); the
min / median / max columns are over prompts. Every method must give AR's tokens. Then the
greedy text statistics (ddtree.sglang.cpu.pair_quality) of the target's outputs beside the
held-out text that follows the same prompts. The host's load is printed with the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench_args import budget_list, positive_int  # noqa: E402  (benchmarks/, the script's folder)
from ddtree.decode import DecodeConfig, generate_autoregressive, generate_ddtree, generate_dflash  # noqa: E402
from ddtree.dflash_drafter import load_dflash_drafter, load_target  # noqa: E402
from ddtree.sglang.cpu import pair_quality, trained_pair  # noqa: E402


def per_prompt_tau(result) -> float:
    return statistics.mean(result.acceptance_lengths)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=budget_list, default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--tokens", type=positive_int, default=48)
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--pair", type=Path, help="a folder holding a pair (default: the committed one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the committed pair (or this machine's cache), read only
    source = args.pair if args.pair is not None else trained_pair.source_folder()
    record = json.loads((source / trained_pair.RECIPE_NAME).read_text())
    items = [json.loads(line) for line in (source / trained_pair.PROMPTS_NAME).read_text().splitlines()]
    items = items[: args.prompts]
    target = load_target(str(source / "target"), "cpu", torch.float32)
    drafter = load_dflash_drafter(str(source / "drafter"), target)
    prompts = [torch.tensor([item["input_ids"]]) for item in items]
    load_before = os.getloadavg()

    print(f"## Trained pair: recipe {record['recipe_hash']}\n")
    print("| target steps | drafter steps | threads | held-out nats/byte | wall s | CPU s | load before / after |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {record['target_steps']} | {record['drafter_steps']} | {record['threads']} | "
          f"{record['held_out_nats_per_byte']} | {record['wall_s']} | {record['cpu_s']} | "
          f"{record['loadavg_before'][0]:.1f} / {record['loadavg_after'][0]:.1f} |\n")

    config = DecodeConfig(max_new_tokens=args.tokens)
    reference = [generate_autoregressive(target, p, config).new_token_ids for p in prompts]
    methods = {"dflash": lambda p: generate_dflash(target, drafter, p, config)}
    for budget in args.budgets:
        methods[f"ddtree b{budget}"] = lambda p, b=budget: generate_ddtree(target, drafter, p, config, budget=b)
    rows = []
    for name, run in methods.items():
        results = [run(p) for p in prompts]
        taus = [per_prompt_tau(r) for r in results]
        identical = sum(r.new_token_ids == expected for r, expected in zip(results, reference))
        rows.append((name, statistics.mean(taus), taus, identical))
    dflash_tau = rows[0][1]
    print(f"## Offline acceptance: {len(prompts)} held-out prompts, {args.tokens} new bytes, T=0, float32, "
          f"CPU (load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})\n")
    print("| method | tau | x DFlash | per prompt min / median / max | identical to AR |")
    print("|---|---:|---:|---|---:|")
    for name, tau, taus, identical in rows:
        print(f"| {name} | {tau:.2f} | {tau / dflash_tau:.2f} | {spread(taus)} | {identical}/{len(prompts)} |")

    outputs = pair_quality.greedy_outputs(str(source / "target"), [i["input_ids"] for i in items], 64)
    model = pair_quality.summarize(outputs)
    held_out = pair_quality.summarize([i["continuation_ids"] for i in items])
    print("\n## Greedy text: the target's 64 bytes after each prompt, beside the held-out text's\n")
    print("| text | distinct bytes | longest run of one byte | whitespace share | unique 8-gram share |")
    print("|---|---:|---:|---:|---:|")
    for label, stats in (("target greedy", model), ("held-out text", held_out)):
        print(f"| {label} | {stats.distinct_bytes} | {stats.longest_run} | {stats.whitespace_share} | "
              f"{stats.unique_ngram_share} |")
    print("\nexample:", repr(bytes(items[0]["input_ids"][-40:])), "->", repr(bytes(outputs[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
