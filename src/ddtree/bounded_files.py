"""The reading rule, once for every side: a file an operator or a host can hand us (an
inventory, a baseline, a run record, a qualification file, ...). Stdlib only: the operator's
CLI, the host side and the SGLang gate (which runs in a host's own Python) all import it.

- Only a regular file is read. It is opened with O_NONBLOCK, so a FIFO cannot hang the open,
  and `fstat` of what was opened decides: never a check of the name and then an open of
  whatever is there by then. A FIFO, a device (`/dev/zero`), a socket or a folder is refused.
- Its size is capped (checked on the open file, and again while reading: it may grow).
- Text is UTF-8, strictly; JSON is nested at most MAX_DEPTH deep (past Python's recursion
  limit a parse raises RecursionError, and every later walk of a deep value would too).
  YAML (operator side only) gets the same limits in ddtree_ops.yaml_files.
A link on the way is followed: reading through the operator's own links is fine, and what it
leads to must pass the same checks. Writing has its rule in ddtree_ops.hostside.safe_write.

Everything refused is `FileRefused` ("<path>: <why>"); a missing file is FileNotFoundError.
"""
from __future__ import annotations

import json
import os
import stat
from typing import IO, Any, Iterable, Union

MAX_DOCUMENT_BYTES = 32 << 20  # an inventory, a baseline, a record, a qualification file
MAX_DEPTH = 64  # nesting of a JSON or YAML document (ours are under 10 deep)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)

PathLike = Union[str, "os.PathLike[str]"]


class FileRefused(OSError, ValueError):
    """A file we will not read; `str()` is "<path>: <why>". An OSError (code that reads files
    already handles those) and a ValueError (code that parses text already handles those)."""

    def __init__(self, path: Any, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = str(path), why


class NotJson(FileRefused):
    """Text that does not parse as JSON; `detail` is the parser's own line."""

    def __init__(self, path: Any, detail: str):
        super().__init__(path, f"not JSON: {detail}")
        self.detail = detail


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a regular file"


def _os_why(err: OSError) -> str:
    return err.strerror or type(err).__name__


# ------------------------------------------------------------------------------ reading

def open_regular(path: PathLike, max_bytes: int | None = MAX_DOCUMENT_BYTES) -> IO[bytes]:
    """The opened regular file at `path` (binary, blocking reads), at most `max_bytes` long
    (None: no cap, for a caller that bounds what it reads itself). FileNotFoundError if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC | _O_NOCTTY)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise FileRefused(path, f"cannot open it: {_os_why(err)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(path, f"{file_kind(info.st_mode)}, not a regular file: refused")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileRefused(path, f"{info.st_size} bytes, past the limit of {max_bytes}: refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: PathLike, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The whole regular file, at most `max_bytes` (a file that grew past it is refused)."""
    with open_regular(path, max_bytes) as handle:
        try:
            data = handle.read(max_bytes + 1)
        except OSError as err:
            raise FileRefused(path, f"cannot read it: {_os_why(err)}") from None
    if len(data) > max_bytes:
        raise FileRefused(path, f"more than {max_bytes} bytes (it grew while read): refused")
    return data


def decode_text(data: bytes, where: Any) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileRefused(where, f"not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None


def read_text(path: PathLike, max_bytes: int = MAX_DOCUMENT_BYTES) -> str:
    return decode_text(read_bytes(path, max_bytes), path)


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), counted without recursion and
    only up to `limit + 1` (enough to say it is past the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children: Iterable[Any] = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_depth(value: Any, where: Any, limit: int = MAX_DEPTH) -> Any:
    if nesting_depth(value, limit) > limit:
        raise FileRefused(where, f"values nested deeper than {limit} levels: refused")
    return value


def parse_json(text: str, where: Any, limit: int = MAX_DEPTH) -> Any:
    """JSON text (from a file or a host's reply) with the depth limit; FileRefused naming `where`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise FileRefused(where, f"values nested deeper than {limit} levels: refused") from None
    except ValueError as err:  # JSONDecodeError, and an int past Python's digit limit
        raise NotJson(where, str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    return check_depth(value, where, limit)


def read_json(path: PathLike, max_bytes: int = MAX_DOCUMENT_BYTES, limit: int = MAX_DEPTH) -> Any:
    return parse_json(read_text(path, max_bytes), path, limit)
