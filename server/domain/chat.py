"""The one implementation of a neuro-san chat turn, and the directory of agents that answer.

It keeps neuro-san's StreamingChat contract (protos/neuro_san/api/grpc/agent.proto;
docs/protocols/neuro-san.md) and adds uibus's session behaviour:

* MINIMAL/UNKNOWN stream only the final AGENT_FRAMEWORK message (answer + chat_context);
  MAXIMAL streams every message with its origin, and each ChatResponse echoes the request.
* No `user_message.text` → one empty ChatResponse, nothing else happens.
* A request without `chat_context` continues the session's stored conversation with the agent;
  one with a `chat_context` (even an empty one, which starts over) wins. A caller that named no
  session keeps no conversation on the server (`keep=False`): without a `chat_context` it starts a
  fresh one, as upstream neuro-san does, and what it returns is only the caller's to send back —
  otherwise every unnamed client (neuro-san's, curl, an MCP inspector) would continue, and read,
  each other's conversation in `default`.
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
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, aclosing
from typing import Any

from google.protobuf import json_format, struct_pb2

from uibus.agents import AgentError, AgentSpec, Backend, Final, SessionBackend, Stop, Turn
from uibus.agents.acp_access import DIRECTORIES_KEY
from uibus.agents.config import AgentTable
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.feed import UiFeed
from uibus.domain.history import ChatHistory
from uibus.infra.errors import InvalidArgument, ResourceExhausted, Unimplemented
from uibus.infra.proto_check import undefined_enum
from uibus.infra.telemetry.spans import traced_turn
from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2, concierge_pb2

log = logging.getLogger("uibus.chat")

PARTIAL_INTERVAL_S = 0.05
MAX_CONTEXT_MESSAGES = 200  # per agent history kept in the stored/returned ChatContext
ECHO_BYTES = 64 * 1024  # a bigger request is echoed in MAXIMAL responses without its context and sly_data
_MAXIMAL = agent_pb2.MAXIMAL
_AI = chat_pb2.ChatMessage.AI
_HUMAN = chat_pb2.ChatMessage.HUMAN
_FRAMEWORK = chat_pb2.ChatMessage.AGENT_FRAMEWORK
_ROLES = {chat_pb2.ChatMessage.HUMAN: "user", chat_pb2.ChatMessage.AI: "assistant",
          chat_pb2.ChatMessage.SYSTEM: "system"}
_FILTERS = ", ".join(f"{n} ({v})" for n, v in agent_pb2.ChatFilterType.items())
_FILTER_VALUES = frozenset(agent_pb2.ChatFilterType.values())
SOURCE = "neuro-san"
# Metadata a backend may forward upstream (neuro-san clients send these).
_FORWARD = ("user_id", "request_id", DIRECTORIES_KEY)  # the last: an editor's additionalDirectories


class UnknownAgent(Unimplemented):
    """No such agent here (UNIMPLEMENTED, as neuro-san answers)."""


def check_request(request: agent_pb2.ChatRequest) -> None:
    """InvalidArgument when an enum anywhere in the request (the filter, the message, a chat
    context's histories) carries a value the proto does not define: the HTTP API's and the MCP
    tools' schemas list the defined ones, and every transport takes the same requests."""
    value = request.chat_filter.chat_filter_type
    if value not in _FILTER_VALUES:
        raise InvalidArgument(f"chat_filter.chat_filter_type={value} is not one of {_FILTERS}")
    why = undefined_enum(request)
    if why is not None:
        raise InvalidArgument(why)


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


def fit_context(ctx: chat_pb2.ChatContext, agent: str, budget: int) -> int:
    """Drops the oldest messages of `ctx` (in place) until it serializes to at most `budget`
    bytes; returns how many were dropped.

    Other agents' histories go first (oldest first), the conversation with `agent` last, so what
    the next turn continues from is kept longest. Sizes are summed per message (one ByteSize each),
    not recomputed per drop, and checked exactly at the end.
    """
    dropped = 0
    while (size := ctx.ByteSize()) > budget:
        own = agent_history(ctx, agent)
        order = [h for h in ctx.chat_histories if h is not own] + ([own] if own is not None else [])
        over = size - budget
        for history in order:
            n = 0
            for message in history.messages:
                if over <= 0:
                    break
                over -= message.ByteSize() + 3  # the field's tag and length prefix
                n += 1
            if n:
                del history.messages[:n]
                dropped += n
            if over <= 0:
                break
        for i in range(len(ctx.chat_histories) - 1, -1, -1):
            if not ctx.chat_histories[i].messages:
                del ctx.chat_histories[i]
        if not any(h.messages for h in ctx.chat_histories) and ctx.ByteSize() > budget:
            ctx.Clear()  # only origins/metadata left and still over: nothing worth keeping
    return dropped


def short_echo(request: agent_pb2.ChatRequest) -> agent_pb2.ChatRequest:
    """What MAXIMAL responses echo of a big request: every one of them carries it, so a request
    near the message limit would make each response unsendable. The echo keeps the user message
    (cut to ECHO_BYTES) and the filter, and leaves out chat_context and sly_data."""
    echo = agent_pb2.ChatRequest()
    echo.CopyFrom(request)
    echo.ClearField("chat_context")
    echo.ClearField("sly_data")
    text = echo.user_message.text.encode()
    if len(text) > ECHO_BYTES:
        echo.user_message.text = text[:ECHO_BYTES].decode(errors="ignore")
    return echo


def _fit_reply(response: agent_pb2.ChatResponse, limit: int) -> None:
    """Makes the final response fit the send limit by cutting the answer (said in the text): its
    context is within budget and a big request is echoed short (short_echo), so only an answer
    near the limit itself can be over — and a reply that cannot be sent helps nobody."""
    over = response.ByteSize() - limit
    if over > 0:
        text = response.response.text.encode()
        note = f"\n[uibus: answer cut by {over + 200} bytes to fit the {limit}-byte message limit]"
        keep = max(0, len(text) - over - 200)
        response.response.text = text[:keep].decode(errors="ignore") + note


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(value)
    return s


class Chat:
    def __init__(self, agents: AgentTable, history: ChatHistory, feed: UiFeed, sessions: AgentSessions, *,
                 context_bytes: int = 1024 * 1024, send_limit: int = 4 * 1024 * 1024) -> None:
        """`context_bytes` bounds each (session, agent) ChatContext, stored and
        returned; `send_limit` is the largest message the transports send (the final reply is fitted to it)."""
        self.agents = agents
        self.history = history
        self.feed = feed
        self.sessions = sessions
        self.context_bytes = context_bytes
        self.send_limit = send_limit
        self.context_dropped = 0  # ChatContext messages dropped to keep contexts within budget
        self.directory = concierge_pb2.ConciergeResponse(agents=[
            concierge_pb2.AgentInfo(agent_name=s.name, description=s.description, tags=list(s.tags))
            for s in agents.specs.values()])

    # ---- the directory ----

    @property
    def default_agent(self) -> str:
        return self.agents.default

    def names(self) -> list[str]:
        return self.agents.names()

    def spec(self, agent: str) -> AgentSpec:
        spec = self.agents.specs.get(agent)
        if spec is None:
            raise UnknownAgent(f"agent {agent!r} is not served here; known agents: {', '.join(self.agents.names())}")
        return spec

    def hosted(self, agent: str) -> bool:
        """Whether `agent` is a hosted agent (a process per session, with a lease across replicas)."""
        return isinstance(self.agents.backends.get(agent), SessionBackend)

    def backend(self, agent: str) -> Backend:
        self.spec(agent)
        return self.agents.backends[agent]

    def function(self, agent: str) -> agent_pb2.FunctionResponse:
        spec, backend = self.spec(agent), self.backend(agent)
        function = agent_pb2.Function(description=spec.description)
        if spec.parameters:
            function.parameters.update(spec.parameters)
        schema = spec.sly_data_schema if spec.sly_data_schema is not None else backend.sly_data_schema()
        if schema:
            function.sly_data_schema.update(schema)
        return agent_pb2.FunctionResponse(function=function)

    def connectivity(self, agent: str) -> agent_pb2.ConnectivityResponse:
        spec = self.spec(agent)
        info = agent_pb2.ConnectivityInfo(origin=agent, tools=list(spec.tools), display_as=spec.display_as)
        metadata: dict[str, Any] = {"description": spec.description, "tags": list(spec.tags), "backend": spec.backend}
        accepts = self.backend(agent).prompt_capabilities()
        if accepts is not None:  # what a turn's attachments may be (`uibus acp` advertises it to editors)
            metadata["prompt_capabilities"] = accepts
        roots = self.backend(agent).directories()
        if roots is not None:  # what an editor's additionalDirectories may name (uibus.agents.acp_access)
            metadata["additional_directories"] = roots
        return agent_pb2.ConnectivityResponse(connectivity_info=[info], metadata=_struct(metadata))

    # ---- the turn ----

    def check(self, agent: str, request: agent_pb2.ChatRequest) -> None:
        """Raises what would make `turn` fail before it starts (unknown agent, bad enum)."""
        self.spec(agent)
        check_request(request)

    def placed(self, agent: str, request: agent_pb2.ChatRequest, keep: bool = True) -> bool:
        """Whether this turn belongs to one hosted agent process of its session (a kept turn with
        text, of a hosted agent): such a turn runs where that process lives, so the edge places it
        (uibus.replicas.placement); every other turn runs wherever it arrived."""
        return keep and bool(request.user_message.text) and self.hosted(agent)

    @staticmethod
    def carried(metadata: Mapping[str, str] | None) -> dict[str, str]:
        """The part of a placed turn's metadata that reaches its agent (wherever it runs)."""
        return {k: v for k, v in (metadata or {}).items() if k in _FORWARD}

    @traced_turn  # a span per turn when tracing is on (uibus.infra.telemetry)
    async def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest,
                   metadata: Mapping[str, str] | None = None, *,
                   keep: bool = True) -> AsyncIterator[agent_pb2.ChatResponse]:
        """The ChatResponses of one turn, run here. Bad input fails (with `check`'s errors) before anything
        happens; after that an agent failure is an answer, and only a store failure or a
        cancellation ends the stream otherwise. `keep=False` (a caller that named no session): the
        stored conversation is neither continued nor written; the turn goes on from the request's
        own `chat_context`, or from nothing."""
        self.check(agent, request)
        backend = self.agents.backends[agent]
        text = request.user_message.text
        if not text:
            yield agent_pb2.ChatResponse()
            return
        budget = self.context_bytes
        size = len(text.encode())
        if size + 16 > budget:
            raise ResourceExhausted(
                f"user_message.text is {size} bytes; a chat context holds at most {budget} bytes per "
                f"(session, agent) (--chat-context-bytes), so this turn could never be kept: send less")
        maximal = request.chat_filter.chat_filter_type == _MAXIMAL
        history = self.history
        own_context = request.HasField("chat_context")
        if own_context:
            ctx = request.chat_context
        elif keep:
            ctx = await history.load_context(session, agent)
        else:
            ctx = chat_pb2.ChatContext()
        echo = request
        if maximal and request.ByteSize() > ECHO_BYTES:
            echo = short_echo(request)
        piece_chars = self.send_limit // 8  # a UTF-8 character is at most 4 bytes: half the limit
        sly_data = json_format.MessageToDict(request.sly_data) if request.HasField("sly_data") else {}
        turn = Turn(agent=agent, text=text, history=history_of(ctx, agent), sly_data=sly_data, chat_context=ctx,
                    metadata=self.carried(metadata),
                    attachments=[(m.mime_type, m.mime_bytes) for m in request.user_message.mime_data])
        held = AsyncExitStack()  # the agent session of the turn (if the backend has them), held for it
        source, error = backend.stream, ""
        if isinstance(backend, SessionBackend):  # a limit (max_processes) raises here: the call's status, nothing kept
            try:
                live = await held.enter_async_context(self.sessions.use(session, agent, backend, keep=keep))
            except AgentError as exc:  # could not start: the answer says why
                live, error = None, f"Error from {agent}: {exc}"
            if live is not None:
                source = live.stream
        try:
            await history.append(session, "user", text, agent=agent, source=SOURCE)
        except BaseException:
            await held.aclose()
            raise

        feed = self.feed
        origin = [chat_pb2.Origin(tool=agent, instantiation_index=1)]
        await feed.prepare(session)
        if not turn.history:  # a new conversation: a new epoch in the session's log
            feed.log.new_epoch(session)
        feed.question(session, text)  # before the reply's ts: the turn shows (and replays) in order
        ts = 0  # the reply's message, taken at its first piece: what an agent shows before it comes first
        parts: list[str] = []
        final: Final | None = None
        stop = ""  # the upstream's own stop reason, if it says one (Stop)
        published_at = 0.0
        try:
            if not error:
                async with aclosing(source(turn)) as pieces:
                    async for piece in pieces:
                        if type(piece) is str:
                            if not ts:
                                ts = feed.clock.next()
                            parts.append(piece)
                            if maximal:
                                for start in range(0, len(piece), piece_chars) if len(piece) > piece_chars else (0,):
                                    yield agent_pb2.ChatResponse(request=echo, response=chat_pb2.ChatMessage(
                                        type=_AI, text=piece[start:start + piece_chars], origin=origin))
                            now = time.monotonic()
                            if now - published_at >= PARTIAL_INTERVAL_S:
                                published_at = now
                                feed.say(session, "".join(parts), ui_pb2.TEXT, ts=ts, partial=True, agent=agent)
                        elif isinstance(piece, Final):
                            final = piece
                        elif isinstance(piece, Stop):
                            stop = piece.reason
                        elif maximal:
                            if not piece.origin:
                                piece.origin.extend(origin)
                            yield agent_pb2.ChatResponse(request=echo, response=piece)
        except Exception as exc:  # an agent failure is an answer, not a call error (neuro-san does the same)
            error = f"Error from {agent}: {exc}"
        except BaseException:
            # Cancelled or closed: still end the webview's message (if one was shown), so no UI shows
            # a reply "typing" forever; say() never awaits, so this cannot delay the cancel.
            if published_at:
                feed.say(session, "".join(parts), ui_pb2.TEXT, ts=ts, agent=agent)
            raise
        finally:
            await held.aclose()  # the next turn of this (session, agent) may start
        if error:
            log.warning("agent failed", extra={"fields": {"agent": agent, "session": session, "error": error}})
            answer, new_ctx, returned_sly = error, ctx, None
        elif final is not None:
            answer = final.text
            new_ctx = final.chat_context if final.chat_context is not None else next_context(ctx, agent, text,
                                                                                             answer)
            returned_sly = final.sly_data
        else:
            answer = "".join(parts)
            new_ctx, returned_sly = next_context(ctx, agent, text, answer), None
        if not error:
            feed.say(session, answer, ui_pb2.TEXT, ts=ts, agent=agent)
        else:  # what was streamed stays as it was, finished; the failure is Cline's ERROR message
            if published_at:
                feed.say(session, "".join(parts), ui_pb2.TEXT, ts=ts, agent=agent)
            feed.say(session, answer, ui_pb2.ERROR)
        if not error and keep:
            new_ctx = await self._keep(session, agent, ctx, new_ctx, own_context, text, answer)
        elif not error:
            self.context_dropped += fit_context(new_ctx, agent, self.context_bytes)
        await history.append(session, "assistant", answer, agent=agent, source=SOURCE, error=bool(error))
        message = chat_pb2.ChatMessage(type=_FRAMEWORK, text=answer, chat_context=new_ctx)
        if stop:
            message.structure.update({"stop_reason": stop})
        if error:  # the marker a client tells a failure by (`uibus chat` exits non-zero), not the text's wording
            message.structure.update({"error": answer, "tool": agent})
        if returned_sly:
            message.sly_data.update(returned_sly)
        reply = agent_pb2.ChatResponse(request=echo, response=message) if maximal \
            else agent_pb2.ChatResponse(response=message)
        _fit_reply(reply, self.send_limit)
        await feed.durable(session)  # acknowledged is durable: the reply is in the log before the caller has it
        yield reply

    async def _keep(self, session: str, agent: str, loaded: chat_pb2.ChatContext, new_ctx: chat_pb2.ChatContext,
                    own_context: bool, question: str, answer: str) -> chat_pb2.ChatContext:
        """Stores the turn's context within budget; returns what the reply carries.

        A client that sent its own context manages its conversation: what this turn made of it is
        stored as it is. Otherwise the turn is merged into the *current* stored context in one
        store transaction: when another turn of the same (session, agent) finished meanwhile, this
        turn's question and answer are added after it rather than overwriting it, so N parallel
        turns leave all N in the context (on one process or many replicas alike).
        """
        budget = self.context_bytes
        dropped = [0]

        def fitted(ctx: chat_pb2.ChatContext) -> chat_pb2.ChatContext:
            dropped[0] = fit_context(ctx, agent, budget)
            return ctx

        if own_context:
            result = fitted(new_ctx)
            await self.history.save_context(session, agent, result)
        else:
            def change(current: chat_pb2.ChatContext) -> chat_pb2.ChatContext:
                if current == loaded:  # nobody wrote meanwhile: the backend's own context stands
                    base = chat_pb2.ChatContext()
                    base.CopyFrom(new_ctx)
                    return fitted(base)
                return fitted(next_context(current, agent, question, answer))

            result = await self.history.update_context(session, agent, change)
        self.context_dropped += dropped[0]
        return result
