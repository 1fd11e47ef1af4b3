"""The compatibility gate: is this SGLang installation one the plugin was built against?

Static only (files, hashes, `ast`), never an import of sglang, so it runs on any host,
GPU or not, before anything is installed. Stdlib only. Two levels of evidence: the
structure (every hooked name and signature, and the worker's AST facts) and the pins (the
version and file hashes of a shipped manifest, or of an entry of a qualification file).

    python -m ddtree.sglang.gate [--package-dir DIR] [--qualified FILE] [--json]

exit 0: passes; 1: findings (printed, one line each); 2: no sglang found, or a bad file.
"""
from __future__ import annotations

import argparse
import ast
import gc
import importlib.util
import json
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

from ddtree.sglang.manifest import (
    PARSED_TEXTS_KEPT,
    Manifest,
    RequiredName,
    SourceSnapshot,
    definition_digest,
    describe_static,
    find_definition,
    module_digest,
    parse_text,
    read_plain_file,
    version_key,
)
from ddtree.sglang.manifests import newest
from ddtree.sglang.qualification import FILE_NAME as QUALIFICATION_FILE
from ddtree.sglang.qualification import Qualification, QualificationError
from ddtree.sglang.qualification import load as load_qualifications
from ddtree.sglang.qualification import find as find_qualification
from ddtree.sglang.structure import check_worker, worker_source


class Evidence(Enum):
    """Two levels, reported separately: the structure decides whether the plugin can work;
    the pins say whether this exact SGLang is one we (or the operator's fleet) tested."""

    STRUCTURE = "structure"  # hooked names, signatures, the worker's AST facts
    PINS = "pins"  # version and file hashes match a shipped manifest


class FindingKind(Enum):
    UNKNOWN_VERSION = "unknown-version"
    MISSING_FILE = "missing-file"
    HASH_MISMATCH = "hash-mismatch"
    NAME_MISMATCH = "name-mismatch"  # missing name, changed signature, fields or value
    UNPARSABLE = "unparsable"
    BYTECODE_MISMATCH = "bytecode-mismatch"  # the .pyc Python would run is not the gated source (no qualification vouches for it)
    WORKER_FACT = "worker-fact"  # something the worker's code assumes no longer holds

    @property
    def evidence(self) -> Evidence:
        return Evidence.PINS if self in (FindingKind.UNKNOWN_VERSION, FindingKind.HASH_MISMATCH) else Evidence.STRUCTURE


@dataclass(frozen=True)
class GateFinding:
    kind: FindingKind
    file: str  # absolute path of the offending file (or the package dir)
    detail: str
    name: str | None = None  # the SGLang qualname a structural finding is about (the hook)

    def line(self) -> str:
        return f"{self.file}: {self.kind.value}: {self.detail}"


