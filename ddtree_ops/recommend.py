"""Which variant to serve on a host at a concurrency level, from the `sglang_load` table.

The sglang-e2e stage drives every server (no speculation, DFlash, DFlash + DDTree at each
budget) at a few concurrency levels. Per host and level the fastest variant wins, unless the
runner-up of another kind is within `margin` of it (one measurement per cell: a smaller gap
is within run-to-run noise), or a baseline is missing: then the verdict says it cannot decide
and why, and never guesses. Among DDTree budgets within the margin of each other the smaller
budget is chosen (less memory, the same speed as far as one run can tell).

Speed is worth nothing if the output changed: a host whose sglang-e2e stage did not pass its
lossless check (every variant's tokens equal to no speculation's, near-ties aside), or whose
record lacks that check for a variant it measured under load, gets no verdict but undecided,
saying why; so does a DDTree row whose budget the plugin would refuse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Mapping

from ddtree.sglang.config import MAX_BUDGET, MIN_BUDGET
from ddtree_ops.errors import quoted
from ddtree_ops.hostside.protocol import Status
from ddtree_ops.report.model import DECODE_STAGE, SERVER_LOAD_TABLE, SERVER_STAGE, SERVER_TABLE

DEFAULT_MARGIN = 0.05  # relative: 5 % between two single measurements decides nothing


class Choice(str, Enum):
    DDTREE = "ddtree"
    DFLASH = "dflash"
    NO_SPECULATION = "no-spec"
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class Recommendation:
    host: str
    concurrency: int
    choice: Choice
    budget: int | None  # DDTree's budget when the choice is DDTree
    tokens_per_s: float | None  # of the chosen variant
    speedup_vs_no_spec: float | None
    speedup_vs_dflash: float | None
    why: str  # one sentence an operator acts on

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "concurrency": self.concurrency, "choice": self.choice.value,
                "budget": self.budget, "tokens_per_s": self.tokens_per_s,
                "speedup_vs_no_spec": self.speedup_vs_no_spec, "speedup_vs_dflash": self.speedup_vs_dflash,
                "why": self.why}


@dataclass(frozen=True)
class _Cell:
    choice: Choice
    budget: int | None
    tokens_per_s: float

    @property
    def name(self) -> str:
        return f"DDTree budget {self.budget}" if self.choice is Choice.DDTREE else {
            Choice.DFLASH: "DFlash", Choice.NO_SPECULATION: "no speculation"}[self.choice]


_MODES = {"ddtree": Choice.DDTREE, "dflash": Choice.DFLASH, "no-spec": Choice.NO_SPECULATION}


def _cells(rows: Iterable[Mapping[str, Any]]) -> list[_Cell]:
    cells = []
    for row in rows:
        choice, speed = _MODES.get(str(row.get("mode"))), row.get("tokens_per_s")
        if choice is None or isinstance(speed, bool) or not isinstance(speed, (int, float)):
            continue
        if math.isfinite(speed) and speed > 0:
            budget = row.get("budget") if choice is Choice.DDTREE else None
            cells.append(_Cell(choice, budget if isinstance(budget, int) else None, float(speed)))
    return cells


def budget_problem(value: Any) -> str:
    """'' for a budget the plugin takes, else why not, naming the value (bools are no integers)."""
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_BUDGET <= value <= MAX_BUDGET:
        return f"must be an integer between {MIN_BUDGET} and {MAX_BUDGET}, got {quoted(value)}"
    return ""


def _bad_budget(rows: Iterable[Mapping[str, Any]]) -> str:
    for row in rows:
        problem = budget_problem(row.get("budget")) if _MODES.get(str(row.get("mode"))) is Choice.DDTREE else ""
        if problem:
            return f"the {LOAD_TABLE} row of variant {quoted(row.get('variant'))} has a budget that {problem}"
    return ""


def _cpu_numbers(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Rows the sglang-e2e stage measured on SGLang's CPU engine (the CPU test server)."""
    return any(row.get("device") == "cpu" for row in rows)


def _ratio(a: _Cell | None, b: _Cell | None) -> float | None:
    return round(a.tokens_per_s / b.tokens_per_s, 3) if a and b else None


