"""One embedded store, one serving uibus: an OS lock on a file beside the SQLite file.

SQLite itself lets two processes open one file, and two `uibus serve` on one store did so with no
word: each keeps its own session count, retention sweep and in-memory state of what it serves, so
each undoes the other's bookkeeping, and a UI on one never sees the other's events (there is no bus
between them). Replicas that share state do so through Redis (`--redis-url`), which has a bus.

So a serving uibus holds `flock(LOCK_EX)` on `<store>.lock` for as long as its store is open, and
writes there who it is (pid, ports, start time, working directory) for the one it refuses. The lock
is the kernel's, on the open file: it dies with the process however it ends (a crash, SIGKILL, the
OOM killer), so a stale file never blocks a start, and it is never inherited by the agents uibus
starts (the descriptor is close-on-exec). The file stays (removing it would let a third process lock
a new file while the second still holds the old one); its content is rewritten by each holder.
Readers of the file (tests, `uibus backup`, sqlite3) take no lock and are never refused.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from uibus.infra.errors import ConfigError

__all__ = ["StoreInUse", "StoreLock", "holder"]


class StoreInUse(ConfigError):
    """Another uibus serves this store: not a bad setting but a machine state, like a taken port."""


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".lock")


def _said(record: dict[str, Any]) -> str:
    """The holder in words: `pid 123 (gRPC 127.0.0.1:26040, HTTP port 8080, since …, in /dir)`."""
    if not record.get("pid"):
        return "another uibus (it is starting)"
    parts = [f"gRPC {record['grpc']}" if record.get("grpc") else "",
             f"HTTP port {record['http']}" if record.get("http") else "",
             f"since {record['started']}" if record.get("started") else "",
             f"in {record['cwd']}" if record.get("cwd") else ""]
    return f"uibus pid {record['pid']} ({', '.join(p for p in parts if p)})"


def _refusal(store: Path, record: dict[str, Any]) -> StoreInUse:
    return StoreInUse("--store", f"{store} is served by {_said(record)}; a store is served by one uibus at a "
                                 "time: give this one its own (--store PATH), or run replicas on one Redis "
                                 "(--redis-url)")


def _read(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data.strip() else {}
        return record if isinstance(record, dict) else {}
    return {}


class StoreLock:
    """Held from construction to `release()`; raises StoreInUse (naming the holder) when another
    process holds it. `about` is what this uibus says of itself (its addresses) in the file."""

    def __init__(self, store: Path, about: dict[str, Any]) -> None:
        self.path = lock_path(store)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(self._fd)
            self.release()
            raise _refusal(store, record) from None
        except OSError:
            self.release()
            raise
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        record = {"pid": os.getpid(), "started": started, "cwd": os.getcwd(), **about}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode() + b"\n", 0)

    def release(self) -> None:
        """Unlocks (closing the descriptor is what frees a flock); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def holder(store: Path) -> StoreInUse | None:
    """The refusal a `serve` on `store` would meet now, or None when no process serves it: asked
    before binding any port, so a second `uibus serve` with the same ports hears about the store
    (the cause) rather than the ports. Takes the lock for an instant when it is free."""
    path = lock_path(store)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (never served), or its folder is not there yet
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _refusal(store, _read(fd))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None
