"""The server's acceptance held against the offline numbers, per host, method and budget.

The sglang-e2e stage's acceptance length (accepted tokens per verify round, from SGLang's
per-request histograms) stands beside:
1. the offline loop with the same method, budget and block on the same prompts, following the
   server's own tokens (the stage's own check, `ddtree_ops.hostside.acceptance`);
2. the same host's decode-bench tau in the same run (same method key; a budget served with a
   shorter draft block than decode-bench's is not compared with it);
3. a decode baseline's cell (`report --baseline FILE`, e.g. from `baseline import`), matched by
   dataset, model, temperature and method (`--baseline-dataset` / `--baseline-model` alias them).
A server acceptance below any of them by more than the tolerance is a regression (exit 5): a
server that stays lossless but accepts less than the same models accept offline (a drafting
bug, a drafter/target mismatch). Above is no loss and not judged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree_ops.report.model import SERVER_STAGE, Report, as_number, on_host


@dataclass(frozen=True)
class ServerCheck:
    """One server acceptance against one offline number."""

    host: str
    method: str
    budget: int | None
    server: float
    offline: float
    source: str  # where the offline number comes from, as a person reads it
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.server >= self.offline - self.tolerance

    @property
    def verdict(self) -> str:
        return "ok" if self.ok else "regression"

    @property
    def metric(self) -> str:
        return f"{SERVER_STAGE}.acceptance.{self.method}"

    def line(self) -> str:
        budget = "" if self.budget is None else f" (budget {self.budget})"
        relation = "within" if self.ok else "below"
        return (f"{self.metric}{budget}{on_host(self.host)}: server acceptance length {self.server:.3f}, "
                f"{self.source} {self.offline:.3f} ({self.server - self.offline:+.3f}, {relation} the "
                f"tolerance {self.tolerance:g})")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "host": self.host, "method": self.method, "budget": self.budget,
                "server": self.server, "offline": self.offline, "source": self.source,
                "tolerance": self.tolerance, "ok": self.ok, "verdict": self.verdict}


@dataclass(frozen=True)
class MismatchCheck:
    """The stage's per-request verdicts: requests whose acceptance differed from the offline
    loop's with no near-tie to explain it (ddtree_ops.hostside.acceptance), whatever the means say."""

    host: str
    method: str
    budget: int | None
    mismatched: int
    requests: int
    server: float | None
    offline: float | None

    ok = False
    verdict = "regression"

    @property
    def metric(self) -> str:
        return f"{SERVER_STAGE}.acceptance.{self.method}"

    def line(self) -> str:
        budget = "" if self.budget is None else f" (budget {self.budget})"
        means = "" if self.server is None or self.offline is None else \
            f" (server acceptance length {self.server:.3f}, the offline loop's {self.offline:.3f})"
        return (f"{self.metric}{budget}{on_host(self.host)}: {self.mismatched} of {self.requests} request(s) "
                f"accepted otherwise than the offline loop on the same prompt, with no near-tie to explain it{means}")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "host": self.host, "method": self.method, "budget": self.budget,
                "mismatched": self.mismatched, "requests": self.requests, "server": self.server,
                "offline": self.offline, "ok": False, "verdict": self.verdict}


@dataclass
class ServerComparison:
    tolerance: float
    rows: list[dict[str, Any]]  # one per host and speculative variant, the numbers side by side
    checks: list[ServerCheck | MismatchCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[ServerCheck | MismatchCheck]:
        return [c for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "rows": self.rows, "checks": [c.to_dict() for c in self.checks],
                "notes": self.notes, "regressions": len(self.regressions)}


def _decode_tau(report: Report, host: str, method: str) -> float | None:
    for row in report.decode:
        if row["host"] == host and row.get("method") == method:
            return as_number(row.get("tau"))
    return None


def _baseline_cell(baseline: Any, row: dict[str, Any], dataset: str | None, model: str | None) -> Any:
    if baseline is None:
        return None
    key = (dataset or str(row.get("dataset")), model or str(row.get("model")),
           float(as_number(row.get("temperature")) or 0.0), str(row.get("method")))
    return baseline.index().get(key)


def compare_server(report: Report, tolerance: float, baseline: Any = None, dataset: str | None = None,
                   model: str | None = None) -> ServerComparison:
    """Every host's sglang-e2e speculative rows against the offline numbers the run (and a
    decode baseline, when given) holds for the same method and budget."""
    comparison = ServerComparison(tolerance=tolerance, rows=[])
    for row in report.server:
        method, server = row.get("method"), as_number(row.get("acceptance_length"))
        if not method or server is None:
            continue
        host, budget = row["host"], row.get("budget")
        shorter = row.get("block_size") is not None  # served with a shorter draft block than its own
        cell = None if shorter else _baseline_cell(baseline, row, dataset, model)
        offline = {
            "the offline loop on the server's text": as_number(row.get("offline_acceptance_length")),
            "decode-bench tau": None if shorter else _decode_tau(report, host, method),
            f"baseline {getattr(cell, 'dataset', '')} · {getattr(cell, 'model', '')} tau": None if cell is None else cell.tau,
        }
        mismatched = as_number(row.get("acceptance_mismatch")) or 0
        if mismatched:
            requests = sum(int(as_number(row.get(k)) or 0)
                           for k in ("acceptance_equal", "acceptance_near_tie", "acceptance_mismatch"))
            comparison.checks.append(MismatchCheck(host, method, budget, int(mismatched), requests, server,
                                                   offline["the offline loop on the server's text"]))
        for source, value in offline.items():
            if value is not None:
                comparison.checks.append(ServerCheck(host, method, budget, server, value, source, tolerance))
        if shorter and (_decode_tau(report, host, method) is not None or baseline is not None):
            comparison.notes.append(f"{host}: {method} was served with a draft block of {row['block_size']} "
                                    f"(budget + 1): held against the stage's offline loop only")
        judged = [c for c in comparison.checks if c.host == host and c.method == method]
        comparison.rows.append({
            "host": host, "variant": row.get("variant"), "method": method, "budget": budget,
            "block_size": row.get("block_size"), "device": row.get("device"), "acceptance_length": server,
            "offline_acceptance_length": offline["the offline loop on the server's text"],
            "decode_bench_tau": offline["decode-bench tau"],
            "baseline_tau": None if cell is None else cell.tau,
            "baseline_cell": None if cell is None else f"{cell.dataset} · {cell.model} · T={cell.temperature:g}",
            "acceptance_equal": row.get("acceptance_equal"), "acceptance_near_tie": row.get("acceptance_near_tie"),
            "acceptance_mismatch": row.get("acceptance_mismatch"),
            "acceptance_histogram": row.get("acceptance_histogram"),
            "offline_acceptance_histogram": row.get("offline_acceptance_histogram"),
            "histogram_distance": row.get("histogram_distance"),
            "verdict": None if not judged else "ok" if all(c.ok for c in judged) else "regression",
        })
    if baseline is not None and report.server and not any("baseline" in c.source for c in comparison.checks):
        comparison.notes.append("no sglang-e2e row matched a cell of the baseline (name one with "
                                "--baseline-dataset / --baseline-model)")
    return comparison

