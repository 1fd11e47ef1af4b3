"""How one host ended a command, and the one rule that turns the hosts' outcomes into the
command's exit code (DESIGN.md): 0 all passed, 6 partial (some passed, others did not),
4 no host could be reached, 5 a remote step or stage failed, 130 interrupted, 2 a host's
runner refused the plan as a usage error."""
from __future__ import annotations

from collections.abc import Iterable
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