def recommend_level(host: str, concurrency: int, rows: Iterable[Mapping[str, Any]],
                    margin: float = DEFAULT_MARGIN, noisy_why: str = "", lossy_why: str = "") -> Recommendation:
    """The verdict for one host and level from that level's `sglang_load` rows; `lossy_why`
    (the lossless check failed or is missing), a budget the plugin refuses, or `noisy_why` (the
    host was busy while they were measured) makes it undecided."""
    rows = list(rows)
    cells = sorted(_cells(rows), key=lambda c: -c.tokens_per_s)
    best_of = {kind: next((c for c in cells if c.choice is kind), None) for kind in Choice}
    no_spec, dflash = best_of[Choice.NO_SPECULATION], best_of[Choice.DFLASH]

    def verdict(choice: Choice, chosen: _Cell | None, why: str) -> Recommendation:
        return Recommendation(host, concurrency, choice, chosen.budget if chosen else None,
                              chosen.tokens_per_s if chosen else None, _ratio(chosen, no_spec),
                              _ratio(chosen, dflash), why)

    if lossy_why:
        return verdict(Choice.UNDECIDED, None, f"not lossless: {lossy_why}; fix it and measure again")
    bad_budget = _bad_budget(rows)
    if bad_budget:
        return verdict(Choice.UNDECIDED, None, f"unusable measurement: {bad_budget}")
    if _cpu_numbers(rows):
        return verdict(Choice.UNDECIDED, None, "CPU numbers: measured on SGLang's CPU engine, which shows that the "
                                               "plugin serves losslessly, not what is fastest on a GPU; measure on a GPU host")
    if noisy_why:
        return verdict(Choice.UNDECIDED, None, f"too noisy to decide: {noisy_why}; measure again on a quiet host")
    missing = [name for name, cell in (("no speculation", no_spec), ("DFlash", dflash),
                                       ("any DDTree budget", best_of[Choice.DDTREE])) if cell is None]
    if missing:
        return verdict(Choice.UNDECIDED, None, f"too few points: nothing measured for {', '.join(missing)}")
    top = cells[0]
    rival = next(c for c in cells if c.choice is not top.choice)
    if top.tokens_per_s < rival.tokens_per_s * (1 + margin):
        return verdict(Choice.UNDECIDED, None,
                       f"{top.name} ({top.tokens_per_s:.1f} tokens/s) and {rival.name} ({rival.tokens_per_s:.1f}) "
                       f"are within {margin:.0%}: too close to call from one run; measure again with more requests")
    if top.choice is Choice.DDTREE:
        close = [c for c in cells if c.choice is Choice.DDTREE and c.tokens_per_s * (1 + margin) >= top.tokens_per_s]
        chosen = min(close, key=lambda c: c.budget if c.budget is not None else math.inf)
        tie = "" if chosen is top else f" (budget {top.budget} is within {margin:.0%}; the smaller budget uses less memory)"
        return verdict(Choice.DDTREE, chosen,
                       f"deploy DDTree with budget {chosen.budget}: {_ratio(chosen, no_spec)}x no speculation, "
                       f"{_ratio(chosen, dflash)}x DFlash{tie}")
    if top.choice is Choice.DFLASH:
        return verdict(Choice.DFLASH, top, f"DDTree does not pay at {concurrency} concurrent requests: deploy DFlash "
                                           f"({_ratio(top, no_spec)}x no speculation)")
    return verdict(Choice.NO_SPECULATION, top, f"speculation does not pay at {concurrency} concurrent requests: "
                                               f"deploy neither DFlash nor DDTree")


def recommend(load_rows: Iterable[Mapping[str, Any]], margin: float = DEFAULT_MARGIN,
              noisy_hosts: Mapping[str, str] | None = None,
              lossy_hosts: Mapping[str, str] | None = None) -> list[Recommendation]:
    """A verdict per (host, concurrency) present in `load_rows` (each row carries `host`);
    `noisy_hosts`: host -> why its measurements cannot be trusted; `lossy_hosts`: host -> why
    its output is not known to equal no speculation's."""
    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for row in load_rows:
        level = row.get("concurrency")
        if isinstance(level, int) and not isinstance(level, bool):
            groups.setdefault((str(row.get("host")), level), []).append(row)
    noisy_hosts, lossy_hosts = noisy_hosts or {}, lossy_hosts or {}
    return [recommend_level(host, level, rows, margin, noisy_hosts.get(host, ""), lossy_hosts.get(host, ""))
            for (host, level), rows in sorted(groups.items())]


# ----------------------------------------------------------------------------- from a run

