"""The exception tree of ddtree-ops and the exit code each kind of failure maps to.

Only the CLI boundary (`ddtree_ops.cli.app.main`) turns these into exit codes; every layer
below raises them with a one-line message that names the file, field, host or value.
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    UNEXPECTED = 1  # a bug: traceback to the debug log, one line on screen
    USAGE = 2
    CONFIG = 3  # hosts.yaml / inventory / local config
    CONNECT = 4  # could not connect to any selected host
    REMOTE = 5  # a remote step or stage failed
    PARTIAL = 6  # some hosts failed, others passed
    INTERRUPTED = 130


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
    kind = "host key rejected"


class ConnectionLost(TransportError):
    kind = "connection lost"


class CommandTimeout(TransportError):
    """A remote command outlived its per-command deadline; the channel was closed."""

    kind = "command timed out"


class HostLocked(RemoteStepError):
    """Another ddtree-ops process holds the host's layout lock (`<workdir>/lock`)."""


class BaselineFileError(ConfigError):
    """A baseline or reference run file that cannot be read as one (names the file and why)."""
