"""The agents config file: which agents this server offers and which backend answers each.

JSON (`*.json`) or TOML (`*.toml`, read with the stdlib `tomllib`), the same shape either way::

    default_agent = "hello_world"          # for the canonical AgentService path; else the first

    [[agents]]
    name = "hello_world"                   # routes /hello_world.AgentService/...
    description = "Says hello"             # Function.description and ConciergeService.List
    tags = ["demo"]
    backend = "local"                      # local | openai | neuro-san | rpc | acp
    options = { chunks = 8, delay_ms = 20 }

Optional per agent: `parameters` and `sly_data_schema` (Function), `tools` and `display_as`
(Connectivity). Mistakes fail start-up with a message naming the agent and the field, so a
server never runs with half a config.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from uibus.agents import AgentSpec, Backend, network, option
from uibus.agents.bubblewrap import git_common_dir, installation_of, sandbox_problem
from uibus.agents.gvisor import KERNEL
from uibus.agents.gvisor import problem as gvisor_problem
from uibus.agents.launcher import HOME_FILES, Sandbox, forbidden_name
from uibus.agents.limits import Limits, parse_limits, settle_limits
from uibus.agents.workspaces import MODES, WORKTREE, default_workspaces_dir, repository_of
from uibus.infra.config import InvalidConfig

log = logging.getLogger("uibus.agents")

# backend name -> "module:Class"; imported only when configured.
BACKENDS = {
    "local": "uibus.agents.local:LocalAgent",
    "openai": "uibus.agents.openai_compat:OpenAICompatAgent",
    "neuro-san": "uibus.agents.neurosan_proxy:NeuroSanProxyAgent",
    "rpc": "uibus.agents.rpc:RpcAgent",
    "acp": "uibus.agents.acp:AcpAgent",
}
# An agent name is a proto package (`<name>.AgentService`), so it must be an identifier.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_FIELDS = {"name", "description", "tags", "backend", "options", "parameters", "sly_data_schema", "tools",
           "display_as"}

BUILTIN: dict[str, Any] = {
    "default_agent": "hello_world",
    "agents": [
        {"name": "hello_world", "backend": "local", "tags": ["demo", "local"],
         "description": "A deterministic local agent (no network, no key): greets you, repeats what you "
                        "said, remembers the conversation, and streams its reply in chunks."},
    ],
}


@dataclass
class AgentTable:
    """The configured agents, in config order, each with its ready backend."""

    specs: dict[str, AgentSpec]
    backends: dict[str, Backend]
    default: str
    workspaces_dir: str = ""  # the file's `workspaces_dir` ("": not set there)

    def names(self) -> list[str]:
        return list(self.specs)

    async def aclose(self) -> None:
        for backend in self.backends.values():
            await backend.aclose()

    async def __aenter__(self) -> AgentTable:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# ==== Workspaces (docs/hosting/isolation.md): a git worktree per conversation ====
# Top level of the agents file: `workspaces_dir` (an absolute path; default <state dir>/workspaces,
# the state dir being the default store's folder; `--workspaces-dir` / UIBUS_WORKSPACES_DIR win over
# it). Per stdio agent (rpc, acp):
#   workspace = "shared"     the default: every session's agent works in `cwd` itself (one user's checkout)
#   workspace = "worktree"   each (session, agent) in its own `git worktree` of the repository at `cwd`
#                            (uibus.agents.workspaces); `cwd` must then be in a git repository
WORKSPACE_TOP_LEVEL = frozenset({"workspaces_dir"})
WORKSPACE_OPTIONS = frozenset({"workspace"})


def workspaces_dir_of(where: str, data: dict[str, Any]) -> str:
    """The file's `workspaces_dir`, checked ("" when not set)."""
    value = data.get("workspaces_dir", "")
    if not isinstance(value, str) or (value and not Path(value).expanduser().is_absolute()):
        raise ValueError(f"{where}: workspaces_dir must be an absolute path (a string), not {value!r}")
    return str(Path(value).expanduser()) if value else ""


