"""Line diffs of an agent's file edits, as the UIs show them.

An agent reports an edit as the text before and after (ACP `diff` content: path, oldText, newText;
pi's `edit` tool: oldText/newText, its `write` tool: the whole new content). Shown as they come, a
one-line change in a 300-line file is 600 lines behind one `-` and one `+`. `unified` turns them
into a standard unified diff (difflib, the standard library's, with context lines and `@@` hunks),
which Cline's webview and uibus's page colour by the first character of each line; a new file is a
diff from `/dev/null`, as git and patch write it. Bounded: a huge edit is cut at MAX_LINES lines.
"""

from __future__ import annotations

import difflib

CONTEXT = 3  # unchanged lines around each change (diff -u's default)
MAX_LINES = 2000  # lines of one diff kept; the rest is summarised in a last line


def unified(path: str, old: str | None, new: str, context: int = CONTEXT) -> str:
    """The unified diff of `old` (None: a new file) to `new` for `path`."""
    before = (old or "").splitlines(keepends=True)
    after = new.splitlines(keepends=True)
    # git's a/ b/ prefixes for a relative path; an absolute one (what ACP sends) is shown as it is
    old_name, new_name = (path, path) if path.startswith("/") else (f"a/{path}", f"b/{path}")
    lines = list(difflib.unified_diff(before, after, "/dev/null" if old is None else old_name, new_name,
                                      n=context))
    out: list[str] = []
    for line in lines[:MAX_LINES]:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    if len(lines) > MAX_LINES:
        out.append(f"… {len(lines) - MAX_LINES} more lines of this diff not shown\n")
    return "".join(out).rstrip("\n")


def stats(diff: str) -> tuple[int, int]:
    """(lines added, lines removed) of a unified diff."""
    added = removed = 0
    for line in diff.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed
