"""Shipped manifests: one JSON file per pinned SGLang version (`sglang-<version>.json`,
written by manifest_tool from a qualified installation). Adding a version is a data change:
drop the file here; nothing else names it. Stdlib only."""
from __future__ import annotations

from pathlib import Path

from ddtree.sglang.manifest import Manifest, version_key

MANIFEST_GLOB = "sglang-*.json"


def parse_manifests(texts: dict[str, str]) -> dict[str, Manifest]:
    """{file name: JSON text} -> {version: manifest}; a malformed file raises ValueError naming it."""
    found: dict[str, Manifest] = {}
    for name, text in sorted(texts.items()):
        try:
            manifest = Manifest.from_json(text)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        found[manifest.sglang_version] = manifest
    return found


def shipped_texts() -> dict[str, str]:
    """The JSON files next to this module; none when it was loaded from memory (the deploy
    installer passes the release's manifests to the gate itself)."""
    here = Path(__file__)
    if not here.is_file():
        return {}
    from ddtree.bounded_files import read_text  # a FIFO or a huge file dropped here is refused, never read

    return {path.name: read_text(path) for path in sorted(here.parent.glob(MANIFEST_GLOB))}


SUPPORTED: dict[str, Manifest] = parse_manifests(shipped_texts())


def newest(manifests: dict[str, Manifest]) -> Manifest | None:
    return manifests[max(manifests, key=version_key)] if manifests else None


def manifest_for(version: str | None) -> Manifest | None:
    return SUPPORTED.get(version or "")


def structure_for(version: str | None, manifests: dict[str, Manifest] | None = None) -> Manifest | None:
    """The manifest whose names are the structure expected of `version`: its own when we
    ship one, else the newest (what the plugin in this release was written against)."""
    manifests = SUPPORTED if manifests is None else manifests
    return manifests.get(version or "") or newest(manifests)


def manifest_for_installed_sglang() -> tuple[Manifest | None, str | None]:
    """(structure manifest, version) for the sglang distribution of this interpreter (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("sglang")
    except PackageNotFoundError:
        return None, None
    return structure_for(installed), installed
