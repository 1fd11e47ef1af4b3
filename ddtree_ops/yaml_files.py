"""The one YAML reader of the operator side (inventories, Ansible inventories, metrics
baselines): a regular file of bounded size (ddtree.bounded_files), then pyyaml's SafeLoader with
the limits a file handed to us needs:

- nesting at most bounded_files.MAX_DEPTH deep, counted while composing (pyyaml's composer
  recurses per level: deeper input would end in RecursionError);
- aliases (`*name`) may repeat a value, never multiply one: past ALIAS_EXPANSION_LIMIT values
  added by expanding them, or an alias inside the value it names, the file is refused (counted
  on the node graph, each node once, never by expanding);
- a key given twice in one mapping is refused (plain safe_load keeps the last);
- merge keys (`<<: *common`, `<<: [*a, *b]`) work as in YAML 1.1 and Ansible: the mapping's
  own keys win over merged ones, and a merged mapping counts toward the alias limit.
Every refusal is a ConfigError naming the file (and the line where there is one).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ddtree.bounded_files import MAX_DEPTH, FileRefused, read_text

from ddtree_ops.errors import ConfigError, quoted

# Nine nested `[*a, *a, ...]` lines make 10^9 values; real files repeat a few blocks.
ALIAS_EXPANSION_LIMIT = 10_000
MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """A document the loader will not build; `line` (1-based) where known."""

    def __init__(self, why: str, line: int | None = None):
        super().__init__(why)
        self.why, self.line = why, line


def _line(node: Any) -> int:
    return node.start_mark.line + 1


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader with the limits of the module docstring."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"values nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _check_alias_expansion(node)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue  # `<<`: merged below; the mapping's own keys win over merged ones
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class reports it
                    break
                if duplicate:
                    raise _Refused(f"{quoted(key)}: duplicate key (the later entry would win)", _line(key_node))
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # SafeConstructor's: flattens `<<` first


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_alias_expansion(root: Any) -> None:
    """_Refused for a document whose aliases, expanded, add more than ALIAS_EXPANSION_LIMIT
    values, or one that refers to a value containing it."""
    expanded: dict[int, int] = {}  # id(node) -> values it stands for, aliases expanded
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
            continue
        if key in expanded:
            continue
        if key in on_path:
            raise _Refused("an alias refers to the value that contains it", _line(node))
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in expanded)
    added = expanded[id(root)] - len(expanded)
    if added > ALIAS_EXPANSION_LIMIT:
        raise _Refused(f"YAML aliases expand to {added} more values, past the limit of {ALIAS_EXPANSION_LIMIT} "
                       "(write the values out, or alias fewer)")


def parse_yaml(text: str, where: Any) -> Any:
    """One YAML document; ConfigError `where: line N: why` for anything the loader refuses."""
    try:
        return yaml.load(text, Loader=BoundedLoader)
    except _Refused as err:
        at = f"line {err.line}: " if err.line is not None else ""
        raise ConfigError(f"{where}: {at}{err.why}") from None
    except RecursionError:  # a path this loader does not bound: refused all the same
        raise ConfigError(f"{where}: invalid YAML: values nested too deeply") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: {at}invalid YAML: {problem}") from None


def read_text_file(path: Path, what: str) -> str:
    """A document's text through the bounded reader; ConfigError naming the file and `what` it is."""
    try:
        return read_text(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except FileRefused as err:
        raise ConfigError(f"{path}: cannot read {what}: {err.why}") from None
