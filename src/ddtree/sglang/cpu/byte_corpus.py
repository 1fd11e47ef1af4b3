"""The trained tiny pair's corpus: Python standard library sources as bytes, pinned file by file.

Every machine has a standard library, but not the same one (it changes between Python
releases), so the corpus is a pinned list: each file's path under the stdlib folder and the
sha256 of its bytes, recorded once (`pin`) from the Python that trained the committed pair.
`load` reads exactly those files and stops, in one line naming the file, at the first whose
bytes differ or that is missing. Text is bytes (token = byte value); leading groups of four
spaces become one tab, so indentation does not dominate what a small model learns (with raw
spaces a target's greedy output was two thirds spaces). Files are sorted by path; every 20th
(index 19, 39, ...) is held out: the prompts come from those, training from the rest.
"""
from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HOLD_OUT_EVERY = 20
# Folders left out of the selection: tests (huge, repetitive), third-party packages, and the
# build's platform config (config-3.11-x86_64-linux-gnu/ differs per machine).
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test")
EXCLUDED_DIR_PREFIXES = ("config-",)
_LEADING_SPACES = re.compile(rb"^((?:    )+)", re.MULTILINE)


class CorpusMismatchError(RuntimeError):
    """This machine's standard library is not the pinned one; the message names the file."""


@dataclass(frozen=True)
class PinnedFile:
    path: str  # posix, relative to the stdlib folder
    sha256: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[bytes, ...]  # per file, indentation already turned into tabs
    held_out: tuple[bytes, ...]
    held_out_paths: tuple[str, ...]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def selected(root: Path) -> list[str]:
    """The .py files under `root` the corpus takes, sorted (what `pin` records)."""
    paths = []
    for path in root.rglob("*.py"):
        folders = path.relative_to(root).parts[:-1]
        if any(f in EXCLUDED_DIRS or f.startswith(EXCLUDED_DIR_PREFIXES) for f in folders):
            continue
        paths.append(path.relative_to(root).as_posix())
    return sorted(paths)


def pin(root: Path | None = None) -> dict:
    """The manifest of this machine's selection: {"python": version, "files": [[path, sha256]]}."""
    import platform

    root = root or stdlib_dir()
    files = [[rel, hashlib.sha256((root / rel).read_bytes()).hexdigest()] for rel in selected(root)]
    return {"python": platform.python_version(), "files": files}


def read_manifest(path: Path) -> tuple[str, tuple[PinnedFile, ...]]:
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    return str(raw["python"]), tuple(PinnedFile(str(p), str(h)) for p, h in raw["files"])


def tabs_for_spaces(text: bytes) -> bytes:
    """Each line's leading groups of four spaces -> one tab each (a remainder stays spaces)."""
    return _LEADING_SPACES.sub(lambda m: b"\t" * (len(m.group(1)) // 4), text)


def load(manifest: Path, root: Path | None = None) -> Corpus:
    """The pinned files from `root` (this Python's stdlib), checked byte for byte, split."""
    python, pinned = read_manifest(manifest)
    root = root or stdlib_dir()
    train, held_out, held_out_paths = [], [], []
    for index, entry in enumerate(pinned):
        path = root / entry.path
        if not path.is_file():
            raise CorpusMismatchError(
                f"{path}: missing; the trained pair's corpus is Python {python}'s standard library ({manifest})")
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CorpusMismatchError(
                f"{path}: sha256 {digest[:12]} differs from the pinned {entry.sha256[:12]}; the trained pair's "
                f"corpus is Python {python}'s standard library ({manifest})")
        text = tabs_for_spaces(data)
        if index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1:
            held_out.append(text)
            held_out_paths.append(entry.path)
        else:
            train.append(text)
    return Corpus(tuple(train), tuple(held_out), tuple(held_out_paths))
