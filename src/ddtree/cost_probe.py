"""Measures the costs `ddtree.throughput_model` predicts from, on the host's own target.

Verify cost is a few target forwards of `width` tokens for `bs` requests over a prefilled
context, under an explicit 4-D mask (the kernel path a tree verify takes), not a decode.
Tau, draft cost and the round's overhead (tree build, verify inputs, commit) come from the
decode loop's own stage times at a few budgets. Every timing is the
median of `repeats` calls of `clock` (wall time by default, synchronised on CUDA; a caller
on a shared CPU passes `time.process_time`, which other processes' load does not inflate).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ddtree.decode import DecodeConfig, DecodeResult, generate_ddtree
from ddtree.drafters import Drafter
from ddtree.hf_target import HFTarget
from ddtree.kvcache import crop_cache
from ddtree.throughput_model import HostCosts, predict_ddtree, tau_curve

Clock = Callable[[], float]


def device_clock(device: torch.device) -> Clock:
    if device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    return time.perf_counter


def _median_seconds(call: Callable[[], object], repeats: int, clock: Clock) -> float:
    call()  # warm-up: kernels, allocator, lazy imports
    times = []
    for _ in range(repeats):
        began = clock()
        call()
        times.append(clock() - began)
    return statistics.median(times)


@torch.inference_mode()
def measure_verify_costs(
    target: HFTarget,
    batch_sizes: Sequence[int],
    widths: Sequence[int],
    context_len: int,
    repeats: int = 3,
    clock: Clock | None = None,
) -> dict[int, dict[int, float]]:
    """{bs: {width: seconds}} of one forward of `width` new tokens per request over a
    `context_len`-token cache, for every bs and width asked."""
    if context_len < 1 or repeats < 1 or min(batch_sizes, default=0) < 1 or min(widths, default=0) < 1:
        raise ValueError(f"context_len, repeats, batch sizes and widths must be >= 1, got "
                         f"{context_len}, {repeats}, {list(batch_sizes)}, {list(widths)}")
    clock = clock or device_clock(target.device)
    device, vocab = target.device, target.vocab_size
    generator = torch.Generator().manual_seed(0)
    costs: dict[int, dict[int, float]] = {}
    for bs in batch_sizes:
        context = torch.randint(0, vocab, (bs, context_len), generator=generator).to(device)  # [bs, ctx]
        cache = target.new_cache()
        target.model(context, use_cache=True, **{target.cache_keyword: cache})
        costs[bs] = {}
        for width in widths:
            ids = torch.randint(0, vocab, (bs, width), generator=generator).to(device)  # [bs, width]
            positions = (context_len + torch.arange(width, device=device)).expand(bs, width)  # [bs, width]
            mask = torch.zeros(bs, 1, width, context_len + width, dtype=target.dtype, device=device)
            causal = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)  # [width, width]
            mask[:, :, :, context_len:].masked_fill_(causal, torch.finfo(target.dtype).min)

            def forward() -> None:
                target.model(ids, position_ids=positions, attention_mask=mask, **{target.cache_keyword: cache},
                             use_cache=True)
                crop_cache(cache, context_len)  # every call verifies over the same committed context

            costs[bs][width] = _median_seconds(forward, repeats, clock)
    return costs


OVERHEAD_STAGES = ("tree_build", "tree_compile", "commit")  # the round's work outside the forwards


@dataclass(frozen=True)
class DecodeMeasurement:
    """One budget's decode of a prompt set, per round and per second of `clock` time."""

    tau: float  # mean accepted nodes per round, root included (= tokens committed per round)
    draft_s: float  # per round
    overhead_s: float  # per round: tree build + verify inputs + commit
    tokens_per_s: float  # output tokens over the whole calls' time (prefill included)


def round_costs(results: Sequence[DecodeResult]) -> tuple[float, float, float]:
    """(tau, draft_s, overhead_s) per decode round over the loop's results of one method."""
    rounds = max(sum(r.decode_rounds for r in results), 1)
    accepted = sum(sum(r.acceptance_lengths) for r in results)
    draft = sum(r.stage_times.get("draft", 0.0) for r in results)
    overhead = sum(r.stage_times.get(name, 0.0) for r in results for name in OVERHEAD_STAGES)
    return accepted / rounds, draft / rounds, overhead / rounds


def measure_decode(target: HFTarget, drafter: Drafter, prompts: Sequence[torch.Tensor], budget: int,
                   max_new_tokens: int, clock: Clock) -> DecodeMeasurement:
    results, seconds = [], 0.0
    for prompt in prompts:  # each [1, n] int64
        began = clock()
        results.append(generate_ddtree(target, drafter, prompt, DecodeConfig(max_new_tokens, timer=clock), budget))
        seconds += clock() - began
    tokens = sum(r.num_output_tokens for r in results)
    tau, draft, overhead = round_costs(results)
    return DecodeMeasurement(tau, draft, overhead, tokens / seconds if seconds > 0 else math.inf)


@dataclass(frozen=True)
class BudgetRow:
    """One budget of `compare_budgets`: the model's prediction beside the measured decode."""

    budget: int
    calibrated: bool  # this budget's decode fed the model (tau, draft and overhead)
    tau_measured: float
    tau_model: float
    predicted_tokens_per_s: float
    measured_tokens_per_s: float

    @property
    def error(self) -> float:
        """Prediction error relative to the measurement (0.1 = 10 % high)."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0


def compare_budgets(
    target: HFTarget,
    drafter: Drafter,
    prompts: Sequence[torch.Tensor],  # each [1, n] int64
    budgets: Sequence[int],
    calibration_budgets: Sequence[int],
    max_new_tokens: int,
    clock: Clock | None = None,
    repeats: int = 3,
) -> list[BudgetRow]:
    """Calibrate the throughput model (verify cost at every budget's width from forwards alone;
    tau, draft and round overhead from decodes at `calibration_budgets` only), predict every
    budget, and set each prediction beside a decode of `prompts` at that budget."""
    if not set(calibration_budgets) <= set(budgets):
        raise ValueError(f"calibration budgets {list(calibration_budgets)} must be among {list(budgets)}")
    clock = clock or device_clock(target.device)
    decodes = {b: measure_decode(target, drafter, prompts, b, max_new_tokens, clock) for b in budgets}
    context_len = max(int(p.shape[1]) for p in prompts) + max_new_tokens // 2
    calibration = [decodes[b] for b in calibration_budgets]
    costs = HostCosts(
        verify_s=measure_verify_costs(target, [1], [b + 1 for b in budgets], context_len, repeats, clock),
        draft_s={1: statistics.fmean(d.draft_s for d in calibration)},
        build_s={b: decodes[b].overhead_s for b in calibration_budgets},
    )
    taus = tau_curve({b: decodes[b].tau for b in calibration_budgets})
    rows = []
    for budget in budgets:
        prediction = predict_ddtree(costs, taus, budget, concurrency=1)
        rows.append(BudgetRow(budget, budget in calibration_budgets, decodes[budget].tau, prediction.tau,
                              prediction.tokens_per_s, decodes[budget].tokens_per_s))
    return rows


def predicted_choice_ratio(rows: Sequence[BudgetRow]) -> tuple[BudgetRow, BudgetRow, float]:
    """(the model's pick, the measured best, measured throughput of the pick / of the best)."""
    pick = max(rows, key=lambda r: r.predicted_tokens_per_s)
    best = max(rows, key=lambda r: r.measured_tokens_per_s)
    return pick, best, pick.measured_tokens_per_s / best.measured_tokens_per_s
