"""The `ddtree-ops` console script: `main()` in a process that starts and ends cheaply.

A CLI process lives for a second and builds ~10^5 long-lived objects while importing typer,
pydantic, rich and paramiko. Two things cost it more than they are worth here:
- the cyclic GC, which rescans those objects ~100 times during imports: it is paused while
  the command modules import, and what they built is frozen out of later collections;
- interpreter teardown (every module and object freed one by one, ~50 ms): after stdout and
  stderr are flushed, the process ends with `os._exit`. Every file the commands write is
  closed or flushed by then (results are written atomically as they arrive), so nothing is lost.

`main()` itself stays a plain function: the tests call it many times in one process (it turns
SIGTERM into an interrupt only while a command runs, see `ddtree_ops.cli.interrupts`).
"""
from __future__ import annotations

import gc
import os
import sys


def run() -> None:
    gc.disable()
    try:
        from ddtree_ops.cli.app import main, prepare

        prepare()
    finally:
        gc.freeze()
        gc.enable()
    from ddtree_ops.cli.interrupts import keep_settled_after_command

    # Once the command has reported, a late signal (a second CI cancel) neither kills the
    # process before its output is flushed nor raises: the exit status is already decided.
    keep_settled_after_command()
    code = main(sys.argv[1:])
    _flush_or_drop(sys.stdout)
    _flush_or_drop(sys.stderr)
    os._exit(code)


def _flush_or_drop(stream) -> None:
    """Flush; a reader that went away (`ddtree-ops report | head`) is not an error."""
    try:
        stream.flush()
    except (OSError, ValueError):  # BrokenPipeError is an OSError; ValueError: closed
        pass
