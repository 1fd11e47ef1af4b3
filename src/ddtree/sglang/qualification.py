"""The qualification file: SGLang versions an operator's fleet has qualified for the plugin.

`ddtree-ops sglang qualify` appends an entry when the `plugin` stage (and `sglang-e2e` on a
GPU host) passed against a host's installed SGLang; `deploy` accepts a version whose pinned
files match an entry, and `manifest_tool --qualified` turns an entry into a shipped manifest.
The file lives next to the inventory and is reviewed like code. Stdlib only (the gate reads
it on the host, in the environment's own Python):

    {"qualified": [{"sglang": "0.5.24", "files": {"srt/plugins/__init__.py": "<sha256>", ...},
                    "run": "<run id>", "host": "gpu1", "release": "<release id>",
                    "stages": {"plugin": "pass"}, "qualified_at": "2026-12-01T22:00:00Z"}]}
"""
from __future__ import annotations

import json
import reprlib
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ddtree.bounded_files import FileRefused, parse_json, read_text

FILE_NAME = "sglang-qualified.json"
_HEX = set(string.hexdigits.lower())


class QualificationError(ValueError):
    """A malformed qualification file; the message names the file and the field."""


@dataclass(frozen=True)
class Qualification:
    sglang: str
    files: dict[str, str]  # path relative to the sglang package -> sha256
    run: str  # the run id whose stages passed (the evidence)
    host: str
    release: str = ""
    stages: dict[str, str] = field(default_factory=dict)
    qualified_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"sglang": self.sglang, "files": dict(sorted(self.files.items())), "run": self.run,
                "host": self.host, "release": self.release, "stages": self.stages,
                "qualified_at": self.qualified_at}

    def matches(self, version: str | None, hashes: dict[str, str], pinned: Iterable[str]) -> bool:
        """This entry vouches for an installation: same version, it lists every file the manifest
        pins (`pinned`: an entry over fewer files would vouch for the others unseen), and every
        file it lists identical."""
        pinned = set(pinned)
        return version == self.sglang and bool(pinned) and pinned <= set(self.files) and all(
            hashes.get(rel) == digest for rel, digest in self.files.items())

    def uncovered(self, pinned: Iterable[str]) -> list[str]:
        """The pinned files this entry does not vouch for (none for a usable entry)."""
        return sorted(set(pinned) - set(self.files))


def _shown(value: Any) -> str:
    """A bad value in a message: its repr, cut short (a file can hold anything)."""
    text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _text(where: str, entry: dict[str, Any], key: str, *, required: bool = True) -> str:
    value = entry.get(key, None if required else "")
    if not isinstance(value, str) or (required and not value.strip()):
        raise QualificationError(f"{where}.{key}: expected a non-empty string, got {_shown(value)}")
    return value


def _entry(where: str, entry: Any) -> Qualification:
    if not isinstance(entry, dict):
        raise QualificationError(f"{where}: expected an object, got {type(entry).__name__}")
    files = entry.get("files")
    if not isinstance(files, dict) or not files:
        raise QualificationError(f"{where}.files: expected an object of file -> sha256, got {_shown(files)}")
    for rel, digest in files.items():
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
            raise QualificationError(f"{where}.files[{_shown(rel)}]: expected a sha256 (64 hex digits), got {_shown(digest)}")
    stages = entry.get("stages", {})
    if not isinstance(stages, dict) or not all(isinstance(v, str) for v in stages.values()):
        raise QualificationError(f"{where}.stages: expected an object of stage -> status, got {_shown(stages)}")
    return Qualification(
        sglang=_text(where, entry, "sglang"), files=dict(files), run=_text(where, entry, "run"),
        host=_text(where, entry, "host"), release=_text(where, entry, "release", required=False),
        stages=dict(stages), qualified_at=_text(where, entry, "qualified_at", required=False))


def parse(text: str, source: str) -> list[Qualification]:
    """Raises QualificationError naming `source` and the field (JSON nested at most
    bounded_files.MAX_DEPTH deep: the file may come from anyone with write access to it)."""
    try:
        document = parse_json(text, source)
    except FileRefused as err:
        raise QualificationError(str(err)) from None
    if not isinstance(document, dict) or not isinstance(document.get("qualified"), list):
        raise QualificationError(f"{source}: expected an object with a `qualified` list")
    try:
        return [_entry(f"qualified[{i}]", e) for i, e in enumerate(document["qualified"])]
    except QualificationError as err:
        raise QualificationError(f"{source}: {err}") from None


def load(path: Path) -> list[Qualification]:
    """The file's entries; [] when it does not exist yet. Read by the bounded reader: a regular
    file (never a FIFO or a device) of bounded size, UTF-8."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        return []
    except FileRefused as err:
        raise QualificationError(f"{path}: cannot read: {err.why}") from None
    return parse(text, str(path))


def render(entries: list[Qualification]) -> str:
    return json.dumps({"qualified": [e.to_dict() for e in entries]}, indent=1) + "\n"


def find(entries: list[Qualification], version: str | None, hashes: dict[str, str],
         pinned: Iterable[str]) -> Qualification | None:
    pinned = list(pinned)
    return next((e for e in entries if e.matches(version, hashes, pinned)), None)