def workspace_repo(spec: AgentSpec, cwd: str | None) -> str | None:
    """The option `workspace` of `spec`, checked: the configured `cwd` when it is "worktree" (then
    it must be in a git repository), None for "shared". ValueError naming agent and option."""
    mode = option(spec, "workspace", str, "shared")
    if mode not in MODES:
        raise ValueError(f"agent {spec.name!r}: option workspace must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != WORKTREE:
        return None
    if not cwd:
        raise ValueError(f"agent {spec.name!r}: option workspace = \"worktree\" needs option cwd (the repository "
                         "each conversation gets a worktree of)")
    try:
        repository_of(cwd)
    except ValueError as exc:
        raise ValueError(f"agent {spec.name!r}: option workspace = \"worktree\": {exc}") from exc
    return cwd
# ==== end of the workspaces block ====


# ==== Isolation of hosted agents (docs/hosting/isolation.md): what they inherit, the sandbox, tenants' homes ====
# Tenants' homes live in `<workspaces_dir>/homes/` (the workspaces block's `workspaces_dir`, as
# `--workspaces-dir` or the agents file set it; conversations' worktrees are in its `sessions/`).
# Per stdio agent (rpc, acp):
#   inherit_env = ["NAME", …]   more of uibus's environment to hand on (never UIBUS_*, Redis, TLS, OTLP)
#   sandbox     = false         true: run under bubblewrap (docs/hosting/isolation.md)
#   bwrap       = "bwrap"       the bubblewrap program (on PATH, or a path)
#   network     = "outbound"    with sandbox: a network of its own through pasta (uibus.agents.network):
#                               other hosts yes, the host's loopback and abstract sockets no; `true`
#                               means "outbound" too; "host": the host's network, shared; false: none
#   loopback_ports = [11434, …] "outbound": host loopback ports the agent may reach (a local model
#                               server); uibus's own /mcp port is added for an ACP agent offered it
#   read_only   = ["/path", …]  more to show read-only inside (the agent's installation is found)
#   home_files  = [".pi/agent/models.json", …]  what of the operator's HOME is shown read-only
#   limits      = { pids = 512, memory_mb = 4096, cpu = 1, disk_mb = 10240 }  the defaults, any
#                 agent, sandboxed or not (uibus.agents.limits; 0 turns one off)
#   sandbox     = "gvisor"      the same view of the files under gVisor's kernel (runsc; needs network = false)
#   runsc       = "runsc"       gVisor's runsc (on PATH, or a path)
#   nested_sandbox = false      true: the agent may make user namespaces inside (codex confines its own
#                               commands with bubblewrap); it still holds no capability over ours
ISOLATION_OPTIONS = frozenset({"inherit_env", "sandbox", "bwrap", "network", "read_only", "home_files", "limits",
                               "nested_sandbox", "runsc", "loopback_ports"})


@dataclass(frozen=True)
class Isolation:
    """An agent's isolation options, checked: what it inherits, and its sandbox (None: none)."""

    inherit_env: tuple[str, ...]
    sandbox: Sandbox | None
    limits: Limits | None = None  # option limits, as enforceable here (None: none)

    @classmethod
    def of(cls, spec: AgentSpec, program: str, path: str) -> Isolation:
        """ValueError naming agent and option; a sandbox that cannot start here is one (start-up fails)."""
        name = spec.name
        limits = settle_limits(name, parse_limits(name, spec.options.get("limits")))
        inherit = option(spec, "inherit_env", list, [])
        if not all(isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) for v in inherit):
            raise ValueError(f"agent {name!r}: option inherit_env must be a list of environment variable names")
        own = [v for v in inherit if forbidden_name(v)]
        if own:
            raise ValueError(f"agent {name!r}: option inherit_env: {', '.join(own)} belong(s) to uibus "
                             "(its settings, Redis, TLS, OTLP headers) and are never handed to an agent")
        kind = spec.options.get("sandbox", False)
        if kind not in (True, False, "bwrap", KERNEL):
            raise ValueError(f"agent {name!r}: option sandbox must be true (bubblewrap), false or \"{KERNEL}\", "
                             f"not {kind!r}")
        if kind is False:
            for key in ("bwrap", "network", "read_only", "home_files", "nested_sandbox", "runsc", "loopback_ports"):
                if key in spec.options:
                    raise ValueError(f"agent {name!r}: option {key} needs sandbox = true")
            return cls(tuple(inherit), None, limits)
        if not option(spec, "cwd", str, ""):
            raise ValueError(f"agent {name!r}: option sandbox = true needs option cwd (the folder the agent may "
                             "write; without it, it would be uibus's own working directory)")
        bwrap = option(spec, "bwrap", str, "bwrap")
        found = bwrap if os.sep in bwrap else (shutil.which(bwrap) or bwrap)
        nested = option(spec, "nested_sandbox", bool, False)
        runsc = option(spec, "runsc", str, "runsc") if kind == KERNEL else ""
        if runsc:  # gVisor: the same view of the files, another kernel (uibus.agents.gvisor)
            runsc = runsc if os.sep in runsc else (shutil.which(runsc) or runsc)
            if spec.options.get("network") is not False or nested:
                raise ValueError(f"agent {name!r}: option sandbox = \"{KERNEL}\" needs network = false and no "
                                 "nested_sandbox (rootless gVisor has no network of its own here)")
            problem = gvisor_problem(runsc)
        else:
            if "runsc" in spec.options:
                raise ValueError(f"agent {name!r}: option runsc needs sandbox = \"{KERNEL}\"")
            problem = sandbox_problem(found, nested)
        if problem:
            raise ValueError(f"agent {name!r}: option sandbox = {json.dumps(kind)} cannot start here (option "
                             f"{'runsc' if runsc else 'bwrap'} = {runsc or bwrap!r}): {problem}")
        extra = [_strings(f"agent {name!r}: option read_only", option(spec, "read_only", list, []))]
        for path in extra[0]:
            if not os.path.isabs(path):
                raise ValueError(f"agent {name!r}: option read_only: {path!r} is not an absolute path")
        home_files = _strings(f"agent {name!r}: option home_files", option(spec, "home_files", list, list(HOME_FILES)))
        if any(os.path.isabs(f) or ".." in Path(f).parts for f in home_files):
            raise ValueError(f"agent {name!r}: option home_files names paths inside HOME (relative, no ..)")
        workspaces = spec.workspaces_dir or default_workspaces_dir()
        mode, ports, pasta = network.settle(name, spec.options, found, nested)  # "outbound" tried once
        return cls(tuple(inherit), Sandbox(
            bwrap=found, network=mode, loopback_ports=ports, pasta=pasta,
            read_only=(*installation_of(program, path), *extra[0]), home_files=home_files,
            homes_dir=str(Path(workspaces) / "homes"), nested=nested, runsc=runsc,
            git_common=git_common_dir(str(Path(option(spec, "cwd", str, "")).expanduser()))), limits)
