"""The compatibility gate: is this SGLang installation one the plugin was built against?

Static only (files, hashes, `ast`), never an import of sglang, so it runs on any host,
GPU or not, before anything is installed. Stdlib only.

    python -m ddtree.sglang.gate [--package-dir DIR] [--json]

exit 0: passes; 1: findings (printed, one line each); 2: no sglang found.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ddtree.sglang.manifest import Manifest, describe_static, sha256_file


class FindingKind(Enum):
    UNKNOWN_VERSION = "unknown-version"
    MISSING_FILE = "missing-file"
    HASH_MISMATCH = "hash-mismatch"
    NAME_MISMATCH = "name-mismatch"  # missing name, changed signature, fields or value
    UNPARSABLE = "unparsable"
    BYTECODE_MISMATCH = "bytecode-mismatch"  # the cached .pyc Python would run is not the gated source


@dataclass(frozen=True)
class GateFinding:
    kind: FindingKind
    file: str  # absolute path of the offending file (or the package dir)
    detail: str

    def line(self) -> str:
        return f"{self.file}: {self.kind.value}: {self.detail}"


@dataclass
class GateReport:
    package_dir: str
    version: str | None
    manifest_version: str | None
    findings: list[GateFinding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "package_dir": self.package_dir,
            "version": self.version,
            "manifest_version": self.manifest_version,
            "findings": [
                {"kind": f.kind.value, "file": f.file, "detail": f.detail} for f in self.findings
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
        metadata = dist / "METADATA"
        if metadata.is_file():
            text = metadata.read_text(encoding="utf-8", errors="replace")
            if (_metadata_field(text, "Name") or "").lower() == "sglang":
                return _metadata_field(text, "Version")
    version_file = package_dir / "_version.py"
    if version_file.is_file():
        tree = ast.parse(version_file.read_text(encoding="utf-8"))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets
            ):
                value = ast.literal_eval(stmt.value)
                return value if isinstance(value, str) else None
    return None


def find_package_dir() -> Path | None:
    """Where this interpreter would import sglang from (find_spec runs no package code)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def check_files(package_dir: Path, manifest: Manifest) -> list[GateFinding]:
    findings: list[GateFinding] = []
    for rel, expected in manifest.file_sha256.items():
        path = package_dir / rel
        if not path.is_file():
            findings.append(GateFinding(FindingKind.MISSING_FILE, str(path), "not found"))
            continue
        actual = sha256_file(path)
        if actual != expected:
            findings.append(
                GateFinding(
                    FindingKind.HASH_MISMATCH,
                    str(path),
                    f"sha256 {actual[:16]}..., sglang {manifest.sglang_version} has {expected[:16]}...",
                )
            )
    return findings


def check_names(package_dir: Path, manifest: Manifest) -> list[GateFinding]:
    findings: list[GateFinding] = []
    parsed: dict[str, ast.Module | None] = {}
    for required in manifest.names:
        path = package_dir / required.file
        if required.file not in parsed:
            try:
                parsed[required.file] = ast.parse(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                parsed[required.file] = None
                findings.append(GateFinding(FindingKind.MISSING_FILE, str(path), "not found"))
            except (SyntaxError, UnicodeDecodeError) as err:
                parsed[required.file] = None
                findings.append(GateFinding(FindingKind.UNPARSABLE, str(path), str(err)))
        tree = parsed[required.file]
        if tree is None:
            continue
        ok, detail = describe_static(tree, required)
        if not ok:
            findings.append(
                GateFinding(FindingKind.NAME_MISMATCH, str(path), f"{required.qualname}: {detail}")
            )
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


def check_bytecode(package_dir: Path, manifest: Manifest) -> list[GateFinding]:
    """The gate reads sources, but Python runs a cached .pyc when its header says it is fresh
    (and never looks at the source again): each gated file's caches that would run must hold
    exactly the code its source compiles to. Code objects compare by bytecode, constants,
    names and nested code (not by file name), so a cache pip or Python wrote passes."""
    import importlib.util
    import marshal

    findings: list[GateFinding] = []
    if sys.implementation.cache_tag is None:
        return findings  # this interpreter neither writes nor reads bytecode caches
    for rel in sorted(set(manifest.file_sha256) | {r.file for r in manifest.names}):
        path = package_dir / rel
        if not path.is_file():
            continue  # reported by the other checks
        source = path.read_bytes()
        for tag, level in OPTIMIZATION_LEVELS:
            cache = Path(importlib.util.cache_from_source(str(path), optimization=tag))
            try:
                pyc = cache.read_bytes()
            except OSError:
                continue
            if not bytecode_python_would_run(path, source, pyc):
                continue  # stale or foreign: Python recompiles from the (gated) source
            try:
                same = marshal.loads(pyc[16:]) == compile(source, str(path), "exec", dont_inherit=True, optimize=level)
            except (ValueError, EOFError, TypeError, SyntaxError):
                same = False
            if not same:
                findings.append(GateFinding(FindingKind.BYTECODE_MISMATCH, str(cache),
                                            f"cached bytecode that would run instead of {rel} is not compiled from it"
                                            " (delete the file; Python rewrites it from the source)"))
    return findings


def run_gate(package_dir: Path, manifests: dict[str, Manifest] | None = None) -> GateReport:
    """All findings for one installation. An unknown version is checked against the newest
    manifest too, so the operator sees what would break under --force."""
    if manifests is None:
        from ddtree.sglang.manifests import SUPPORTED as manifests
    version = read_installed_version(package_dir)
    manifest = manifests.get(version or "")
    findings: list[GateFinding] = []
    if manifest is None:
        supported = ", ".join(sorted(manifests)) or "none"
        findings.append(
            GateFinding(
                FindingKind.UNKNOWN_VERSION,
                str(package_dir),
                f"sglang {version or '(version unreadable)'} is not supported (supported: {supported})",
            )
        )
        manifest = manifests[max(manifests, key=_version_key)] if manifests else None
    if manifest is not None:
        checks = check_files(package_dir, manifest) + check_names(package_dir, manifest)
        for finding in checks + check_bytecode(package_dir, manifest):
            if finding not in findings:  # a file both checks need is reported missing once
                findings.append(finding)
    return GateReport(
        package_dir=str(package_dir),
        version=version,
        manifest_version=manifest.sglang_version if manifest else None,
        findings=findings,
    )


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.sglang.gate", description=__doc__.splitlines()[0])
    parser.add_argument("--package-dir", type=Path, help="the `sglang` package directory (default: find it)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    package_dir = args.package_dir or find_package_dir()
    if package_dir is None or not package_dir.is_dir():
        message = f"sglang not found by {sys.executable}"
        print(json.dumps({"ok": False, "error": message}) if args.json else message)
        return 2
    report = run_gate(package_dir)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"sglang {report.version} at {report.package_dir}: {'passes' if report.ok else 'REFUSED'}")
        for finding in report.findings:
            print(finding.line())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
