"""The shell and Python blocks of README.md and docs/**, as a reader meets them, and how each is run.

A block is a fenced block whose info string starts with `sh`, `bash`, `shell`, `console` or
`python`; any other block (`text`, `toml`, `json`, a bare ```) is not a command and is not run.
What the docs test does with a block is said in the Markdown itself, by an HTML comment on the
line right before its fence (several directives separated by `;`; `skip` takes the rest of the comment as its reason):

    <!-- docs-test: skip needs a Kubernetes cluster -->   not run; reported as a skip with the reason
    <!-- docs-test: server -->        starts the uibus the later blocks talk to: run once, in the
                                      background, before the first page; a later `server` block
                                      must be the same command (the server is already running)
    <!-- docs-test: background -->    runs in the background (a stream that waits for Ctrl-C) until
                                      the page ends; the next block runs once it has connected
    <!-- docs-test: expect TEXT -->   the block's output must contain TEXT (for a background
                                      block: by the end of the page)
    <!-- docs-test: timeout 90 -->    seconds the block may take (default 45)

Pages run in order (README.md, docs/index.md, docs/getting-started.md, then the rest by path), the
blocks of a page in order, each in a fresh `bash` from the checkout's root with `.venv/bin` on PATH
(as after `source .venv/bin/activate`). A `console` block runs its `$ ` lines; a `python` block runs
as `python -m asyncio` would (top-level `await` and `async with` allowed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_LANGS = {"sh": "sh", "bash": "sh", "shell": "sh", "console": "console", "python": "python", "py": "python"}
DEFAULT_TIMEOUT = 45.0
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARK = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
DIRECTIVES = ("skip", "server", "background", "expect", "timeout")


@dataclass
class Block:
    """One runnable block: where it is, what it says, and the directives before it."""

    page: str            # path from the checkout's root, e.g. docs/getting-started.md
    line: int            # the line of its opening fence (1-based)
    lang: str            # sh | console | python
    text: str            # the block as printed, its indentation removed
    skip: str = ""       # the reason, when marked skip
    server: bool = False
    background: bool = False
    expect: list[str] = field(default_factory=list)
    timeout: float = DEFAULT_TIMEOUT

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def script(self) -> str:
        """What bash runs: the block itself, or a console block's `$ ` commands."""
        if self.lang != "console":
            return self.text
        lines: list[str] = []
        more = False
        for raw in self.text.splitlines():
            if more or raw.startswith("$ "):
                cmd = raw[2:] if raw.startswith("$ ") and not more else raw
                lines.append(cmd)
                more = cmd.rstrip().endswith("\\")
        return "\n".join(lines) + "\n"


def _directives(block: Block, body: str) -> None:
    parts = body.split(";")
    for n, part in enumerate(p.strip() for p in parts):
        if not part:
            continue
        word, _, rest = part.partition(" ")
        rest = rest.strip()
        if word == "skip":  # the reason is the rest of the comment, `;` and all
            reason = ";".join([rest, *parts[n + 1:]]).strip()
            if not reason:
                raise ValueError(f"{block.where}: `docs-test: skip` needs a reason")
            block.skip = reason
            return
        elif word == "server":
            block.server = True
        elif word == "background":
            block.background = True
        elif word == "expect":
            block.expect.append(rest)
        elif word == "timeout":
            block.timeout = float(rest)
        else:
            raise ValueError(f"{block.where}: unknown docs-test directive {word!r} (one of {', '.join(DIRECTIVES)})")


def page_blocks(page: Path) -> list[Block]:
    """The runnable blocks of one Markdown page, in order, with their directives."""
    full = page.resolve()
    rel = full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else str(full)
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if _MARK.match(lines[i]) and not _next_is_fence(lines, i):
                raise ValueError(f"{rel}:{i + 1}: a docs-test comment must be right before a block's fence")
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$",
                                                  lines[end]):
            end += 1
        lang = RUN_LANGS.get(info.split()[0].lstrip("{.").rstrip("}") if info else "")
        if lang is not None:
            body = "\n".join(line[indent:] if line[:indent].strip() == "" else line.lstrip()
                             for line in lines[i + 1:end]) + "\n"
            block = Block(page=rel, line=i + 1, lang=lang, text=body)
            mark = _MARK.match(lines[i - 1]) if i > 0 else None
            if mark:
                _directives(block, mark["body"])
            blocks.append(block)
        i = end + 1
    return blocks


def _next_is_fence(lines: list[str], i: int) -> bool:
    return i + 1 < len(lines) and _FENCE.match(lines[i + 1]) is not None


def pages() -> list[Path]:
    """README.md, docs/index.md, docs/getting-started.md, then every other docs page by path."""
    first = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "getting-started.md"]
    rest = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in first)
    return [p for p in first if p.exists()] + rest


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page)]
