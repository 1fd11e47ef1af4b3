"""Per-round overhead of the DDTree decode loop outside the target and drafter forwards.

    .venv/bin/python benchmarks/decode.py [--budgets 16,32,64,128,256] [--vocab 96] [--tokens 64]

A tiny random Llama target (2 layers, hidden 64) and a tiny random DFlash drafter (one forward
per round, block 16) decode a few prompts with `generate_ddtree` at each budget. From the
loop's own stage times: draft and verify are the model forwards; tree build + tree compile +
commit are the loop's overhead, printed as a share of the whole round. Autoregressive decoding
runs in the same process for the time-per-token ratio. Rows for CUDA are added when present.
The tiny target makes the verify forward cheap, so the overhead share here is an upper bound
of what a real target sees.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench_args import budget_list, positive_int  # noqa: E402  (benchmarks/, the script's folder)
from ddtree.build import BuildMethod  # noqa: E402
from ddtree.decode import DecodeConfig, generate_autoregressive, generate_ddtree  # noqa: E402
from ddtree.dflash_drafter import load_dflash_drafter  # noqa: E402
from ddtree.lossless import build_tiny_target, prompt_set, save_tiny_dflash_drafter, tiny_dflash_config  # noqa: E402

OVERHEAD_STAGES = ("tree_build", "tree_compile", "commit")


def measure(device: str, budgets: list[int], vocab: int, tokens: int, prompts: int, dtype: torch.dtype) -> list[dict]:
    target = build_tiny_target(seed=0, vocab_size=vocab, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_dflash_drafter(Path(folder) / "d", tiny_dflash_config(vocab_size=vocab, block_size=16))
        drafter = load_dflash_drafter(str(path), target)
    inputs = prompt_set(prompts, 16, vocab, seed=1)
    config = DecodeConfig(max_new_tokens=tokens)
    generate_autoregressive(target, inputs[0], DecodeConfig(max_new_tokens=8))  # warm-up
    ar_tpot = statistics.median(generate_autoregressive(target, p, config).time_per_output_token for p in inputs)
    rows = []
    for budget, builder in [(b, m) for b in budgets for m in (BuildMethod.AUTO, BuildMethod.HEAP)]:
        generate_ddtree(target, drafter, inputs[0], DecodeConfig(max_new_tokens=8), budget=budget,
                        build_method=builder)  # warm-up
        stages = {name: 0.0 for name in ("draft", "tree_build", "tree_compile", "verify", "commit")}
        rounds, tpots = 0, []
        for prompt in inputs:
            result = generate_ddtree(target, drafter, prompt, config, budget=budget, build_method=builder)
            for name, seconds in result.stage_times.items():
                stages[name] += seconds
            rounds += result.decode_rounds
            tpots.append(result.time_per_output_token)
        round_s = sum(stages.values()) / rounds
        overhead_s = sum(stages[name] for name in OVERHEAD_STAGES) / rounds
        rows.append({
            "device": device, "budget": budget, "builder": builder.value, "round_ms": round_s * 1e3,
            "draft_ms": stages["draft"] / rounds * 1e3, "verify_ms": stages["verify"] / rounds * 1e3,
            "build_ms": stages["tree_build"] / rounds * 1e3, "compile_ms": stages["tree_compile"] / rounds * 1e3,
            "commit_ms": stages["commit"] / rounds * 1e3, "overhead_pct": 100 * overhead_s / round_s,
            "tpot_vs_ar": statistics.median(tpots) / ar_tpot,
        })
    return rows


def print_table(rows: list[dict], vocab: int, tokens: int) -> None:
    print(f"DDTree loop overhead per round (tiny Llama target, tiny DFlash drafter, block 16, V={vocab}, "
          f"{tokens} new tokens per prompt)")
    header = ("device", "budget", "builder", "round ms", "draft ms", "verify ms", "build ms", "compile ms", "commit ms",
              "overhead %", "tpot / AR")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print(f"| {r['device']} | {r['budget']} | {r['builder']} | {r['round_ms']:.2f} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | "
              f"{r['build_ms']:.2f} | {r['compile_ms']:.2f} | {r['commit_ms']:.2f} | {r['overhead_pct']:.1f} | "
              f"{r['tpot_vs_ar']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=budget_list, default="16,32,64,128,256")
    parser.add_argument("--vocab", type=positive_int, default=96, help="96: the test suite's tiny model")
    parser.add_argument("--tokens", type=positive_int, default=64)
    parser.add_argument("--prompts", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads (1: steady on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = args.budgets
    rows = measure("cpu", budgets, args.vocab, args.tokens, args.prompts, torch.float32)
    if torch.cuda.is_available():
        rows += measure("cuda", budgets, args.vocab, args.tokens, args.prompts, torch.float32)
    print_table(rows, args.vocab, args.tokens)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - started:.1f} s)")