@dataclass
class GateReport:
    package_dir: str
    version: str | None
    manifest_version: str | None  # the manifest the pins were compared with
    findings: list[GateFinding] = field(default_factory=list)
    file_sha256: dict[str, str] = field(default_factory=dict)  # the pinned files as installed
    qualified_by: dict[str, Any] | None = None  # the qualification entry that vouches for drifted pins
    # every file the gate read (pinned, named, the worker's facts), as it read it: the probe
    # imports these files only from bytes with these hashes
    checked_sha256: dict[str, str] = field(default_factory=dict)
    # pinned files whose code (not only comments or layout) differs from the manifest's: a
    # qualification of such a build needs an end-to-end pass (QUALIFICATION_NEEDS_E2E)
    code_changed: list[str] = field(default_factory=list)
    qualification_note: str | None = None  # why a matching qualification entry does not vouch

    def of(self, evidence: Evidence) -> list[GateFinding]:
        return [f for f in self.findings if f.kind.evidence is evidence]

    @property
    def structure_ok(self) -> bool:
        return not self.of(Evidence.STRUCTURE)

    @property
    def pinned(self) -> bool:
        return not self.of(Evidence.PINS)

    @property
    def ok(self) -> bool:
        """Deployable: the structure holds, and the pins match or the version is qualified."""
        return self.structure_ok and (self.pinned or self.qualified_by is not None)

    @property
    def broken_hooks(self) -> list[str]:
        return list(dict.fromkeys(f.name or f.detail for f in self.of(Evidence.STRUCTURE)))

    @property
    def drifted_files(self) -> list[str]:
        return [f.file for f in self.findings if f.kind is FindingKind.HASH_MISMATCH]

    def verdict(self) -> str:
        """One phrase: what the evidence says."""
        if not self.structure_ok:
            return "structure differs"
        if self.pinned:
            return "structure ok, pinned"
        drift = "hashes drifted" if self.drifted_files else "version not pinned"
        if self.qualified_by is not None:
            return "structure ok, %s, qualified (run %s)" % (drift, self.qualified_by.get("run"))
        return "structure ok, %s, not qualified" % drift

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "structure_ok": self.structure_ok,
            "pinned": self.pinned,
            "qualified_by": self.qualified_by,
            "verdict": self.verdict(),
            "package_dir": self.package_dir,
            "version": self.version,
            "manifest_version": self.manifest_version,
            "broken_hooks": self.broken_hooks,
            "file_sha256": self.file_sha256,
            "checked_sha256": self.checked_sha256,
            "code_changed": self.code_changed,
            "qualification_note": self.qualification_note,
            "findings": [
                {"kind": f.kind.value, "evidence": f.kind.evidence.value, "file": f.file, "detail": f.detail,
                 "name": f.name}
                for f in self.findings
            ],
        }