LOAD_STAGE, LOAD_TABLE, LOSSLESS_TABLE = SERVER_STAGE, SERVER_LOAD_TABLE, SERVER_TABLE
PREDICTION_STAGE, PREDICTION_TABLE = DECODE_STAGE, "predictions"
_PREDICTED_METHOD = {"no-spec": "ar", "dflash": "dflash", "ddtree": "ddtree"}  # sglang mode -> model method


def _stage_rows(run: Any, stage: str, table: str) -> list[dict[str, Any]]:
    rows = []
    for host, record in run.hosts.items():
        found = record.stages.get(stage)
        for row in (found.tables.get(table, []) if found is not None else []):
            if isinstance(row, Mapping):
                rows.append({**row, "host": host})
    return rows


def lossless_problem(stage: Any) -> str:
    """'' when an sglang-e2e stage record passed and holds a lossless check (its `sglang_e2e`
    row, no divergence beyond near-ties) for every speculative variant it measured under load;
    else what failed or is missing."""
    if stage is None:
        return f"no {LOAD_STAGE} stage in this run"
    if stage.status is not Status.PASS:
        reason = " ".join(str(stage.reason or "no reason given").split())  # one line, however the host wrote it
        return f"the {LOAD_STAGE} stage did not pass ({stage.status.value}: {reason[:240]})"
    checks = {str(r.get("variant")): r for r in stage.tables.get(LOSSLESS_TABLE, []) if isinstance(r, Mapping)}
    for row in stage.tables.get(LOAD_TABLE, []):
        if not isinstance(row, Mapping) or _MODES.get(str(row.get("mode"))) is Choice.NO_SPECULATION:
            continue  # no speculation is the reference the others are checked against
        name = str(row.get("variant"))
        check = checks.get(name)
        if check is None:
            return f"no lossless check ({LOSSLESS_TABLE} row) for variant {quoted(name)}"
        diverged, ties = check.get("divergent_prompts"), check.get("near_ties")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (diverged, ties)) or diverged != ties:
            return (f"variant {quoted(name)}: its lossless check failed or is unreadable "
                    f"(divergent_prompts={quoted(diverged)}, near_ties={quoted(ties)})")
    return ""


def run_recommendations(run: Any, margin: float = DEFAULT_MARGIN) -> list[Recommendation]:
    """Verdicts from a run's sglang-e2e load tables, undecided on a host whose lossless check
    did not pass or that was busy then."""
    from ddtree_ops.noise import load_problem

    noisy, lossy = {}, {}
    for host, record in run.hosts.items():
        found = record.stages.get(LOAD_STAGE)
        if found is None:
            continue
        noisy[host], lossy[host] = load_problem(found.load), lossless_problem(found)
    return recommend(_stage_rows(run, LOAD_STAGE, LOAD_TABLE), margin, noisy, lossy)


def _cell_key(*values: Any) -> tuple[Any, ...]:
    """A table cell's key; a value a host wrote as a list or an object (no level, no budget)
    stands for itself as text, so that it matches nothing measured and breaks no lookup."""
    return tuple(v if isinstance(v, (str, int, float, type(None))) else f"<{type(v).__name__}>" for v in values)


def predicted_vs_measured(run: Any) -> list[dict[str, Any]]:
    """Where decode-bench predicted a cell that sglang-e2e measured (same host, level, method
    and budget): both throughputs and the prediction's error relative to the measurement."""
    predicted = {_cell_key(r["host"], r.get("concurrency"), r.get("method"), r.get("budget")): r
                 for r in _stage_rows(run, PREDICTION_STAGE, PREDICTION_TABLE)}
    rows = []
    for measured in _stage_rows(run, LOAD_STAGE, LOAD_TABLE):
        method = _PREDICTED_METHOD.get(str(measured.get("mode")))
        budget = measured.get("budget") if method == "ddtree" else None
        match = predicted.get(_cell_key(measured["host"], measured.get("concurrency"), method, budget))
        speed, guess = measured.get("tokens_per_s"), match.get("tokens_per_s") if match else None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                   for v in (speed, guess)):
            continue
        rows.append({"host": measured["host"], "concurrency": measured.get("concurrency"),
                     "variant": measured.get("variant"), "predicted_tokens_per_s": guess,
                     "measured_tokens_per_s": speed, "error": round(guess / speed - 1.0, 4)})
    return rows
