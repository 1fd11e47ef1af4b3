"""What the plugin relies on in one SGLang version, and how to read it without importing SGLang.

A manifest pins (1) the sha256 of every SGLang file we hook, subclass or call into, and
(2) the names we use there, each with its parameter list in a canonical form and the digest
of its definition's syntax tree. The same canonical form is produced statically (from the
file's `ast`) by the gate and at runtime (from `inspect.signature`) by the self-check, so
both compare against one string. The names are the structure the plugin expects; the file
hashes pin the exact release we tested. Shipped manifests are JSON data
(`manifests/sglang-<version>.json`, written by manifest_tool).

Stdlib only: the gate runs on hosts before anything is installed, in any Python.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path


class NameKind(Enum):
    FUNCTION = "function"  # module-level def
    METHOD = "method"  # def in a class body (first parameter dropped)
    CLASSMETHOD = "classmethod"  # @classmethod in a class body (first parameter dropped)
    CLASS = "class"  # a class must exist
    FIELDS = "fields"  # a class must declare these annotated fields (dataclass inputs)
    CONSTANT = "constant"  # a module-level NAME = <literal> with this exact value


@dataclass(frozen=True)
class RequiredName:
    file: str  # relative to the `sglang` package directory, '/'-separated
    qualname: str  # "_handle_dflash", "HookRegistry.register"
    kind: NameKind
    signature: str | None = None  # canonical parameter list, e.g. "(server_args)"
    fields: tuple[str, ...] = ()  # for FIELDS
    value: str | None = None  # repr() of the literal, for CONSTANT
    why: str = ""  # what the plugin does with it (shown in findings)
    ast_sha256: str | None = None  # definition_digest() of its definition in this version

    def to_dict(self) -> dict[str, object]:
        return {"file": self.file, "qualname": self.qualname, "kind": self.kind.value,
                "signature": self.signature, "fields": list(self.fields), "value": self.value,
                "why": self.why, "ast_sha256": self.ast_sha256}

    @classmethod
    def from_dict(cls, data: dict) -> "RequiredName":
        return cls(str(data["file"]), str(data["qualname"]), NameKind(data["kind"]), data.get("signature"),
                   tuple(data.get("fields") or ()), data.get("value"), str(data.get("why") or ""),
                   data.get("ast_sha256"))

    @property
    def module(self) -> str:
        """Dotted module name: 'srt/plugins/__init__.py' -> 'sglang.srt.plugins'."""
        parts = self.file[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(["sglang", *parts])

    @property
    def label(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Manifest:
    sglang_version: str
    file_sha256: dict[str, str] = field(default_factory=dict)  # relative path -> hex digest
    names: tuple[RequiredName, ...] = ()
    # relative path -> module_digest() of each pinned file: a file whose bytes drifted but whose
    # code did not (comments, formatting) is told apart from one whose code changed. Empty in an
    # older manifest: then every drifted file counts as changed code.
    file_ast_sha256: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        document = {"sglang_version": self.sglang_version, "file_sha256": self.file_sha256,
                    "file_ast_sha256": self.file_ast_sha256, "names": [r.to_dict() for r in self.names]}
        return json.dumps(document, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Raises ValueError (with the field) on a malformed document."""
        from ddtree.bounded_files import parse_json

        data = parse_json(text, "manifest")  # FileRefused (a ValueError) past the depth limit
        try:
            return cls(str(data["sglang_version"]), {str(k): str(v) for k, v in data["file_sha256"].items()},
                       tuple(RequiredName.from_dict(r) for r in data["names"]),
                       {str(k): str(v) for k, v in data.get("file_ast_sha256", {}).items()})
        except (KeyError, TypeError, AttributeError, RecursionError) as err:
            raise ValueError(f"malformed manifest: {type(err).__name__}: {err}") from None


def version_key(version: str) -> tuple[int, ...]:
    """Release order of 'X.Y.Z' versions (a non-numeric part sorts first)."""
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def definition_digest(node: ast.AST) -> str:
    """sha256 of a definition's syntax tree: comments, blank lines and line numbers do not
    count, any change to the code does."""
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode("utf-8")).hexdigest()


