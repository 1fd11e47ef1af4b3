"""The throughput model: its arithmetic on hand-computed cases, its refusals, and, on a small
CPU target, that the budget it predicts best decodes within 10 % of the best budget measured."""
from __future__ import annotations

import math

import pytest
import torch

from ddtree.throughput_model import (
    Curve,
    HostCosts,
    Method,
    best_ddtree_budget,
    predict_autoregressive,
    predict_ddtree,
    predict_dflash,
    tau_curve,
)


def test_curve_interpolates_between_points_and_extrapolates_as_told():
    line = Curve({1: 1.0, 3: 5.0})
    assert line(2) == 3.0 and line(5) == 9.0 and line(0) == 0.0  # linear past both ends, never < 0
    assert Curve({1: 1.0, 3: 5.0}, extrapolate="flat")(7) == 5.0
    assert Curve({4: 2.5})(100) == 2.5  # one point: a constant


@pytest.mark.parametrize("points", [{}, {1: float("nan")}, {1: -1.0}, {float("inf"): 1.0}])
def test_curve_refuses_what_was_not_measured(points):
    with pytest.raises(ValueError):
        Curve(points)


def test_tau_is_linear_in_log_budget_and_never_extrapolated_upward():
    taus = tau_curve({4: 2.0, 16: 3.0})
    assert taus(math.log2(8)) == pytest.approx(2.5)
    assert taus(math.log2(1024)) == 3.0 and taus(0.0) == 2.0
    with pytest.raises(ValueError, match="tau at budget 8"):
        tau_curve({8: 0.5})


COSTS = HostCosts(
    verify_s={1: {1: 0.010, 9: 0.012, 65: 0.015}, 8: {1: 0.020, 9: 0.040, 65: 0.200}},
    draft_s={1: 0.005, 8: 0.008},
    build_s={8: 0.001, 64: 0.004},
)


def test_predictions_follow_the_round_cost_formula():
    ar = predict_autoregressive(COSTS, 1)
    assert (ar.method, ar.width, ar.tau, ar.tokens_per_s) == (Method.AUTOREGRESSIVE, 1, 1.0, pytest.approx(100.0))
    dflash = predict_dflash(COSTS, tau=3.0, block_size=9, concurrency=8)
    assert dflash.round_s == pytest.approx(0.008 + 0.040)
    assert dflash.tokens_per_s == pytest.approx(8 * 3.0 / 0.048)
    taus = tau_curve({8: 3.0, 64: 4.5})
    tree = predict_ddtree(COSTS, taus, budget=64, concurrency=1)
    assert tree.width == 65 and tree.tau == 4.5
    assert tree.round_s == pytest.approx(0.005 + 0.004 + 0.015)
    between = predict_ddtree(COSTS, taus, budget=32, concurrency=4)  # bs and width both interpolated
    verify_bs1 = 0.012 + (0.015 - 0.012) * (33 - 9) / (65 - 9)
    verify_bs8 = 0.040 + (0.200 - 0.040) * (33 - 9) / (65 - 9)
    verify = verify_bs1 + (verify_bs8 - verify_bs1) * 3 / 7
    draft = 0.005 + 0.003 * 3 / 7
    build = 0.001 + 0.003 * 24 / 56
    assert between.round_s == pytest.approx(draft + build + verify)
    assert between.tau == pytest.approx(4.0)


def test_the_best_budget_moves_down_as_concurrency_makes_wide_verifies_dear():
    taus = tau_curve({8: 3.0, 64: 4.5})
    assert best_ddtree_budget(COSTS, taus, [8, 64], concurrency=1).budget == 64
    assert best_ddtree_budget(COSTS, taus, [8, 64], concurrency=8).budget == 8
    with pytest.raises(ValueError):
        best_ddtree_budget(COSTS, taus, [], concurrency=1)


class ForwardWorkClock:
    """A clock that advances only with the target's forwards: a fixed cost per call (as a
    kernel launch) plus one unit per token processed. The decode loop's real forwards,
    widths and acceptances set what it reads, never the host's load, so a test that compares
    the model with decodes is deterministic (wall-clock comparisons live in
    benchmarks/budget_choice.py)."""

    PER_CALL = 32.0

    def __init__(self, model: torch.nn.Module):
        self.now = 0.0
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]  # [bs, n]
        self.now += self.PER_CALL + ids.numel()

    def __call__(self) -> float:
        return self.now


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_the_predicted_best_budget_decodes_within_10_percent_of_the_measured_best():
    """One run on a small random target: verify costs from forwards alone, tau / draft / round
    overhead from decodes at three of five budgets; every budget is then decoded for real.
    Costs are read from `ForwardWorkClock`, so what is compared is the model against the
    decode loop, not against the noise of a shared machine."""
    pytest.importorskip("transformers")
    from ddtree.cost_probe import compare_budgets, predicted_choice_ratio
    from ddtree.drafters import NoisyTargetDrafter
    from ddtree.lossless import build_tiny_target, prompt_set

    target = build_tiny_target(seed=0, vocab_size=4096, dtype=torch.float32)
    drafter = NoisyTargetDrafter(target, block_size=8, noise=0.3)
    clock = ForwardWorkClock(target.model)
    rows = compare_budgets(target, drafter, prompt_set(2, 12, 4096, seed=1), budgets=[1, 4, 16, 64, 256],
                           calibration_budgets=[1, 16, 256], max_new_tokens=32, clock=clock)
    pick, best, ratio = predicted_choice_ratio(rows)
    table = ", ".join(f"{r.budget}: predicted {r.predicted_tokens_per_s:.4f} measured {r.measured_tokens_per_s:.4f}"
                      for r in rows)
    assert clock() > 0 and len({r.budget for r in rows}) == 5
    assert ratio >= 0.9, f"predicted best {pick.budget} decodes at {ratio:.2f}x of measured best {best.budget} ({table})"
    # the model leaves the prefill out, so it runs a little high; never far off either way
    assert all(abs(r.error) <= 0.15 for r in rows), table
    assert all(r.tau_model == r.tau_measured for r in rows if r.calibrated), table


def test_prediction_rows_cover_the_budgets_between_the_measured_ones_and_say_which_were_measured():
    from ddtree.throughput_model import budgets_between, prediction_rows

    assert budgets_between([16, 100]) == [16, 32, 64, 100] and budgets_between([]) == []
    table = prediction_rows(COSTS, {8: 3.0, 64: 4.5}, levels=[1, 8], dflash=(2.5, 9))
    assert [(r["concurrency"], r["method"], r["budget"]) for r in table[:5]] == [
        (1, "ar", None), (1, "dflash", None), (1, "ddtree", 8), (1, "ddtree", 16), (1, "ddtree", 32)]
    assert len(table) == 2 * 6
    by = {(r["concurrency"], r["method"], r["budget"]): r for r in table}
    assert by[(1, "ddtree", 16)]["tau_measured"] is False and by[(8, "ddtree", 64)]["tau_measured"] is True
    assert by[(8, "dflash", None)]["tokens_per_s"] == pytest.approx(8 * 2.5 / 0.048, abs=0.01)
    assert by[(1, "ddtree", 64)]["round_ms"] == pytest.approx(24.0)
