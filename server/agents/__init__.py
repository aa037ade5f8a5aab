"""Chat backends ("agents"): what answers a neuro-san `StreamingChat` turn.

A backend only turns one user turn into a stream of pieces; the chat engine
(uibus.domain.chat) owns everything around it — filters, ChatContext, the session store and
the UI feed — so a new backend is one small module with no gRPC in it. Pieces are:

* `str` — the next piece of the reply text (streamed as an `AI` message under MAXIMAL),
* a `chat_pb2.ChatMessage` — any other message worth showing under MAXIMAL (progress, tool
  output, a proxied upstream message); it is not part of the answer,
* `Final` — the whole answer and the conversation state, for backends (the neuro-san proxy)
  whose upstream keeps its own ChatContext.

A failure is an ordinary exception; the engine turns it into the final message as neuro-san does.
Cancellation is never caught here: it must reach the backend's await so its work stops at once.

Agents that live across turns (a coding agent's process that keeps its own conversation and asks
the user things while it works) are a `SessionBackend`: the engine then owns one `AgentSession`
per (uibus session, agent), opened by `SessionBackend.open_session`, started on first use and
closed when idle, when the uibus session is evicted and at shutdown (uibus.domain.agent_sessions),
and hands it a `SessionUi`: the session's dialogs, fire-and-forget UI and webview messages,
implemented by the domain, so an agent backend reaches every UI of its session without knowing
any transport or RPC path. Any other backend stays a per-turn generator (`Backend.stream`). Which
kind a backend is is said once, by its class.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

Role = str  # "user", "assistant" or "system", as chat-completion APIs name them


class AgentError(Exception):
    """A backend could not answer; the message is shown to the user in the final message."""


@dataclass(frozen=True)
class AgentSpec:
    """One configured agent: what Function/Connectivity/List report and which backend answers."""

    name: str
    description: str = ""
    tags: tuple[str, ...] = ()
    backend: str = "local"
    options: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] | None = None  # Function.parameters (JSON schema of the call)
    sly_data_schema: dict[str, Any] | None = None  # Function.sly_data_schema; backend default if None
    tools: tuple[str, ...] = ()  # Connectivity: what the agent can call
    display_as: str = "llm_agent"
    workspaces_dir: str = ""  # the agents file's `workspaces_dir` (tenants' homes, workspaces)


@dataclass
class Turn:
    """Everything a backend may use to answer one user message."""

    agent: str
    text: str
    history: list[tuple[Role, str]]  # earlier messages of this agent's conversation, oldest first
    sly_data: dict[str, Any]
    chat_context: chat_pb2.ChatContext  # the conversation state as neuro-san carries it (for proxies)
    metadata: dict[str, str] = field(default_factory=dict)  # call metadata worth forwarding (user_id, …)
    # (mime type, bytes) of each image or file sent with the message (ChatMessage.mime_data);
    # hosted agents pass them on in their protocol's words (uibus.agents.attachments)
    attachments: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass
class Final:
    """The answer and conversation state as an upstream reported them."""

    text: str
    chat_context: chat_pb2.ChatContext | None = None
    sly_data: dict[str, Any] | None = None


@dataclass
class Stop:
    """Why the upstream ended the turn, in its own words where it has them (ACP's stopReason:
    end_turn, max_tokens, max_turn_requests, refusal, cancelled). Chat puts it in the final
    message's `structure` (`stop_reason`), so a client (`uibus acp`) can pass it on exactly
    instead of reading it out of the answer's text."""

    reason: str


Piece = str | chat_pb2.ChatMessage | Final | Stop


Dialog = ext_pb.SelectRequest | ext_pb.ConfirmRequest | ext_pb.InputRequest | ext_pb.EditorRequest


class SessionUi(Protocol):
    """Everything an agent session may do at the UIs of its uibus session (the domain implements it:
    uibus.domain.agent_sessions). Dialogs and fire-and-forget UI go through the domain's `Dialogs`,
    so every UI of the session shows them, on any replica; `say` is a Cline SAY message on the
    session's webview streams."""

    session: str
    # Whose session this is (uibus.infra.auth.Tokens.tenant): a sandboxed agent's home is its tenant's.
    tenant: str
    # The directory this (session, agent) works in when it has a workspace of its own (option
    # `workspace = "worktree"`: its git worktree, uibus.agents.workspaces); "" for the configured cwd.
    workspace: str
    # The conversation handle the last agent process of this (session, agent) reported (an ACP
    # sessionId and cwd, a pi sessionFile), or None: resume it rather than start a new conversation.
    handle: dict[str, Any] | None

    async def keep_handle(self, handle: dict[str, Any]) -> None:
        """Records the handle of the conversation this process holds (in the session store), so the
        next process of this (session, agent) can resume it."""
        ...

    def resumed(self) -> None:
        """The agent picked up the conversation of `handle` (counted)."""
        ...

    async def started_fresh(self, why: str) -> None:
        """The agent could not resume `handle` and started a new conversation: the session's UIs
        are told, once (never a silent loss of the conversation)."""
        ...

    async def ask(self, request: Dialog) -> ext_pb.DialogResult:
        """Opens a dialog at every UI of the session and waits for its outcome; cancelling the
        awaiting task closes it for every UI."""
        ...

    async def fire(self, request: ext_pb.NotifyRequest | ext_pb.SetStatusRequest | ext_pb.SetWidgetRequest
                   | ext_pb.SetTitleRequest | ext_pb.SetEditorTextRequest) -> None:
        """A fire-and-forget UI request (notify, status, widget, title, editor text)."""
        ...

    def say(self, text: str, say: int = ui_pb2.TEXT, *, ts: int = 0, partial: bool = False) -> int:
        """Shows (or, with the same `ts`, updates) a SAY ClineMessage on the session's webviews."""
        ...

    def next_ts(self) -> int:
        """A fresh message ts, later than every earlier one of this server."""
        ...

    def mcp_endpoint(self, agent: str = "") -> tuple[str, dict[str, str]] | None:
        """uibus's own MCP server (URL and the headers that reach this session, naming `agent` as
        the caller), if it serves one: what a hosted agent can be given as an MCP server (ask_user,
        notify_user, the other agents). Its token, if tokens are in force, is minted for this
        (session, agent) alone and revoked when the agent session closes; never uibus's own."""
        ...


