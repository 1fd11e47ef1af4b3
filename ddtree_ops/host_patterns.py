"""Host patterns as Ansible reads them, for inventory host names and `-H` selections.

Ranges: `gpu-[01:16]` (numbers keep the width of a zero-padded start), `node[a:f]` (single
letters), `gpu-[0:30:10]` (a stride), several in one name (`r[1:2]-gpu[1:4]`).

Selections (`select_names`): terms split on `,` (or, when there is no comma, on `:` outside
brackets); a term is `all`/`*`, a host, a group, a range or a `*?` wildcard; `&term`
intersects, `!term` excludes. As in Ansible the position does not matter: the union of the
plain terms (all hosts when there is none) is taken first, then each `&`, then each `!`.
A term that names nothing is an error in any position: a typo after `!` would otherwise
select the very host the operator meant to exclude.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from ddtree_ops.errors import UsageError, quoted

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


ALL_HOSTS = "all"
_COLON_TERMS = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")  # ':'-separated, a [x:y] range kept whole
_KNOWN_SHOWN = 10  # names listed in an unknown-term error (a 100k-host fleet must not be printed)


PATTERN_CHARS = "*?["  # a wildcard, or the start of a range or a character class


def unaddressable(name: str) -> str | None:
    """Why no -H pattern could select exactly the host or group `name` (so an inventory may
    not hold it), or None. `!prod` is the pattern "all but prod", `&x` an intersection, `*`
    every host; a wildcard or a bracket makes the name a pattern matching others (or none)."""
    if name in (ALL_HOSTS, "*"):
        return f"{name!r} means every host"
    if name[:1] in ("&", "!"):
        return f"a leading {name[0]!r} makes it a pattern operator ({name[0]}TERM)"
    found = next((c for c in name if c in PATTERN_CHARS), None)
    if found is not None:
        return f"{found!r} makes it a wildcard or range pattern"
    return None


def split_terms(text: str, hosts: Mapping[str, object]) -> list[str]:
    """One -H value as its terms: on ',' when it has one, else on ':' outside brackets (a
    whole value that is a host name, as an IPv6 address may be, stays one term)."""
    if "," in text:
        parts: Iterable[str] = text.split(",")
    elif text.strip() in hosts:
        parts = [text]
    else:
        parts = _COLON_TERMS.findall(text)
    return [p.strip() for p in parts if p.strip()]


def select_names(items: Sequence[str], hosts: Mapping[str, object], groups: Mapping[str, Sequence[str]],
                 source: str) -> set[str]:
    """The host names the -H values `items` select (UsageError naming the first term that
    names nothing, or a selection that ends empty)."""
    terms = [t for item in items for t in split_terms(item, hosts)]
    if not terms:
        raise UsageError(f"-H/--hosts: empty host selection {quoted(','.join(items))} "
                         "(name hosts or groups, or 'all')")
    plain = [t for t in terms if t[0] not in "&!"]
    chosen: set[str] = set()
    for term in plain or [ALL_HOSTS]:
        chosen |= _match(term, hosts, groups, source)
    for term in (t for t in terms if t[0] == "&"):
        chosen &= _match(term[1:], hosts, groups, source)
    for term in (t for t in terms if t[0] == "!"):
        chosen -= _match(term[1:], hosts, groups, source)
    if not chosen:
        raise UsageError(f"{source}: -H {quoted(','.join(items))}: selects no host")
    return chosen


def _match(term: str, hosts: Mapping[str, object], groups: Mapping[str, Sequence[str]], source: str) -> set[str]:
    term = term.strip()
    if term in (ALL_HOSTS, "*"):
        return set(hosts)
    if term in hosts:
        return {term}
    if term in groups:
        return set(groups[term])
    if has_range(term):
        try:
            names = expand(term)
        except RangeError as err:
            raise UsageError(f"-H/--hosts: {err}") from None
        missing = [n for n in names if n not in hosts and n not in groups]
        if missing:  # a range must not silently narrow
            raise UsageError(f"{source}: -H {quoted(term)}: no host or group named "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        return {h for n in names for h in (groups[n] if n in groups else (n,))}
    if any(c in term for c in "*?["):
        found = {h for n in [*hosts, *groups] if fnmatch.fnmatchcase(n, term)
                 for h in (groups[n] if n in groups else (n,))}
        if not found:
            raise UsageError(f"{source}: -H {quoted(term)}: matches no host or group")
        return found
    known = sorted({*hosts, *groups})
    shown = ", ".join(known[:_KNOWN_SHOWN]) + (f" and {len(known) - _KNOWN_SHOWN} more" if len(known) > _KNOWN_SHOWN else "")
    raise UsageError(f"{source}: no host or group named {quoted(term)} (known: {shown or 'none'})")
