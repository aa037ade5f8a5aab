"""The one implementation of a neuro-san chat turn, for every transport (gRPC here; the HTTP API
and gRPC-Web reach it through the same method handler).

It keeps neuro-san's StreamingChat contract (SPEC.md §2) and adds uibus's session behaviour:

* MINIMAL/UNKNOWN stream only the final AGENT_FRAMEWORK message (answer + chat_context);
  MAXIMAL streams every message with its origin, and each ChatResponse echoes the request.
* No `user_message.text` → one empty ChatResponse, nothing else happens.
* A request without `chat_context` continues the session's stored conversation with the agent;
  one with a `chat_context` (even an empty one, which starts over) wins.
* A backend failure ends the stream normally, the error text in the final message, and the
  conversation state is left as it was.
* The reply is mirrored to the session's partial-message stream as a growing ClineMessage, so
  a Cline webview shows the chat live.

The per-piece path is kept lean for long streams: no store writes, no logging, and partial
messages are published at most every PARTIAL_INTERVAL_S (the bus coalesces them by ts anyway).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.protobuf import json_format

from uibus import chat_history, topics
from uibus.agents import AgentSpec, Backend, Final, Turn
from uibus.agents.config import AgentTable
from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.services.common import Runtime

log = logging.getLogger("uibus.chat")

PARTIAL_INTERVAL_S = 0.05
MAX_CONTEXT_MESSAGES = 200  # per agent history kept in the stored/returned ChatContext
_MINIMAL = agent_pb2.MINIMAL
_MAXIMAL = agent_pb2.MAXIMAL
_AI = chat_pb2.ChatMessage.AI
_HUMAN = chat_pb2.ChatMessage.HUMAN
_FRAMEWORK = chat_pb2.ChatMessage.AGENT_FRAMEWORK
_ROLES = {chat_pb2.ChatMessage.HUMAN: "user", chat_pb2.ChatMessage.AI: "assistant",
          chat_pb2.ChatMessage.SYSTEM: "system"}
_FILTERS = ", ".join(f"{n} ({v})" for n, v in agent_pb2.ChatFilterType.items())
_SOURCE = "neuro-san"
# Metadata a backend may forward upstream (neuro-san clients send these).
_FORWARD = ("user_id", "request_id")


class ChatInputError(ValueError):
    """The request cannot be served as sent (→ INVALID_ARGUMENT)."""


class UnknownAgent(LookupError):
    """No such agent here (→ UNIMPLEMENTED, as neuro-san answers)."""


def check_request(request: agent_pb2.ChatRequest) -> None:
    """Raises ChatInputError when an enum carries a value the proto does not define."""
    value = request.chat_filter.chat_filter_type
    if value not in agent_pb2.ChatFilterType.values():
        raise ChatInputError(f"chat_filter.chat_filter_type={value} is not one of {_FILTERS}")
    value = request.user_message.type
    if value not in chat_pb2.ChatMessage.ChatMessageType.values():
        raise ChatInputError(f"user_message.type={value} is not a ChatMessageType")


def agent_history(ctx: chat_pb2.ChatContext, agent: str) -> chat_pb2.ChatHistory | None:
    """The history the agent's conversation lives in: the one whose origin ends at `agent`,
    else the first (what a neuro-san server returns for its front man)."""
    for history in ctx.chat_histories:
        if history.origin and history.origin[-1].tool == agent:
            return history
    return ctx.chat_histories[0] if ctx.chat_histories else None


def history_of(ctx: chat_pb2.ChatContext, agent: str) -> list[tuple[str, str]]:
    history = agent_history(ctx, agent)
    if history is None:
        return []
    return [(_ROLES[m.type], m.text) for m in history.messages if m.type in _ROLES]


def next_context(ctx: chat_pb2.ChatContext, agent: str, question: str, answer: str) -> chat_pb2.ChatContext:
    """`ctx` with this turn added to the agent's history (other histories kept as they are)."""
    new = chat_pb2.ChatContext()
    new.CopyFrom(ctx)
    history = agent_history(new, agent)
    if history is None:
        history = new.chat_histories.add()
        history.origin.add(tool=agent, instantiation_index=1)
    history.messages.add(type=_HUMAN, text=question)
    history.messages.add(type=_AI, text=answer, origin=[chat_pb2.Origin(tool=agent, instantiation_index=1)])
    if len(history.messages) > MAX_CONTEXT_MESSAGES:
        del history.messages[:len(history.messages) - MAX_CONTEXT_MESSAGES]
    return new


