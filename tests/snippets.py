"""The fenced blocks of README.md and docs/, read by the tests that run them.

Every block carries a mark on the line above it: `<!-- snippet: NAME -->`, and a test reads it by that name
(`snippet("NAME")`, `commands("NAME")`) and runs it, or parses it (YAML: `test_docs.py`); or `<!-- illustrative:
why -->`, with the reason it is not run. `test_docs.py` fails on a block without a mark and on a name no test reads,
so a command in the manual is the command a test ran.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))
MARK = re.compile(r"^\s*<!--\s*(snippet|illustrative):\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    text: str  # without the fences, the indentation of a block inside a list item removed
    kind: str | None  # "snippet", "illustrative" or None (unmarked)
    label: str  # the snippet's name, or the reason it is illustrative

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(pages: tuple[Path, ...] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        index = 0
        while index < len(lines):
            opening = FENCE.match(lines[index])
            if opening is None:
                index += 1
                continue
            indent, lang = opening.groups()
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[index + 1 : end]]
            before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            mark = MARK.match(before)
            kind, label = mark.groups() if mark else (None, "")
            found.append(Block(page, index + 1, lang, "\n".join(body) + "\n", kind, label))
            index = end + 1
    return found


def snippet(name: str) -> Block:
    named = [block for block in blocks() if block.kind == "snippet" and block.label == name]
    assert len(named) == 1, f"{len(named)} blocks are marked <!-- snippet: {name} -->"
    return named[0]


def commands(name: str, **placeholders: str) -> list[list[str]]:
    """The snippet's shell commands as argument lists: continuation lines joined, comments dropped, `a && b` as two
    commands, and each placeholder the text names (`/data/my_text`) replaced by what the test has. A leading
    `parallelkit` is kept: the caller says how it runs the command."""
    text = snippet(name).text.replace("\\\n", " ")
    for old, new in placeholders.items():
        assert old in text, f"snippet {name} does not mention {old}"
        text = text.replace(old, new)
    found = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while "&&" in words:
            cut = words.index("&&")
            found.append(words[:cut])
            words = words[cut + 1 :]
        if words:
            found.append(words)
    return found


def parallelkit_args(name: str, index: int = 0, **placeholders: str) -> list[str]:
    """The arguments after `parallelkit` of the snippet's `index`-th parallelkit command."""
    runs = [words[1:] for words in commands(name, **placeholders) if words[0] == "parallelkit"]
    return runs[index]
