"""How a hosted agent's process comes to life: a `Launch` (what to run, where, with which
environment, home and confinement, for which tenant) handed to a `Launcher`, which starts it and
owns what it started until its `async with` ends.

Only the local launcher exists (`LOCAL`): the agent runs on this machine as uibus's child, plainly
or, with `sandbox = true`, under bubblewrap (`bwrap`). A Kubernetes launcher (a pod per agent
session through the SIG Apps agent-sandbox `Sandbox` CRD) would take the same `Launch`; see
docs/hosting/isolation.md for that mapping. uibus.agents.stdio starts processes only through here.

What no agent ever gets, sandbox or not (`agent_env`): uibus's own environment. The environment is
an allow-list — PATH, HOME, LANG, LC_*, TERM, TMPDIR, USER, SHELL, then the names the agents file
lists in `inherit_env`, then the agent's own `env` — and uibus's settings (`UIBUS_*`, Redis URLs,
TLS paths, the OTLP exporter's headers) can be neither inherited nor listed.

The sandbox (`bwrap_argv`): the system (/usr, /etc, …) and the agent's own installation read-only,
its working directory read-write (and, for a git worktree, the repository's common .git directory,
which git needs to commit), its tenant's home read-write at HOME with the operator's configuration
files read-only inside it, its tenant's own /tmp (in that home; a fresh one without a home), a new
PID namespace with its own /proc, and nothing of uibus's: every path uibus names as its own
(state directory, store, tokens file, TLS files, agents file) is masked wherever it would
otherwise show through.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

# ---- the environment: an allow-list --------------------------------------------------------------

# What every agent inherits from uibus's environment (when set): enough to find programs, its home,
# its language, its terminal and temporary files; nothing that configures uibus.
ALLOWED_ENV = ("PATH", "HOME", "LANG", "LANGUAGE", "TERM", "TMPDIR", "USER", "SHELL")
_LOCALE = re.compile(r"LC_[A-Z_]+")
# Never handed on, even when listed in `inherit_env`: uibus's own settings and secrets.
_UIBUS_OWN = re.compile(r"UIBUS_.*|.*REDIS.*|OTEL_EXPORTER_OTLP_.*|.*TLS.*|SSLKEYLOGFILE")


def forbidden_name(name: str) -> bool:
    """A variable that belongs to uibus (its settings, Redis URLs, TLS paths, OTLP headers)."""
    return _UIBUS_OWN.fullmatch(name.upper()) is not None


def agent_env(inherit: Iterable[str], own: Mapping[str, str], environ: Mapping[str, str] | None = None
              ) -> dict[str, str]:
    """An agent's whole environment: the allow-list and `inherit` from `environ` (uibus's), then
    the agent's own `env` (which may set anything, being the operator's words for that agent)."""
    source = os.environ if environ is None else environ
    names = set(ALLOWED_ENV) | set(inherit)
    env = {k: v for k, v in source.items()
           if (k in names or _LOCALE.fullmatch(k)) and not forbidden_name(k)}
    env.update(own)
    return env


# ---- what a launcher is given ---------------------------------------------------------------------

# The operator's configuration inside HOME that a sandboxed agent sees read-only (when present):
# pi's models, settings, auth, prompts, extensions and themes; Claude Code's settings, memory,
# agents and commands; codex's and gemini's configuration. Conversations (~/.pi/agent/sessions,
# ~/.claude/projects, ~/.claude.json, ~/.codex/sessions) are written in the tenant's own home.
HOME_FILES = (".pi/agent/models.json", ".pi/agent/settings.json", ".pi/agent/auth.json", ".pi/agent/prompts",
              ".pi/agent/extensions", ".pi/agent/themes", ".pi/agent/AGENTS.md",
              ".claude/settings.json", ".claude/CLAUDE.md", ".claude/agents", ".claude/commands",
              ".codex/config.toml", ".codex/auth.json", ".gemini/settings.json", ".gitconfig",
              ".config/git/config")
# The system, read-only; the top-level links of a merged /usr (bin -> usr/bin) are made again.
TMP = ".tmp"  # in a tenant's home: its agents' /tmp
SYSTEM = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
          "/run/systemd/resolve")


@dataclass(frozen=True)
class Sandbox:
    """How to confine an agent (option `sandbox = true`)."""

    bwrap: str  # the bubblewrap program
    network: bool = True  # False: a network namespace of its own, with nothing in it (--unshare-net)
    read_only: tuple[str, ...] = ()  # the agent's installation and the operator's extra paths
    home_files: tuple[str, ...] = HOME_FILES  # inside the operator's HOME, shown read-only
    homes_dir: str = ""  # where tenants' homes live (<workspaces_dir>/homes)
    hide: tuple[str, ...] = ()  # uibus's own paths, masked wherever they would show through


@dataclass(frozen=True)
class Launch:
    """One agent process to start: everything a launcher needs, nothing of uibus's."""

    agent: str
    session: str
    tenant: str  # whose agent this is (uibus.auth.Tokens.tenant): its home, when sandboxed
    argv: tuple[str, ...]  # argv[0] resolved at start-up
    cwd: str | None
    env: dict[str, str] = field(repr=False, default_factory=dict)
    sandbox: Sandbox | None = None
    stop_timeout: float = 5.0
    limit: int = 2 ** 16  # the stdout reader's line bound

    @property
    def home(self) -> str:
        """The home the agent sees (its HOME): the operator's, as configured."""
        return self.env.get("HOME", "")

    def tenant_home(self) -> str | None:
        """The host directory bound at HOME for this launch's tenant (sandboxed only)."""
        if self.sandbox is None or not self.sandbox.homes_dir or not self.home:
            return None
        return str(Path(self.sandbox.homes_dir) / _safe(self.tenant or "operator"))


    def host_path(self, path: str) -> str:
        """Where a path the agent names lies on this host: under HOME, in the tenant's home when
        sandboxed (uibus looks at an agent's files there: pi's session file, before resuming it)."""
        home, tenant_home = self.home, self.tenant_home()
        if tenant_home is None or not _under(path, home):
            return path
        return tenant_home + path[len(home.rstrip("/")):]