def module_digest(tree: ast.Module) -> str:
    """sha256 of a whole file's syntax tree: what its code is, comments and layout aside."""
    return definition_digest(tree)


# One gate run reads a file in several checks, and a process (the operator's, a deploy's)
# runs the gate again on the same files: a parse costs ~20 ms for a large SGLang file, the
# text compare that finds it again well under 1 ms. Keyed by the text itself, so an edited
# file is parsed anew; callers only read the trees, never change them.
PARSED_TEXTS_KEPT = 128


@lru_cache(maxsize=PARSED_TEXTS_KEPT)
def parse_text(text: str) -> ast.Module:
    """`ast.parse(text)`, remembered by content (the tree is shared: do not modify it). A text
    nested past what the parser's stack or memory takes (a hostile host's "SGLang file") is a
    SyntaxError like any other unparsable file, never a RecursionError or MemoryError."""
    try:
        return ast.parse(text)
    except (RecursionError, MemoryError):
        raise SyntaxError("nested too deep to parse") from None


def parse_file(path: Path) -> ast.Module:
    """The parsed UTF-8 file (OSError, UnicodeDecodeError and SyntaxError as from reading
    and parsing it)."""
    return parse_text(path.read_text(encoding="utf-8"))


SOURCE_READ_MAX = 16 << 20  # bytes; SGLang's largest source file is under 1 MB


class SourceSnapshot:
    """The files of one SGLang installation, each read once (a plain file, never a FIFO or a
    device, at most SOURCE_READ_MAX bytes): one gate run hashes, parses and compiles the same
    bytes, so a file changed during the run cannot pass one check with old bytes and another
    with new ones. `checked_sha256` is what the run read; the probe imports exactly those
    bytes (ddtree.sglang.probe), so nothing changes between the check and the import."""

    def __init__(self, package_dir: Path):
        self.package_dir = Path(package_dir)
        self._read: dict[str, bytes | OSError] = {}

    def read(self, rel: str) -> bytes:
        """The file's bytes (OSError as from reading it; FileNotFoundError when it is absent)."""
        if rel not in self._read:
            try:
                self._read[rel] = read_plain_file(self.package_dir / rel)
            except OSError as err:
                self._read[rel] = err
        found = self._read[rel]
        if isinstance(found, OSError):
            raise found
        return found

    def is_file(self, rel: str) -> bool:
        return self.unreadable(rel) is None

    def unreadable(self, rel: str) -> str | None:
        """Why the file cannot be read ("not found", "not a plain file", ...), or None."""
        try:
            self.read(rel)
        except FileNotFoundError:
            return "not found"
        except OSError as err:
            return err.strerror or str(err)
        return None

    def sha256(self, rel: str) -> str:
        return hashlib.sha256(self.read(rel)).hexdigest()

    def tree(self, rel: str) -> ast.Module:
        """The parsed file, as parse_file reads it (UTF-8, universal newlines)."""
        text = self.read(rel).decode("utf-8")
        return parse_text(text.replace("\r\n", "\n").replace("\r", "\n"))

    @property
    def checked_sha256(self) -> dict[str, str]:
        return {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(self._read.items())
                if isinstance(data, bytes)}


