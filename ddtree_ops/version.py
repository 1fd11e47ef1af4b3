"""What `ddtree-ops --version` says: the installed package's version and the release `push`
would send from here (its id, and the git commit its files come from).

Cheap on purpose: package metadata, the release's files hashed (well under a megabyte) and two
`git` calls; no torch, no paramiko, no Rich."""
from __future__ import annotations


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddtree-ops")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def version_lines() -> list[str]:
    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.release import build_bundle

    lines = [f"ddtree-ops {package_version()}"]
    try:
        bundle = build_bundle()
    except DdtreeOpsError as err:  # no ddtree next to us: say why instead of a release
        return [*lines, f"release: none ({err})"]
    git = "" if bundle.git is not None else " (not a git checkout)"
    lines.append(f"release {bundle.described}{git} from {bundle.source_root}")
    return lines
