"""The editor's way to uibus: the public services, called through a channel, as any UI calls them.

`channel` is anything with grpc.aio's `unary_unary` / `unary_stream`: a grpc.aio channel (`uibus
acp`, to a local or remote uibus) or the app's in-process channel (`/acp`, whose calls the call
driver runs through the pipeline). The session is named on every call (`x-uibus-session`), so one
editor connection can hold several sessions over one channel; the token rides on the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from uibus.agents.acp_access import DIRECTORIES_KEY, encode
from uibus.edge.calls.acting import client_named
from uibus.infra.session import SESSION_KEY, SINCE_KEY
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2, webview_pb2

CANONICAL_AGENT = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
_EXT = ext_pb.DESCRIPTOR.services_by_name["ExtensionUiService"].full_name
_SESSIONS = sessions_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name
_WEBVIEW = webview_pb2.DESCRIPTOR.services_by_name["WebviewService"].full_name
CONNECTIVITY_S = 3.0  # initialize waits at most this long to learn what the hosted agent takes


async def each(call: Any) -> AsyncIterator[Any]:
    """The messages of a server-streaming call; leaving early cancels the call on either kind of
    channel (a grpc.aio call is cancelled, an in-process one closed: the handler's `finally` runs)."""
    try:
        async for message in call:
            yield message
    finally:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()
        else:
            with contextlib.suppress(RuntimeError):  # already closing
                await call.aclose()


def _rpc(channel: Any, path: str, request: type[Message], reply: type[Message], streaming: bool = False) -> Any:
    """A callable for one method at `path` (unary or server-streaming) on either kind of channel."""
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(path, request_serializer=request.SerializeToString, response_deserializer=reply.FromString)


class Uplink:
    def __init__(self, channel: Any, agent: str = "") -> None:
        self.channel = channel
        self.agent = agent  # "" = the server's default agent (the canonical AgentService path)
        self._user_agent = str(getattr(channel, "client", ""))  # the door's own name for the caller
        service = f"{agent}.AgentService" if agent else CANONICAL_AGENT
        self._chat = _rpc(channel, f"/{service}/StreamingChat", agent_pb2.ChatRequest, agent_pb2.ChatResponse,
                          streaming=True)
        self._connectivity = _rpc(channel, f"/{service}/Connectivity", agent_pb2.ConnectivityRequest,
                                  agent_pb2.ConnectivityResponse)
        self._webview = _rpc(channel, f"/{_WEBVIEW}/Subscribe", webview_pb2.WebviewSubscribeRequest,
                             webview_pb2.WebviewEvent, streaming=True)
        self._dialogs = _rpc(channel, f"/{_EXT}/Subscribe", ext_pb.SubscribeRequest, ext_pb.ExtensionUiEvent,
                             streaming=True)
        self._respond = _rpc(channel, f"/{_EXT}/Respond", ext_pb.RespondRequest, ext_pb.RespondReply)
        self._set_mode = _rpc(channel, f"/{_SESSIONS}/SetMode", sessions_pb2.SetModeRequest, sessions_pb2.AgentState)
        self._watch = _rpc(channel, f"/{_SESSIONS}/WatchSessions", sessions_pb2.ListSessionsRequest,
                           sessions_pb2.SessionList, streaming=True)
        self._list = _rpc(channel, f"/{_SESSIONS}/ListSessions", sessions_pb2.ListSessionsRequest,
                          sessions_pb2.SessionList)
        self._create = _rpc(channel, f"/{_SESSIONS}/CreateSession", sessions_pb2.CreateSessionRequest,
                            sessions_pb2.SessionEntry)

    @staticmethod
    def _md(session: str) -> tuple[tuple[str, str], ...]:
        return ((SESSION_KEY, session),)

    def chat(self, session: str, request: agent_pb2.ChatRequest,
             directories: list[str] | None = None) -> AsyncIterator[agent_pb2.ChatResponse]:
        """One turn of the configured agent on `session` (neuro-san's StreamingChat); `directories`:
        the editor's additionalDirectories, carried to the hosted agent (uibus.agents.acp_access)."""
        metadata = self._md(session)
        if directories is not None:
            metadata = (*metadata, (DIRECTORIES_KEY, encode(directories)))
        return each(self._chat(request, metadata=metadata))

    def name_client(self, info: Any) -> None:
        """The editor's `clientInfo` (initialize) as the audit log's client of every call it makes
        from now on — on an in-process channel (`/acp`); a gRPC channel's user-agent is its own."""
        if hasattr(self.channel, "client"):
            self.channel.client = client_named(info, self._user_agent)

    async def facts(self) -> dict[str, Any] | None:
        """Connectivity's metadata for the configured agent; None where uibus cannot be reached."""
        try:
            reply = await asyncio.wait_for(self._connectivity(agent_pb2.ConnectivityRequest()), CONNECTIVITY_S)
        except (grpc.aio.AioRpcError, TimeoutError):
            return None
        return json_format.MessageToDict(reply.metadata)

    @staticmethod
    def prompt_capabilities_in(facts: dict[str, Any] | None) -> dict[str, bool] | None:
        """What the configured agent takes with a prompt besides text (ACP's promptCapabilities,
        from Connectivity's metadata); None where uibus does not know (yet) or cannot be reached."""
        found = (facts or {}).get("prompt_capabilities")
        if not isinstance(found, dict):
            return None
        return {k: found.get(k) is True for k in ("image", "audio", "embeddedContext")}

    async def prompt_capabilities(self) -> dict[str, bool] | None:
        return self.prompt_capabilities_in(await self.facts())

    async def directory_facts(self) -> dict[str, Any] | None:
        """What an editor's additionalDirectories may name (`roots`) and whether the agent takes them
        (`supported`: None until it started); None: it takes none (uibus.agents.acp_access)."""
        found = (await self.facts() or {}).get("additional_directories")
        return found if isinstance(found, dict) else None

    def feed(self, session: str, client_id: str, since: int | None = None) -> Any:
        """The session's UI feed as a webview gets it: its recent messages first (`replayed`; with
        `since`, those that changed after that seq, or a `gap` event and the recent ones when the log
        no longer reaches back to it), then one `replay_complete` event, then live. The call itself
        (read it with `each`): a grpc.aio call's headers say it is subscribed."""
        metadata = self._md(session) if since is None else (*self._md(session), (SINCE_KEY, str(since)))
        return self._webview(webview_pb2.WebviewSubscribeRequest(client_id=client_id, mark_replay_end=True),
                             metadata=metadata)

    def dialogs(self, session: str) -> AsyncIterator[ext_pb.ExtensionUiEvent]:
        """The session's dialogs (those waiting first, `replayed`) and their closings."""
        return each(self._dialogs(ext_pb.SubscribeRequest(), metadata=self._md(session)))

    async def respond(self, session: str, answer: ext_pb.RespondRequest) -> None:
        await self._respond(answer, metadata=self._md(session))

    async def sessions(self, prefix: str = "") -> sessions_pb2.SessionList:
        """The sessions the channel's token may use (named `prefix…`), most recently active first."""
        return await self._list(sessions_pb2.ListSessionsRequest(prefix=prefix))

    async def check_agent(self) -> None:
        """Raises the server's UNIMPLEMENTED, which names the agents it has, when the configured agent
        is not one of them: `session/new` refuses at once rather than leaving it to the first prompt.
        The default agent ("") is always there; any other failure is left to the prompt to say."""
        if not self.agent:
            return
        try:
            await self._connectivity(agent_pb2.ConnectivityRequest(), timeout=CONNECTIVITY_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise
        except TimeoutError:
            return

    async def create(self, session: str) -> None:
        """Makes `session` exist (CreateSession: listed at once, counted in the tenant's sessions
        per minute), naming the configured agent."""
        await self._create(sessions_pb2.CreateSessionRequest(agent=self.agent), metadata=self._md(session))

    def _state_in(self, listed: sessions_pb2.SessionList, session: str) -> sessions_pb2.AgentState | None:
        for entry in listed.sessions:
            if entry.session == session:
                agent = self.agent or entry.agent
                return next((state for state in entry.agents if state.agent == agent), None)
        return None

    async def agent_state(self, session: str) -> sessions_pb2.AgentState | None:
        """What the session's agent (the configured one, else the one it last talked to) offers
        now: modes, commands. None before it ever ran there."""
        return self._state_in(await self.sessions(session), session)

    @staticmethod
    def busy_in(listed: sessions_pb2.SessionList, session: str) -> bool:
        """Whether an agent runs a turn in `session` now (from any UI), as the listing says."""
        return any(entry.running for entry in listed.sessions if entry.session == session)

    async def busy(self, session: str) -> bool:
        return self.busy_in(await self.sessions(session), session)

    async def agent_states(self, session: str) -> AsyncIterator[tuple[sessions_pb2.AgentState | None, bool]]:
        """`agent_state` (and whether a turn runs) now and again each time the session's listing
        changes (WatchSessions: a mode set from any UI, the agent's own mode or commands, a turn
        starting or ending)."""
        async for listed in each(self._watch(sessions_pb2.ListSessionsRequest(prefix=session),
                                             metadata=self._md(session))):
            yield self._state_in(listed, session), self.busy_in(listed, session)

    async def set_mode(self, session: str, agent: str, mode: str) -> sessions_pb2.AgentState:
        return await self._set_mode(sessions_pb2.SetModeRequest(agent=agent, mode_id=mode),
                                    metadata=self._md(session))
