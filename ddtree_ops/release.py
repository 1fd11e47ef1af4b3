"""Release bundles: what `push` sends, its sha256 manifest, and its content-addressed id.

A bundle keeps the repository-relative layout (`src/ddtree/...`, `ddtree_ops/hostside/...`) so
that `<workdir>/current/src` on `sys.path` imports our `ddtree` on the host, and `<workdir>/current`
the host-side package. The manifest lists
`<sha256>  <relpath>` per file, sorted; the release id is the first 16 hex digits of the
manifest's sha256, so equal content gives an equal id on every machine.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import threading
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ddtree_ops.errors import UsageError
from ddtree_ops.hostside.agent import MANIFEST_NAME, manifest_id  # the host reads what we write: one rule

if TYPE_CHECKING:  # pragma: no cover
    import tarfile

HOSTSIDE_DIR = "ddtree_ops/hostside"  # the code that runs on a host: agent, runner, stages, installer
RUNNER_RELPATH = f"{HOSTSIDE_DIR}/runner.py"
STAGES_DIR = f"{HOSTSIDE_DIR}/stages"
# Repository-relative directories and files a release carries; missing optional ones are skipped.
BUNDLE_DIRS: tuple[str, ...] = ("src/ddtree", HOSTSIDE_DIR)
BUNDLE_FILES: tuple[str, ...] = ("ddtree_ops/__init__.py",)  # makes the host side a package there
REQUIRED_DIR = "src/ddtree"
_SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".swp")


@dataclass(frozen=True)
class BundleFile:
    relpath: str  # posix, repository-relative
    source: Path
    sha256: str
    size: int
    executable: bool


@dataclass(frozen=True)
class GitOrigin:
    commit: str  # full sha of HEAD
    dirty: bool  # the bundled folders differ from that commit (changed or untracked files)

    def __str__(self) -> str:
        return f"git {self.commit[:12]}{', dirty' if self.dirty else ''}"

    def to_dict(self) -> dict[str, object]:
        return {"commit": self.commit, "dirty": self.dirty}


def git_origin(root: Path) -> Optional[GitOrigin]:
    """HEAD of the git checkout `root` is in, and whether the bundled folders differ from it;
    None when there is no git, no checkout (an installed package), or git does not answer."""
    import subprocess

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                                  env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = (git("rev-parse", "--verify", "HEAD") or "").strip()
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=normal", "--", *BUNDLE_DIRS, *BUNDLE_FILES)
    return GitOrigin(commit=commit, dirty=status is None or bool(status.strip()))


@dataclass
class ReleaseBundle:
    source_root: str  # where the files were read from, for messages
    files: tuple[BundleFile, ...]
    manifest: bytes
    release_id: str
    # the git commit the files were read from and whether they differ from it (None: not a git checkout)
    git: Optional["GitOrigin"] = None
    _archive: Optional[bytes] = field(default=None, repr=False)
    _payloads: dict[tuple[int, ...], bytes] = field(default_factory=dict, repr=False)
    _archive_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def described(self) -> str:
        """The release id with where it came from: `3f9a1c2d5e6f7a8b (git 1a2b3c4d5e6f, dirty)`."""
        return self.release_id + (f" ({self.git})" if self.git is not None else "")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def archive(self) -> bytes:
        """One gzip'd tar of the whole release, manifest first (the agent's `install` checks
        each file against it as it arrives)."""
        with self._archive_lock:
            if self._archive is None:
                self._archive = _gzip_tar([(MANIFEST_NAME, self.manifest, False)] +
                                          [(f.relpath, f.source.read_bytes(), f.executable) for f in self.files])
            return self._archive

    def offer(self) -> bytes:
        """What a push says first, before any file: the manifest and which of its lines are
        executable, as one JSON line (the agent's `read_offer`)."""
        executable = [line for line, entry in enumerate(self.files) if entry.executable]
        return json.dumps({"manifest": self.manifest.decode("utf-8"), "executable": executable}).encode() + b"\n"

    def files_payload(self, lines: tuple[int, ...]) -> bytes:
        """The files on these manifest lines, the ones a host asked for, as its agent reads
        them (`receive_files`): one zlib stream of `<size>\n<bytes>` per file, in that order.

        Made once per set of lines and shared by every host of a push that asks for it (a
        fleet on one release asks for the same files)."""
        with self._archive_lock:
            payload = self._payloads.get(lines)
            if payload is None:
                packer = zlib.compressobj(1)
                parts = []
                for line in lines:
                    data = self.files[line].source.read_bytes()
                    parts += [packer.compress(b"%d\n" % len(data)), packer.compress(data)]
                payload = self._payloads[lines] = b"".join(parts) + packer.flush()
            return payload


def _gzip_tar(members: list[tuple[str, bytes, bool]]) -> bytes:
    """(name, data, executable) members as one deterministic gzip'd tar."""
    import gzip
    import tarfile

    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=1, mtime=0) as packed, \
            tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, executable in members:
            _add_bytes(tar, name, data, executable=executable)
    return buffer.getvalue()


