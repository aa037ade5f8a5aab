"""Limits per hosted agent and per tenant, enforced by the kernel (docs/hosting/isolation.md, "Limits").

Agent option `limits = { pids = N, memory_mb = N, cpu = F, disk_mb = N }` (0 turns one off; a name
left out takes its default, DEFAULTS), applied by the local launcher to every stdio agent, sandboxed
or not (a cgroup needs no sandbox), on top of the per-tenant totals `--quota-tenant-memory-mb` and
`--quota-tenant-pids`:

* pids, memory_mb, cpu: a cgroup per agent process — cgroup v2 where uibus's own cgroup is
  delegated to it (writable, controllers available), else cgroup v1 where the controller's
  hierarchy is writable — `uibus-<uibus pid>/t-<tenant>/a-<agent>-<n>` under uibus's own cgroup in
  each hierarchy; the tenant's directory carries the tenant's totals. The agent's shell writes its
  own pid into the cgroup before it execs the agent (`JOIN`), so nothing of the agent ever runs
  outside it; when the launch ends every process left in the cgroup is killed (a daemon that left
  the process group included) and the directories are removed (rmdir once empty).
  pids → pids.max (a fork past it fails; the agent lives on), memory_mb → memory.limit_in_bytes and
  memory.memsw.limit_in_bytes (v1: swap off) / memory.max, memory.swap.max = 0 and memory.oom.group
  (v2), cpu → cpu.cfs_quota_us / cpu.cfs_period_us (v1) / cpu.max (v2).
* disk_mb: no kernel quota exists on a plain directory (project quotas need an XFS or ext4 mounted
  with prjquota; a loop-mounted image per tenant needs mount rights uibus does not have unprivileged),
  so the agent's workspace and its tenant's home are measured (`usage`: os.scandir, links not
  followed, at most MAX_ENTRIES entries, every DISK_CHECK_S or ten times the last walk's time,
  whichever is longer) and the agent is stopped past it; plus RLIMIT_FSIZE = disk_mb, which the
  kernel enforces at once on any one file (a write past it fails: SIGXFSZ / EFBIG).

An agent stopped at a limit ends with the reason ("stopped: memory limit 256 MB"), which reaches
every UI as any end of an agent process does; the next turn starts a new process. An OOM in the
agent's cgroup stops the whole agent (v2: memory.oom.group; v1: the agent's cgroup has its OOM
killer off, and uibus, seeing `under_oom` within MEMORY_CHECK_S, kills every process in it), so a
turn never goes on with half an agent. Where the cgroups are and how a limit is written:
uibus.agents.cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from uibus.agents import cgroups

log = logging.getLogger("uibus.agents.limits")

NAMES = ("pids", "memory_mb", "cpu", "disk_mb")
CONTROLLERS = {"pids": "pids", "memory_mb": "memory", "cpu": "cpu"}  # disk_mb: measured, no controller
MIN = {"pids": 8, "memory_mb": 16, "cpu": 0.01, "disk_mb": 1}  # a shell, its watcher, bwrap and the agent fit
MEMORY_CHECK_S = 0.25  # how often an OOM in an agent's cgroup is looked for while it runs
DISK_CHECK_S = 5.0  # the least time between two measurements of an agent's disk
MAX_ENTRIES = 500_000  # entries one measurement walks; more counts as over the limit
JOIN_EXIT = 125  # the agent's shell could not join its cgroup


@dataclass(frozen=True)
class Limits:
    """An agent's limits (0: none) and which of them the agents file set (`explicit`)."""

    pids: int = 0
    memory_mb: int = 0
    cpu: float = 0.0
    disk_mb: int = 0
    explicit: frozenset[str] = frozenset()
    count_cwd: bool = True  # disk_mb counts the working directory (not a shared checkout by default)

    def kernel(self) -> dict[str, float]:
        """The limits a cgroup enforces, by name."""
        return {n: getattr(self, n) for n in CONTROLLERS if getattr(self, n)}

    def describe(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in NAMES}


DEFAULTS = Limits(pids=512, memory_mb=4096, cpu=1.0, disk_mb=10240)