def _private_dirs(*paths: str) -> None:
    """Made if missing, readable by uibus's user alone (a tenant's home, its /tmp)."""
    for path in paths:
        os.makedirs(path, mode=0o700, exist_ok=True)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "_"


class Launcher(abc.ABC):
    """Starts agent processes. `start` is an async context manager: the process is up inside it,
    and when it ends whatever the launch started is gone (its group, its sandbox)."""

    @abc.abstractmethod
    def start(self, launch: Launch) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
        """The agent's process, with stdin/stdout/stderr pipes, in a process group of its own."""


# ---- the local launcher -------------------------------------------------------------------------

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

    @asynccontextmanager
    async def start(self, launch: Launch) -> AsyncIterator[asyncio.subprocess.Process]:
        argv = list(launch.argv)
        if launch.sandbox is not None:
            home = launch.tenant_home()
            if home is not None:
                await asyncio.to_thread(_private_dirs, home, os.path.join(home, TMP))
            argv = await asyncio.to_thread(bwrap_argv, launch, await git_common_dir(launch.cwd))
        lifeline, keep = os.pipe()  # both ends non-inheritable: only this agent's watcher gets one
        tenths = str(max(1, round(launch.stop_timeout * 10)))
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", WATCHED, "uibus-agent", str(lifeline), tenths, *argv,
                cwd=launch.cwd, env=launch.env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=launch.limit, pass_fds=(lifeline,))
        except BaseException:
            os.close(keep)
            raise
        finally:
            os.close(lifeline)
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            os.close(keep)  # the watcher is gone with the group (or goes now: its pipe's end closed)


LOCAL = LocalLauncher()


