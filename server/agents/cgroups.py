"""The kernel's side of uibus.agents.limits: where each cgroup controller (pids, memory, cpu) can be
used by this process — cgroup v2 where uibus's own cgroup is delegated (writable, the controller
available; enabled for the children, uibus moving itself into a leaf `uibus-<pid>-main` when it is
alone in a cgroup that must have no processes of its own), else cgroup v1 where the controller's
hierarchy is writable — and the files that set a limit in either version. Every agent cgroup lies
under `uibus-<pid>` in uibus's own cgroup of each hierarchy; what a dead uibus left there (empty)
is swept at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
from dataclasses import dataclass

KINDS = ("cpu", "memory", "pids")
CPU_PERIOD_US = 100_000
SEQ = itertools.count(1)  # names of agent cgroups and probes, unique in this process


@dataclass
class Hierarchy:
    """One controller's place: its cgroup version, and uibus's own cgroup in it (a directory)."""

    controller: str
    version: int
    own: str

    @property
    def parent(self) -> str:
        """This uibus process's directory, under which every agent's cgroup lies."""
        return os.path.join(self.own, f"uibus-{os.getpid()}")


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), path)


def _inside(mount: str, root: str, own: str) -> str | None:
    if root == "/":
        return os.path.join(mount, own.lstrip("/"))
    if own == root or own.startswith(root.rstrip("/") + "/"):
        return os.path.join(mount, own[len(root):].lstrip("/"))
    return None


class Hierarchies:
    """Where each controller can be used by this process (found once), and why not where it cannot."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self.proc = proc  # where mountinfo and cgroup are read (tests: a fake one)
        self._found: dict[str, Hierarchy | str] | None = None
        self._ready: dict[str, str] = {}  # controller -> problem found making the parent ("" ready)

    def _discover(self) -> dict[str, Hierarchy | str]:
        try:
            with open(os.path.join(self.proc, "mountinfo"), encoding="utf-8") as f:
                mounts = f.read().splitlines()
            with open(os.path.join(self.proc, "cgroup"), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            return {c: f"cannot read /proc: {exc.strerror}" for c in KINDS}
        own_v1: dict[str, str] = {}
        own_v2 = None
        for line in lines:
            _, ctrls, path = line.split(":", 2)
            if ctrls:
                for c in ctrls.split(","):
                    own_v1[c] = path
            else:
                own_v2 = path
        v1: dict[str, tuple[str, str]] = {}
        v2: tuple[str, str] | None = None
        for line in mounts:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or len(rest) < 3:
                continue
            root, point = _unescape(fields[3]), _unescape(fields[4])
            if rest[0] == "cgroup2" and v2 is None:
                v2 = (point, root)
            elif rest[0] == "cgroup":
                for opt in rest[2].split(","):
                    v1.setdefault(opt, (point, root))
        found: dict[str, Hierarchy | str] = {}
        for c in KINDS:
            why = f"no {c} cgroup controller mounted"
            if v2 is not None and own_v2 is not None:
                own = _inside(*v2, own_v2)
                if own is not None and c in read(os.path.join(own, "cgroup.controllers")).split():
                    found[c] = Hierarchy(c, 2, own)
                    continue
            if c in v1 and c in own_v1:
                own = _inside(*v1[c], own_v1[c])
                if own is not None and os.path.isdir(own):
                    found[c] = Hierarchy(c, 1, own)
                    continue
                why = f"uibus's own {c} cgroup ({own_v1[c]}) is not visible under {v1[c][0]}"
            found[c] = why
        return found

    def get(self, controller: str) -> Hierarchy | str:
        if self._found is None:
            self._found = self._discover()
        return self._found[controller]

    def problem(self, controller: str) -> str:
        """Why `controller` cannot be used here ("" when it can): tried by making a cgroup and
        writing its limit file, then removing it."""
        if controller in self._ready:
            return self._ready[controller]
        h = self.get(controller)
        if isinstance(h, str):
            why = h
        else:
            try:
                probe = os.path.join(self.ensure(h), f"probe-{next(SEQ)}")
                os.mkdir(probe)
                try:
                    write(probe, unlimited_file(h), "max" if h.version == 2 or h.controller == "pids" else "-1")
                finally:
                    os.rmdir(probe)
                why = ""
            except OSError as exc:
                why = (f"no writable {controller} cgroup (cgroup v{h.version} at {h.own}: "
                       f"{(exc.strerror or str(exc)).lower()})")
            with contextlib.suppress(OSError):
                os.rmdir(h.parent)  # made again at the first agent's start
        self._ready[controller] = why
        return why

    def ensure(self, h: Hierarchy) -> str:
        """This process's parent directory in `h`, made (after sweeping dead uibus processes' empty
        ones) with the controller enabled below it (v2). OSError when it cannot be."""
        if not os.path.isdir(h.parent):
            _sweep(h.own)
            if h.version == 2:
                enable(h, h.own)
            with contextlib.suppress(FileExistsError):
                os.mkdir(h.parent)
        if h.version == 2:
            enable(h, h.parent)
        return h.parent


HIERARCHIES = Hierarchies()
SEQ = itertools.count(1)


def unlimited_file(h: Hierarchy) -> str:
    return {"pids": "pids.max", "memory": "memory.max" if h.version == 2 else "memory.limit_in_bytes",
            "cpu": "cpu.max" if h.version == 2 else "cpu.cfs_quota_us"}[h.controller]


def read(path: str) -> str:
    """A cgroup file's text ("" when it cannot be read: gone, or no such file in this version)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""


def write(directory: str, name: str, value: str) -> None:
    """Writes a cgroup file; OSError as the kernel refuses it."""
    with open(os.path.join(directory, name), "w", encoding="ascii") as f:
        f.write(value)


def enable(h: Hierarchy, directory: str) -> None:
    """cgroup v2: the controller enabled for `directory`'s children. A cgroup with processes of its
    own cannot (no internal processes): when that is uibus alone, it moves into a leaf beside."""
    if h.controller in read(os.path.join(directory, "cgroup.subtree_control")).split():
        return
    try:
        write(directory, "cgroup.subtree_control", f"+{h.controller}")
    except OSError as exc:
        if exc.errno != errno.EBUSY or directory != h.own:
            raise
        leaf = os.path.join(h.own, f"uibus-{os.getpid()}-main")
        os.makedirs(leaf, exist_ok=True)
        write(leaf, "cgroup.procs", str(os.getpid()))  # others left in it: the retry fails, said
        write(directory, "cgroup.subtree_control", f"+{h.controller}")


_OURS = re.compile(r"uibus-(\d+)(-main)?")


def _sweep(own: str) -> None:
    """Removes what dead uibus processes left (their directories, once empty: rmdir never removes a
    cgroup with processes)."""
    try:
        names = os.listdir(own)
    except OSError:
        return
    for name in names:
        m = _OURS.fullmatch(name)
        if m is None or int(m[1]) == os.getpid() or _alive(int(m[1])):
            continue
        for root, dirs, _files in os.walk(os.path.join(own, name), topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, d))
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(own, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def safe_name(name: str) -> str:
    """A tenant's or agent's name as part of one directory name."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)[:100] or "_"


def set_limit(h: Hierarchy, path: str, limit: str, value: float) -> None:
    """Writes limit `limit` (pids, memory_mb, cpu: uibus.agents.limits' names) of cgroup `path`."""
    if limit == "pids":
        write(path, "pids.max", str(int(value)))
    elif limit == "memory_mb":
        size = str(int(value) * 2**20)
        if h.version == 2:
            write(path, "memory.max", size)
            with contextlib.suppress(OSError):  # no swap accounting: there is no swap to limit
                write(path, "memory.swap.max", "0")
            if os.path.basename(path).startswith("a-"):  # an agent's own: OOM kills all of it, never a part
                with contextlib.suppress(OSError):
                    write(path, "memory.oom.group", "1")
        else:
            write(path, "memory.limit_in_bytes", size)
            with contextlib.suppress(OSError):  # memsw exists only with swap accounting on
                write(path, "memory.memsw.limit_in_bytes", size)
            if os.path.basename(path).startswith("a-"):
                # An agent's own: no OOM killer — its processes wait, uibus sees under_oom within
                # limits.MEMORY_CHECK_S and kills them all, so no half-killed agent answers first (v1 has
                # no oom.group). A tenant's total keeps the kernel's killer: it picks the victim.
                with contextlib.suppress(OSError):
                    write(path, "memory.oom_control", "1")
    elif limit == "cpu":
        quota = max(1000, round(value * CPU_PERIOD_US))
        if h.version == 2:
            write(path, "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            write(path, "cpu.cfs_period_us", str(CPU_PERIOD_US))
            write(path, "cpu.cfs_quota_us", str(quota))


def event(text: str, name: str) -> int:
    """The number on line `name` of a flat keyed file (memory.events, memory.oom_control, pids.events)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            with contextlib.suppress(ValueError):
                return int(value)
    return 0


def leftovers() -> list[str]:
    """This process's cgroup directories still present (tests: none once every agent is gone)."""
    found = []
    for c in KINDS:
        h = HIERARCHIES.get(c)
        if not isinstance(h, str) and os.path.isdir(h.parent):
            found.extend(root for root, _d, _f in os.walk(h.parent))
    return found
