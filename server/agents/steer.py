"""What a hosted agent offers beyond turns, in each protocol's words: its modes, models and commands,
the conversation's title, and the calls that change them (uibus.domain.steering reads and calls
these through the session's `steering`, and refuses what an agent lacks).

* ACP: `session/new` may return `modes` ({currentModeId, availableModes}) and `models`
  ({currentModelId, availableModels}); `session/update` brings `current_mode_update`,
  `available_commands_update` and `session_info_update` (a title) at any time, in a turn or not;
  `session/set_mode`, `session/set_model` change them; a new conversation is another `session/new`.
* pi (RPC mode): `get_state` (model, session id and name), `get_available_models`,
  `get_commands`; `set_model` {provider, modelId}; `new_session`.

Each session class (uibus.agents.acp.AcpSession, uibus.agents.rpc.RpcSession) owns one as its
`steering`, built with what it acts through (the session's own calls, said in its constructor), so
the protocol modules only tell it what they saw (`seen_session`, `seen_update` / `refresh`) and
stay about turns; the domain's Steering reads `state()` and calls `set_mode`, `set_model`,
`new_conversation` where `state()["can"]` offers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from uibus.agents import AgentError
from uibus.infra.errors import FailedPrecondition

STATE_TIMEOUT_S = 10.0  # how long pi may take to answer a command asking for its state
MAX_ITEMS = 200  # modes, models or commands kept of one agent (a UI shows a picker, not a catalogue)


def _s(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _items(raw: Any, ident: str) -> list[dict[str, str]]:
    """[{"id"/"name", "name", "description", ...}] of a list of the agent's JSON objects."""
    out: list[dict[str, str]] = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, dict) and _s(item.get(ident)):
            out.append({"id": _s(item.get(ident)), "name": _s(item.get("name")) or _s(item.get(ident)),
                        "description": _s(item.get("description"))})
        if len(out) >= MAX_ITEMS:
            break
    return out


class Controls:
    """What one hosted agent said it offers, as the sessions API shows it."""

    def __init__(self) -> None:
        self.modes: list[dict[str, str]] = []
        self.current_mode = ""
        self.models: list[dict[str, str]] = []
        self.current_model = ""
        self.commands: list[dict[str, str]] = []
        self.title = ""
        self.conversations: list[str] = []  # earlier conversations, oldest first

    def state(self, conversation: str, can: list[str]) -> dict[str, Any]:
        return {"modes": self.modes, "current_mode": self.current_mode, "models": self.models,
                "current_model": self.current_model, "commands": self.commands, "title": self.title,
                "conversation": conversation, "conversations": list(self.conversations), "can": can}


class AcpConversation(Protocol):
    """The ACP session a steering acts through (AcpSession)."""

    session_id: str  # the ACP session now; a new conversation replaces it
    cwd: str
    mcp_servers: list[dict[str, Any]]  # what the first session/new offered (the next one offers the same)

    async def call(self, method: str, params: dict[str, Any]) -> Any: ...

    async def keep_conversation(self) -> None:
        """Keeps the new conversation's handle (option resume: the next process resumes it)."""
        ...


class AcpSteering:
    """ACP's modes, models, commands and conversations of one session."""

    def __init__(self, session: AcpConversation) -> None:
        self.session = session
        self.controls = Controls()

    def seen_session(self, created: dict[str, Any]) -> None:
        """A `session/new` (or load) result: its modes and models, if it offers them."""
        c = self.controls
        modes = created.get("modes") if isinstance(created.get("modes"), dict) else {}
        c.modes = _items(modes.get("availableModes"), "id")
        c.current_mode = _s(modes.get("currentModeId"))
        models = created.get("models") if isinstance(created.get("models"), dict) else {}
        c.models = _items(models.get("availableModels"), "modelId")
        c.current_model = _s(models.get("currentModelId"))

    def seen_update(self, update: Any) -> None:
        """A `session/update` of the agent's own session (in a turn or between turns)."""
        if not isinstance(update, dict):
            return
        kind = update.get("sessionUpdate")
        c = self.controls
        if kind == "current_mode_update":
            c.current_mode = _s(update.get("currentModeId")) or _s(update.get("modeId"))
        elif kind == "available_commands_update":
            commands = []
            for item in update.get("availableCommands") or []:
                if isinstance(item, dict) and _s(item.get("name")):
                    hint = item.get("input") if isinstance(item.get("input"), dict) else {}
                    commands.append({"name": _s(item.get("name")), "description": _s(item.get("description")),
                                     "input_hint": _s(hint.get("hint"))})
            c.commands = commands[:MAX_ITEMS]
        elif kind == "session_info_update" and "title" in update:
            c.title = _s(update.get("title"))

    def state(self) -> dict[str, Any]:
        c = self.controls
        can = ["new_conversation"]
        if c.modes:
            can.append("set_mode")
        if c.models:
            can.append("set_model")
        return c.state(self.session.session_id, can)

    async def set_mode(self, mode_id: str) -> None:
        await self.session.call("session/set_mode", {"sessionId": self.session.session_id, "modeId": mode_id})
        self.controls.current_mode = mode_id

    async def set_model(self, model_id: str) -> None:
        await self.session.call("session/set_model", {"sessionId": self.session.session_id, "modelId": model_id})
        self.controls.current_model = model_id

    async def new_conversation(self) -> None:
        session = self.session
        created = await session.call("session/new", {"cwd": session.cwd, "mcpServers": session.mcp_servers})
        if not isinstance(created, dict) or not isinstance(created.get("sessionId"), str):
            raise AgentError("session/new did not return a sessionId")
        c = self.controls
        if session.session_id:
            c.conversations.append(session.session_id)
        session.session_id = created["sessionId"]
        c.title, c.commands = "", []
        self.seen_session(created)
        await session.keep_conversation()  # the next process resumes the new conversation, not the old one


