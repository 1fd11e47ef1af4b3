"""How one host ended a command, and the one rule that turns the hosts' outcomes into the
command's exit code (DESIGN.md): 0 all passed, 6 partial (some passed, others did not),
4 no host could be reached, 5 a remote step or stage failed, 130 interrupted, 2 a host's
runner refused the plan as a usage error."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ddtree_ops.errors import ExitCode


class HostOutcome(str, Enum):
    PASS = "pass"  # every step (stage) passed or skipped
    FAIL = "fail"  # the host answered and a step failed
    LOST = "lost"  # the host stopped answering mid-run: partial results
    UNREACHABLE = "unreachable"  # never started (connect, push or runner start failed)
    HOST_KEY_REFUSED = "host key refused"  # never started: the host's key is not the known one
    INTERRUPTED = "interrupted"  # stopped by the operator
    NOT_STARTED = "not_started"  # never tried (a stopped rollout, --fail-fast)
    PENDING = "pending"  # no outcome recorded yet (run in progress)
    REFUSED = "refused"  # the host's runner refused the plan (unknown stage or option): usage


def exit_code_for(outcomes: Iterable[HostOutcome]) -> ExitCode:
    outcomes = list(outcomes)
    if HostOutcome.INTERRUPTED in outcomes:
        return ExitCode.INTERRUPTED
    if HostOutcome.REFUSED in outcomes:
        return ExitCode.USAGE
    passed = sum(o is HostOutcome.PASS for o in outcomes)
    if passed == len(outcomes):
        return ExitCode.OK
    if passed:
        return ExitCode.PARTIAL
    never_connected = (HostOutcome.UNREACHABLE, HostOutcome.HOST_KEY_REFUSED)
    if any(o in never_connected for o in outcomes) and \
            all(o in never_connected or o is HostOutcome.NOT_STARTED for o in outcomes):
        return ExitCode.CONNECT
    return ExitCode.REMOTE


# The stage statuses (hostside/protocol.py Status values) a finished host may end a stage in and
# still pass; anything else (fail, not_run, missing, a value no runner sends) fails it.
PASSING_STAGE_STATUSES = frozenset({"pass", "skip"})


# A run_end that says the plan never ran to its end (stopped by the operator, or refused by the
# runner as a usage error): never a pass, so taken as the host says; its unreported stages are
# not run, not missing.
STOPPED_RUN_ENDS = {"interrupted": HostOutcome.INTERRUPTED, "error": HostOutcome.REFUSED}


@dataclass(frozen=True)
class Verdict:
    outcome: HostOutcome
    disagreements: tuple[str, ...] = ()  # which of the host's records contradicted the verdict, and how


def judge_finished_host(asked: list[str], planned: list[str], ended: dict[str, str],
                        run_end_status: object) -> Verdict:
    """The outcome of a host whose runner sent its run_end, from the stages the operator asked
    for (`asked`; the host's own run_start list when the operator could not know it) and the
    stage_end records that came back (`ended`: stage -> status). The host's run_end and
    run_start are its word, never the verdict: they may only make the outcome worse (a fail, an
    interruption, a refusal), and where they claim more than the stage records show, the verdict
    says so. A stage asked for and never reported is `missing`; it fails the host."""
    if run_end_status in STOPPED_RUN_ENDS:
        return Verdict(STOPPED_RUN_ENDS[run_end_status])  # type: ignore[index]
    wanted = asked or planned
    statuses = {stage: ended.get(stage, "missing") for stage in wanted}
    statuses.update({s: v for s, v in ended.items() if s not in statuses})  # unasked but reported: counted too
    bad = {s: v for s, v in statuses.items() if v not in PASSING_STAGE_STATUSES}
    said: list[str] = []
    if asked and planned != asked:
        said.append(f"run_start listed {_names(planned)}, but {_names(asked)} were asked for")
    if bad and run_end_status == "pass":
        said.append("run_end says pass, but " + ", ".join(f"{s} is {v}" for s, v in bad.items()))
    if not bad and run_end_status != "pass":
        said.append(f"run_end says {run_end_status!r:.40} while every stage passed: kept as a fail")
    if not statuses:  # nothing asked, nothing reported: no stage passed, so neither did the host
        said.append("run_end came with no stage at all")
    passed = bool(statuses) and not bad and run_end_status == "pass"
    outcome = HostOutcome.PASS if passed else HostOutcome.FAIL
    return Verdict(outcome, tuple(said))


def _names(stages: list[str]) -> str:
    return ",".join(stages) if stages else "no stages"
