"""`deploy --budget`: the plugin's server defaults (DDTREE_ENABLE, DDTREE_BUDGET) a deploy writes.

`auto` takes them from the host's latest recommendation at the concurrency level the operator
serves (`--for-concurrency`): the newest run in the local run store (in the order the store
created its runs: a clock set ahead or a hand-named copy cannot make an old run the newest)
whose record for that host has sglang-e2e load rows at that level. DDTree chosen: enabled with its budget; DFlash or no
speculation chosen: deployed disabled. Undecided, or no such run: refused before any host is
touched (exit 3), naming the smoke run that would decide it: so is a run whose lossless
check failed or is missing (`recommend.lossless_problem`), and a budget outside what the
plugin takes (`recommend.budget_problem`), whether given or read from a run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddtree.sglang.config import ENV_BUDGET, ENV_ENABLE
from ddtree_ops.errors import ConfigError, UsageError
from ddtree_ops.recommend import LOAD_STAGE, LOAD_TABLE, Choice, Recommendation, budget_problem, run_recommendations

AUTO = "auto"


@dataclass(frozen=True)
class ServerDefaults:
    variables: dict[str, str]
    provenance: dict[str, Any]
    note: str  # one line for the deploy output

    def to_payload(self) -> dict[str, Any]:
        """What the installer writes into the payload (and echoes back once applied)."""
        return {"variables": dict(self.variables), "provenance": dict(self.provenance)}


def parse_budget_option(budget: Optional[str], for_concurrency: Optional[int]) -> Optional[int | str]:
    """--budget as AUTO or an int (None: not given); usage errors say which option is wrong."""
    if budget is None:
        if for_concurrency is not None:
            raise UsageError("--for-concurrency: only with --budget auto")
        return None
    if budget.strip().lower() == AUTO:
        if for_concurrency is None or for_concurrency < 1:
            raise UsageError("--budget auto: needs --for-concurrency N (N >= 1), the load the host serves")
        return AUTO
    if for_concurrency is not None:
        raise UsageError("--for-concurrency: only with --budget auto")
    try:
        value = int(budget.strip(), 10)
    except ValueError:
        raise UsageError(f"--budget: expected auto or an integer, got {budget!r}") from None
    problem = budget_problem(value)
    if problem:
        raise UsageError(f"--budget: {problem}")
    return value


def explicit_defaults(budget: int) -> ServerDefaults:
    return ServerDefaults({ENV_ENABLE: "1", ENV_BUDGET: str(budget)}, {"source": "--budget"},
                          f"DDTree enabled, budget {budget} (--budget)")


def latest_recommendation(runs_root: Path, host: str, level: int,
                          left_out: list[str] | None = None) -> tuple[str, Recommendation] | None:
    """(run id, verdict) from the newest run (RunStore.runs_newest_first: the order the store
    created them in, not their names) whose record for `host` has load rows at `level`.
    `left_out` collects the runs not considered, each with why: one dated in the future, or
    one whose record cannot be read (it decides nothing and hides no other run)."""
    from ddtree_ops.results import RunStore

    store = RunStore(runs_root)
    runs, skipped = store.runs_newest_first()
    if left_out is not None:
        left_out.extend(skipped)
    for run_id in runs:
        try:
            run = store.load(run_id)
        except ConfigError as err:
            if left_out is not None:
                left_out.append(str(err))
            continue
        record = run.hosts.get(host)
        stage = record.stages.get(LOAD_STAGE) if record is not None else None
        rows = stage.tables.get(LOAD_TABLE, []) if stage is not None else []
        if any(isinstance(r, dict) and r.get("concurrency") == level for r in rows):
            found = [r for r in run_recommendations(run) if r.host == host and r.concurrency == level]
            if found:
                return run_id, found[0]
    return None


def auto_defaults(runs_root: Path, host: str, level: int) -> ServerDefaults:
    """The host's server defaults at `level`, or ConfigError naming what to run."""
    measure = f"`ddtree-ops smoke -H {host} --stages sglang-e2e --set sglang_concurrency={level}`"
    left_out: list[str] = []
    found = latest_recommendation(runs_root, host, level, left_out)
    if found is None:
        why = f" (left out: {'; '.join(left_out[:3])})" if left_out else ""
        raise ConfigError(f"{host}: --budget auto: no sglang-e2e measurement at {level} concurrent under "
                          f"{runs_root}{why}; run {measure} first")
    run_id, verdict = found
    if verdict.choice is Choice.UNDECIDED:
        raise ConfigError(f"{host}: --budget auto: run {run_id} cannot decide at {level} concurrent "
                          f"({verdict.why}); run {measure} again, or pass --budget N")
    problem = budget_problem(verdict.budget) if verdict.choice is Choice.DDTREE else ""
    if problem:  # recommend refuses such a row already; what is written to a host is checked here too
        raise ConfigError(f"{host}: --budget auto: run {run_id}: the recommended budget {problem}")
    provenance = {"source": "--budget auto", "run": run_id, "concurrency": level, "choice": verdict.choice.value}
    passed_over = f" (passed over {len(left_out)} run(s): {left_out[0]})" if left_out else ""
    if left_out:
        provenance["passed_over"] = left_out
    if verdict.choice is Choice.DDTREE:
        return ServerDefaults({ENV_ENABLE: "1", ENV_BUDGET: str(verdict.budget)}, provenance,
                              f"DDTree enabled, budget {verdict.budget} (run {run_id}, {level} concurrent){passed_over}")
    return ServerDefaults({ENV_ENABLE: "0"}, provenance,
                          f"DDTree does not pay at {level} concurrent on {host}: deployed disabled (run {run_id})"
                          f"{passed_over}")
