"""Child processes that load bytecode as an installed package does.

With PYTHONDONTWRITEBYTECODE=1 in the environment (as on the shared VM), an editable checkout
compiles every module from source on every start, which no installed `ddtree-ops` does. The
timed children write and read their bytecode in a folder of their own instead
(PYTHONPYCACHEPREFIX), so no checkout gets files, and a checkout compared against is treated
alike; run each command once before timing it.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def bytecode_env() -> dict[str, str]:
    """This process's environment for timed children; their bytecode folder goes at exit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = folder = tempfile.mkdtemp(prefix="ddtree-bench-pycache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return env
