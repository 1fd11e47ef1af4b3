"""Local output folders named on the command line (`--plot DIR`, `--runs-dir`), checked
before any work starts: a bad one is a one-line usage error, not a traceback at the end of a
sweep that then loses the sweep's exit code."""
from __future__ import annotations

from pathlib import Path

from ddtree_ops.errors import UsageError


def ensure_output_dir(path: Path, option: str) -> Path:
    """Create `path` (and its parents) if needed; UsageError naming the option and the path
    when it is a file or cannot be created."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{option} {path}: exists and is not a folder") from None
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot create the folder: {err.strerror or err}") from None
    return path
