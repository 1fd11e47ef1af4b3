"""Local output folders and files named on the command line (`--plot DIR`, `--runs-dir`,
`-o FILE`): a folder is checked before any work starts (a bad one is a one-line usage error,
not a traceback at the end of a sweep that then loses the sweep's exit code), and a file is
written whole, never through a link at its name (hostside.safe_write)."""
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


def write_output_file(path: Path, text: str, what: str) -> None:
    """`text` as the file `path` (`-o FILE`): via a temporary file in the same folder and a
    rename, so never half-written and never written through a link at the name (one there is
    replaced). UsageError naming the path when it is a folder or cannot be written."""
    from ddtree_ops.hostside.safe_write import WriteRefused, write_file

    if path.is_dir():
        raise UsageError(f"{path}: is a folder; name the {what.removeprefix('the ')} file to write (e.g. {path / 'baseline.json'})")
    try:
        write_file(path.parent, path.name, text)
    except WriteRefused as err:
        raise UsageError(f"{path}: cannot write {what} here: {err.why}") from None
