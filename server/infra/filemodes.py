"""uibus's own files are its user's alone: the state directory 0700, the store (and SQLite's side
files) 0600 — every transcript is in there.

New files are made so from the start (the store is created 0600 before SQLite opens it; SQLite
gives its -wal and -shm files the database's mode). An existing install's looser modes (0755 and
0644, as a default umask made them before) are fixed when uibus starts, and said once in the log,
naming each path and its old and new mode. A directory uibus did not make and that is not its
state directory (an explicit `--store` in a project folder) is the operator's: it is left as it is,
the files in it are still made private.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("uibus.infra.store")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's files beside a database


def state_dir() -> Path:
    """uibus's state directory: `$XDG_STATE_HOME/uibus`, else `~/.local/state/uibus` (the default
    store's folder)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "uibus"


def tighten(paths: Iterable[tuple[Path, int]]) -> list[str]:
    """Takes every permission beyond `mode` from each existing path (never following a link);
    what was changed, as `path 0644 -> 0600`."""
    changed = []
    for path, mode in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        old = stat.S_IMODE(st.st_mode)
        if old & ~mode & 0o777:
            try:
                os.chmod(path, old & mode)
            except OSError as exc:
                log.warning("cannot make a file of uibus's private", extra={"fields": {
                    "path": str(path), "mode": f"{old:04o}", "error": exc.strerror or str(exc)}})
                continue
            changed.append(f"{path} {old:04o} -> {old & mode:04o}")
    return changed


def private_store(file: Path) -> list[str]:
    """Makes `file`'s folder (0700 when uibus makes it, or when it is uibus's state directory) and
    the database file itself (0600, empty, if it does not exist yet), and takes every permission of
    other users from what is there already; what it changed, for `said` (once the store opened, so
    a start that fails still fails with its one line)."""
    folder = file.parent
    made = not folder.exists()
    if made:
        folder.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    fix: list[tuple[Path, int]] = []
    if made or folder.resolve() == state_dir().resolve():
        fix.append((folder, PRIVATE_DIR))
    if not file.exists():
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), PRIVATE_FILE)
        os.close(fd)
    fix += [(file, PRIVATE_FILE), *((Path(f"{file}{side}"), PRIVATE_FILE) for side in SIDE_FILES)]
    return tighten(fix)


def said(changed: list[str]) -> None:
    """The one log line of what `private_store` changed (nothing when it changed nothing)."""
    if changed:
        log.warning("uibus's files were readable by other users; made private to its own user",
                    extra={"fields": {"changed": "; ".join(changed)}})
