"""The exception tree of ddtree-ops and the exit code each kind of failure maps to.

Only the CLI boundary (`ddtree_ops.cli.app.main`) turns these into exit codes; every layer
below raises them with a one-line message that names the file, field, host or value.
"""
from __future__ import annotations

import reprlib
from enum import IntEnum
from typing import Any


class _BoundedRepr(reprlib.Repr):
    """reprlib's bounded containers and strings; any other object (whose own repr could walk
    anything) is named by its type."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 60, 60
        self.maxlist = self.maxdict = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = 6

    def repr_int(self, obj: int, level: int) -> str:
        if abs(obj) >= 10 ** 60:  # a huge int's digits cost time (and past 4300, an error)
            return f"<int of {obj.bit_length()} bits>"
        return super().repr_int(obj, level)

    def repr_instance(self, obj: Any, level: int) -> str:
        if obj is None or isinstance(obj, (bool, float, complex)):
            return super().repr_instance(obj, level)
        shape, dtype = getattr(type(obj), "shape", None), getattr(type(obj), "dtype", None)
        if shape is not None and dtype is not None:  # a tensor or array: what it is, not its values
            return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
        return f"<{type(obj).__name__}>"


def quoted(value: Any) -> str:
    """`value` as an error message quotes it: its repr, bounded in length and in the work it
    takes however large, deep or self-repeating the value is (values come from files and hosts)."""
    return _BoundedRepr().repr(value)


class ExitCode(IntEnum):
    OK = 0
    UNEXPECTED = 1  # a bug: traceback to the debug log, one line on screen
    USAGE = 2
    CONFIG = 3  # hosts.yaml / inventory / local config
    CONNECT = 4  # could not connect to any selected host
    REMOTE = 5  # a remote step or stage failed
    PARTIAL = 6  # some hosts failed, others passed
    INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, as the CLI's signal handlers raise it: a KeyboardInterrupt
    that says which signal came, so the final line and the hosts' records name the right one."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def interrupt_signal_name(err: BaseException) -> str:
    """The signal behind an interrupt; a plain KeyboardInterrupt is Python's own SIGINT."""
    while err is not None and not isinstance(err, Interrupted):
        err = err.__cause__ or err.__context__  # a wrapper (the CLI's CommandInterrupted) names its cause
    return err.signal_name if err is not None else "SIGINT"


class DdtreeOpsError(Exception):
    """Base of every error we expect; `str(err)` is the one line shown to the operator."""

    exit_code: ExitCode = ExitCode.UNEXPECTED


class UsageError(DdtreeOpsError):
    exit_code = ExitCode.USAGE


class ConfigError(DdtreeOpsError):
    """A broken inventory or local file: the message starts with the file and field."""

    exit_code = ExitCode.CONFIG


class RemoteStepError(DdtreeOpsError):
    """A command or stage on a host ran and failed."""

    exit_code = ExitCode.REMOTE


class TransportError(DdtreeOpsError):
    """Base for everything that goes wrong reaching a host (never a remote result)."""

    exit_code = ExitCode.CONNECT

    def __init__(self, host: str, detail: str):
        self.host = host
        self.detail = detail
        super().__init__(f"{host}: {self.kind}: {detail}")

    kind = "transport error"


class HostUnreachable(TransportError):
    kind = "unreachable"


class ConnectionRefused(TransportError):
    kind = "connection refused"


class ConnectTimeout(TransportError):
    kind = "timed out"


class AuthenticationFailed(TransportError):
    kind = "authentication failed"


class HostKeyRejected(TransportError):
    kind = "host key refused"


class ConnectionLost(TransportError):
    kind = "connection lost"


class CommandTimeout(TransportError):
    """A remote command outlived its per-command deadline; the channel was closed."""

    kind = "command timed out"


class OutputLimitExceeded(RemoteStepError):
    """A host sent more than a command may send (a line, or output in all): the command was
    stopped; what arrived before the limit is kept."""


class HostLocked(RemoteStepError):
    """Another ddtree-ops process holds the host's layout lock (`<workdir>/lock`)."""


class BaselineFileError(ConfigError):
    """A baseline or reference run file that cannot be read as one (names the file and why)."""
