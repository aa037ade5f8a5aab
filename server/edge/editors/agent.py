"""`Editor`: one editor's ACP connection to uibus, whatever carries it (stdio lines for `uibus acp`,
WebSocket frames for `/acp`). The way in hands it each incoming message (`receive`) and gives it a
`write` for outgoing ones; `Editor` does the rest: the methods, the sessions, the questions.

Sessions are uibus sessions, named by their ACP `sessionId`: `session/new` makes a fresh one,
`session/load` attaches to one in use (its transcript replayed as `session/update`s before the
answer), `session/resume` attaches without the replay — or, given a cursor (`_meta`
`{"uibus/since": <seq>}`, or the v2 draft's `replayFrom: {"type": "start"}`), replays exactly
what the session log holds after it, then goes live on the same subscription —, `session/close`
detaches this editor only. Every update that comes from the session log carries its position in
`_meta` (`uibus/seq`), and the answers to session/load, resume and prompt carry the highest
one the editor has been shown, so an editor always knows the cursor to resume from.
A prompt is one turn of the configured agent through StreamingChat. Requests run concurrently
(a `session/cancel` must overtake its prompt), each answered once, errors as the ACP schema names
them. The requests, their answers, cancels and the end are the one JSON-RPC core's
(uibus.infra.peer.Peer): this module is ACP's methods only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import grpc

from uibus import version
from uibus.edge.editors import roots, updates, v2
from uibus.edge.editors.account import Account, Identity
from uibus.edge.editors.attached import Attached
from uibus.edge.editors.cursor import GAP_KEY, SEQ_KEY, cursor_of
from uibus.edge.editors.prompts import prompt_of
from uibus.edge.editors.uplink import Uplink
from uibus.edge.editors.v2_turns import V2Turns
from uibus.infra.errors import InvalidArgument
from uibus.infra.jsonrpc import (
    AUTH_REQUIRED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    RESOURCE_NOT_FOUND,
    RpcError,
    dump,
)
from uibus.infra.peer import Peer, Receive
from uibus.infra.session import check_session
from uibus.infra.tasks import caller_cancelled, cancel_and_wait
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import sessions_pb2

log = logging.getLogger("uibus.edge.editors")

PROTOCOL_VERSION = 1
MAX_SESSIONS = 64  # sessions one editor connection may hold at once
DEFAULT_PREFIX = "acp-"  # of the sessions session/new makes
LIST_PAGE = 100  # sessions per session/list answer
MAX_IN_FLIGHT = 64  # requests of one editor running at once (each is a task); more are refused
PASSED_STOPS = ("end_turn", "max_tokens", "max_turn_requests", "cancelled")  # ACP stop reasons passed on as said
# What uibus takes with a prompt whatever the hosted agent: text, with embedded resources' text inlined.
BASELINE = {"image": False, "audio": False, "embeddedContext": True}
_STATUS_CODES = {grpc.StatusCode.UNAUTHENTICATED: AUTH_REQUIRED, grpc.StatusCode.PERMISSION_DENIED: AUTH_REQUIRED,
                 grpc.StatusCode.INVALID_ARGUMENT: INVALID_PARAMS, grpc.StatusCode.NOT_FOUND: RESOURCE_NOT_FOUND,
                 grpc.StatusCode.UNIMPLEMENTED: RESOURCE_NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION: INVALID_REQUEST}

Write = Callable[[str], Awaitable[None]]
Method = Callable[[dict[str, Any]], Awaitable[Any]]
WriteMessage = Callable[[dict[str, Any], str], Awaitable[None]]


def _status_error(exc: Exception) -> RpcError | None:
    """uibus refused a call: the same words the editor's user reads, under ACP's code for it."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return RpcError(_STATUS_CODES.get(exc.code(), INTERNAL_ERROR), f"uibus: {exc.code().name}: {exc.details()}")
    return None


def check_prefix(prefix: str) -> str:
    """A session-name prefix `session/new` can use (InvalidArgument, saying why, if not)."""
    try:
        if len(prefix) > 100:
            raise InvalidArgument("")
        check_session(prefix + "x")
    except InvalidArgument:
        raise InvalidArgument(f"{prefix[:40]!r} cannot start a session name: use at most 100 characters from "
                              "A-Z a-z 0-9 . _ : @ / + = -") from None
    return prefix


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _session_id(params: dict[str, Any]) -> str:
    name = params.get("sessionId")
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "sessionId (a string) is required")
    try:
        return check_session(name)
    except InvalidArgument as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None


