"""Is a pushed release on this host intact? Stdlib only: the runner asks before it imports
anything of the release beyond `ddtree_ops.hostside` itself, and the `import` stage asks again.

The manifest format is ddtree_ops/release.py's: `<sha256>  <relpath>` lines (split on
"\\n" only), id = the first 16 hex digits of the manifest's sha256. Intact means: every listed
file is a regular file with its hash, nothing else is in the release (bytecode caches aside:
the runner never reads them), no link anywhere, and the folder's name is the manifest's id
when it sits in a `releases/` folder.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

MANIFEST_NAME = "MANIFEST.sha256"
RELEASE_ID_CHARS = 16
BYTECODE_DIR = "__pycache__"


def has_manifest(release_root: Path) -> bool:
    return (release_root / MANIFEST_NAME).is_file()


def manifest_entries(manifest: bytes) -> tuple[dict[str, str], list[str]]:
    """({relpath: sha256}, problems with malformed lines)."""
    entries: dict[str, str] = {}
    problems = []
    for number, line in enumerate(manifest.decode("utf-8", "replace").split("\n"), start=1):
        if not line:
            continue
        digest, sep, relpath = line.partition("  ")
        if not sep or len(digest) != 64 or not relpath or relpath.startswith("/") or "\x00" in relpath \
                or any(part in ("", ".", "..") for part in relpath.split("/")):
            problems.append(f"{MANIFEST_NAME}:{number}: malformed line {line!r:.80}")
            continue
        entries[relpath] = digest
    return entries, problems


def check_release(release_root: Path) -> tuple[str, list[str]]:
    """(release id computed from the manifest, every problem found), for a release folder
    that has a manifest. `release_root` may be a link (`current`): its target is checked."""
    root = Path(os.path.realpath(release_root))
    manifest = (root / MANIFEST_NAME).read_bytes()
    release_id = hashlib.sha256(manifest).hexdigest()[:RELEASE_ID_CHARS]
    entries, problems = manifest_entries(manifest)
    for relpath, digest in entries.items():
        path = root / relpath
        if path.is_symlink():
            problems.append(f"{relpath}: a link, not the released file")
            continue
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except (OSError, ValueError) as err:
            problems.append(f"{relpath}: unreadable ({getattr(err, 'strerror', None) or err})")
            continue
        if actual != digest:
            problems.append(f"{relpath}: sha256 {actual[:12]}.. != manifest {digest[:12]}..")
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        for name in dirs + files:
            if (base / name).is_symlink():
                problems.append(f"{(base / name).relative_to(root).as_posix()}: unexpected link")
        dirs[:] = [d for d in dirs if d != BYTECODE_DIR and not (base / d).is_symlink()]
        for name in files:
            relpath = (base / name).relative_to(root).as_posix()
            if relpath != MANIFEST_NAME and relpath not in entries and not (base / name).is_symlink():
                problems.append(f"{relpath}: unexpected file (not in the manifest)")
    if root.parent.name == "releases" and root.name != release_id:
        problems.append(f"release directory {root.name} holds manifest {release_id}")
    return release_id, problems


def summary(problems: list[str]) -> str:
    """The first problem, and how many more."""
    return problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