# ==== end of the isolation block ====


def read_config(path: str) -> dict[str, Any]:
    """The parsed file, or the built-in default when `path` is empty."""
    if not path:
        return BUILTIN
    file = Path(path).expanduser()
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {(exc.strerror or str(exc)).lower()}") from exc
    kind = "TOML" if file.suffix == ".toml" else "JSON"
    try:
        data = tomllib.loads(raw.decode()) if kind == "TOML" else json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid {kind}: byte {exc.start} is not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}") from exc
    except ValueError as exc:  # tomllib (3.11) puts the place in the message: "… (at line 3, column 7)"
        at = re.fullmatch(r"(.*) \(at (?:line (\d+), column (\d+)|(end of document))\)", str(exc), re.DOTALL)
        where = "" if not at else "end of file: " if at[4] else f"line {at[2]}, column {at[3]}: "
        raise ValueError(f"{path}: {where}not valid {kind}: {at[1] if at else exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be an object with an `agents` list")
    return data


def _strings(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings")
    return tuple(value)


def parse_spec(where: str, entry: Any) -> AgentSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name {name!r} is invalid: agents are routed as `/<name>.AgentService/...`, "
                         "so use a letter or _ then up to 63 letters, digits or _")
    backend = entry.get("backend", "local")
    if backend not in BACKENDS:
        raise ValueError(f"{where} ({name}): backend {backend!r} is not one of {', '.join(BACKENDS)}")
    for key in ("description", "display_as"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"{where} ({name}): {key} must be a string")
    for key in ("options", "parameters", "sly_data_schema"):
        if key in entry and not isinstance(entry[key], dict):
            raise ValueError(f"{where} ({name}): {key} must be an object")
    return AgentSpec(
        name=name, description=entry.get("description", ""),
        tags=_strings(f"{where} ({name}): tags", entry.get("tags", [])), backend=backend,
        options=dict(entry.get("options", {})), parameters=entry.get("parameters"),
        sly_data_schema=entry.get("sly_data_schema"),
        tools=_strings(f"{where} ({name}): tools", entry.get("tools", [])),
        display_as=entry.get("display_as", "llm_agent"))


