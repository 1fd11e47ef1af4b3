"""The shell commands README.md and docs/ print, read the way a person copies them.

Every ```bash, ```sh, ```shell and ```console block counts (```console: the lines after a
`$ ` prompt; the lines after a command, up to the next prompt, are what it printed, and an
`(exit N)` / `: exit N (` there is the exit status the doc promises). A command may continue
over lines ending in `\\`.

A command the tests cannot run carries a tag, visible in the doc, at the start of a comment on
its own (last) line or on a comment line just above it (docs/dev/extending.md):

    # [GPU host] ...   needs a GPU host (and its models); scripts/device_check.sh runs the GPU paths
    # [real fleet] ... needs real remote machines (the tests' sshd fleet cannot stand in)
    # [CI] ...         is what CI itself runs (`make test`), or part of it
    # [by hand] ...    a maintainer's step that changes the repository or reaches a registry

and one that runs until the person stops it is run and stopped:

    # [Ctrl-C] ...     runs until Ctrl-C: the test sends it SIGINT after CTRL_C_AFTER_S
                       and expects exit 130

Every other command is run, exactly as written, by test_doc_commands.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TAGS = ("GPU host", "real fleet", "CI", "by hand")  # not run by the tests
CTRL_C = "Ctrl-C"  # run, then interrupted
CTRL_C_AFTER_S = 12
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")  # a fence line: the fence and its language
_TAG = re.compile(r"(?:^|\s)#\s*\[([^\]]+)\]")
_EXIT = re.compile(r"(?:\(exit (\d+)\)|: exit (\d+) \()")


@dataclass(frozen=True)
class DocCommand:
    doc: str  # repository-relative path of the doc
    line: int  # 1-based line of the command's first line
    text: str  # as written (continuation lines kept), without a console prompt
    tag: Optional[str]  # one of TAGS: not run by the tests; CTRL_C: run and interrupted; None: run
    expected_exit: int  # what the doc shows it exits with (console blocks), else 0 (130 for CTRL_C)

    @property
    def runs(self) -> bool:
        return self.tag not in TAGS

    @property
    def as_run(self) -> str:
        """The command as the test runs it: as written, or with Ctrl-C pressed for it (SIGINT
        after CTRL_C_AFTER_S, as `timeout` sends it)."""
        if self.tag == CTRL_C:
            return f"timeout --preserve-status -s INT {CTRL_C_AFTER_S} {self.text}"
        return self.text

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class DocBlock:
    doc: str
    line: int  # of the opening fence
    language: str
    commands: tuple[DocCommand, ...]


class TagError(ValueError):
    pass


def doc_files(root: Path) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def shell_blocks(path: Path, root: Path) -> list[DocBlock]:
    doc = path.relative_to(root).as_posix()
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, language = opening.group(2), opening.group(3).lower()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if language in SHELL_LANGUAGES:
            body = list(enumerate(lines[index + 1:end], start=index + 2))
            parse = _console_commands if language == "console" else _script_commands
            blocks.append(DocBlock(doc, index + 1, language, tuple(parse(doc, body))))
        index = end + 1
    return blocks


def _tag_of(line: str, doc: str, number: int) -> Optional[str]:
    found = _TAG.search(line)
    if found is None:
        return None
    if found.group(1) not in (*TAGS, CTRL_C):
        raise TagError(f"{doc}:{number}: unknown tag [{found.group(1)}]; the tags are "
                       + ", ".join(f"[{t}]" for t in (*TAGS, CTRL_C)) + " (docs/dev/extending.md)")
    return found.group(1)


def _script_commands(doc: str, body: list[tuple[int, str]]) -> list[DocCommand]:
    commands, pending_tag = [], None
    position = 0
    while position < len(body):
        number, line = body[position]
        stripped = line.strip()
        if not stripped:
            position += 1
            continue
        if stripped.startswith("#"):  # a comment line: its tag, if any, is for the next command
            pending_tag = _tag_of(stripped, doc, number) or pending_tag
            position += 1
            continue
        first, parts = number, [line]
        while parts[-1].rstrip().endswith("\\") and position + 1 < len(body):
            position += 1
            parts.append(body[position][1])
        tag = _tag_of(parts[-1], doc, body[position][0]) or pending_tag
        commands.append(DocCommand(doc, first, "\n".join(parts), tag, 130 if tag == CTRL_C else 0))
        pending_tag = None
        position += 1
    return commands


def _console_commands(doc: str, body: list[tuple[int, str]]) -> list[DocCommand]:
    found: list[tuple[int, list[str], list[str]]] = []  # (line, command lines, output lines)
    for number, line in body:
        if line.startswith("$ "):
            found.append((number, [line[2:]], []))
        elif found and found[-1][1][-1].rstrip().endswith("\\") and not found[-1][2]:
            found[-1][1].append(line)
        elif found:
            found[-1][2].append(line)
    commands = []
    for number, parts, output in found:
        exits = [int(a or b) for a, b in _EXIT.findall("\n".join(output))]
        tag = _tag_of(parts[-1], doc, number + len(parts) - 1)
        commands.append(DocCommand(doc, number, "\n".join(parts), tag, exits[-1] if exits else 0))
    return commands
