"""What changed between two SGLang installations in the files the gate checks, by hook.

For every file the gate reads in either installation (the files a shipped manifest pins or
names, and those the worker's structural facts read, such as logits_processor.py):
unchanged, or changed and how: each hooked definition whose signature or code changed (code:
its syntax tree, so comments and formatting do not count), and the other definitions of that
file that changed. A reviewer sees at a glance whether an upgrade touches what the plugin
depends on. Stdlib only.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ddtree.sglang.gate import read_installed_version
from ddtree.sglang.manifest import (
    Manifest,
    NameKind,
    SourceSnapshot,
    definition_digest,
    find_definition,
    signature_from_ast,
)


class Change(Enum):
    SAME = "same"
    CODE = "code changed"  # same signature, different body
    SIGNATURE = "signature changed"
    REMOVED = "removed"
    ADDED = "added"


@dataclass(frozen=True)
class HookChange:
    qualname: str
    change: Change
    detail: str = ""


class CheckedAs(Enum):
    """How the gate checks a file (the first that applies)."""

    PINNED = "pinned"  # its sha256 is pinned
    NAMED = "hooked names"  # names the plugin hooks or calls are checked in it
    WORKER_FACTS = "worker facts"  # the worker's structural facts read it


@dataclass
class FileDiff:
    file: str
    state: str  # "same", "changed", "only in A", "only in B", "in neither", "unreadable in A: why" (or B)
    hooks: list[HookChange] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # other definitions that changed
    checked_as: CheckedAs = CheckedAs.PINNED

    @property
    def hooks_touched(self) -> list[HookChange]:
        return [h for h in self.hooks if h.change is not Change.SAME]


@dataclass
class SglangDiff:
    a: str
    b: str
    version_a: str | None
    version_b: str | None
    files: list[FileDiff]

    @property
    def hooks_touched(self) -> list[str]:
        return [h.qualname for f in self.files for h in f.hooks_touched]

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "version_a": self.version_a, "version_b": self.version_b,
                "hooks_touched": self.hooks_touched,
                "files": [{"file": f.file, "state": f.state, "checked_as": f.checked_as.value, "elsewhere": f.elsewhere,
                           "hooks": [{"name": h.qualname, "change": h.change.value, "detail": h.detail}
                                     for h in f.hooks]} for f in self.files]}


def definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions and classes, and the methods of those classes, by qualname."""
    found: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.ClassDef):
            # the class itself without its methods (each method is its own entry)
            found[stmt.name] = ast.ClassDef(
                name=stmt.name, bases=stmt.bases, keywords=stmt.keywords, decorator_list=stmt.decorator_list,
                body=[s for s in stmt.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))],
                type_params=getattr(stmt, "type_params", []))
            for inner in stmt.body:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{stmt.name}.{inner.name}"] = inner
    return found


def _parse(files: SourceSnapshot, rel: str) -> ast.Module | None:
    try:
        return files.tree(rel)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _signature(node: ast.AST, kind: NameKind) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return signature_from_ast(node, drop_first=kind is not NameKind.FUNCTION)
    return None


def _hook_change(tree_a: ast.Module, tree_b: ast.Module, qualname: str, kind: NameKind) -> HookChange:
    node_a, node_b = find_definition(tree_a, qualname), find_definition(tree_b, qualname)
    if node_a is None and node_b is None:
        return HookChange(qualname, Change.SAME, "in neither")
    if node_b is None:
        return HookChange(qualname, Change.REMOVED)
    if node_a is None:
        return HookChange(qualname, Change.ADDED)
    sig_a, sig_b = _signature(node_a, kind), _signature(node_b, kind)
    if sig_a != sig_b:
        return HookChange(qualname, Change.SIGNATURE, f"{sig_a} -> {sig_b}")
    if definition_digest(node_a) != definition_digest(node_b):
        return HookChange(qualname, Change.CODE)
    return HookChange(qualname, Change.SAME)


def diff_file(a: Path, b: Path, rel: str, manifest: Manifest,
              files_a: SourceSnapshot | None = None, files_b: SourceSnapshot | None = None) -> FileDiff:
    """How `rel` differs between the installations `a` and `b` (read through SourceSnapshot:
    a FIFO, a device or a huge file is unreadable, never a hang)."""
    files_a, files_b = files_a or SourceSnapshot(a), files_b or SourceSnapshot(b)
    why_a, why_b = files_a.unreadable(rel), files_b.unreadable(rel)
    if why_a == why_b == "not found":
        return FileDiff(rel, "in neither")
    if why_a == "not found" or why_b == "not found":
        return FileDiff(rel, "only in B" if why_a else "only in A")
    if why_a or why_b:
        return FileDiff(rel, f"unreadable in {'A' if why_a else 'B'}: {why_a or why_b}")
    if files_a.sha256(rel) == files_b.sha256(rel):
        return FileDiff(rel, "same")
    tree_a, tree_b = _parse(files_a, rel), _parse(files_b, rel)
    if tree_a is None or tree_b is None:
        return FileDiff(rel, "changed", elsewhere=["(a file does not parse)"])
    required = [r for r in manifest.names if r.file == rel]
    hooks = [_hook_change(tree_a, tree_b, r.qualname, r.kind) for r in required]
    hooked = {r.qualname for r in required}
    defs_a, defs_b = definitions(tree_a), definitions(tree_b)
    elsewhere = []
    for name in sorted(set(defs_a) | set(defs_b)):
        if name in hooked or any(name.startswith(h + ".") for h in hooked):
            continue
        if name not in defs_a or name not in defs_b or definition_digest(defs_a[name]) != definition_digest(defs_b[name]):
            elsewhere.append(name)
    return FileDiff(rel, "changed", hooks, elsewhere)


def hooked_files(manifest: Manifest) -> list[str]:
    return list(dict.fromkeys([*manifest.file_sha256, *(r.file for r in manifest.names)]))


def checked_files(a: Path, b: Path, manifest: Manifest) -> dict[str, CheckedAs]:
    """Every file the gate reads in `a` or in `b` (pinned and named files first, in the
    manifest's order, then the worker's facts' files by name), and how it checks each."""
    from ddtree.sglang.gate import run_gate

    found = {rel: CheckedAs.PINNED for rel in manifest.file_sha256}
    for rel in hooked_files(manifest):
        found.setdefault(rel, CheckedAs.NAMED)
    read = set()
    for package in (a, b):
        read |= set(run_gate(package, {manifest.sglang_version: manifest}).checked_sha256)
    for rel in sorted(read):
        found.setdefault(rel, CheckedAs.WORKER_FACTS)
    return found


def diff_installations(a: Path, b: Path, manifest: Manifest) -> SglangDiff:
    """`a`, `b`: two `sglang` package directories."""
    files, files_a, files_b = [], SourceSnapshot(a), SourceSnapshot(b)
    for rel, checked_as in checked_files(a, b, manifest).items():
        diff = diff_file(a, b, rel, manifest, files_a, files_b)
        diff.checked_as = checked_as
        files.append(diff)
    return SglangDiff(str(a), str(b), read_installed_version(a), read_installed_version(b), files)