async def git_common_dir(cwd: str | None) -> str | None:
    """The repository's common .git directory when `cwd` is inside a git worktree whose .git lies
    outside it (a `git worktree add` checkout): git writes objects and refs there to commit."""
    if not cwd or not Path(cwd, ".git").is_file() or shutil.which("git") is None:  # noqa: ASYNC240
        return None
    proc = await asyncio.create_subprocess_exec(
        "git", "-C", cwd, "rev-parse", "--path-format=absolute", "--git-common-dir",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    common = out.decode().strip()
    if proc.returncode != 0 or not common or not Path(common).is_dir():  # noqa: ASYNC240
        return None
    return common


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def bwrap_argv(launch: Launch, common_dir: str | None = None) -> list[str]:
    """The bwrap command line that runs `launch.argv` confined (see the module docstring).
    Order matters to bwrap: later mounts go on top of earlier ones, so the private /tmp comes
    before the working directory (which may lie under /tmp) and uibus's masks come last."""
    box = launch.sandbox
    assert box is not None
    args = [box.bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "uibus-agent"]
    if not box.network:
        args.append("--unshare-net")
    bound: list[str] = []  # host trees visible inside

    def bind(kind: str, src: str, dest: str | None = None) -> None:
        args.extend([kind, src, dest or src])
        bound.append(src)

    for path in SYSTEM:
        if os.path.islink(path):
            args.extend(["--symlink", os.readlink(path), path])
        elif os.path.exists(path):
            bind("--ro-bind", path)
    home, tenant_home = launch.home, launch.tenant_home()
    # /tmp: the tenant's own, kept (caches such as jiti's compiled TypeScript, which pi's extensions
    # would otherwise pay at every start: measured +200 ms), or a fresh tmpfs without a tenant home
    tmp = ["--bind", os.path.join(tenant_home, TMP), "/tmp"] if tenant_home is not None else ["--tmpfs", "/tmp"]
    args.extend(["--proc", "/proc", "--dev", "/dev", *tmp, "--tmpfs", "/var/tmp"])
    for path in box.read_only:
        real = os.path.realpath(path)
        if os.path.exists(real):
            bind("--ro-bind", real)
            if real != os.path.abspath(path):  # reachable by the name it is configured as, too
                bind("--ro-bind", real, os.path.abspath(path))
    if tenant_home is not None:
        bind("--bind", tenant_home, home)
        for name in box.home_files:
            src = os.path.join(home, name)
            if os.path.exists(src):
                bind("--ro-bind", src)
    if launch.cwd:
        bind("--bind", launch.cwd)
        if common_dir and not _under(common_dir, launch.cwd):
            bind("--bind", common_dir)
    for path in box.hide:  # uibus's own files, wherever a bind above would show them
        if not os.path.lexists(path) or not any(_under(path, b) for b in bound):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            args.extend(["--tmpfs", path])
        else:
            args.extend(["--ro-bind", "/dev/null", path])
    if launch.cwd:
        args.extend(["--chdir", launch.cwd])
    return [*args, "--", *launch.argv]


def installation_of(program: str, path: str) -> list[str]:
    """Where an agent program lives, to be shown read-only in its sandbox: its package folder (the
    outermost `node_modules` on its way, or the prefix above its `bin`), by the name configured and
    by its real name, and likewise for the interpreter its `#!` line names (node, python)."""
    found: list[str] = []
    for p in (program, os.path.realpath(program)):
        found.append(_root(p))
    interpreter = _shebang(os.path.realpath(program), path)
    if interpreter:
        for p in (interpreter, os.path.realpath(interpreter)):
            found.append(_root(p))
    return list(dict.fromkeys(f for f in found if f not in ("/", "") and not any(_under(f, s) for s in SYSTEM)))


def _root(path: str) -> str:
    parts = Path(path).parts
    if "node_modules" in parts:
        return str(Path(*parts[:parts.index("node_modules") + 1]))
    parent = Path(path).parent
    return str(parent.parent if parent.name == "bin" else parent)


def _shebang(program: str, path: str) -> str | None:
    try:
        with open(program, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return shutil.which(rest[0], path=path) if rest else None
    return words[0]


def sandbox_problem(bwrap: str) -> str:
    """Why a sandbox cannot start here ("" when it can): bwrap missing, or it fails to make its
    namespaces (no user namespaces for an unprivileged uibus, a seccomp profile forbidding them)."""
    if not os.access(bwrap, os.X_OK):
        return f"{bwrap} is not an executable file (install bubblewrap, or set option bwrap)"
    try:
        done = subprocess.run([bwrap, "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "--", "/bin/true"],
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} cannot run: {exc}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return f"{bwrap} cannot make a sandbox here: {why[-1] if why else f'exit code {done.returncode}'}"
    return ""