class PiSteering:
    """pi's models, commands and sessions of one agent process."""

    def __init__(self, command: Callable[..., Awaitable[dict[str, Any]]],
                 keep_conversation: Callable[[], Awaitable[None]]) -> None:
        """`command(kind, **fields)`: a command to pi and its reply (RpcSession.command);
        `keep_conversation()`: keeps the handle of the session file now open (option resume)."""
        self.command = command
        self.keep_conversation = keep_conversation
        self.controls = Controls()
        self.conversation = ""  # pi's session id (or file): the conversation now
        self.provider = ""  # the provider of the current model

    async def _data(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """The data of a successful reply; None when refused, when the process went, or (an agent
        that does not know the command may never answer) not answered within STATE_TIMEOUT_S."""
        try:
            async with asyncio.timeout(STATE_TIMEOUT_S):
                reply = await self.command(kind, **fields)
        except (TimeoutError, AgentError):  # not answered, or the process went: it offers nothing more
            return None
        if not reply.get("success"):
            return None
        data = reply.get("data")
        return data if isinstance(data, dict) else {}

    async def refresh(self, state: dict[str, Any] | None = None) -> None:
        """Reads pi's state, models and commands (an older pi lacking one just offers less)."""
        c = self.controls
        if state is None:
            state = await self._data("get_state") or {}
        model = state.get("model") if isinstance(state.get("model"), dict) else {}
        c.current_model = _s(model.get("id"))
        self.provider = _s(model.get("provider"))
        self.conversation = _s(state.get("sessionId")) or _s(state.get("sessionFile"))
        c.title = _s(state.get("sessionName"))
        models = await self._data("get_available_models") or {}
        raw = models.get("models") if isinstance(models.get("models"), list) else []
        c.models = [{"id": _s(m.get("id")), "name": _s(m.get("name")) or _s(m.get("id")),
                     "description": _s(m.get("provider")), "provider": _s(m.get("provider"))}
                    for m in raw if isinstance(m, dict) and _s(m.get("id"))][:MAX_ITEMS]
        commands = await self._data("get_commands") or {}
        raw = commands.get("commands") if isinstance(commands.get("commands"), list) else []
        c.commands = [{"name": _s(m.get("name")), "description": _s(m.get("description")), "input_hint": ""}
                      for m in raw if isinstance(m, dict) and _s(m.get("name"))][:MAX_ITEMS]

    def state(self) -> dict[str, Any]:
        c = self.controls
        can = ["new_conversation"] + (["set_model"] if c.models else [])
        return c.state(self.conversation, can)

    async def set_model(self, model_id: str) -> None:
        provider = next((m.get("provider", "") for m in self.controls.models if m["id"] == model_id), "")
        reply = await self.command("set_model", provider=provider, modelId=model_id)
        if not reply.get("success"):
            raise FailedPrecondition(f"pi refused set_model: {_s(reply.get('error')) or 'no reason given'}")
        self.controls.current_model = model_id

    async def new_conversation(self) -> None:
        old = self.conversation
        data = await self._data("new_session")
        if data is None or data.get("cancelled"):
            raise FailedPrecondition("pi did not start a new session (an extension cancelled it, or it refused)")
        if old:
            self.controls.conversations.append(old)
        await self.refresh()
        await self.keep_conversation()  # the next process reopens the new session file, not the old one
