"""Stage `import`: the `ddtree` this run uses is the pushed release's, intact.

Checks that `ddtree` (and every loaded `ddtree.*` module) comes from `<release_root>/src`,
that no other `ddtree` sits on the host's `sys.path` (a stale or foreign copy would shadow
ours in other processes, e.g. SGLang's; a copy identical to the release's files is neither), that every file the release's `MANIFEST.sha256`
lists still has its hash, and that the manifest's id is the release the operator pushed.
What "intact" means is `ddtree_ops.hostside.release_check`'s (the runner checks it before it imports
`ddtree`; this stage says so in the results).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ddtree_ops.hostside.protocol import StageContext, StageResult
from ddtree_ops.hostside.agent import MANIFEST_NAME, AgentError, file_sha256, parse_manifest, read_manifest
from ddtree_ops.hostside.release_check import check_release, summary

NAME = "import"
DESCRIPTION = "the release's ddtree is the one imported, and its files match the manifest"


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def _same_as_release(copy: Path, release_root: Path) -> bool:
    """A `ddtree` folder whose files are exactly the release's `src/ddtree`, by the manifest's
    hashes: the installed package the release was bundled from, when the host is the operator's
    own Python (`local` after `pip install ddtree-ops`). It shadows nothing; any other is foreign."""
    prefix = "src/ddtree/"
    try:
        listed = parse_manifest(read_manifest(str(release_root)))
        found = {path.relative_to(copy).as_posix(): file_sha256(path) for path in copy.rglob("*")
                 if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")}
    except (OSError, AgentError):
        return False
    return found == {relpath[len(prefix):]: digest for relpath, digest in listed.items() if relpath.startswith(prefix)}


def _foreign_copies(src_root: Path) -> list[str]:
    """Other `ddtree` packages reachable through sys.path entries."""
    found = []
    for entry in sys.path:
        try:
            base = Path(entry or ".").resolve()
        except OSError:
            continue
        if base == src_root:
            continue
        for candidate in (base / "ddtree" / "__init__.py", base / "ddtree.py"):
            if candidate.is_file():
                found.append(str(candidate.parent if candidate.name == "__init__.py" else candidate))
    return sorted(set(found))


def run(ctx: StageContext) -> StageResult:
    release_root = Path(os.path.realpath(ctx.release_root))
    src_root = release_root / "src"
    metrics: dict = {"release_root": str(ctx.release_root), "resolved_root": str(release_root),
                     "expected_release": ctx.expected_release}
    try:
        import ddtree

        for name in ddtree.__all__:  # the core's names load on first use: load them all here
            getattr(ddtree, name)
    except Exception as err:  # noqa: BLE001 - any import failure is this stage's verdict
        return StageResult.failed(f"import ddtree failed: {type(err).__name__}: {err}",
                                  metrics=metrics)
    package_file = Path(os.path.realpath(ddtree.__file__ or ""))
    metrics["ddtree_file"] = str(package_file)
    if not _under(package_file, src_root / "ddtree"):
        return StageResult.failed(f"ddtree was imported from {package_file}, not from the "
                                  f"release at {src_root}", metrics=metrics)
    strays = sorted(name for name, module in list(sys.modules.items())
                    if (name == "ddtree" or name.startswith("ddtree."))
                    and getattr(module, "__file__", None)
                    and not _under(Path(os.path.realpath(module.__file__)), src_root))
    if strays:
        return StageResult.failed(f"modules loaded from outside the release: {strays}",
                                  metrics=metrics)
    foreign = [copy for copy in _foreign_copies(src_root) if not _same_as_release(Path(copy), release_root)]
    metrics["foreign_ddtree"] = foreign
    if foreign:
        return StageResult.failed(f"another ddtree is on sys.path: {', '.join(foreign)}",
                                  metrics=metrics)
    if not (release_root / MANIFEST_NAME).is_file():
        return StageResult.failed(f"no {MANIFEST_NAME} in {release_root}: not a pushed release",
                                  metrics=metrics)
    release_id, problems = check_release(release_root)
    metrics["release"] = release_id
    metrics["manifest_problems"] = problems[:20]
    ctx.log(f"ddtree from {package_file}; manifest id {release_id}")
    if problems:
        return StageResult.failed(f"release {release_id} is damaged: {summary(problems)}", metrics=metrics)
    if ctx.expected_release and ctx.expected_release != release_id:
        return StageResult.failed(f"host runs release {release_id}, operator pushed "
                                  f"{ctx.expected_release}", metrics=metrics)
    return StageResult.passed(f"release {release_id} intact, ddtree from it", metrics=metrics)
