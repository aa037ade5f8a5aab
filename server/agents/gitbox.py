"""uibus's own git commands, and the box they run in when they touch what an agent can write.

Why a box: a conversation's repository is the agent's (uibus.agents.workspaces). Everything in it —
its config, its attributes, its objects directory, any name in it — may have been planted by a
model told to by a stranger's text, and git reads all of it: filters, diff drivers, fsmonitor and
hooks run programs, and paths lead wherever a link points. So every git command uibus runs on a
workspace (summary, diff, export) runs confined, as hosted agents are (uibus.agents.confinement's
`confinement`: a user namespace, every capability dropped, the seccomp filter), with no network,
the system read-only with its secrets masked, the workspace read-only, and writable only the
private folder uibus keeps for that workspace (never shown to the agent). A command that the agent
managed to make git run would find nothing of uibus's: no environment (an allow-list below), no
files, no sockets, nothing to write but that folder.

And no configuration of the agent's reaches uibus's own index: summaries stage the workspace into
uibus's own git directory (its config is uibus's: no filter, no driver, no hook), borrowing objects
from the base repository and the agent's through alternates; only the count of commits reads the
agent's repository, and that inside the box.

Commands on the operator's base repository (its top level, making a conversation's repository,
fetching an export) run unboxed: that repository is the operator's, never written by an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from uibus.agents import seccomp
from uibus.agents.confinement import confinement, system_binds

GIT_TIMEOUT_S = 60.0  # one git command; checking out a big repository takes seconds
# What uibus's own git commands get of its environment: enough to find git and to speak C.
_GIT_ENV = ("PATH", "LANG", "TMPDIR", "GIT_EXEC_PATH")
# For the base repository, the operator's own git configuration too (safe.directory, identity).
_OPERATOR_ENV = ("HOME", "USER", "XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_SYSTEM")
# Switched off for every command: what would run a program or reach the network on git's own.
_SAFE = ("-c", "core.quotepath=off", "-c", "color.ui=never", "-c", "core.fsmonitor=false", "-c",
         "core.hooksPath=/dev/null", "-c", "protocol.allow=never", "-c", "protocol.file.allow=always",
         "-c", "core.sshCommand=false", "-c", "diff.external=", "-c", "core.pager=cat")


class GitError(Exception):
    """A git command failed; the message names the command and says git's own words."""


@dataclass(frozen=True)
class Box:
    """Where a confined git runs: `bwrap` ("" when there is none here: the command runs plain, as
    when no agent is sandboxed), what it sees read-only and what it may write."""

    bwrap: str
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()

    def argv(self, cwd: str, seccomp_fd: int) -> list[str]:
        args = [self.bwrap, *confinement(), "--unshare-net", "--new-session", "--seccomp", str(seccomp_fd),
                *system_binds(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in self.read_only:
            if os.path.isdir(path):
                args.extend(["--ro-bind", path, path])
        for path in self.writable:
            args.extend(["--bind", path, path])
        return [*args, "--chdir", cwd, "--"]


async def git(*args: str, cwd: str, env: dict[str, str] | None = None, limit: int = 16 * 1024 * 1024,
              check: bool = True, box: Box | None = None, operator: bool = False,
              out_fd: int | None = None) -> tuple[int, bytes, bool]:
    """Runs `git args` in `cwd` (no shell; never a pager, a prompt or an editor); returns (exit code,
    stdout cut at `limit` bytes, whether it was cut). Bounded by GIT_TIMEOUT_S; a cancel kills it.
    `box`: confined (see the module docstring); `operator`: the operator's git configuration applies
    (the base repository), else none but the repository's own; `out_fd`: stdout is copied there
    (up to `limit` bytes) instead of returned."""
    names = _GIT_ENV + (_OPERATOR_ENV if operator else ())
    full = {k: v for k, v in os.environ.items() if k in names}
    if not operator:
        full.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent",
                     "GIT_ATTR_NOSYSTEM": "1", "GIT_NO_REPLACE_OBJECTS": "1"})
    full.update({**(env or {}), "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "GIT_EDITOR": "true", "LC_ALL": "C"})
    argv = ["git", *_SAFE, *args]
    fd: int | None = None
    if box is not None and box.bwrap:
        fd = seccomp.memfd()
        argv = [*box.argv(cwd, fd), *argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=() if fd is None else (fd,), start_new_session=box is not None)
    finally:
        if fd is not None:
            os.close(fd)
    assert proc.stdout is not None and proc.stderr is not None
    err_task = asyncio.ensure_future(_tail(proc.stderr, 64 * 1024))
    try:
        async with asyncio.timeout(GIT_TIMEOUT_S):
            out, cut = await _upto(proc.stdout, limit, out_fd)
            if cut:  # the rest is not wanted: stop it rather than read it
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            err = await err_task
            code = await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        err_task.cancel()
        await asyncio.shield(proc.wait())
        raise
    if check and code != 0 and not cut:
        words = err.decode(errors="replace").strip().splitlines()
        raise GitError(f"git {_verb(args)} failed (exit {code}): {words[-1] if words else 'no message'}")
    return code, out, cut


async def _upto(stream: asyncio.StreamReader, limit: int, out_fd: int | None) -> tuple[bytes, bool]:
    """Everything `stream` gives until its end, or its first `limit` bytes and True when it has
    more; copied to `out_fd` (and not kept) when given. (`StreamReader.read(n)` returns what has
    arrived so far, not n bytes: read until the end.)"""
    kept: list[bytes] = []
    total = 0
    while chunk := await stream.read(1 << 16):
        over = total + len(chunk) > limit
        chunk = chunk[: limit - total] if over else chunk
        total += len(chunk)
        if out_fd is None:
            kept.append(chunk)
        else:
            view = memoryview(chunk)
            while view:
                view = view[await asyncio.to_thread(os.write, out_fd, view):]
        if over:
            return b"".join(kept), True
    return b"".join(kept), False


async def _tail(stream: asyncio.StreamReader, keep: int) -> bytes:
    """Everything `stream` gives until its end (a full pipe would stall git), its last `keep` bytes kept."""
    last = b""
    while chunk := await stream.read(1 << 16):
        last = (last + chunk)[-keep:]
    return last


def _verb(args: Sequence[str]) -> str:
    """The git command's name, past its global options."""
    return next((a for a in args if not a.startswith("-") and "=" not in a), "?")
