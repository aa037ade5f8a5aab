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
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uibus.agents import AgentSpec, Backend, option
from uibus.agents.workspaces import MODES, WORKTREE, repository_of
from uibus.config import InvalidConfig

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


# ==== Workspaces (issue 42, item 1): a git worktree per conversation ====
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


def load_agents(path: str) -> AgentTable:
    """Reads and checks the config and builds every backend (which checks its options). A mistake raises
    InvalidConfig naming `--agents`, the file and the place, so `uibus serve` reports it as one line
    (and callers catching ValueError still do)."""
    try:
        return _load_agents(path)
    except ValueError as exc:
        raise InvalidConfig("--agents", str(exc)) from exc


def _load_agents(path: str) -> AgentTable:
    data = read_config(path)
    where = path or "(built-in)"
    unknown = sorted(set(data) - {"agents", "default_agent"} - WORKSPACE_TOP_LEVEL)
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; known: agents, default_agent, "
                         f"{', '.join(sorted(WORKSPACE_TOP_LEVEL))}")
    workspaces_dir = workspaces_dir_of(where, data)
    entries = data.get("agents")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: `agents` must be a non-empty list")
    specs: dict[str, AgentSpec] = {}
    for i, entry in enumerate(entries):
        spec = parse_spec(f"{where}: agents[{i}]", entry)
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
    return AgentTable(specs=specs, backends=backends, default=default, workspaces_dir=workspaces_dir)
