"""Predicted decode throughput of AR, DFlash and DDTree from costs measured on a host.

One speculative round for `bs` concurrent requests costs

    round_s = draft_s(bs) + build_s(budget) + verify_s(bs, width)

and commits `tau` tokens per request (accepted drafts plus the bonus), so the server emits
`bs * tau / round_s` tokens per second. The verify width is `budget + 1` for DDTree (root and
nodes), the block size for DFlash, and 1 for plain decoding (no draft, no build, tau = 1).

`verify_s` is measured at a few (bs, width) points and interpolated; `tau` is measured at a
few budgets (decode runs) and interpolated in log2(budget), flat past the last measured
budget (acceptance saturates). Pure arithmetic: no torch, so the operator side can use it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Sequence


class Method(str, Enum):
    AUTOREGRESSIVE = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"


class Curve:
    """Piecewise-linear y(x) through measured points. Between points: linear. Past the ends:
    flat (`extrapolate="flat"`) or along the nearest segment (`"linear"`, for costs that keep
    growing), never below zero."""

    def __init__(self, points: Mapping[float, float], extrapolate: str = "linear"):
        if not points:
            raise ValueError("a curve needs at least one measured point")
        for x, y in points.items():
            if not (math.isfinite(x) and math.isfinite(y)) or y < 0:
                raise ValueError(f"measured point ({x}, {y}) must be finite and >= 0")
        if extrapolate not in ("flat", "linear"):
            raise ValueError(f"extrapolate must be 'flat' or 'linear', got {extrapolate!r}")
        self.xs = sorted(float(x) for x in points)
        self.ys = [float(points[x]) for x in sorted(points)]
        self.extrapolate = extrapolate

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        if x <= xs[0] or x >= xs[-1]:
            if self.extrapolate == "flat":
                return ys[0] if x <= xs[0] else ys[-1]
            i = 0 if x <= xs[0] else len(xs) - 2
        else:
            i = bisect.bisect_right(xs, x) - 1
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class HostCosts:
    """Seconds measured on one host. `verify_s[bs][width]`: one target forward of `width`
    tokens per request for `bs` requests; `draft_s[bs]`: one drafter call for `bs` requests;
    `build_s[budget]`: the round's work outside the forwards (tree build, verify inputs, commit),
    measured per round at bs 1 and taken as it is at every bs (a batched device builder)."""

    verify_s: Mapping[int, Mapping[int, float]]
    draft_s: Mapping[int, float]
    build_s: Mapping[int, float] = field(default_factory=dict)

    def verify(self, bs: int, width: int) -> float:
        if not self.verify_s:
            raise ValueError("no verify cost measured")
        by_bs = {b: Curve(row)(width) for b, row in self.verify_s.items()}
        return Curve(by_bs)(bs)

    def draft(self, bs: int) -> float:
        if not self.draft_s:
            raise ValueError("no draft cost measured")
        return Curve(self.draft_s)(bs)

    def build(self, budget: int) -> float:
        return Curve(self.build_s)(budget) if self.build_s else 0.0


def tau_curve(measured: Mapping[int, float]) -> Curve:
    """Acceptance length per round at a budget, from the budgets measured: linear in
    log2(budget) between them, flat outside (never extrapolated upward)."""
    for budget, tau in measured.items():
        if budget < 1 or not tau >= 1.0:
            raise ValueError(f"tau at budget {budget} must be >= 1 (the bonus always commits), got {tau}")
    return Curve({math.log2(b): t for b, t in measured.items()}, extrapolate="flat")


@dataclass(frozen=True)
class Prediction:
    method: Method
    budget: int | None  # DDTree's node budget; DFlash's block size is in `width`
    concurrency: int
    width: int
    tau: float
    round_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency * self.tau / self.round_s if self.round_s > 0 else math.inf


def predict_autoregressive(costs: HostCosts, concurrency: int) -> Prediction:
    return Prediction(Method.AUTOREGRESSIVE, None, concurrency, 1, 1.0, costs.verify(concurrency, 1))


def predict_dflash(costs: HostCosts, tau: float, block_size: int, concurrency: int) -> Prediction:
    round_s = costs.draft(concurrency) + costs.verify(concurrency, block_size)
    return Prediction(Method.DFLASH, None, concurrency, block_size, tau, round_s)


def predict_ddtree(costs: HostCosts, taus: Curve, budget: int, concurrency: int) -> Prediction:
    width = budget + 1
    round_s = costs.draft(concurrency) + costs.build(budget) + costs.verify(concurrency, width)
    return Prediction(Method.DDTREE, budget, concurrency, width, taus(math.log2(budget)), round_s)


def best_ddtree_budget(costs: HostCosts, taus: Curve, budgets: Sequence[int], concurrency: int) -> Prediction:
    """The budget with the highest predicted throughput (the smaller budget on a tie)."""
    if not budgets:
        raise ValueError("no candidate budgets")
    predictions = [predict_ddtree(costs, taus, b, concurrency) for b in sorted(budgets)]
    return max(predictions, key=lambda p: p.tokens_per_s)


def budgets_between(measured: Sequence[int]) -> list[int]:
    """The measured budgets plus every power of two between the smallest and the largest."""
    if not measured:
        return []
    low, high = min(measured), max(measured)
    powers = [1 << k for k in range(high.bit_length() + 1) if low <= 1 << k <= high]
    return sorted(set(measured) | set(powers))


def prediction_rows(costs: HostCosts, measured_taus: Mapping[int, float], levels: Sequence[int],
                    dflash: tuple[float, int] | None = None) -> list[dict]:
    """Predicted throughput per concurrency level: AR, DFlash (`(tau, block_size)`) and DDTree
    at every measured budget and the powers of two between them (`tau_measured` says which)."""
    taus = tau_curve(measured_taus)
    rows = []
    for level in levels:
        predictions = [predict_autoregressive(costs, level)]
        if dflash is not None:
            predictions.append(predict_dflash(costs, dflash[0], dflash[1], level))
        predictions += [predict_ddtree(costs, taus, b, level) for b in budgets_between(list(measured_taus))]
        for p in predictions:
            rows.append({"concurrency": level, "method": p.method.value, "budget": p.budget, "width": p.width,
                         "tau": round(p.tau, 4), "tau_measured": p.budget is None or p.budget in measured_taus,
                         "round_ms": round(p.round_s * 1e3, 4), "tokens_per_s": round(p.tokens_per_s, 2)})
    return rows
