"""Run one task per host in a bounded pool, with per-host deadlines and a per-host result map.

Unlike Fabric's ThreadingGroup (one unbounded thread per host, joined without a timeout), at
most `parallel` hosts run at once, one host's failure never stops the others (unless
`fail_fast`), and a host that outlives its deadline is marked timed out and its connection is
closed instead of holding the whole run. Progress goes to an optional callback (the CLI draws
its live table from it); this module prints nothing.
"""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Optional, TypeVar

from ddtree_ops.errors import (
    CommandTimeout,
    ConnectTimeout,
    DdtreeOpsError,
    ExitCode,
    HostKeyRejected,
    TransportError,
)
from ddtree_ops.inventory import Host
from ddtree_ops.outcome import HostOutcome, exit_code_for
from ddtree_ops.transport.base import Transport

DEFAULT_PARALLEL = 32
T = TypeVar("T")


# An interrupted host's command may already be past the point of no return on the host (a
# deploy finishes its install; the next deploy/rollback recovers a half-done one).
INTERRUPTED_DETAIL = "interrupted while under way: the host may still finish this step"


class HostState(str, Enum):
    QUEUED = "queued"
    CONNECTING = "connecting"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"  # a remote step failed (or the connection dropped mid-task)
    UNREACHABLE = "unreachable"  # could not connect / authenticate
    HOST_KEY_REFUSED = "host key refused"  # reached, but its key is not the known one (or unknown)
    TIMED_OUT = "timed out"
    SKIPPED = "skipped"  # not started because of --fail-fast
    INTERRUPTED = "interrupted"  # under way when the operator interrupted (Ctrl-C / SIGTERM)

    @property
    def terminal(self) -> bool:
        return self not in (HostState.QUEUED, HostState.CONNECTING, HostState.RUNNING)


ProgressCallback = Callable[[str, HostState, str], None]  # (host name, state, detail)


@dataclass
class HostResult(Generic[T]):
    host: str
    state: HostState = HostState.QUEUED
    value: Optional[T] = None
    error: Optional[BaseException] = None
    duration_s: float = 0.0
    detail: str = ""  # the last progress note, or the one-line error

    @property
    def ok(self) -> bool:
        return self.state is HostState.OK

    @property
    def never_connected(self) -> bool:
        """Failed before a connection existed (refused, unreachable, host key, auth, connect
        timeout): what exit code 4 means. A connection lost mid-task is a failed step."""
        return self.state in (HostState.UNREACHABLE, HostState.HOST_KEY_REFUSED) or \
            isinstance(self.error, ConnectTimeout)

    @property
    def outcome(self) -> HostOutcome:
        if self.state is HostState.OK:
            return HostOutcome.PASS
        if self.state is HostState.INTERRUPTED:
            return HostOutcome.INTERRUPTED
        if self.state is HostState.SKIPPED:
            return HostOutcome.NOT_STARTED
        if self.state is HostState.HOST_KEY_REFUSED:
            return HostOutcome.HOST_KEY_REFUSED
        return HostOutcome.UNREACHABLE if self.never_connected else HostOutcome.FAIL

    def message(self) -> str:
        if self.error is None:
            return self.detail
        if isinstance(self.error, DdtreeOpsError):
            return str(self.error)
        return f"internal error: {type(self.error).__name__}: {self.error}"


class FanoutResult(dict):
    """host name -> HostResult, in the order the hosts were given (like Fabric's GroupResult)."""

    @property
    def succeeded(self) -> dict[str, HostResult]:
        return {name: o for name, o in self.items() if o.ok}

    @property
    def failed(self) -> dict[str, HostResult]:
        return {name: o for name, o in self.items() if not o.ok}

    def exit_code(self) -> ExitCode:
        """The command's exit code, by the one rule (ddtree_ops.outcome)."""
        return exit_code_for(o.outcome for o in self.values())


@dataclass
class HostContext:
    """What a task gets: the host, its open connection (reused for every step), and a way to
    say what it is doing."""

    host: Host
    transport: Transport
    _progress: Callable[[str], None] = field(repr=False)

    def report(self, detail: str) -> None:
        self._progress(detail)


def _failure_state(err: BaseException, connected: bool) -> HostState:
    if isinstance(err, (CommandTimeout, ConnectTimeout)):
        return HostState.TIMED_OUT
    if isinstance(err, HostKeyRejected):
        return HostState.HOST_KEY_REFUSED
    if isinstance(err, TransportError) and not connected:
        return HostState.UNREACHABLE
    return HostState.FAILED


