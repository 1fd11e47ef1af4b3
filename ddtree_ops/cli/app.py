"""The `ddtree-ops` entry point and the one error boundary that maps failures to exit codes.

Command modules are imported here but keep heavy imports (torch, fabric, paramiko) inside
their functions, so `ddtree-ops --help` stays fast.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import typer

from ddtree_ops.errors import DdtreeOpsError, ExitCode

app = typer.Typer(
    name="ddtree-ops",
    help="Push the DDTree core to GPU hosts, smoke-test it there, and deploy the SGLang plugin.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# One module per command group; each exposes `register(app)`.
COMMAND_MODULES: list[str] = ["hosts", "push", "baseline", "smoke", "collect", "report", "bench", "deploy"]


_registered = False


def prepare() -> None:
    """Attach every command module once (tests call `main()` many times in one process)."""
    global _registered
    if _registered:
        return
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"ddtree_ops.cli.{name}").register(app)
    _registered = True


def debug_log_path() -> Path:
    override = os.environ.get("DDTREE_OPS_DEBUG_LOG")
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return base / "ddtree-ops" / "debug.log"


def _record_traceback() -> Path | None:
    path = debug_log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as log:
            log.write(traceback.format_exc())
            log.write("\n")
        return path
    except OSError:
        return None


class _DebugLogHandler(logging.Handler):
    """Appends library log records to the debug log, resolved per record (the path follows
    $DDTREE_OPS_DEBUG_LOG); a record that cannot be written is dropped, never printed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            path = debug_log_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as log:
                log.write(f"{record.name} {record.levelname}: {self.format(record)}\n")
        except Exception:  # noqa: BLE001 - logging must never break or spam the command
            pass


def _route_library_logs() -> None:
    """Warnings and errors that libraries log (Paramiko's handshake tracebacks) go to the
    debug log, never to the terminal: each failure is already reported in one line."""
    logger = logging.getLogger("paramiko")
    if not any(isinstance(h, _DebugLogHandler) for h in logger.handlers):
        handler = _DebugLogHandler(logging.WARNING)
        logger.addHandler(handler)


def _say(message: str) -> None:
    sys.stderr.write(f"ddtree-ops: {message}\n")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return (and exit with) the process exit code."""
    prepare()
    _route_library_logs()
    try:
        result = app(args=argv, standalone_mode=False, prog_name="ddtree-ops")
        code = int(result) if isinstance(result, int) else ExitCode.OK
    except DdtreeOpsError as err:
        _say(f"error: {err}")
        code = err.exit_code
    except typer.Exit as exit_:
        code = exit_.exit_code
    except typer.Abort:
        _say("interrupted")
        code = ExitCode.INTERRUPTED
    except typer.TyperException as err:
        # Typer 0.29 vendors click: its usage errors derive from TyperException, not click's.
        show = getattr(err, "show", None)
        if callable(show):
            show()
        else:
            _say(f"error: {err.format_message()}")
        code = ExitCode.USAGE
    except KeyboardInterrupt:
        _say("interrupted")
        code = ExitCode.INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the boundary: a bug, reported in one line
        log = _record_traceback()
        where = f" (traceback in {log})" if log else ""
        _say(f"unexpected error: {type(err).__name__}: {err}{where}")
        code = ExitCode.UNEXPECTED
    if argv is None:
        sys.exit(int(code))
    return int(code)


if __name__ == "__main__":  # pragma: no cover
    main()
