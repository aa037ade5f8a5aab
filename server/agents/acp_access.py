"""What an ACP agent uibus hosts is let at besides its prompts: the editor's extra workspace roots
(ACP's `additionalDirectories`) and its sign-in (ACP's `authMethods`, `auth/status`).

Roots. An editor may name directories beyond `cwd` (session/new, load, resume). uibus decides what
a hosted agent sees, never the editor: a directory passes only when it is one the agent's
configuration already shows it — its working directory (option `cwd`, when conversations share it;
a worktree conversation works in a checkout of its own, which no editor names) or one of its
sandbox's `read_only` paths — or lies inside one, and never inside uibus's own files. Nothing is
bound or unhidden for an editor: `additionalDirectories` names a root set inside the box, it never
widens the box. The rule is checked twice: lexically where the editor attaches (uibus.edge.editors,
possibly another machine, with the roots Connectivity reports), then here, authoritatively, with
symbolic links resolved, before the roots reach the agent.

Sign-in. uibus never runs a command an agent names: ACP's terminal auth is the client running the
configured agent program with the method's `args`/`env` in an interactive terminal, which a server
has no user for. uibus advertises no `auth.terminal` (so a conforming agent offers no terminal
method), and when an agent needs a sign-in that only a terminal can give, the turn says so and names
the command the operator configured for it (option `login`), never one from the agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from uibus.agents import AgentError
from uibus.infra.errors import InvalidArgument

DIRECTORIES_KEY = "x-uibus-directories"  # a turn's metadata: the editor's additionalDirectories (JSON list)
MAX_DIRECTORIES = 32
MAX_PATH = 4096
AUTH_REQUIRED = -32000  # ACP's auth_required


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def directories_of(value: Any, what: str = "additionalDirectories") -> list[str]:
    """The list as the schema has it (absolute paths; none is no extra root), normalized; InvalidArgument
    saying which entry is wrong."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_DIRECTORIES:
        raise InvalidArgument(f"{what} must be an array of at most {MAX_DIRECTORIES} absolute paths")
    out: list[str] = []
    for entry in value:
        if not isinstance(entry, str) or not entry.startswith("/") or len(entry) > MAX_PATH or "\0" in entry:
            raise InvalidArgument(f"{what}: {str(entry)[:200]!r} is not an absolute path")
        norm = os.path.normpath(entry)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        if norm not in out:
            out.append(norm)
    return out


def rule(agent: str, roots: Sequence[str]) -> str:
    """The rule in words, for the refusal an editor reads."""
    shown = ", ".join(roots) if roots else "none: the agent's configuration names no cwd or read_only path"
    return (f"uibus lets agent {agent!r} see only the directories its configuration shows it (option cwd "
            f"of a shared workspace, option read_only of its sandbox) and folders inside them, never uibus's own "
            f"files; an editor's directories cannot widen that. Allowed roots: {shown}")


def check_directories(agent: str, dirs: Sequence[str], roots: Sequence[str], hidden: Sequence[str] = (), *,
                      resolve: bool = False) -> None:
    """InvalidArgument naming the first directory outside `roots` (or inside `hidden`) and the rule.
    `resolve`: symbolic links followed first (where the paths are this machine's: the agent's side)."""
    def real(p: str) -> str:
        return os.path.realpath(p) if resolve else p

    allowed = [real(r) for r in roots]
    for d in dirs:
        path = real(d)
        if not any(under(path, r) for r in allowed):
            raise InvalidArgument(f"additionalDirectories: {d} is outside what agent {agent!r} may see. "
                                  f"{rule(agent, roots)}")
        if any(under(path, real(h)) or under(real(h), path) for h in hidden):
            raise InvalidArgument(f"additionalDirectories: {d} holds or is among uibus's own files (its store, "
                                  f"tokens, configuration), which no agent sees. {rule(agent, roots)}")


def requested(metadata: Mapping[str, str]) -> list[str] | None:
    """The additionalDirectories a turn carries (None: the turn names none, the roots stay)."""
    raw = metadata.get(DIRECTORIES_KEY)
    if raw is None:
        return None
    try:
        return directories_of(json.loads(raw))
    except (ValueError, InvalidArgument) as exc:
        raise AgentError(f"the turn's {DIRECTORIES_KEY} metadata is not usable: {exc}") from None


def encode(dirs: Sequence[str]) -> str:
    """The metadata value (ASCII, as gRPC text metadata must be)."""
    return json.dumps(list(dirs), ensure_ascii=True)


# ---- sign-in ----


def auth_methods(init: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """(ids of the methods `authenticate` takes, the terminal methods) of an initialize answer."""
    methods = [m for m in init.get("authMethods") or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    terminal = [m for m in methods if m.get("type") == "terminal"]
    return [m["id"] for m in methods if m.get("type", "agent") == "agent"], terminal


def signin_problem(agent: str, terminal: Sequence[Mapping[str, Any]], login: Sequence[str], why: str) -> AgentError:
    """The turn's error when the agent is not signed in: what uibus can do (nothing it names itself)
    and what the operator does — the configured `login` command, never a command from the agent."""
    offered = ", ".join(f"{str(m.get('name') or m['id'])[:60]!r} ({str(m['id'])[:60]})" for m in terminal)
    how = (f"run `{' '.join(login)}` once on the uibus host as the user its agents run as (option login)"
           if login else "sign it in once on the uibus host as the user its agents run as, as its own documentation "
                         "says, and set option login to that command so this message names it")
    terminal_words = (f"it offers terminal sign-in ({offered}), which means running its program in an interactive "
                      "terminal; uibus never runs a command an agent names and has no terminal for it. "
                      if terminal else "")
    return AgentError(f"agent {agent!r} is not signed in ({why}): {terminal_words}To sign it in, {how}; or configure "
                      "option auth_method with one of its own (agent) sign-in methods")