def run_fanout(
    hosts: Sequence[Host],
    task: Callable[[HostContext], T],
    *,
    parallel: int = DEFAULT_PARALLEL,
    fail_fast: bool = False,
    deadline_s: Optional[float] = None,
    on_progress: Optional[ProgressCallback] = None,
    on_launched: Optional[Callable[[], None]] = None,
    accept_new_host_keys: bool = False,
    connect: Optional[Callable[[Host], Transport]] = None,
) -> FanoutResult:
    """Open a connection per host and run `task` on it, at most `parallel` hosts at a time.

    `deadline_s` bounds each host from the moment it starts (connect included); `connect`
    replaces `open_transport` (tests); `on_launched()` runs in the calling thread once the
    hosts are started (slow set-up such as drawing can overlap their connecting there).
    Never raises for a host's failure: see the result map.
    An unreadable ssh_config is not a host's failure but the inventory's: ConfigError, raised
    before any host starts."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if connect is None:
        from ddtree_ops.transport.factory import check_connection_config, open_transport

        check_connection_config(hosts)  # raises ConfigError (exit 3) before any host is touched

        def connect(host: Host) -> Transport:
            return open_transport(host, accept_new_host_keys=accept_new_host_keys)

    result = FanoutResult((h.name, HostResult(h.name)) for h in hosts)
    lock = threading.Lock()
    stop = threading.Event()
    started_at: dict[str, float] = {}
    transports: dict[str, Transport] = {}
    interrupted = threading.Event()

    def update(name: str, state: HostState, detail: str = "", **fields: Any) -> bool:
        """Record a state change unless the host already finished (e.g. timed out meanwhile)."""
        with lock:
            outcome = result[name]
            if outcome.state.terminal:
                return False
            outcome.state = state
            outcome.detail = detail
            for key, value in fields.items():
                setattr(outcome, key, value)
            if state.terminal and name in started_at:
                outcome.duration_s = time.monotonic() - started_at[name]
            if on_progress is not None:  # under the lock: a host's states arrive in order
                on_progress(name, state, detail)
        return True

    def work(host: Host) -> None:
        if stop.is_set():
            update(host.name, HostState.SKIPPED, "not started (--fail-fast)")
            return
        with lock:
            started_at[host.name] = time.monotonic()
        update(host.name, HostState.CONNECTING, host.target())
        transport = None
        try:
            transport = connect(host)
            with lock:
                transports[host.name] = transport
            update(host.name, HostState.RUNNING, "")
            value = task(HostContext(host, transport, lambda d: update(host.name, HostState.RUNNING, d)))
            update(host.name, HostState.OK, "", value=value)
        except BaseException as err:  # noqa: BLE001 - every failure stays with its host
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                stop.set()
            if interrupted.is_set():  # its connection was closed by the interrupt, not lost
                update(host.name, HostState.INTERRUPTED, INTERRUPTED_DETAIL)
                return
            detail = str(err) if isinstance(err, DdtreeOpsError) else traceback.format_exc(limit=-3).strip()
            if update(host.name, _failure_state(err, transport is not None), detail.splitlines()[-1], error=err):
                if fail_fast:
                    stop.set()
        finally:
            if transport is not None:
                transport.close()

    if on_progress is not None:
        for host in hosts:
            on_progress(host.name, HostState.QUEUED, "")
    pool = ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts))), thread_name_prefix="fanout")
    futures: dict[Future, Host] = {pool.submit(work, h): h for h in hosts}
    pending = set(futures)
    try:
        if on_launched is not None:
            on_launched()
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            if deadline_s is None:
                continue
            now = time.monotonic()
            for future in list(pending):
                host = futures[future]
                with lock:
                    began = started_at.get(host.name)
                    transport = transports.get(host.name)
                if began is None or now - began <= deadline_s:
                    continue
                err = CommandTimeout(host.name, f"gave up after the per-host deadline of {deadline_s:g}s")
                if update(host.name, HostState.TIMED_OUT, str(err), error=err) and fail_fast:
                    stop.set()
                if transport is not None:
                    transport.close()  # unblocks the worker; its late result is ignored
                pending.discard(future)
    except KeyboardInterrupt:
        interrupted.set()
        stop.set()
        with lock:
            open_now = list(transports.values())
        for transport in open_now:
            transport.close()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for name, outcome in result.items():  # cancelled before they started
        if not outcome.state.terminal:
            update(name, HostState.SKIPPED, "not started (--fail-fast)")
    return result
