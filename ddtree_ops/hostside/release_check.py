"""Is a pushed release on this host intact? The runner asks before it imports anything of the
release beyond `ddtree_ops.hostside` itself, and the `import` stage asks again. The check is
the agent's (`release_problems`): one rule for push, prune, deploy and smoke.
"""
from __future__ import annotations

from pathlib import Path

from ddtree_ops.hostside.agent import MANIFEST_NAME, manifest_id, read_manifest, release_problems


def has_manifest(release_root: Path) -> bool:
    return (release_root / MANIFEST_NAME).is_file()


def check_release(release_root: Path) -> tuple[str, list[str]]:
    """(release id computed from the manifest, every problem found), for a release folder that
    has a manifest. `release_root` may be a link (`current`): its target is checked, and when it
    sits in a `releases/` folder its name must be that id."""
    root = release_root.resolve()
    release_id = manifest_id(read_manifest(str(root)))
    problems = release_problems(str(root))
    if root.parent.name == "releases" and root.name != release_id:
        problems.append(f"release directory {root.name} holds manifest {release_id}")
    return release_id, problems


def summary(problems: list[str]) -> str:
    """The first problem, and how many more."""
    return problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
