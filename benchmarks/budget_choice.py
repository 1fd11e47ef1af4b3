"""Does the throughput model pick the budget that decodes fastest? One table per run.

    .venv/bin/python benchmarks/budget_choice.py [--budgets 1,4,16,64,256] [--calibrate 1,16,256]
        [--vocab 4096] [--tokens 32] [--prompts 2] [--runs 3]

A small random Llama target (2 layers, hidden 64) with a noisy-target drafter (block 8). The
model (`ddtree.throughput_model`) is calibrated from verify forwards at every budget's width
and from decodes at the `--calibrate` budgets only (tau, draft, round overhead); every budget
is then decoded for real. Times are CPU time of this process (one torch thread), so the other
processes on a shared machine do not decide the ranking; the host's load is printed anyway.
Each run repeats the whole calibration; the table gives min / median / max over runs. Measured
throughput includes each prompt's prefill, which the model leaves out: predictions run high by
about that share; what matters is the ranking.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench_args import budget_list, positive_int  # noqa: E402  (benchmarks/, the script's folder)
from ddtree.cost_probe import compare_budgets, predicted_choice_ratio  # noqa: E402
from ddtree.drafters import NoisyTargetDrafter  # noqa: E402
from ddtree.lossless import build_tiny_target, prompt_set  # noqa: E402


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"


def spread(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=budget_list, default=[1, 4, 16, 64, 256])
    parser.add_argument("--calibrate", type=budget_list, default=[1, 16, 256])
    parser.add_argument("--vocab", type=positive_int, default=4096)
    parser.add_argument("--tokens", type=positive_int, default=32)
    parser.add_argument("--prompts", type=positive_int, default=2)
    parser.add_argument("--runs", type=positive_int, default=3)
    args = parser.parse_args()
    if not set(args.calibrate) <= set(args.budgets) or 0 in args.budgets:
        parser.error("--calibrate must be among --budgets, and budgets must be >= 1")

    torch.set_num_threads(1)
    target = build_tiny_target(seed=0, vocab_size=args.vocab, dtype=torch.float32)
    drafter = NoisyTargetDrafter(target, block_size=8, noise=0.3)
    prompts = prompt_set(args.prompts, 12, args.vocab, seed=1)
    print(f"budget choice, {time.strftime('%Y-%m-%d')}, {load()} before; CPU time, 1 torch thread")
    runs = []
    for _ in range(args.runs):
        runs.append(compare_budgets(target, drafter, prompts, args.budgets, args.calibrate, args.tokens,
                                    clock=time.process_time))
    print(f"{'budget':>6} {'calib':>5} {'tau':>5} {'tau*':>5} | {'predicted tok/s':>23} | "
          f"{'measured tok/s':>23} | {'error':>6}")
    print(f"{'':>6} {'':>5} {'':>5} {'':>5} | {'min':>7} {'median':>7} {'max':>7} | "
          f"{'min':>7} {'median':>7} {'max':>7} |")
    for i, budget in enumerate(args.budgets):
        rows = [run[i] for run in runs]
        print(f"{budget:>6} {'yes' if rows[0].calibrated else 'no':>5} "
              f"{statistics.median(r.tau_measured for r in rows):5.2f} {statistics.median(r.tau_model for r in rows):5.2f} | "
              f"{spread([r.predicted_tokens_per_s for r in rows])} | {spread([r.measured_tokens_per_s for r in rows])} | "
              f"{statistics.median(r.error for r in rows):+6.0%}")
    for number, run in enumerate(runs, start=1):
        pick, best, ratio = predicted_choice_ratio(run)
        print(f"run {number}: model picks budget {pick.budget}, measured best {best.budget}: "
              f"the pick decodes at {ratio:.2f}x of the best")
    print(f"tau: measured in that budget's decode; tau*: what the model used (measured at calibrated budgets, "
          f"interpolated in log2(budget) elsewhere). error: median predicted / measured - 1. {load()} after.")


if __name__ == "__main__":
    main()