def parse_limits(agent: str, value: Any) -> Limits:
    """Option `limits` of `agent` over DEFAULTS; ValueError naming the agent and the option."""
    if value is None:
        return DEFAULTS
    if not isinstance(value, Mapping):
        raise ValueError(f"agent {agent!r}: option limits must be a table such as "
                         "{ pids = 512, memory_mb = 4096, cpu = 1, disk_mb = 10240 }")
    unknown = sorted(set(value) - set(NAMES))
    if unknown:
        raise ValueError(f"agent {agent!r}: option limits: unknown name(s) {', '.join(map(str, unknown))}; "
                         f"known: {', '.join(NAMES)}")
    got: dict[str, Any] = {}
    for name, v in value.items():
        number = (int, float) if name == "cpu" else (int,)
        if isinstance(v, bool) or not isinstance(v, number) or v < 0 or (v and v < MIN[name]):
            raise ValueError(f"agent {agent!r}: option limits.{name} must be 0 (no limit) or "
                             f"{'a number' if name == 'cpu' else 'a whole number'} of at least {MIN[name]:g}, "
                             f"not {v!r}")
        got[name] = float(v) if name == "cpu" else v
    return replace(DEFAULTS, **got, explicit=frozenset(got))


def settle_limits(agent: str, limits: Limits) -> Limits:
    """`limits` as this machine can enforce them: a set one that cannot be is a ValueError naming
    the option (start-up fails); a default one is dropped, with one warning per controller."""
    dropped: dict[str, float] = {}
    for name in limits.kernel():
        problem = cgroups.HIERARCHIES.problem(CONTROLLERS[name])
        if not problem:
            continue
        if name in limits.explicit:
            raise ValueError(f"agent {agent!r}: option limits.{name} cannot be enforced here: {problem}")
        dropped[name] = 0.0 if name == "cpu" else 0
        _warn_once(f"default {name}", "an agent limit's default cannot be enforced here; agents run without it "
                   "(set it to 0 in option limits to say so, or give uibus a writable cgroup)",
                   limit=name, default=getattr(limits, name), why=problem)
    return replace(limits, **dropped) if dropped else limits


# ---- the per-tenant totals (--quota-tenant-memory-mb, --quota-tenant-pids) ---------------------

_tenant: dict[str, int] = {"memory_mb": 0, "pids": 0}


def set_tenant_totals(memory_mb: int, pids: int, explicit: Iterable[str] = ()) -> None:
    """The totals every tenant's agents stay under together (per uibus process); ValueError naming the
    flag when one set explicitly cannot be enforced here, a warning once for a default one."""
    wanted = {"memory_mb": memory_mb, "pids": pids}
    for name, value in wanted.items():
        problem = cgroups.HIERARCHIES.problem(CONTROLLERS[name]) if value else ""
        if problem:
            flag = f"--quota-tenant-{name.replace('_', '-')}"
            if name in set(explicit):
                raise ValueError(f"{flag} = {value} cannot be enforced here: {problem}")
            _warn_once(f"tenant {name}", "a per-tenant total's default cannot be enforced here; tenants run "
                       "without it", flag=flag, default=value, why=problem)
            wanted[name] = 0
    _tenant.update(wanted)


def tenant_totals(cfg: Any) -> None:
    """uibus.app at start (with hosted agents): Config's --quota-tenant-memory-mb and
    --quota-tenant-pids, an explicit one (not its default) that cannot be enforced an InvalidConfig."""
    from uibus.infra.config import InvalidConfig
    from uibus.infra.quotas import QUOTAS

    values = {n: getattr(cfg, f"quota_tenant_{n}") for n in ("memory_mb", "pids")}
    explicit = [n for n, v in values.items() if v != QUOTAS[f"tenant_{n}"].default]
    try:
        set_tenant_totals(values["memory_mb"], values["pids"], explicit)
    except ValueError as exc:  # "--quota-tenant-pids = 99 cannot …" -> "--quota-tenant-pids: 99 cannot …"
        flag, _, what = str(exc).partition(" = ")
        raise InvalidConfig(flag, what) from exc


_warned: set[str] = set()


def _warn_once(key: str, message: str, **fields: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, extra={"fields": fields})


# ---- one agent process's limits ------------------------------------------------------------------

