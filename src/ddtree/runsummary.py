"""Per-method summaries of decode records: ours (`DecodeResult`) and the reference's run files.

A record is anything with the reference's attributes (`acceptance_lengths`,
`time_per_output_token`, `output_ids`, `num_input_tokens`); the reference stores
`types.SimpleNamespace` objects, we store `DecodeResult`. The formulas are the reference's
(`make_latex_table.py`): tau = mean over requests of the per-request mean acceptance length;
speedup = mean AR time per output token / mean method time per output token.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Any, Mapping, Sequence

from ddtree.decode import DDTREE_KEY_PREFIX, DecodeMethod
from ddtree.metrics import acceptance_histogram, mean_acceptance_length

AUTOREGRESSIVE_KEY = DecodeMethod.AUTOREGRESSIVE.value  # "baseline"


def budget_of(method: str) -> int | None:
    """`ddtree_tb64` -> 64; None for the other method keys."""
    digits = method.removeprefix(DDTREE_KEY_PREFIX)
    if digits != method and digits.isdigit():
        return int(digits)
    return None


def tau(records: Sequence[Any]) -> float:
    """The paper's tau; 0.0 when no request had a round (e.g. a stop token at prefill)."""
    lengths = [list(r.acceptance_lengths) for r in records]
    return mean_acceptance_length(lengths) if any(lengths) else 0.0


def histogram_fractions(records: Sequence[Any]) -> dict[int, float]:
    """Fraction of all rounds (over all requests) with each acceptance length 1..max."""
    counts = acceptance_histogram([list(r.acceptance_lengths) for r in records])
    total = sum(counts.values())
    return {length: n / total for length, n in counts.items()} if total else {}


def mean_time_per_output_token(records: Sequence[Any]) -> float:
    return float(mean(float(r.time_per_output_token) for r in records))


def new_tokens(record: Any) -> list[int]:
    ids = record.output_ids  # [1, n] int64 in both ours and the reference's records
    row = ids[0] if ids.dim() == 2 else ids
    return [int(t) for t in row[int(record.num_input_tokens):].tolist()]


def identical_fraction(records: Sequence[Any], reference: Sequence[Any]) -> float:
    """Share of requests whose new tokens equal the autoregressive ones."""
    if len(records) != len(reference):
        raise ValueError(f"cannot compare {len(records)} requests with {len(reference)} autoregressive ones")
    same = sum(new_tokens(a) == new_tokens(b) for a, b in zip(records, reference))
    return same / len(records) if records else 1.0


@dataclass
class MethodSummary:
    """One (dataset, model, temperature, method) cell: what baselines and decode-bench store."""

    dataset: str
    model: str
    temperature: float
    method: str  # "baseline", "dflash", "ddtree_tb<B>", or the paper's "ddtree_best"
    budget: int | None
    tau: float
    speedup: float | None
    time_per_output_token: float | None  # seconds
    histogram: dict[int, float]  # acceptance length -> fraction of rounds
    requests: int | None
    identical_to_ar: float | None  # share of requests token-identical to AR (T=0 only)
    stage_split: dict[str, float] | None = None  # stage -> share of summed stage time
    source: str = ""

    @property
    def key(self) -> tuple[str, str, float, str]:
        return (self.dataset, self.model, round(float(self.temperature), 6), self.method)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["histogram"] = {str(k): v for k, v in self.histogram.items()}
        return data

    def check(self) -> None:
        """ValueError naming the field for a value a baseline file or decode-bench record must
        not hold (NaN, inf, a negative count): what `from_dict` would refuse on reading it."""
        MethodSummary.from_dict(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> "MethodSummary":
        """A summary from plain JSON (a baseline file, a decode-bench record). Raises
        ValueError naming the field and the value for anything the file should not hold:
        a comparison must never meet a string where it expects a number."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELD_KINDS))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field")
        missing = [name for name in _REQUIRED_FIELDS if name not in data]
        if missing:
            raise ValueError(f"{missing[0]}: required field is missing")
        values = {name: _checked(name, kind, data[name]) for name, kind in _FIELD_KINDS.items() if name in data}
        return cls(**values)


# MethodSummary's fields as JSON holds them: "text", "number", "count", "histogram", "shares";
# a trailing "?" allows null.
_FIELD_KINDS = {
    "dataset": "text", "model": "text", "temperature": "number", "method": "text", "budget": "count?",
    "tau": "number", "speedup": "number?", "time_per_output_token": "number?", "histogram": "histogram",
    "requests": "count?", "identical_to_ar": "number?", "stage_split": "shares?", "source": "text",
}
_REQUIRED_FIELDS = ("dataset", "model", "temperature", "method", "budget", "tau", "speedup",
                    "time_per_output_token", "histogram", "requests", "identical_to_ar")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _checked(name: str, kind: str, value: Any) -> Any:
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind == "text" and isinstance(value, str):
        return value
    if kind == "number" and _is_number(value):
        return float(value)
    if kind == "count" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if kind == "histogram" and isinstance(value, Mapping):
        if all(str(k).isdigit() and _is_number(v) for k, v in value.items()):
            return {int(k): float(v) for k, v in value.items()}
    if kind == "shares" and isinstance(value, Mapping):
        if all(isinstance(k, str) and _is_number(v) for k, v in value.items()):
            return {k: float(v) for k, v in value.items()}
    expected = {
        "text": "a string", "number": "a finite number", "count": "a whole number >= 0",
        "histogram": "an object of acceptance length -> finite number",
        "shares": "an object of stage -> finite number",
    }[kind]
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise ValueError(f"{name}: expected {expected}, got {shown}")


def stage_split(records: Sequence[Any]) -> dict[str, float]:
    totals: Counter[str] = Counter()
    for r in records:
        for stage, seconds in dict(r.stage_times).items():
            totals[stage] += float(seconds)
    whole = sum(totals.values())
    return {stage: (seconds / whole if whole else 0.0) for stage, seconds in totals.items()}


def summarize_methods(
    records_by_method: Mapping[str, Sequence[Any]],
    dataset: str,
    model: str,
    temperature: float,
    source: str = "",
) -> list[MethodSummary]:
    """One summary per method key; speedup and token identity relative to `baseline` if present."""
    reference = records_by_method.get(AUTOREGRESSIVE_KEY)
    ar_tpot = mean_time_per_output_token(reference) if reference else None
    summaries = []
    for method, records in records_by_method.items():
        tpot = mean_time_per_output_token(records)
        identical = None
        if reference is not None and float(temperature) == 0.0:
            identical = identical_fraction(records, reference)
        summaries.append(MethodSummary(
            dataset=dataset, model=model, temperature=float(temperature), method=method,
            budget=budget_of(method), tau=tau(records),
            speedup=(ar_tpot / tpot) if ar_tpot is not None and tpot > 0 else None,
            time_per_output_token=tpot, histogram=histogram_fractions(records),
            requests=len(records), identical_to_ar=identical, stage_split=stage_split(records),
            source=source,
        ))
    return summaries
