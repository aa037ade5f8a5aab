"""How a hosted agent's process comes to life: a `Launch` (what to run, where, with which
environment, home, confinement and limits, for which tenant) handed to a `Launcher`, which starts
it and owns what it started until its `async with` ends.

Only the local launcher exists (uibus.agents.local_launcher, `LOCAL`): the agent runs on this machine as
uibus's child, plainly, under bubblewrap (`sandbox = true`: what it sees is
uibus.agents.bubblewrap's plan) or gVisor (`sandbox = "gvisor"`). A Kubernetes launcher (a pod
per agent session through the SIG Apps agent-sandbox `Sandbox` CRD) would take the same `Launch`;
see docs/hosting/isolation.md and deploy/k8s/agent-sandbox for that mapping.
uibus.agents.stdio starts processes only through a launcher.

What no agent ever gets, sandbox or not (`agent_env`): uibus's own environment. The environment is
an allow-list — PATH, HOME, LANG, LC_*, TERM, TMPDIR, USER, SHELL, then the names the agents file
lists in `inherit_env`, then the agent's own `env` — and uibus's settings (`UIBUS_*`, Redis URLs,
TLS paths, the OTLP exporter's headers) can be neither inherited nor listed.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

from uibus.agents.limits import Limits

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
    # option network (uibus.agents.network): "outbound" (pasta), "host" or True (the host's), "none" or
    # False (a namespace with only a loopback: --unshare-net); the agents file maps `true` to "outbound"
    network: bool | str = True
    loopback_ports: tuple[int, ...] = ()  # "outbound": host loopback ports forwarded (and uibus's /mcp)
    pasta: str = ""  # "outbound": the pasta program (found on PATH when empty)
    read_only: tuple[str, ...] = ()  # the agent's installation and the operator's extra paths
    home_files: tuple[str, ...] = HOME_FILES  # inside the operator's HOME, shown read-only
    homes_dir: str = ""  # where tenants' homes live (<workspaces_dir>/homes)
    hide: tuple[str, ...] = ()  # uibus's own paths, masked wherever they would show through
    nested: bool = False  # option nested_sandbox: the agent may make user namespaces (its own sandbox)
    git_common: str = ""  # the configured cwd's repository's common .git when cwd is a git worktree
    runsc: str = ""  # option sandbox = "gvisor": gVisor's runsc runs what bwrap would (uibus.agents.gvisor)


@dataclass(frozen=True)
class Launch:
    """One agent process to start: everything a launcher needs, nothing of uibus's."""

    agent: str
    session: str
    tenant: str  # whose agent this is (uibus.infra.auth.Tokens.tenant): its home, when sandboxed
    argv: tuple[str, ...]  # argv[0] resolved at start-up
    cwd: str | None
    env: dict[str, str] = field(repr=False, default_factory=dict)
    sandbox: Sandbox | None = None
    stop_timeout: float = 5.0
    limit: int = 2 ** 16  # the stdout reader's line bound
    limits: Limits | None = None  # option limits (uibus.agents.limits); None: none

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
        if tenant_home is None or not under(path, home):
            return path
        return tenant_home + path[len(home.rstrip("/")):]


def private_dirs(*paths: str) -> None:
    """Made if missing, readable by uibus's user alone (a tenant's home, its /tmp)."""
    for path in paths:
        os.makedirs(path, mode=0o700, exist_ok=True)


def _safe(name: str) -> str:
    """A tenant's name as one directory name: `+` kept (sessions two named tenants share, `a+b`,
    must not meet a tenant named `a_b`), anything else outside A-Z a-z 0-9 . _ - made `_`, and
    never `.` or `..`."""
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", name)[:160]
    return "_" if safe in ("", ".", "..") else safe


class Launcher(abc.ABC):
    """Starts agent processes. `start` is an async context manager: the process is up inside it,
    and when it ends whatever the launch started is gone (its group, its sandbox)."""

    @abc.abstractmethod
    def start(self, launch: Launch) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
        """The agent's process, with stdin/stdout/stderr pipes, in a process group of its own."""

    def why_stopped(self, proc: asyncio.subprocess.Process) -> str:
        """Why the launcher stopped `proc` at one of its limits ("" when it did not)."""
        return ""


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