def _add_bytes(tar: "tarfile.TarFile", name: str, data: bytes, *, executable: bool) -> None:
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o755 if executable else 0o644
    info.mtime = 0  # deterministic archives
    tar.addfile(info, io.BytesIO(data))


def default_source_root() -> Path:
    """The checkout (or install prefix) of the `ddtree` package this process runs with.

    Located with find_spec, so ddtree (and torch) are not imported."""
    spec = importlib.util.find_spec("ddtree")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the ddtree package is not installed here; pass --source PATH to a checkout")
    package_dir = Path(list(spec.submodule_search_locations)[0]).resolve()
    if package_dir.parent.name == "src":
        return package_dir.parent.parent  # editable install: the checkout
    return package_dir.parent  # installed: its prefix holds ddtree/ (bundled as src/ddtree)


def collect_files(source_root: Path) -> list[tuple[str, Path]]:
    """(release relpath, local file) pairs, sorted by relpath."""
    pairs: list[tuple[str, Path]] = []
    package = source_root / REQUIRED_DIR
    if not (package / "__init__.py").is_file():
        alt = source_root / "ddtree"  # an installed package directory (site-packages/ddtree)
        if not (alt / "__init__.py").is_file():
            raise UsageError(f"--source {source_root}: no {REQUIRED_DIR}/__init__.py there")
        pairs += _walk(alt, REQUIRED_DIR)
    for rel_dir in BUNDLE_DIRS:
        directory = source_root / rel_dir
        if directory.is_dir():
            pairs += _walk(directory, rel_dir)
    for relpath in BUNDLE_FILES:
        if (source_root / relpath).is_file():
            pairs.append((relpath, source_root / relpath))
    return sorted(pairs)


def _walk(directory: Path, prefix: str) -> list[tuple[str, Path]]:
    pairs = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in dirs:
            if (Path(root) / name).is_symlink():  # os.walk would silently leave it out
                raise UsageError(f"{Path(root) / name}: a linked folder; a release holds real files "
                                 "(copy it in, or point --source at the real tree)")
        for name in files:
            if name.startswith(".") or name.endswith(_SKIPPED_SUFFIXES):
                continue
            path = Path(root) / name
            if not path.is_file():
                continue
            rel = path.relative_to(directory).as_posix()
            _check_printable_name(path, rel)
            pairs.append((f"{prefix}/{rel}", path))
    return pairs


def _check_printable_name(path: Path, rel: str) -> None:
    """Manifest lines are split on newlines and names travel as UTF-8: a path with a control
    or line-separator character (or bytes that are not UTF-8) cannot be a release file."""
    for char in rel:
        category = unicodedata.category(char)
        if category[0] == "C" or category in ("Zl", "Zp"):
            raise UsageError(f"{str(path)!r}: file name holds {char!r}; a release file name must be "
                             "printable UTF-8 (rename or remove it)")


def build_bundle(source: str | os.PathLike[str] | None = None) -> ReleaseBundle:
    root = Path(source).expanduser().resolve() if source else default_source_root()
    if source and not root.is_dir():
        raise UsageError(f"--source {source}: not a directory")
    files = []
    for relpath, path in collect_files(root):
        data = path.read_bytes()
        files.append(
            BundleFile(
                relpath=relpath,
                source=path,
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                executable=os.access(path, os.X_OK),
            )
        )
    manifest = "".join(f"{f.sha256}  {f.relpath}\n" for f in files).encode("utf-8")
    return ReleaseBundle(
        source_root=str(root), files=tuple(files), manifest=manifest, release_id=manifest_id(manifest),
        git=git_origin(root),
    )
