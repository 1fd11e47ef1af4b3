"""Host name ranges as Ansible writes them: `gpu-[01:16]` (numbers keep the width of a
zero-padded start), `node[a:f]` (single letters), `gpu-[0:30:10]` (a stride), several in one
name (`r[1:2]-gpu[1:4]`). Used for inventory host names and for `-H` selections."""
from __future__ import annotations

import re

_RANGE = re.compile(r"\[([^\[\]:]*):([^\[\]:]*)(?::([^\[\]:]*))?\]")
MAX_EXPANDED = 100_000  # a typo like [0:99999999] must not build a list the size of memory


class RangeError(ValueError):
    """A range that does not parse; the message names the pattern."""


def has_range(text: str) -> bool:
    return _RANGE.search(text) is not None


def expand(pattern: str) -> list[str]:
    """Every name a pattern stands for, in order; a name without a range stands for itself."""
    match = _RANGE.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    items = _items(pattern, *match.groups())
    rest = expand(tail)
    if len(items) * len(rest) > MAX_EXPANDED:
        raise RangeError(f"host range {pattern!r}: more than {MAX_EXPANDED} names")
    return [f"{head}{item}{after}" for item in items for after in rest]


def _items(pattern: str, start: str, end: str, stride: str | None) -> list[str]:
    try:
        step = int(stride) if stride not in (None, "") else 1
    except ValueError:
        raise RangeError(f"host range {pattern!r}: the stride {stride!r} is not a number") from None
    if step < 1:
        raise RangeError(f"host range {pattern!r}: the stride must be >= 1, got {step}")
    if start.isdigit() and end.isdigit():
        first, last = int(start), int(end)
        width = len(start) if start.startswith("0") and len(start) > 1 else 0
        if last < first:
            raise RangeError(f"host range {pattern!r}: the end {end} is before the start {start}")
        if (last - first) // step + 1 > MAX_EXPANDED:
            raise RangeError(f"host range {pattern!r}: more than {MAX_EXPANDED} names")
        return [str(n).zfill(width) for n in range(first, last + 1, step)]
    if len(start) == 1 and len(end) == 1 and start.isalpha() and end.isalpha():
        if ord(end) < ord(start):
            raise RangeError(f"host range {pattern!r}: the end {end} is before the start {start}")
        return [chr(c) for c in range(ord(start), ord(end) + 1, step)]
    raise RangeError(f"host range {pattern!r}: expected [START:END] of numbers or of single letters")
