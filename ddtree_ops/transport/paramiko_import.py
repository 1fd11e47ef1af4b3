"""Paramiko, imported once for the transport modules, without `invoke` and without tracebacks
on the operator's terminal."""
from __future__ import annotations

import logging


def _import_paramiko_without_invoke():
    """paramiko.config imports `invoke` (~190 ms, more than half of paramiko's import time)
    only to evaluate `Match exec` in ssh_config, which we do not support. Hide it during the
    import; anything imported later (Fabric) still gets the real invoke."""
    import sys

    if "invoke" in sys.modules:
        import paramiko as module

        return module
    sys.modules["invoke"] = None  # type: ignore[assignment]  # makes `import invoke` fail fast
    try:
        import paramiko as module
    finally:
        del sys.modules["invoke"]
    return module


paramiko = _import_paramiko_without_invoke()
# Paramiko logs a failed handshake's traceback at ERROR; with no handler of its own, Python's
# last-resort handler would print it on the operator's terminal. Our errors already say what
# happened in one line; the CLI routes these records to its debug log (`cli.app`).
logging.getLogger("paramiko").addHandler(logging.NullHandler())
