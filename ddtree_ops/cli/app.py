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
from typing import Any, Optional

import typer
from typer.core import TyperGroup

from ddtree_ops.cli.console import inert, say
from ddtree_ops.errors import DdtreeOpsError, ExitCode, interrupt_signal_name


class CommandInterrupted(Exception):
    """A KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one) that left a command. Typer
    would turn it into a silent `Exit(130)`; carried this way it reaches the boundary."""


class _InterruptCarryingGroup(TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as err:
            raise CommandInterrupted() from err


app = typer.Typer(
    cls=_InterruptCarryingGroup,
    name="ddtree-ops",
    help="Push the DDTree core to GPU hosts, smoke-test it there, and deploy the SGLang plugin.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _print_version(wanted: bool) -> None:
    if wanted:
        from ddtree_ops.version import version_lines

        for line in version_lines():
            typer.echo(line)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the version and the release `push` sends from here (its git commit), then exit."),
) -> None:
    pass  # only the root's options live here (its help is the app's)


# One module per command group; each exposes `register(app)`.
COMMAND_MODULES: list[str] = ["hosts", "push", "baseline", "smoke", "collect", "report", "bench", "deploy", "sglang", "status"]


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


def _open_debug_log() -> Any:
    """The debug log opened to append; a link at its name is refused, never written through
    (hostside.safe_write): a traceback must not land in whatever file someone linked there."""
    from ddtree_ops.hostside.safe_write import open_append

    path = debug_log_path()
    return open_append(path.parent, path.name)


def _record_traceback() -> Path | None:
    from ddtree_ops.hostside.safe_write import WriteRefused

    try:
        with _open_debug_log() as log:
            log.write(inert(traceback.format_exc()))  # remote text in messages: inert here too
            log.write("\n")
        return debug_log_path()
    except (OSError, WriteRefused):
        return None


class _DebugLogHandler(logging.Handler):
    """Appends library log records to the debug log, resolved per record (the path follows
    $DDTREE_OPS_DEBUG_LOG); a record that cannot be written is dropped, never printed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with _open_debug_log() as log:
                log.write(inert(f"{record.name} {record.levelname}: {self.format(record)}") + "\n")
        except Exception:  # noqa: BLE001 - logging must never break or spam the command
            pass


def _route_library_logs() -> None:
    """Warnings and errors that libraries log (Paramiko's handshake tracebacks) go to the
    debug log, never to the terminal: each failure is already reported in one line."""
    logger = logging.getLogger("paramiko")
    if not any(isinstance(h, _DebugLogHandler) for h in logger.handlers):
        handler = _DebugLogHandler(logging.WARNING)
        logger.addHandler(handler)


def plain_metavars(command: Any) -> None:
    """Help that names values as an operator writes them (`PATH`, `INTEGER`, `RUN_ID`, a flag
    with none), never as Python types (`<bool>`, `<list[str]>`, `{run_id}`): every option and
    argument without its own metavar gets one."""
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)
    help_option = command.get_help_option

    def get_help_option(ctx: Any) -> Any:  # Click makes `--help` per context: a flag, no value
        option = help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option
    for param in command.params:
        if param.metavar is not None:
            continue
        if getattr(param, "param_type_name", "") == "argument":
            # Typer shows a required argument as `{run_id}` and its type as `<str>`: shown
            # here as the value to write, RUN_ID ([RUN_ID] when optional, RUNS... when many)
            name = param.name.upper()
            usage = (name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else "")
            param.metavar = name
            param._usage_display_name = lambda usage=usage: usage
            param.display_type_rich = lambda ctx: None
            param._rich_display_name = lambda usage=usage: usage
        elif getattr(param, "is_flag", False) or getattr(param, "count", False):
            param.metavar = ""
        elif param.type_descriptor.is_choice:
            param.metavar = "|".join(str(getattr(c, "value", c)) for c in param.type_descriptor.choices or ())
        else:
            bare = param.bare_type()  # "int", "Path", "list[str]"
            bare = bare[len("list["):-1] if bare.startswith("list[") else bare
            param.metavar = _VALUE_NAMES.get(bare, bare.upper())


_VALUE_NAMES = {"int": "INTEGER", "float": "NUMBER", "str": "TEXT", "Path": "PATH", "PosixPath": "PATH"}


def _run_command(args: list[str]) -> tuple[int, Optional[str]]:
    """Run the command; report a failure on stderr (one line, or Click's usage text). Returns
    the exit code and that failure as one line for a JSON document (None: nothing failed here)."""
    try:
        command = typer.main.get_command(app)
        plain_metavars(command)
        result = command.main(args=args, standalone_mode=False, prog_name="ddtree-ops")
        return (int(result) if isinstance(result, int) else ExitCode.OK), None
    except DdtreeOpsError as err:
        say(f"error: {err}")
        return err.exit_code, str(err)
    except typer.Exit as exit_:
        return exit_.exit_code, None
    except (CommandInterrupted, KeyboardInterrupt, typer.Abort) as err:
        why = f"interrupted ({interrupt_signal_name(err)})"  # which signal: Ctrl-C is SIGINT, a CI cancel SIGTERM
        say(why)
        return ExitCode.INTERRUPTED, why
    except typer.TyperException as err:
        # Typer 0.29 vendors click: its usage errors derive from TyperException, not click's.
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        show = getattr(err, "show", None)
        if callable(show):
            show()
        else:
            say(f"error: {message}")
        return ExitCode.USAGE, message
    except Exception as err:  # noqa: BLE001 - the boundary: a bug, reported in one line
        from ddtree.bounded_files import FileRefused  # here: `--help` imports neither
        from ddtree_ops.hostside.safe_write import WriteRefused

        if isinstance(err, (FileRefused, WriteRefused)):  # a file handed to us, or a place to write, refused
            say(f"error: {err}")
            return ExitCode.CONFIG, str(err)
        log = _record_traceback()
        where = f" (traceback in {log})" if log else ""
        message = f"unexpected error: {type(err).__name__}: {err}{where}"
        say(message)
        return ExitCode.UNEXPECTED, message


def _flag_scan(args: list[str]) -> bool:
    """`--json` among the options (not after `--`): the fallback when Click cannot parse."""
    options = args[: args.index("--")] if "--" in args else args
    return "--json" in options


def json_request(args: list[str]) -> tuple[Optional[str], bool]:
    """The command path (`push`, `hosts check`; None when no command was named) and whether it
    was given `--json`, read the way Click reads it (resilient parsing, past unknown options:
    a bad value elsewhere does not hide `--json`; `--set --json` is a --set value); by
    scanning the words when no command was resolved or even that parsing fails."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    rest = list(args)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            break
        path.append(rest.pop(0))
        command = sub
    name = " ".join(path) or None
    if not path or hasattr(command, "commands"):
        return name, _flag_scan(rest)
    json_param = next((p for p in command.params if "--json" in getattr(p, "opts", ())), None)
    if json_param is None:
        return name, False
    try:
        ctx = command.make_context(f"ddtree-ops {name}", rest, resilient_parsing=True,
                                   ignore_unknown_options=True)
    except Exception:  # noqa: BLE001 - whatever Click cannot read even so
        return name, _flag_scan(rest)
    return name, bool(ctx.params.get(json_param.name))


def _emit_error_document(args: list[str], code: int, error: Optional[str]) -> None:
    """Under `--json`, a failure that produced no document still gets one, so a script piping
    into `jq` reads the exit code and the reason instead of nothing."""
    from ddtree_ops.cli.console import emit_json

    try:
        command, wanted = json_request(args)
    except Exception:  # noqa: BLE001 - reading argv again must never cost the report
        command, wanted = None, _flag_scan(args)
    if not wanted:
        return
    if error is None:
        error = "interrupted" if code == ExitCode.INTERRUPTED else f"failed with exit code {code}"
    try:
        emit_json({"command": command, "exit_code": int(code), "error": error})
    except (OSError, ValueError):  # the reader went away: the exit code still says it
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return (and exit with) the process exit code.

    The one error boundary: every failure ends here as its exit code and one stderr line;
    under `--json` exactly one JSON document is on stdout whatever happened (the command's,
    or `{"command", "exit_code", "error"}` written here when it wrote none)."""
    from ddtree_ops.cli.console import documents_emitted
    from ddtree_ops.cli.interrupts import signals_interrupt

    prepare()
    _route_library_logs()
    args = list(sys.argv[1:] if argv is None else argv)
    documents_before = documents_emitted()
    with signals_interrupt() as settle:
        code, error = _run_command(args)
        settle()
        if code != ExitCode.OK and documents_emitted() == documents_before:
            _emit_error_document(args, code, error)
    if argv is None:
        sys.exit(int(code))
    return int(code)


if __name__ == "__main__":  # pragma: no cover
    main()
