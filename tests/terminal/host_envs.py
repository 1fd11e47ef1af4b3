"""Host environments for the terminal suite (see verbs.py): the real sglang 0.5.23 whose hooked
spec_info.py drifted (a local patch release: `sglang qualify` qualifies it
on CPU with the `plugin` stage, then `deploy` accepts it)."""
from __future__ import annotations

from pathlib import Path

SPEC_INFO = Path("sglang", "srt", "speculative", "spec_info.py")


def drifted_sglang_python(root: Path) -> Path:
    """A venv's python with sglang 0.5.23 (pip --no-deps) and torch, one hooked file patched."""
    from sglang_plugin.dist import make_sglang_venv, site_dir

    python = make_sglang_venv(root)
    hooked = site_dir(python) / SPEC_INFO
    hooked.write_bytes(hooked.read_bytes() + b"\n# a local patch release\n")
    return python
