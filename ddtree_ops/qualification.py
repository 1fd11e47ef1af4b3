"""The operator's SGLang qualification file (`sglang-qualified.json` next to the inventory):
where it is, reading it (a malformed file is a config error, exit 3) and adding an entry.

The format and the matching rule live in ddtree.sglang.qualification (the gate on the host
applies them); this module only finds, loads and writes the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ddtree.sglang.qualification import FILE_NAME, Qualification, QualificationError, load, render

from ddtree_ops.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ddtree_ops.results import RunRecord


@dataclass(frozen=True)
class QualificationFile:
    path: Path
    entries: list[Qualification] = field(default_factory=list)


def default_path(inventory_source: str) -> Path:
    """Next to the inventory file (the embedded inventory: the current directory)."""
    inventory = Path(inventory_source)
    return (inventory.parent if inventory.is_file() else Path.cwd()) / FILE_NAME


def load_file(explicit: Optional[Path], inventory_source: str, *, create: bool = False) -> QualificationFile:
    """The file named (it must exist, unless `create`: qualify writes it) or the default one
    (absent: no entries)."""
    path = explicit if explicit is not None else default_path(inventory_source)
    if explicit is not None and not create and not path.exists():
        raise ConfigError(f"{path}: qualification file not found")
    try:
        return QualificationFile(path, load(path))
    except QualificationError as err:
        raise ConfigError(str(err)) from None


def add_entry(qualified: QualificationFile, entry: Qualification) -> QualificationFile:
    """Append `entry` (an entry for the same version and files is replaced: the newest run is
    the evidence) and write the file whole, atomically."""
    from ddtree_ops.hostside.safe_write import WriteRefused, write_file

    kept = [e for e in qualified.entries if not (e.sglang == entry.sglang and e.files == entry.files)]
    updated = QualificationFile(qualified.path, kept + [entry])
    try:  # a link at the file's name is replaced, never written through
        write_file(qualified.path.parent, qualified.path.name, render(updated.entries))
    except WriteRefused as err:
        raise ConfigError(f"{qualified.path}: cannot write: {err.why}") from None
    return updated


QUALIFYING_STAGES = ("plugin", "sglang-e2e")  # what a qualification may run; `plugin` always


def entry_from_run(run: "RunRecord", host: str, stages: list[str], release: str, now: str, *,
                   version: Optional[str], hashes: dict[str, str], pinned: list[str],
                   code_changed: Optional[list[str]] = None) -> tuple[Optional[Qualification], str]:
    """The qualification one host's run earns (None and why not): every stage passed, the
    structure held, and the files are the ones ddtree-ops hashed itself (`hashes`, from
    ddtree_ops.pinned_files), covering every file the manifest pins (`pinned`). What the host's
    plugin stage reported is only checked against them, never recorded. `code_changed`: the
    pinned files whose code changed, as the host's gate saw them: then sglang-e2e must have
    passed too (the gate applies the same rule to the entry: ddtree.sglang.gate.e2e_missing)."""
    record = run.hosts.get(host)
    if record is None:
        return None, "no results in the run"
    if code_changed and QUALIFYING_STAGES[1] not in stages:
        return None, (f"code changed in {', '.join(code_changed[:3])}: a static check (plugin) cannot vouch for "
                      f"it; {QUALIFYING_STAGES[1]} must pass too")
    statuses = {name: (record.stages[name].status.value if name in record.stages else "not_run") for name in stages}
    failed = [f"{name} {status}" for name, status in statuses.items() if status != "pass"]
    if failed:
        reasons = [record.stages[name].reason for name in stages if name in record.stages and record.stages[name].reason
                   and statuses[name] != "pass"]
        return None, ", ".join(failed) + (f" ({reasons[0]})" if reasons else "")
    plugin = record.stages["plugin"].metrics
    if not plugin.get("structure_ok") or not isinstance(version, str):
        return None, "the plugin stage did not report a sound structure"
    if plugin.get("pinned"):
        return None, f"sglang {version} is pinned by a shipped manifest: nothing to record"
    if not pinned:
        return None, f"no shipped manifest pins any file to hash for sglang {version}"
    uncovered = sorted(set(pinned) - set(hashes))
    if uncovered:
        return None, (f"ddtree-ops hashed {len(pinned) - len(uncovered)} of the {len(pinned)} pinned files "
                      f"(missing on the host: {', '.join(uncovered)})")
    said = plugin.get("file_sha256")
    differs = sorted(rel for rel, digest in said.items() if hashes.get(rel) != digest) if isinstance(said, dict) else []
    if differs or plugin.get("sglang") not in (None, version):
        what = f"hashes for {', '.join(differs[:3])}" if differs else f"version {plugin.get('sglang')!r:.40}"
        return None, f"the host's plugin stage reported other {what} than ddtree-ops read from its files"
    return Qualification(sglang=version, files={rel: hashes[rel] for rel in pinned}, run=run.run_id, host=host,
                         release=release, stages=statuses, qualified_at=now), ""
