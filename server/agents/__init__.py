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
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from uibus.pb.neuro_san.api.grpc import chat_pb2

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


@dataclass
class Turn:
    """Everything a backend may use to answer one user message."""

    agent: str
    text: str
    history: list[tuple[Role, str]]  # earlier messages of this agent's conversation, oldest first
    sly_data: dict[str, Any]
    chat_context: chat_pb2.ChatContext  # the conversation state as neuro-san carries it (for proxies)
    metadata: dict[str, str] = field(default_factory=dict)  # call metadata worth forwarding (user_id, …)


@dataclass
class Final:
    """The answer and conversation state as an upstream reported them."""

    text: str
    chat_context: chat_pb2.ChatContext | None = None
    sly_data: dict[str, Any] | None = None


Piece = str | chat_pb2.ChatMessage | Final


class Backend(abc.ABC):
    """One agent's way of answering. Built once per agent at start-up; must be safe to run many
    turns concurrently (state per turn lives in `stream`)."""

    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec

    @abc.abstractmethod
    def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        """An async generator of the reply's pieces."""

    def sly_data_schema(self) -> dict[str, Any] | None:
        """The sly_data keys this backend understands (reported by Function)."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Releases connections; called once at shutdown."""


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
