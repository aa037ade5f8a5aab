"""Files uibus keeps beside what agents write, handled so that no link an agent planted is followed.

Why: uibus runs with more than any agent has (its tokens, its store, root itself in a container).
A workspace's checkout is the agent's to write, and links in it lead anywhere on the host: uibus
once copied a file an agent had pointed at the tokens file, and wrote where an agent had pointed
at the operator's `~/.gitconfig`. So uibus's own files about workspaces are made new (`O_EXCL`),
opened without following a link (`O_NOFOLLOW`), in folders of its own that no sandbox shows, and
an agent's tree is removed by `shutil.rmtree`'s descriptor-based walk, which unlinks links rather
than following them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def private_dir(path: Path) -> None:
    """`path` and its missing parents, made readable by uibus's user alone."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def is_dir(path: Path) -> bool:
    """A directory, not a link to one."""
    return path.is_dir() and not path.is_symlink()


def write_new(path: Path, text: str) -> None:
    """A new file uibus writes in a folder it made (refuses to follow a link or reuse a file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes_new(path: Path, data: bytes) -> None:
    """`write_new` for bytes (names an agent chose, as git lists them)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_private(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read(1 << 20)


def remove_tree(path: Path) -> None:
    """`path` gone, whatever the agent left there: links are removed, never followed (rmtree's
    descriptor-based walk), and folders it made unwritable are opened up first."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return

    top = os.path.realpath(path)

    def opened_up(function: Any, name: str, _exc: Any) -> None:
        """An entry that could not be removed: its folder (made unwritable by the agent, when
        uibus is not root) is opened up, by descriptor and only inside the tree, and tried again."""
        parent = os.path.dirname(name)
        with contextlib.suppress(OSError):
            if os.path.realpath(parent) == top or os.path.realpath(parent).startswith(top + os.sep):
                fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fchmod(fd, 0o700)
                finally:
                    os.close(fd)
            function(name)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=opened_up)
    else:
        shutil.rmtree(path, onerror=opened_up)  # 3.11: the same hook, called onerror


def file_beneath(path: str, root: str | None) -> bool:
    """`path` is a regular file (not a link to one) lying inside `root` once every link on its way
    is resolved (None: anywhere, for an agent that runs unconfined and can read it all anyway).
    Why: an agent names files uibus then looks at (pi's session file); a link or a `..` must not
    turn that into a look at the host's."""
    if os.path.islink(path):
        return False
    if root is not None and not os.path.realpath(path).startswith(os.path.realpath(root) + os.sep):
        return False
    return os.path.isfile(path)
