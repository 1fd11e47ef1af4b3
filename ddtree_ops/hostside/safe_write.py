"""The writing rule, once for both sides: everything we write lives under a root (on the
operator's machine: the runs folder, `--plot DIR`, the folder of `-o FILE`; on a host: the
workdir), and below that root no link is ever followed. Stdlib only, and no `ddtree` import:
the host's runner writes its run folder before it may import anything of the release.

- The root is taken as named (a link there is the operator's own choice).
- Each folder on the way is opened with O_NOFOLLOW relative to its parent's descriptor: a link
  or a file where a folder belongs is refused (`WriteRefused`, "<path>: <why>").
- A file is written under a temporary name in its folder and renamed over its name: a link at
  that name is replaced, never written through, and a reader never sees half a file.
- An append opens with O_NOFOLLOW (a link there is refused) and O_NONBLOCK (a FIFO there is
  refused instead of blocking until someone reads it).
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Union

TEMP_PREFIX, TEMP_SUFFIX = ".", ".tmp"  # a file being written: ".<name>.<pid>.<random>.tmp"

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

PathLike = Union[str, "os.PathLike[str]"]
RelPath = Union[str, Iterable[str]]


class WriteRefused(Exception):
    """A place we will not write (or a write that failed there); `str()` is "<path>: <why>"."""

    def __init__(self, path: Any, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = str(path), why


def _os_why(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "a regular file"


def _parts(relpath: RelPath) -> list[str]:
    parts = relpath.split("/") if isinstance(relpath, str) else [str(p) for p in relpath]
    if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
        raise WriteRefused("/".join(parts), "not a relative path of plain names")
    return parts


def _open_folders(root: Path, parts: list[str], create: bool) -> int:
    """A descriptor of root/parts..., each part opened relative to the one before it without
    following a link (made first when `create`)."""
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise WriteRefused(root, "exists and is not a folder") from None
        except OSError as err:
            raise WriteRefused(root, f"cannot create the folder: {_os_why(err)}") from None
    try:
        fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as err:
        raise WriteRefused(root, f"cannot open the folder: {_os_why(err)}") from None
    here = root
    try:
        for part in parts:
            here = here / part
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as err:  # a name too long, no space, no permission
                    raise WriteRefused(here, f"cannot create the folder: {_os_why(err)}") from None
            try:
                child = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                raise _refusal(here, fd, part, err, "a folder") from None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refusal(path: Path, folder_fd: int, name: str, err: OSError, expected: str) -> WriteRefused:
    """Why `name` (in the folder `folder_fd`) could not be opened as `expected` ("a folder",
    "a file"): a link and anything of another kind are named as such."""
    try:
        mode = os.lstat(name, dir_fd=folder_fd).st_mode
    except OSError:
        return WriteRefused(path, f"cannot open it: {_os_why(err)}")
    if stat.S_ISLNK(mode):
        return WriteRefused(path, "a link on the way to a file we write: refused (nothing is written through a link)")
    wanted = stat.S_ISDIR if expected == "a folder" else stat.S_ISREG
    if not wanted(mode):
        return WriteRefused(path, f"{_kind(mode)} where {expected} belongs: refused")
    return WriteRefused(path, f"cannot open it: {_os_why(err)}")


def open_folder(root: PathLike, relpath: RelPath | None = None, create: bool = False) -> int:
    """A descriptor (the caller closes it) of the folder root/relpath, reached following no
    link below root; made on the way when `create`."""
    return _open_folders(Path(root), _parts(relpath) if relpath else [], create)


def make_folders(root: PathLike, relpath: RelPath) -> Path:
    """Create root/relpath (and the folders on the way), following no link below root."""
    root, parts = Path(root), _parts(relpath)
    os.close(_open_folders(root, parts, create=True))
    return root.joinpath(*parts)


@contextmanager
def replacing(root: PathLike, relpath: RelPath, mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A binary file to fill that becomes root/relpath when the `with` block ends normally:
    written under a temporary name in the same folder, then renamed over the name (a link there
    is replaced, never followed); removed if the block raises. Folders on the way are made."""
    root, parts = Path(root), _parts(relpath)
    target = root.joinpath(*parts)
    folder = _open_folders(root, parts[:-1], create=True)
    tmp = f"{TEMP_PREFIX}{parts[-1][:200]}.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=folder)
        except OSError as err:
            raise WriteRefused(target, f"cannot write it: {_os_why(err)}") from None
        try:
            with os.fdopen(fd, "wb") as out:
                yield out
            os.replace(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException as err:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            if isinstance(err, IsADirectoryError):
                raise WriteRefused(target, "a folder where the file belongs: refused") from None
            if isinstance(err, OSError):
                raise WriteRefused(target, f"cannot write it: {_os_why(err)}") from None
            raise
    finally:
        os.close(folder)


def write_file(root: PathLike, relpath: RelPath, data: Union[bytes, str], mode: int = 0o644) -> Path:
    """root/relpath holds `data` (str: UTF-8), all or nothing (`replacing`)."""
    with replacing(root, relpath, mode) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(root).joinpath(*_parts(relpath))


def is_temporary(name: str) -> bool:
    """A name `replacing` writes under (left behind only by a killed process)."""
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def open_append(root: PathLike, relpath: RelPath) -> IO[str]:
    """root/relpath opened to append UTF-8 text (created if absent); a link there is refused."""
    root, parts = Path(root), _parts(relpath)
    folder = _open_folders(root, parts[:-1], create=True)
    try:
        try:
            # O_NONBLOCK: opening a FIFO to write would wait for a reader (here: ENXIO instead)
            fd = os.open(parts[-1], os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK,
                         0o644, dir_fd=folder)
        except OSError as err:
            raise _refusal(root.joinpath(*parts), folder, parts[-1], err, "a file") from None
    finally:
        os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise WriteRefused(root.joinpath(*parts), f"{_kind(info.st_mode)} where a file belongs: refused")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")