class AgentSession(abc.ABC):
    """One agent that lives across turns for one (uibus session, agent): a process, a connection.

    The engine opens it (`start`) on the first turn, runs one turn at a time through `stream`, and
    closes it (`aclose`, once, whatever happened) when idle for `idle_seconds`, when its uibus
    session is evicted, and at shutdown."""

    idle_seconds: float = 900.0

    @abc.abstractmethod
    async def start(self) -> None:
        """Gets the agent ready (spawns it, handshakes); raises AgentError with a clear message."""

    @abc.abstractmethod
    def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        """The pieces of one turn; the engine never runs two at once on one session."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stops the agent and releases everything it holds; safe to call more than once."""

    @property
    def alive(self) -> bool:
        """False once the agent is gone (its process died): the engine then opens a new one."""
        return True


class Backend(abc.ABC):  # noqa: B024 - stateless backends implement stream, SessionBackend open_session
    """One agent's way of answering. Built once per agent at start-up; must be safe to run many
    turns concurrently (state per turn lives in `stream`)."""

    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec

    def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        """An async generator of the reply's pieces (a `SessionBackend` answers through its sessions)."""
        raise NotImplementedError(f"backend {self.spec.backend!r} answers through its agent sessions")

    def sly_data_schema(self) -> dict[str, Any] | None:
        """The sly_data keys this backend understands (reported by Function)."""
        return None

    def prompt_capabilities(self) -> dict[str, bool] | None:
        """What the agent takes with a prompt besides text, in ACP's words (`image`, `audio`,
        `embeddedContext`); None while unknown. Reported in Connectivity's metadata, so `uibus acp`
        can advertise the hosted agent's own promptCapabilities to an editor."""
        return None

    def directories(self) -> dict[str, Any] | None:
        """What an editor's ACP `additionalDirectories` may name for this agent: `{"roots": [...],
        "supported": bool | None}` (None inside: not known until it started). None: it takes none
        (only an ACP agent that advertises them does; uibus.agents.acp_access has the rule)."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Releases connections; called once at shutdown."""


class SessionBackend(Backend):
    """A backend whose agents live across turns: the engine answers each turn through the
    `AgentSession` this opens for the turn's uibus session (uibus.domain.agent_sessions)."""

    # With option `workspace = "worktree"`: the configured cwd, of which each (session, agent) gets a
    # git worktree of its own (uibus.agents.workspaces), made by the engine before `open_session`
    # and handed over as `SessionUi.workspace`. None: every session works in the configured cwd.
    workspace_repo: str | None = None

    @abc.abstractmethod
    def open_session(self, ui: SessionUi) -> AgentSession:
        """The agent for `ui.session`, not started yet. Called by the engine on a session's first
        turn; may raise ResourceExhausted-like uibus errors (too many sessions)."""


def option(spec: AgentSpec, name: str, kind: type | tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
    """Reads one backend option, failing start-up with a message naming agent and option."""
    if name not in spec.options:
        if required:
            raise ValueError(f"agent {spec.name!r} (backend {spec.backend!r}) needs option {name!r}")
        return default
    value = spec.options[name]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ValueError(f"agent {spec.name!r}: option {name!r} must be a number, not {value!r}")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"agent {spec.name!r}: option {name!r} must be {want}, not {value!r}")
    return value


def seconds(spec: AgentSpec, name: str, default: float) -> float:
    """A positive duration option in seconds."""
    value = float(option(spec, name, (int, float), default))
    if value <= 0:
        raise ValueError(f"agent {spec.name!r}: option {name!r} must be more than 0 seconds, not {value:g}")
    return value


def check_options(spec: AgentSpec, known: set[str]) -> None:
    unknown = sorted(set(spec.options) - known)
    if unknown:
        raise ValueError(f"agent {spec.name!r} (backend {spec.backend!r}): unknown option(s) "
                         f"{', '.join(unknown)}; known: {', '.join(sorted(known))}")