# What the agent's shell runs first (uibus.agents.local_launcher.WATCHED follows): its own pid into each
# cgroup.procs named ($1: how many, then the paths), then RLIMIT_FSIZE (in 512-byte blocks, or -),
# before it forks the watcher and execs the agent: so no code of the agent's runs outside its
# cgroup, without a round trip to uibus (uibus writing the child's pid after the fork would race
# the exec; waiting on a pipe for uibus to write it would cost a round trip per start).
JOIN = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || { echo "uibus: cannot join the cgroup $1" >&2; '
        f'exit {JOIN_EXIT}; }}; n=$((n-1)); shift; done; [ "$1" = - ] || ulimit -f "$1" || exit {JOIN_EXIT}; shift; ')


@dataclass
class AgentLimits:
    """The cgroups and the disk watch of one agent process (LocalLauncher.start): `create` before
    the start, `watch` once started, `reason` why it was stopped, `close` when the launch ends."""

    limits: Limits
    tenant: str
    agent: str
    disk_paths: tuple[str, ...] = ()
    dirs: list[tuple[cgroups.Hierarchy, str]] = field(default_factory=list)  # (hierarchy, the agent's cgroup)
    stopped: str = ""
    _task: asyncio.Task[None] | None = None
    _pids_warned: bool = False

    @classmethod
    def of(cls, launch: Any) -> AgentLimits:
        """For a uibus.agents.launcher.Launch (`active` False when it has no limit). disk_mb counts
        its working directory (unless `count_cwd` is off) and, sandboxed, its tenant's home."""
        lim: Limits = launch.limits or Limits()
        disk = [launch.cwd] if lim.count_cwd and launch.cwd else []
        home = launch.tenant_home()
        if home:
            disk.append(home)
        return cls(lim, launch.tenant or "operator", launch.agent, tuple(disk) if lim.disk_mb else ())

    @property
    def active(self) -> bool:
        return bool(self.limits.kernel() or self.limits.disk_mb)

    def script(self, watched: str) -> str:
        """The agent's shell script: `watched` (uibus.agents.local_launcher.WATCHED), after JOIN if active."""
        return JOIN + watched if self.active else watched

    def create(self) -> list[str]:
        """Makes the agent's cgroups with its limits (and its tenant's with the totals, when new);
        the arguments JOIN takes (none when not active). OSError when the kernel refuses."""
        if not self.active:
            return []
        name = f"a-{cgroups.safe_name(self.agent)}-{next(cgroups.SEQ)}"
        try:
            for lim, value in self.limits.kernel().items():
                h = cgroups.HIERARCHIES.get(CONTROLLERS[lim])
                if isinstance(h, str):  # settled at start-up: only a default would be dropped there
                    raise OSError(errno.ENOTSUP, h)
                tenant = os.path.join(cgroups.HIERARCHIES.ensure(h), f"t-{cgroups.safe_name(self.tenant)}")
                if not os.path.isdir(tenant):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(tenant)
                    total = _tenant.get(lim, 0)
                    if total:
                        cgroups.set_limit(h, tenant, lim, total)
                if h.version == 2:
                    cgroups.enable(h, tenant)
                path = os.path.join(tenant, name)
                os.mkdir(path)
                self.dirs.append((h, path))
                cgroups.set_limit(h, path, lim, value)
        except BaseException:
            self._remove()
            raise
        procs = [os.path.join(p, "cgroup.procs") for _, p in self.dirs]
        return [str(len(procs)), *procs, str(self.limits.disk_mb * 2048) if self.limits.disk_mb else "-"]

    def watch(self, proc: asyncio.subprocess.Process) -> None:
        if self.dirs or self.disk_paths:
            self._task = asyncio.get_running_loop().create_task(self._watch(proc), name="agent limits")

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        next_disk = loop.time() + min(DISK_CHECK_S, 1.0)
        while proc.returncode is None and not self.stopped:
            await asyncio.sleep(MEMORY_CHECK_S)
            why = self.memory_reason()
            self._pids_note()
            if not why and self.disk_paths and self.limits.disk_mb and loop.time() >= next_disk:
                began = time.monotonic()
                try:
                    used, entries = await asyncio.to_thread(usage, self.disk_paths, MAX_ENTRIES)
                except Exception:  # a bug here must not end the watch (v1: an OOM waits for it)
                    log.exception("measuring an agent's disk failed", extra={"fields": {"agent": self.agent}})
                    used, entries = 0, 0
                next_disk = loop.time() + max(DISK_CHECK_S, 10 * (time.monotonic() - began))
                if entries >= MAX_ENTRIES:
                    why = f"stopped: disk limit {self.limits.disk_mb} MB (over {MAX_ENTRIES} files)"
                elif used > self.limits.disk_mb * 2**20:
                    why = (f"stopped: disk limit {self.limits.disk_mb} MB (its workspace and home hold "
                           f"{used // 2**20} MB)")
            if why and proc.returncode is None:
                self.stopped = why
                log.warning("agent stopped at a limit", extra={"fields": {
                    "agent": self.agent, "tenant": self.tenant, "pid": proc.pid, "why": why}})
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                self._kill_all()

    def memory_reason(self) -> str:
        """Why an OOM kill happened in the agent's cgroup ("" when none has)."""
        for h, path in self.dirs:
            if h.controller != "memory":
                continue
            events = cgroups.read(os.path.join(path, "memory.events.local" if h.version == 2 else "memory.oom_control"))
            if cgroups.event(events, "oom_kill") <= 0 and cgroups.event(events, "under_oom") <= 0:
                return ""
            own = (cgroups.event(events, "max") if h.version == 2 else cgroups.event(events, "under_oom") + sum(
                int(cgroups.read(os.path.join(path, f)) or 0) for f in ("memory.failcnt", "memory.memsw.failcnt")))
            if own > 0 or not _tenant["memory_mb"]:
                return f"stopped: memory limit {self.limits.memory_mb} MB"
            return f"stopped: the tenant's memory limit {_tenant['memory_mb']} MB (--quota-tenant-memory-mb)"
        return ""

    def _pids_note(self) -> None:
        for h, path in self.dirs:
            hit = h.controller == "pids" and cgroups.event(cgroups.read(os.path.join(path, "pids.events")), "max")
            if hit and not self._pids_warned:
                self._pids_warned = True
                log.warning("agent at its process limit: a fork failed", extra={"fields": {
                    "agent": self.agent, "tenant": self.tenant, "pids": self.limits.pids}})

    def reason(self, returncode: int | None) -> str:
        """Why the agent was stopped at a limit ("" when it was not)."""
        if self.stopped:
            return self.stopped
        why = self.memory_reason()
        if not why and returncode == -signal.SIGXFSZ and self.limits.disk_mb:
            why = f"stopped: disk limit {self.limits.disk_mb} MB (a file reached it)"
        return why

    def _kill_all(self) -> int:
        """SIGKILL to every process in the agent's cgroups (v2: cgroup.kill); how many were there."""
        seen: set[int] = set()
        for h, path in self.dirs:
            if h.version == 2:
                with contextlib.suppress(OSError):
                    cgroups.write(path, "cgroup.kill", "1")
            for word in cgroups.read(os.path.join(path, "cgroup.procs")).split():
                pid = int(word)
                if pid not in seen:
                    seen.add(pid)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        return len(seen)

    async def close(self, timeout: float) -> None:
        """Stops the watch, kills what is left in the cgroups, and removes them once empty (bounded
        by `timeout`; past it they are left, said in the log, and retried at the next close)."""
        if self._task is not None:
            self._task.cancel()  # not awaited: a cancel of this close must stay the caller's
        try:
            for i in range(round(max(timeout, 1.0) / 0.01) + 4):  # a process killed is gone within a few ms
                if not self.dirs or not self._kill_all():
                    break
                await asyncio.sleep(min(0.01, 0.001 * 2 ** i))
        finally:
            self._remove()

    def _remove(self) -> None:
        global _leftover
        left = []
        for h, path in [*self.dirs, *_leftover]:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                left.append((h, path))
                log.warning("an agent's cgroup could not be removed yet", extra={"fields": {
                    "cgroup": path, "error": exc.strerror}})
                continue
            for up in (os.path.dirname(path), h.parent):  # the tenant's, then this process's, once empty
                with contextlib.suppress(OSError):
                    os.rmdir(up)
        self.dirs = []
        _leftover = left


_leftover: list[tuple[cgroups.Hierarchy, str]] = []


def usage(paths: Iterable[str], cap: int = MAX_ENTRIES) -> tuple[int, int]:
    """Bytes on disk (st_blocks) under `paths` and the entries walked, links never followed, a path
    inside another counted once; the walk stops at `cap` entries."""
    roots = sorted({os.path.abspath(p) for p in paths if p})
    roots = [r for r in roots if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in roots)]
    total = entries = 0
    stack = list(roots)
    while stack and entries < cap:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                entries += 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                if entries >= cap:
                    break
    return total, entries