def _metadata_field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        if not line.strip():
            break  # headers end at the first blank line
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def read_installed_version(package_dir: Path) -> str | None:
    """The version of the sglang distribution that owns `package_dir`, read from files."""
    for dist in sorted(package_dir.parent.glob("sglang-*.dist-info")):
        try:
            text = read_plain_file(dist / "METADATA").decode("utf-8", errors="replace")
        except OSError:
            continue  # absent, not a plain file, too large: not a distribution to read
        if (_metadata_field(text, "Name") or "").lower() == "sglang":
            return _metadata_field(text, "Version")
    try:
        tree = parse_text(read_plain_file(package_dir / "_version.py").decode("utf-8", errors="replace"))
    except (OSError, SyntaxError):
        tree = None
    if tree is not None:
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets
            ):
                try:
                    value = ast.literal_eval(stmt.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return None  # not a literal: no version we can read
                return value if isinstance(value, str) else None
    return None


def find_package_dir() -> Path | None:
    """Where this interpreter would import sglang from (find_spec runs no package code)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _changed_definitions(tree: ast.Module | None, names: list[RequiredName]) -> list[str]:
    return [r.qualname for r in names if r.ast_sha256 is not None and (
        tree is None or (node := find_definition(tree, r.qualname)) is None
        or definition_digest(node) != r.ast_sha256)]


def code_unchanged(files: SourceSnapshot, manifest: Manifest, rel: str) -> bool:
    """Whether a pinned file's code is the manifest's (only comments or layout differ). False
    when unsure: no digest in the manifest, an unparsable file, or another Python whose syntax
    trees print differently from the one that made the manifest (3.11)."""
    expected = manifest.file_ast_sha256.get(rel)
    try:
        return expected is not None and module_digest(files.tree(rel)) == expected
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False


def drift_detail(files: SourceSnapshot, manifest: Manifest, rel: str) -> str:
    """Where a drifted file changed: in the definitions the plugin hooks, or elsewhere."""
    if code_unchanged(files, manifest, rel):
        return "comments or formatting only (its code is the pinned code)"
    hooked = [r for r in manifest.names if r.file == rel]
    if not hooked:
        return "no hooked definition in this file"
    try:
        tree: ast.Module | None = files.tree(rel)
    except (OSError, SyntaxError, UnicodeDecodeError):
        tree = None
    changed = _changed_definitions(tree, hooked)
    if changed:
        return "hooked definitions changed: " + ", ".join(changed)
    return "changed only outside the hooked definitions"


def check_files(package_dir: Path, manifest: Manifest,
                files: SourceSnapshot | None = None) -> tuple[list[GateFinding], dict[str, str]]:
    files = files or SourceSnapshot(package_dir)
    findings: list[GateFinding] = []
    hashes: dict[str, str] = {}
    for rel, expected in manifest.file_sha256.items():
        path = package_dir / rel
        why = files.unreadable(rel)
        if why is not None:
            findings.append(GateFinding(FindingKind.MISSING_FILE, str(path), why, rel))
            continue
        actual = hashes[rel] = files.sha256(rel)
        if actual != expected:
            findings.append(
                GateFinding(
                    FindingKind.HASH_MISMATCH,
                    str(path),
                    f"sha256 {actual[:16]}..., sglang {manifest.sglang_version} has {expected[:16]}...; "
                    + drift_detail(files, manifest, rel),
                )
            )
    return findings, hashes


def check_names(package_dir: Path, manifest: Manifest, files: SourceSnapshot | None = None) -> list[GateFinding]:
    files = files or SourceSnapshot(package_dir)
    findings: list[GateFinding] = []
    parsed: dict[str, ast.Module | None] = {}
    for required in manifest.names:
        path = package_dir / required.file
        if required.file not in parsed:
            try:
                parsed[required.file] = files.tree(required.file)
            except OSError:
                parsed[required.file] = None
                findings.append(GateFinding(FindingKind.MISSING_FILE, str(path), files.unreadable(required.file) or
                                            "not found", required.file))
            except (SyntaxError, UnicodeDecodeError) as err:
                parsed[required.file] = None
                findings.append(GateFinding(FindingKind.UNPARSABLE, str(path), str(err), required.file))
        tree = parsed[required.file]
        if tree is None:
            continue
        ok, detail = describe_static(tree, required)
        if not ok:
            findings.append(GateFinding(FindingKind.NAME_MISMATCH, str(path), f"{required.qualname}: {detail}",
                                        required.qualname))
    return findings


# (cache file optimization tag, compile() optimize level): the caches an interpreter may run
OPTIMIZATION_LEVELS = (("", 0), ("1", 1), ("2", 2))


def bytecode_python_would_run(source_path: Path, source: bytes, pyc: bytes) -> bool:
    """True when this interpreter's import system would execute `pyc` instead of compiling
    `source_path` (importlib's own rules): our magic number and either a timestamp header
    matching the source's mtime and size, an unchecked hash-based pyc, or a checked one whose
    source hash matches."""
    import importlib.util

    if len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(pyc[4:8], "little")
    if flags & 0b1:  # hash-based
        return not flags & 0b10 or pyc[8:16] == importlib.util.source_hash(source)
    stat = source_path.stat()
    return (int.from_bytes(pyc[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(pyc[12:16], "little") == stat.st_size & 0xFFFFFFFF)


@lru_cache(maxsize=PARSED_TEXTS_KEPT)  # as `parse_text`: a gate run again compiles the same files
def _compiled(source: bytes, level: int) -> types.CodeType:
    """The code `source` compiles to (the file name is left out: code objects compare without it)."""
    return compile(source, "<gated>", "exec", dont_inherit=True, optimize=level)


def check_bytecode(package_dir: Path, manifest: Manifest, files: SourceSnapshot | None = None) -> list[GateFinding]:
    """The gate reads sources, but Python runs a cached .pyc when its header says it is fresh
    (and never looks at the source again): each gated file's caches that would run must hold
    exactly the code its source compiles to. Code objects compare by bytecode, constants,
    names and nested code (not by file name), so a cache pip or Python wrote passes."""
    import importlib.util
    import marshal

    files = files or SourceSnapshot(package_dir)
    findings: list[GateFinding] = []
    if sys.implementation.cache_tag is None:
        return findings  # this interpreter neither writes nor reads bytecode caches
    for rel in sorted(set(manifest.file_sha256) | {r.file for r in manifest.names}):
        path = package_dir / rel
        if not files.is_file(rel):
            continue  # reported by the other checks
        source = files.read(rel)
        for tag, level in OPTIMIZATION_LEVELS:
            cache = Path(importlib.util.cache_from_source(str(path), optimization=tag))
            try:
                pyc = cache.read_bytes()
            except OSError:
                continue
            if not bytecode_python_would_run(path, source, pyc):
                continue  # stale or foreign: Python recompiles from the (gated) source
            try:
                same = marshal.loads(pyc[16:]) == _compiled(source, level)
            except (ValueError, EOFError, TypeError, SyntaxError, RecursionError, MemoryError):
                same = False
            if not same:
                findings.append(GateFinding(FindingKind.BYTECODE_MISMATCH, str(cache),
                                            f"cached bytecode that would run instead of {rel} is not compiled from it"
                                            " (delete the file; Python rewrites it from the source)"))
    return findings


def check_worker_facts(package_dir: Path, worker: str | None, tree_round: str | None = None,
                       files: SourceSnapshot | None = None) -> list[GateFinding]:
    if worker is None:
        return [GateFinding(FindingKind.WORKER_FACT, str(package_dir),
                            "the worker's source is not available to check its facts", "worker.py")]
    report = check_worker(package_dir, worker, tree_round, files)
    return [GateFinding(FindingKind.WORKER_FACT, str(package_dir / fact.file), f"{fact.name}: {fact.detail}", fact.name)
            for fact in report.broken]


@contextmanager
def collector_paused():
    """No garbage collection inside: the gate parses and walks ~2 MB of SGLang source, and its
    allocations set off full collections that each walk every object of the process (about a
    million after `import torch`): half the gate's CPU time. Whatever it leaves for the
    collector is collected once the block ends."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def run_gate(
    package_dir: Path,
    manifests: dict[str, Manifest] | None = None,
    *,
    qualifications: list[Qualification] | None = None,
    worker: str | None | bool = True,
    tree_round: str | None = None,
) -> GateReport:
    """Both levels of evidence for one installation. An unknown version is checked against
    the newest manifest (the structure this plugin was written against), so the operator
    sees exactly what differs. `worker`: the worker's source (True: find it; False: skip);
    `tree_round`: tree_round.py's source (None: find it)."""
    with collector_paused():
        return _run_gate(package_dir, manifests, qualifications, worker, tree_round)


def _run_gate(package_dir: Path, manifests: dict[str, Manifest] | None, qualifications: list[Qualification] | None,
              worker: str | None | bool, tree_round: str | None) -> GateReport:
    if manifests is None:
        from ddtree.sglang.manifests import SUPPORTED as manifests
    version = read_installed_version(package_dir)
    manifest = manifests.get(version or "")
    findings: list[GateFinding] = []
    if manifest is None:
        supported = ", ".join(sorted(manifests, key=version_key)) or "none"
        findings.append(
            GateFinding(
                FindingKind.UNKNOWN_VERSION,
                str(package_dir),
                f"sglang {version or '(version unreadable)'} is not pinned (shipped manifests: {supported})",
            )
        )
        manifest = newest(manifests)
    hashes: dict[str, str] = {}
    files = SourceSnapshot(package_dir)  # every check reads the same bytes
    if manifest is None:
        findings.append(GateFinding(FindingKind.NAME_MISMATCH, str(package_dir),
                                    "no manifest is shipped: the structure cannot be checked", "manifest"))
    else:
        file_findings, hashes = check_files(package_dir, manifest, files)
        facts = check_worker_facts(package_dir, worker_source() if worker is True else worker, tree_round, files) \
            if worker is not False else []
        for finding in file_findings + check_names(package_dir, manifest, files) + facts \
                + check_bytecode(package_dir, manifest, files):
            if not any(f.file == finding.file and (f.kind is FindingKind.MISSING_FILE or (f.kind, f.name) ==
                       (finding.kind, finding.name)) for f in findings):  # each file/hook reported once
                findings.append(finding)
    report = GateReport(package_dir=str(package_dir), version=version,
                        manifest_version=manifest.sglang_version if manifest else None,
                        findings=findings, file_sha256=hashes, checked_sha256=files.checked_sha256)
    if manifest is not None:
        report.code_changed = [rel for rel in manifest.file_sha256 if rel in hashes
                               and hashes[rel] != manifest.file_sha256[rel] and not code_unchanged(files, manifest, rel)]
    if not report.pinned and qualifications:
        pinned = manifest.file_sha256 if manifest is not None else {}
        entry = find_qualification(qualifications, version, hashes, pinned)
        if entry is not None:
            report.qualification_note = e2e_missing(entry, report.code_changed)
            if report.qualification_note is None:
                report.qualified_by = {k: v for k, v in entry.to_dict().items() if k != "files"}
    return report


QUALIFICATION_NEEDS_E2E = "sglang-e2e"  # the stage that must have passed when pinned code changed


def e2e_missing(entry: Qualification, code_changed: list[str]) -> str | None:
    """Why `entry` cannot vouch for a build whose pinned code changed (None: it can): the
    `plugin` stage only checks structure and that the hooks take, statically on a host without
    a GPU; changed code (eagle_sample's accept logic, a helper it calls) needs the tokens
    served end to end and compared, on a GPU or the CPU test server."""
    if not code_changed or entry.stages.get(QUALIFICATION_NEEDS_E2E) == "pass":
        return None
    shown = ", ".join(code_changed[:3]) + (f" (+{len(code_changed) - 3} more)" if len(code_changed) > 3 else "")
    return (f"the qualification by run {entry.run} ({', '.join(f'{k} {v}' for k, v in entry.stages.items()) or 'no stages'})"
            f" does not vouch for it: code changed in {shown}, which needs {QUALIFICATION_NEEDS_E2E} to have passed"
            " (a GPU host, or the CPU test server)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.sglang.gate", description=__doc__.splitlines()[0])
    parser.add_argument("--package-dir", type=Path, help="the `sglang` package directory (default: find it)")
    parser.add_argument("--qualified", type=Path, metavar="FILE",
                        help=f"a qualification file ({QUALIFICATION_FILE}): drifted hashes it vouches for pass")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    package_dir = args.package_dir or find_package_dir()
    if package_dir is None or not package_dir.is_dir():
        message = f"sglang not found by {sys.executable}" if args.package_dir is None else \
            f"{args.package_dir}: not a directory"
        print(json.dumps({"ok": False, "error": message}) if args.json else message)
        return 2
    try:
        qualifications = load_qualifications(args.qualified) if args.qualified else []
    except QualificationError as err:
        print(json.dumps({"ok": False, "error": str(err)}) if args.json else err)
        return 2
    try:
        report = run_gate(package_dir, qualifications=qualifications)
    except (OSError, ValueError, SyntaxError, RecursionError) as err:  # a file the gate cannot read as one
        message = f"{package_dir}: cannot check this sglang: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(json.dumps({"ok": False, "error": message}) if args.json else message)
        return 2
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"sglang {report.version} at {report.package_dir}: {report.verdict()}: "
              f"{'passes' if report.ok else 'REFUSED'}")
        for evidence in Evidence:  # the structure decides: it comes first
            for finding in report.of(evidence):
                print(f"{evidence.value}: {finding.line()}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