def read_plain_file(path: Path) -> bytes:
    """A plain file's bytes, never blocking on a FIFO or reading past SOURCE_READ_MAX (OSError naming it)."""
    import errno
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the gate
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a plain file", str(path))
        if st.st_size > SOURCE_READ_MAX:
            raise OSError(errno.EFBIG, f"larger than {SOURCE_READ_MAX} bytes", str(path))
        chunks, size = [], 0
        while size <= SOURCE_READ_MAX:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > SOURCE_READ_MAX:
            raise OSError(errno.EFBIG, f"larger than {SOURCE_READ_MAX} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------
# Canonical parameter lists. Tokens: "a", "a=" (has a default), "/", "*", "*args", "**kw".


def _join(tokens: list[str]) -> str:
    return "(" + ", ".join(tokens) + ")"


def signature_from_ast(node: ast.FunctionDef | ast.AsyncFunctionDef, *, drop_first: bool) -> str:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    tokens: list[str] = []
    for index, arg in enumerate(positional):
        tokens.append(arg.arg + ("=" if index >= first_default else ""))
        if args.posonlyargs and index == len(args.posonlyargs) - 1:
            tokens.append("/")
    if args.vararg is not None:
        tokens.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        tokens.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        tokens.append(arg.arg + ("=" if default is not None else ""))
    if args.kwarg is not None:
        tokens.append("**" + args.kwarg.arg)
    if drop_first and positional:
        tokens = tokens[1:]
        if tokens and tokens[0] == "/":
            tokens = tokens[1:]
    return _join(tokens)


def signature_from_callable(fn: object, *, drop_first: bool) -> str:
    """The same canonical form for a live function (follows __wrapped__ through our hooks)."""
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    if drop_first and params:
        params = params[1:]
    tokens: list[str] = []
    kinds = inspect.Parameter
    saw_star = False
    for index, param in enumerate(params):
        if param.kind is kinds.VAR_POSITIONAL:
            tokens.append("*" + param.name)
            saw_star = True
        elif param.kind is kinds.VAR_KEYWORD:
            tokens.append("**" + param.name)
        else:
            if param.kind is kinds.KEYWORD_ONLY and not saw_star:
                tokens.append("*")
                saw_star = True
            tokens.append(param.name + ("=" if param.default is not kinds.empty else ""))
            is_last_posonly = param.kind is kinds.POSITIONAL_ONLY and (
                index + 1 == len(params) or params[index + 1].kind is not kinds.POSITIONAL_ONLY
            )
            if is_last_posonly:
                tokens.append("/")
    return _join(tokens)


# ---------------------------------------------------------------------------------------
# Static lookup of a qualname in a parsed module.


def _is_decorated(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(dec, ast.Name) and dec.id == name
        for dec in getattr(node, "decorator_list", [])
    )


def _find_in_body(body: list[ast.stmt], name: str) -> ast.AST | None:
    found: ast.AST | None = None
    for stmt in body:  # the last definition wins, as at runtime
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if stmt.name == name:
                found = stmt
        elif isinstance(stmt, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                found = stmt
        elif isinstance(stmt, ast.AnnAssign):
            if isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                found = stmt
    return found


def find_definition(tree: ast.Module, qualname: str) -> ast.AST | None:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = _find_in_body(body, part)
        if node is None:
            return None
        body = node.body if isinstance(node, ast.ClassDef) else []
    return node


def class_fields(node: ast.ClassDef) -> set[str]:
    """Names assigned in a class body: dataclass fields, class attributes, enum members."""
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


def describe_static(tree: ast.Module, required: RequiredName) -> tuple[bool, str]:
    """(ok, what was found) for one required name in a parsed file."""
    node = find_definition(tree, required.qualname)
    if node is None:
        return False, "not defined"
    kind = required.kind
    if kind in (NameKind.FUNCTION, NameKind.METHOD, NameKind.CLASSMETHOD):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False, f"is a {type(node).__name__}, not a function"
        if kind is NameKind.CLASSMETHOD and not _is_decorated(node, "classmethod"):
            return False, "is no longer a classmethod"
        found = signature_from_ast(node, drop_first=kind is not NameKind.FUNCTION)
        if found != required.signature:
            return False, f"signature {found}, expected {required.signature}"
        return True, found
    if kind is NameKind.CLASS:
        return (True, "class") if isinstance(node, ast.ClassDef) else (False, "not a class")
    if kind is NameKind.FIELDS:
        if not isinstance(node, ast.ClassDef):
            return False, "not a class"
        missing = [name for name in required.fields if name not in class_fields(node)]
        if missing:
            return False, f"fields missing: {', '.join(missing)}"
        return True, "fields present"
    if kind is NameKind.CONSTANT:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            return False, "not a module-level assignment"
        try:
            value = repr(ast.literal_eval(node.value))
        except ValueError:
            return False, "not a literal"
        if value != required.value:
            return False, f"value {value}, expected {required.value}"
        return True, value
    raise AssertionError(f"unhandled kind {kind}")
