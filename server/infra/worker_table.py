"""What the worker processes of `uibus serve --workers N` share: one status slot each.

The parent (uibus.app.workers) maps a small anonymous shared memory table before it forks, so every
worker inherits the same pages: no file, no socket, no Redis round trip, and nothing to clean up
when the processes are gone. Each slot is written by one writer at a time — its worker while it
runs, the parent once it has exited — and a state is one byte, so a read never sees half a write.

Readiness is all or nothing: a load balancer probing one worker (the ports are shared) must not
hear SERVING while another worker, which gets some of its connections, cannot serve. So each worker
writes its own readiness here and reports ready only when every slot says READY (uibus.app folds
this into the same `not_ready()` its health watch and /readyz read).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from dataclasses import dataclass, field

STARTING, UP, READY, DOWN = 0, 1, 2, 3  # forked / serving calls but not ready / ready / stopping or gone
_WORDS = {STARTING: "starting", UP: "not ready", READY: "ready", DOWN: "down"}
_SLOT = 512  # bytes per worker: the state, then why it failed (one line, for the parent to print once)
_TEXT = 4  # offset of the failure text; bytes 2..3 hold its length


class WorkerTable:
    """`count` status slots in shared memory; create it before forking the workers."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._map = mmap.mmap(-1, count * _SLOT)  # anonymous and MAP_SHARED: shared with forked children

    def state(self, index: int) -> int:
        return self._map[index * _SLOT]

    def set_state(self, index: int, state: int) -> None:
        self._map[index * _SLOT] = state

    def report(self, index: int, text: str) -> None:
        """Keeps why worker `index` failed; the parent prints it (once, however many workers fail alike)."""
        data = text.encode("utf-8", "replace")[:_SLOT - _TEXT]
        at = index * _SLOT
        self._map[at + _TEXT:at + _TEXT + len(data)] = data
        self._map[at + 2:at + _TEXT] = struct.pack("<H", len(data))

    def reported(self, index: int) -> str:
        at = index * _SLOT
        (size,) = struct.unpack("<H", self._map[at + 2:at + _TEXT])
        return self._map[at + _TEXT:at + _TEXT + size].decode("utf-8", "replace")

    def not_ready(self, skip: int = -1) -> str | None:
        """Why some worker (other than `skip`) is not ready, None when all are."""
        for index in range(self.count):
            state = self.state(index)
            if index != skip and state != READY:
                return f"worker {index} of {self.count} is {_WORDS.get(state, 'unknown')}"
        return None


@dataclass
class Worker:
    """What one worker process gets from its parent: its index, the shared table, and the already
    listening HTTP socket (None when the HTTP port is off)."""

    index: int
    table: WorkerTable
    http_socket: socket.socket | None = None
    pid: int = field(default_factory=os.getpid)

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        """Response metadata naming this worker (see uibus.edge.pipeline): which worker answered a call."""
        return (("x-uibus-worker", str(self.index)),)

    def mark(self, ready: bool) -> None:
        """This worker's own readiness (its store, its bus), for the others to read."""
        self.table.set_state(self.index, READY if ready else UP)

    def mark_down(self) -> None:
        self.table.set_state(self.index, DOWN)

    def others_not_ready(self) -> str | None:
        return self.table.not_ready(skip=self.index)

    def report(self, text: str) -> None:
        self.table.report(self.index, text)