def build_backend(spec: AgentSpec) -> Backend:
    module_name, _, cls_name = BACKENDS[spec.backend].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(spec)  # type: ignore[no-any-return]


def load_agents(path: str, protect: tuple[str, ...] = (), workspaces_dir: str = "") -> AgentTable:
    """Reads and checks the config and builds every backend (which checks its options). A mistake raises
    InvalidConfig naming `--agents`, the file and the place, so `uibus serve` reports it as one line
    (and callers catching ValueError still do). `protect`: uibus's own paths (store, tokens file,
    TLS files, …), which no sandboxed agent may see; `workspaces_dir`: --workspaces-dir, over the file's."""
    try:
        return _load_agents(path, protect, workspaces_dir)
    except ValueError as exc:
        raise InvalidConfig("--agents", str(exc)) from exc


def _load_agents(path: str, protect: tuple[str, ...] = (), override: str = "") -> AgentTable:
    data = read_config(path)
    where = path or "(built-in)"
    unknown = sorted(set(data) - {"agents", "default_agent"} - WORKSPACE_TOP_LEVEL)
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; known: agents, default_agent, "
                         f"{', '.join(sorted(WORKSPACE_TOP_LEVEL))}")
    workspaces_dir = workspaces_dir_of(where, data)
    # Where tenants' homes go (the workspaces' directory: --workspaces-dir, else the file's, else the
    # default), and what sandboxes hide: uibus's own files, the agents file, that directory and the
    # state directory (an agent gets its own home and workspace bound back on top).
    workspaces = os.path.expanduser(override or workspaces_dir or default_workspaces_dir())
    hidden = tuple(os.path.abspath(os.path.expanduser(p)) for p in
                   (*protect, *((path,) if path else ()), workspaces, str(Path(default_workspaces_dir()).parent)) if p)
    entries = data.get("agents")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: `agents` must be a non-empty list")
    specs: dict[str, AgentSpec] = {}
    for i, entry in enumerate(entries):
        spec = replace(parse_spec(f"{where}: agents[{i}]", entry), workspaces_dir=workspaces)
        if spec.name in specs:
            raise ValueError(f"{where}: agent {spec.name!r} is configured twice")
        specs[spec.name] = spec
    default = data.get("default_agent", next(iter(specs)))
    if default not in specs:
        raise ValueError(f"{where}: default_agent {default!r} is not one of the agents ({', '.join(specs)})")
    try:
        backends = {name: build_backend(spec) for name, spec in specs.items()}
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    for backend in backends.values():
        hide = getattr(backend, "hide", None)
        if hide is not None:
            hide(hidden)
    return AgentTable(specs=specs, backends=backends, default=default, workspaces_dir=workspaces_dir)
