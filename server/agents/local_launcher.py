"""The local launcher (`LOCAL`): a hosted agent runs on this machine as uibus's child, plainly,
under bubblewrap (uibus.agents.bubblewrap) or under gVisor (uibus.agents.gvisor), in its cgroups
(uibus.agents.limits), with outbound-only networking when asked (uibus.agents.network).

Why a module of its own: uibus.agents.launcher says what a launch is, uibus.agents.bubblewrap what
a sandboxed agent sees; this is the one place that starts a process and owns it until its
`async with` ends — the process group, the watcher, the seccomp filter's descriptor, the gVisor
bundle, pasta, the cgroups — undone in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from uibus.agents import gvisor, network, seccomp
from uibus.agents.bubblewrap import bwrap_argv
from uibus.agents.launcher import TMP, Launch, Launcher, private_dirs
from uibus.agents.limits import AgentLimits

# How an agent is started: /bin/sh forks a watcher into the agent's new process group, then execs the
# agent (same pid, so the agent is uibus's child and its group's leader as before). The watcher blocks
# reading a pipe whose only write end this uibus process holds: when uibus dies in any way (SIGKILL
# and the OOM killer included), the kernel closes that end, and the watcher sends SIGTERM to the
# whole group (the agent and everything it started) after SETTLE_S, then SIGKILL once the agent
# is gone or stop_timeout_seconds have passed. No
# preexec_fn (unsafe in a threaded process), no PR_SET_PDEATHSIG (it fires on the death of the
# forking *thread*, and reaches only one process, not its children), no polling; it costs one small
# shell process per agent (~1 MiB), which ignores the SIGTERM of a normal stop and dies with the
# group's SIGKILL. Needed because some agents ignore the end of their input (codex-acp;
# claude-code-acp 0.16.2 ran on 10 s after its uibus was SIGKILLed).
# (The pipe is named /dev/fd/N: a POSIX shell's redirections take one-digit descriptors only. The
# agent inherits the read end too, which is harmless: only the write end's closing matters.)
# After the SIGTERM it looks every 0.1 s whether the agent ($$: the shell that became it) is gone,
# for at most the stop timeout ($2, in tenths), and then kills what is left of the group, itself too.
# A sandboxed agent is bwrap, which stays in the group (no --new-session: the agent has no terminal
# to push input into) so the group's signals reach it and everything inside (a PID namespace's
# processes are in their parent's process group); bwrap's --die-with-parent is a second lifeline.
SETTLE_S = 0.5
WATCHED = ('fd=$1; steps=$2; shift 2; (trap "" TERM INT HUP; cd /; read _ < "/dev/fd/$fd"; '
           f'sleep {SETTLE_S:g}; kill -TERM 0; i=0; while [ "$i" -lt "$steps" ] && kill -0 "$$" 2>/dev/null; '
           'do sleep 0.1; i=$((i+1)); done; kill -KILL 0) </dev/null >/dev/null 2>&1 & exec "$@"')


class LocalLauncher(Launcher):
    """Agents on this machine, as uibus's children: plain, or inside bwrap."""

    def __init__(self) -> None:
        self._guards: dict[int, AgentLimits] = {}  # pid -> the limits of an agent running now

    @asynccontextmanager
    async def start(self, launch: Launch) -> AsyncIterator[asyncio.subprocess.Process]:
        kernel = contextlib.ExitStack()  # a gVisor launch's bundle and container: gone with the launch
        try:
            async with self._start(launch, kernel) as proc:
                yield proc
        finally:
            await asyncio.to_thread(kernel.close)

    @asynccontextmanager
    async def _start(self, launch: Launch, kernel: contextlib.ExitStack) -> AsyncIterator[asyncio.subprocess.Process]:
        argv = list(launch.argv)
        filter_fd: int | None = None
        home = launch.tenant_home()
        if home is not None:  # sandboxed: its tenant's home and /tmp, uibus's user's alone
            await asyncio.to_thread(private_dirs, home, os.path.join(home, TMP))
        if launch.sandbox is not None and launch.sandbox.runsc:  # the same view, gVisor's kernel
            plan = await asyncio.to_thread(bwrap_argv, launch, launch.sandbox.git_common or None)
            argv = await asyncio.to_thread(kernel.enter_context, gvisor.bundle(launch.sandbox.runsc, plan, launch.env))
        elif launch.sandbox is not None:
            filter_fd = seccomp.memfd(launch.sandbox.nested)
            try:
                # the repository of a configured worktree, found at start-up: never asked of the
                # agent's own files (a `.git` it rewrote would name what to bind)
                argv = await asyncio.to_thread(bwrap_argv, launch, launch.sandbox.git_common or None, filter_fd)
            except BaseException:
                os.close(filter_fd)
                raise
        net = network.plan(launch.sandbox, argv)  # "outbound": pasta attaches to it (uibus.agents.network)
        argv = net.argv
        lifeline, keep = os.pipe()  # both ends non-inheritable: only this agent's watcher gets one
        tenths = str(max(1, round(launch.stop_timeout * 10)))
        guard = AgentLimits.of(launch)  # its limits: cgroups it joins before it execs (uibus.agents.limits)
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", guard.script(WATCHED), "uibus-agent", *guard.create(), str(lifeline), tenths, *argv,
                cwd=launch.cwd, env=launch.env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=launch.limit,
                pass_fds=(lifeline, *net.fds) if filter_fd is None else (lifeline, filter_fd, *net.fds))
        except BaseException:
            os.close(keep)
            net.close()
            await guard.close(0)
            raise
        finally:
            os.close(lifeline)
            if filter_fd is not None:
                os.close(filter_fd)  # bwrap holds its own copy, read once it has made the sandbox
            net.sent()
        guard.watch(proc)
        self._guards[proc.pid] = guard
        try:
            await net.attach(lambda: proc.returncode is None)  # then the agent runs, connected
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            os.close(keep)  # the watcher is gone with the group (or goes now: its pipe's end closed)
            self._guards.pop(proc.pid, None)
            await guard.close(launch.stop_timeout)  # what is left in its cgroups is killed, they are removed
            await net.aclose()  # pasta's group

    def why_stopped(self, proc: asyncio.subprocess.Process) -> str:
        guard = self._guards.get(proc.pid)
        return guard.reason(proc.returncode) if guard else ""


LOCAL = LocalLauncher()