class _Ts:
    """Unique, increasing millisecond timestamps: a webview identifies a message by its ts."""

    last = 0

    @classmethod
    def next(cls) -> int:
        cls.last = max(int(time.time() * 1000), cls.last + 1)
        return cls.last


class ChatEngine:
    def __init__(self, rt: Runtime, agents: AgentTable) -> None:
        self.rt = rt
        self.agents = agents

    def spec(self, agent: str) -> AgentSpec:
        spec = self.agents.specs.get(agent)
        if spec is None:
            raise UnknownAgent(f"agent {agent!r} is not served here; known agents: "
                               f"{', '.join(self.agents.names())}")
        return spec

    def backend(self, agent: str) -> Backend:
        self.spec(agent)
        return self.agents.backends[agent]

    def _publish(self, session: str, ts: int, text: str, partial: bool) -> None:
        msg = ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text, partial=partial)
        self.rt.bus.publish(session, topics.PARTIAL_MESSAGE, msg, key=ts)

    async def stream(self, session: str, agent: str, request: agent_pb2.ChatRequest,
                     metadata: dict[str, str] | None = None) -> AsyncIterator[agent_pb2.ChatResponse]:
        """The ChatResponses of one turn. Callers check `check_request` and `spec` first so that
        bad input fails before the stream starts; this generator then never raises except on
        cancellation, which it always lets through."""
        backend = self.backend(agent)
        text = request.user_message.text
        if not text:
            yield agent_pb2.ChatResponse()
            return
        maximal = request.chat_filter.chat_filter_type == _MAXIMAL
        store = self.rt.store
        if request.HasField("chat_context"):
            ctx = request.chat_context
        else:
            ctx = await chat_history.load_context(store, session, agent)
        sly_data = json_format.MessageToDict(request.sly_data) if request.HasField("sly_data") else {}
        turn = Turn(agent=agent, text=text, history=history_of(ctx, agent), sly_data=sly_data, chat_context=ctx,
                    metadata={k: v for k, v in (metadata or {}).items() if k in _FORWARD})
        await chat_history.append(store, session, "user", text, agent=agent, source=_SOURCE, bus=self.rt.bus)

        origin = [chat_pb2.Origin(tool=agent, instantiation_index=1)]
        ts = _Ts.next()
        parts: list[str] = []
        final: Final | None = None
        error = ""
        published_at = 0.0
        try:
            async with aclosing(backend.stream(turn)) as pieces:
                async for piece in pieces:
                    if type(piece) is str:
                        parts.append(piece)
                        if maximal:
                            yield agent_pb2.ChatResponse(
                                request=request, response=chat_pb2.ChatMessage(type=_AI, text=piece, origin=origin))
                        now = time.monotonic()
                        if now - published_at >= PARTIAL_INTERVAL_S:
                            published_at = now
                            self._publish(session, ts, "".join(parts), True)
                    elif isinstance(piece, Final):
                        final = piece
                    elif maximal:
                        if not piece.origin:
                            piece.origin.extend(origin)
                        yield agent_pb2.ChatResponse(request=request, response=piece)
        except Exception as exc:  # an agent failure is an answer, not a gRPC error (neuro-san does the same)
            error = f"Error from {agent}: {exc}"
            log.warning("agent failed", extra={"fields": {"agent": agent, "session": session, "error": str(exc)}})
        except BaseException:
            # Cancelled or closed: still end the webview's message (if one was shown), so no UI shows
            # a reply "typing" forever; publish() never awaits, so this cannot delay the cancel.
            if published_at:
                self._publish(session, ts, "".join(parts), False)
            raise
        if error:
            answer, new_ctx, returned_sly = error, ctx, None
        elif final is not None:
            answer = final.text
            new_ctx = final.chat_context if final.chat_context is not None else next_context(ctx, agent, text,
                                                                                             answer)
            returned_sly = final.sly_data
        else:
            answer = "".join(parts)
            new_ctx, returned_sly = next_context(ctx, agent, text, answer), None
        self._publish(session, ts, answer, False)
        if not error:
            await chat_history.save_context(store, session, agent, new_ctx)
        await chat_history.append(store, session, "assistant", answer, agent=agent, source=_SOURCE, error=bool(error),
                                  bus=self.rt.bus)
        message = chat_pb2.ChatMessage(type=_FRAMEWORK, text=answer, chat_context=new_ctx)
        if returned_sly:
            message.sly_data.update(returned_sly)
        yield agent_pb2.ChatResponse(request=request, response=message) if maximal \
            else agent_pb2.ChatResponse(response=message)