def _cwd(params: dict[str, Any]) -> None:
    """cwd and mcpServers as the schema has them. The hosted agent's own working directory and
    tools are the server's configuration: an editor's are checked, not used."""
    if not isinstance(params.get("cwd"), str):
        raise RpcError(INVALID_PARAMS, "cwd (an absolute path) is required")
    if not isinstance(params.get("mcpServers", []), list):
        raise RpcError(INVALID_PARAMS, "mcpServers must be an array")


class Editor:
    """One editor connection; `aclose` detaches every session it holds."""

    def __init__(self, uplink: Uplink, write: Write, *, prefix: str = DEFAULT_PREFIX,
                 write_message: WriteMessage | None = None, identity: Identity | None = None) -> None:
        """`prefix` starts the name of every session `session/new` makes: a tenant's token may use
        only sessions matching its patterns (`team-a-*`), so its editors name theirs to match.
        `write_message`, instead of `write`: given the message with its text, for a way out that
        routes by the message (ACP over HTTP) without parsing its own output again. `identity`: who
        the transport let in (its token, its tenant), for `auth/status` (uibus.edge.editors.account)."""
        self.uplink = uplink
        self.prefix = prefix
        self._write = write
        self._write_message = write_message
        self._lock = asyncio.Lock()  # one message at a time on the wire
        self.sessions: dict[str, Attached] = {}
        self.client: dict[str, Any] = {}  # the editor's clientCapabilities
        self.accepts: dict[str, bool] = dict(BASELINE)  # promptCapabilities initialize advertised
        self.blobs = False  # embedded blobs go to the hosted agent as attachments (it takes files)
        self.account = Account(identity or Identity(), uplink, prefix)
        self.v2: V2Turns | None = None  # the v2 draft's framing, once the editor negotiated it
        methods = {"initialize": self.initialize, "authenticate": self.authenticate, "session/new": self.new,
                   "session/load": self.load, "session/resume": self.resume, "session/close": self.close,
                   "session/prompt": self.prompt, "session/list": self.list, "session/set_mode": self.set_mode,
                   "logout": self.logout, "auth/status": self.auth_status}
        self.peer = Peer(self.send, name="acp editor", max_running=MAX_IN_FLIGHT, error_of=_status_error,
                         notified=self._notification,
                         methods={name: self._gated(name, fn) for name, fn in methods.items()})

    def _gated(self, name: str, method: Method) -> Method:
        """`method` refused with auth_required once the connection logged out (uibus.edge.editors.account)."""
        async def gated(params: dict[str, Any]) -> Any:
            self.account.gate(name)
            return await method(params)
        return gated

    async def send(self, message: dict[str, Any]) -> None:
        async with self._lock:
            if self._write_message is not None:
                await self._write_message(message, dump(message))
            else:
                await self._write(dump(message))

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        if self.v2 is not None and method == "session/update":  # v1's update, as v2 says it
            shaped = self.v2.shapes.update(params)
            if shaped is None:
                return
            params = shaped
        await self.peer.notify(method, params)

    async def _ask(self, method: str, params: dict[str, Any], sent: Callable[[int], None]) -> Any:
        if self.v2 is not None and method == "session/request_permission":
            params = v2.permission(params)
        return await self.peer.request(method, params, sent=sent)

    @staticmethod
    def error_of(exc: Exception) -> RpcError | None:
        return _status_error(exc)

    async def aclose(self) -> None:
        """The end: our questions fail, the editor's requests are cancelled and joined, every
        session this connection holds is detached."""
        await self.peer.aclose("the editor's connection closed")
        for attached in list(self.sessions.values()):
            await attached.detach()
        self.sessions.clear()

    # ---- incoming ----

    async def serve(self, receive: Receive) -> None:
        """The connection's receive loop (a framing that reads: WebSocket frames, stdio lines),
        until `receive` gives None; then the end."""
        try:
            await self.peer.run(receive)
        finally:
            await self.aclose()

    async def receive(self, data: str | bytes) -> None:
        """One incoming message (a framing that is handed them), through the one JSON-RPC reader:
        a bad message is answered with its error (-32700 / -32600) and changes nothing else."""
        await self.peer.receive(data)

    async def handle(self, message: dict[str, Any]) -> None:
        """One message `uibus.infra.jsonrpc.read` took. Requests run in tasks of their own."""
        await self.peer.handle(message)

    def _notification(self, method: str, params: dict[str, Any]) -> None:
        if method == "session/cancel" and not self.account.signed_out:
            attached = self.sessions.get(params.get("sessionId"))  # type: ignore[arg-type]
            if attached is not None:
                attached.cancel()

    # ---- methods ----

    async def initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        """Protocol 1, or the v2 draft when the editor asks for 2 or later: from then on this
        connection answers v2's methods (uibus.edge.editors.v2_turns) and speaks v2's shapes."""
        version = params.get("protocolVersion")
        if not isinstance(version, int):
            raise RpcError(INVALID_PARAMS, "protocolVersion (an integer) is required")
        self.uplink.name_client(params.get("clientInfo"))  # who the audit log says made this editor's calls
        if version < v2.PROTOCOL_VERSION:
            return await self.offer(params.get("clientCapabilities"))
        self.v2 = V2Turns(self)
        self.peer.methods = {name: self._gated(name, fn) for name, fn in self.v2.methods().items()}
        return v2.initialize_result(await self.offer(params.get("capabilities")))

    async def offer(self, caps: Any) -> dict[str, Any]:
        """What uibus offers this editor (v1's initialize answer), given its capabilities."""
        self.client = caps if isinstance(caps, dict) else {}
        # The hosted agent's own promptCapabilities where uibus knows them (an ACP agent once it has
        # started, pi always): images and blobs become the turn's attachments. Embedded text is
        # inlined for any agent; audio is not carried.
        facts = await self.uplink.facts()
        hosted = self.uplink.prompt_capabilities_in(facts) or {}
        self.accepts = {**BASELINE, "image": hosted.get("image", False)}
        self.blobs = hosted.get("embeddedContext", False)
        return {"protocolVersion": PROTOCOL_VERSION, "authMethods": [],
                "agentInfo": {"name": "uibus", "title": "uibus", "version": version()},
                "agentCapabilities": {
                    "loadSession": True,
                    "promptCapabilities": {k: self.accepts[k] for k in BASELINE},
                    "mcpCapabilities": {"http": False, "sse": False},
                    "sessionCapabilities": {"list": {}, "resume": {}, "close": {}, **(
                        {"additionalDirectories": {}} if roots.offered(await self.uplink.directory_facts()) else {})},
                    "auth": {"logout": {}, "status": {}}}}

    async def authenticate(self, params: dict[str, Any]) -> dict[str, Any]:
        return {}  # no methods are offered: the token is the transport's (--token, the upgrade's header)

    async def logout(self, params: dict[str, Any]) -> dict[str, Any]:
        """Ends this connection's sign-in (uibus.edge.editors.account): its sessions are detached."""
        self.account.signed_out = True
        for attached in list(self.sessions.values()):
            self._forget(attached)
            await attached.detach()
        return {}

    async def auth_status(self, params: dict[str, Any]) -> dict[str, Any]:
        return await self.account.status()

    def _elicitation(self) -> bool:
        elicitation = self.client.get("elicitation")
        return isinstance(elicitation, dict) and isinstance(elicitation.get("form"), dict)

    async def _attach(self, name: str, *, replay: bool, since: int | None = None,
                      directories: list[str] | None = None) -> Attached:
        """A fresh attachment of `name`, replacing the one this connection held. Each attachment is
        owned by its own object, not by the name: a load and a resume of one session at once each
        detach only what they replaced and remove only themselves (a failed one never takes the
        other's attachment out of `sessions`, where `aclose` would no longer find it)."""
        while (old := self.sessions.pop(name, None)) is not None:  # another may slip in while we detach
            await old.detach()
        if len(self.sessions) >= MAX_SESSIONS:
            raise RpcError(INVALID_REQUEST, f"this connection holds {MAX_SESSIONS} sessions: session/close one first")
        attached = Attached(name, self.uplink, self.notify, self._ask, self.peer.withdraw,
                            elicitation=self._elicitation())
        attached.directories = directories or []  # the editor's additionalDirectories: its turns carry them
        if self.v2 is not None:
            self.v2.watch(attached)
        self.sessions[name] = attached
        try:
            await attached.attach(replay=replay, since=since)
        except BaseException:
            self._forget(attached)
            await attached.detach()
            raise
        return attached

    def _forget(self, attached: Attached) -> None:
        """Removes `attached` from `sessions` if it is still the one held under its name."""
        if self.sessions.get(attached.name) is attached:
            del self.sessions[attached.name]

    async def new(self, params: dict[str, Any]) -> dict[str, Any]:
        _cwd(params)
        dirs = await roots.directories(params, self.uplink)
        await self.uplink.check_agent()  # an agent the server does not have: refused here, naming those it has
        name = f"{self.prefix}{secrets.token_hex(8)}"
        await self.uplink.create(name)  # listed at once (session/list, every UI's ListSessions)
        await self._attach(name, replay=False, directories=dirs)
        return {"sessionId": name}

    async def load(self, params: dict[str, Any]) -> dict[str, Any]:
        _cwd(params)
        name = _session_id(params)
        attached = await self._attach(name, replay=True, directories=await roots.directories(params, self.uplink))
        if not attached.replayed:
            self._forget(attached)
            await attached.detach()
            raise RpcError(RESOURCE_NOT_FOUND, f"session {name} has no conversation to load "
                                               "(session/new starts one, session/resume attaches to any)")
        return await self._offers(attached)

    async def resume(self, params: dict[str, Any]) -> dict[str, Any]:
        """Attaches; with a cursor, what the session log holds after it comes first. A cursor below
        the log's floor (retention dropped what follows it) is never a silent hole: the answer's
        `_meta` says `uibus/gap: true` and the replay is the session's recent history, whole."""
        _cwd(params)
        since = cursor_of(params)
        dirs = await roots.directories(params, self.uplink)
        attached = await self._attach(_session_id(params), replay=since is not None, since=since, directories=dirs)
        answer = await self._offers(attached)
        if since is not None and attached.gap:
            answer.setdefault("_meta", {})[GAP_KEY] = True
        return answer

    async def _offers(self, attached: Attached) -> dict[str, Any]:
        """The agent's modes (the answer's `modes`) and commands (an update) where it has run in
        the session; an agent that never ran there offers nothing yet."""
        state = await self.uplink.agent_state(attached.name)
        for update in attached.offered(state):
            if update["sessionUpdate"] != "current_mode_update":  # the answer's `modes` says it
                await attached.update(update)
        offered = updates.modes(state)
        answer: dict[str, Any] = {"modes": offered} if offered is not None else {}
        if attached.seq:
            answer["_meta"] = {SEQ_KEY: attached.seq}
        return answer

    async def set_mode(self, params: dict[str, Any]) -> dict[str, Any]:
        """The hosted agent's mode (its ACP `session/set_mode`), for every UI of the session."""
        name = _session_id(params)
        attached = self.sessions.get(name)
        if attached is None:
            raise RpcError(RESOURCE_NOT_FOUND, f"session {name} is not open on this connection")
        mode = params.get("modeId")
        if not isinstance(mode, str) or not mode:
            raise RpcError(INVALID_PARAMS, "modeId (a string) is required")
        agent = self.uplink.agent or (await self.uplink.agent_state(name) or sessions_pb2.AgentState()).agent
        if not agent:
            raise RpcError(INVALID_REQUEST, "no agent has run in this session yet: it offers no modes")
        state = await self.uplink.set_mode(name, agent, mode)
        now = state.current_mode or mode
        if attached.now_in_mode(now):
            await attached.update({"sessionUpdate": "current_mode_update", "currentModeId": now})
        return {}

    async def close(self, params: dict[str, Any]) -> dict[str, Any]:
        attached = self.sessions.pop(_session_id(params), None)
        if attached is None:
            raise RpcError(RESOURCE_NOT_FOUND, "this connection holds no session of that id")
        await attached.detach()
        return {}

    async def list(self, params: dict[str, Any]) -> dict[str, Any]:
        """The caller's sessions (every session its token may use), most recently active first, a
        page at a time. uibus keeps no working directory per session: `cwd` is the filter's, or /."""
        cursor, cwd = params.get("cursor"), params.get("cwd")
        if cursor is not None and not (isinstance(cursor, str) and cursor.isdigit()):
            raise RpcError(INVALID_PARAMS, "cursor must be a nextCursor this agent returned")
        if cwd is not None and not isinstance(cwd, str):
            raise RpcError(INVALID_PARAMS, "cwd must be an absolute path")
        start = int(cursor or 0)
        found = (await self.uplink.sessions()).sessions
        page = [{"sessionId": s.session, "cwd": cwd or "/", "title": s.title or None,
                 "updatedAt": _iso(s.last_activity_ms) if s.last_activity_ms else None}
                for s in found[start:start + LIST_PAGE]]
        result: dict[str, Any] = {"sessions": page}
        if start + LIST_PAGE < len(found):
            result["nextCursor"] = str(start + LIST_PAGE)
        return result

    async def prompt(self, params: dict[str, Any]) -> dict[str, Any]:
        attached, turn = self.start_turn(params)
        return await self.finish_turn(attached, turn)

    def start_turn(self, params: dict[str, Any]) -> tuple[Attached, asyncio.Task[Any]]:
        """A prompt's turn started on its session (RpcError, nothing started, when it cannot be)."""
        name = _session_id(params)
        attached = self.sessions.get(name)
        if attached is None:
            raise RpcError(RESOURCE_NOT_FOUND, f"session {name} is not open on this connection: "
                                               "session/new, session/load or session/resume it first")
        text, attached_files = prompt_of(params.get("prompt"), {
            "image": self.accepts["image"], "embeddedContext": self.blobs})
        if not text.strip() and not attached_files:
            raise RpcError(INVALID_PARAMS, "the prompt has no text")
        request = agent_pb2.ChatRequest(
            user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=text, mime_data=attached_files),
            chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
        turn = asyncio.ensure_future(self._turn(attached, request))
        try:
            attached.begin_turn(turn)
        except RpcError:
            turn.cancel()
            raise
        return attached, turn

    async def finish_turn(self, attached: Attached, turn: asyncio.Task[Any]) -> dict[str, Any]:
        """The turn to its end: its stop reason (and cursor), as v1's prompt answers it."""
        try:
            final, streamed, stop = await asyncio.shield(turn)
        except asyncio.CancelledError:
            if caller_cancelled():  # the connection is closing, or the editor withdrew the request
                attached.forget_turn()
                await cancel_and_wait(turn)
                raise
            await attached.end_turn(None)  # session/cancel (or session/close) cancelled the turn
            return {"stopReason": "cancelled"}
        except grpc.aio.AioRpcError as exc:
            await attached.end_turn(None)
            if exc.code() == grpc.StatusCode.CANCELLED:  # another UI stopped the turn (SessionService StopTurn)
                return {"stopReason": "cancelled"}
            raise
        except BaseException:
            await attached.end_turn(None)
            raise
        await attached.end_turn(final)
        # The turn's own messages are streamed from the call, not the feed: the answer says how far
        # the session log has come with them (the cursor a later session/resume gives).
        meta = {"_meta": {SEQ_KEY: attached.seq}} if attached.seq else {}
        if stop == "refusal" or (final is not None and "(stopReason refusal)" in final):  # (the text: an older uibus)
            return {"stopReason": "refusal", **meta}
        if final is not None and final.startswith("Error from "):  # the agent failed: the turn's answer says so
            await attached.update(updates.chunk("agent_message_chunk", f"\n\n{final}" if streamed else final))
        elif final and not streamed:  # an agent that streams no pieces: its answer at once
            await attached.update(updates.chunk("agent_message_chunk", final))
        return {"stopReason": stop if stop in PASSED_STOPS else "end_turn", **meta}

    async def _turn(self, attached: Attached, request: agent_pb2.ChatRequest) -> tuple[str | None, bool, str]:
        """Streams one turn's updates to the editor; (the final answer, whether reply text streamed,
        the hosted agent's own stop reason: the final message's `structure.stop_reason`, or "")."""
        final, streamed, stop = None, False, ""
        async for response in self.uplink.chat(attached.name, request, attached.directories):
            if updates.is_final(response):
                final = response.response.text
                stop = updates.stop_reason(response)
                continue
            for u in updates.turn_updates(response):
                streamed = streamed or u["sessionUpdate"] == "agent_message_chunk"
                await attached.update(u)
        return final, streamed, stop
