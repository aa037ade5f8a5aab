"""Process and machine counters read straight from /proc (Linux), so the bench needs no extra package.

A server's CPU time comes from its own process (utime+stime), never from wall time, so the
per-operation CPU figure does not depend on how busy the other core was.
"""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User+system CPU seconds the process has used so far (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / TICK


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid` (a scan of /proc/*/stat)."""
    return children_of([pid])


def children_of(pids: list[int]) -> list[int]:
    """Pids of the live processes whose parent is one of `pids` (one scan of /proc/*/stat)."""
    parents = set(pids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) in parents:  # ppid (field 4 of stat)
            found.append(int(entry))
    return sorted(found)
