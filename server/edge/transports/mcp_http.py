"""`/mcp`: the Model Context Protocol's streamable HTTP transport, framing only (uibus.edge.mcp.server
has the methods).

* `POST /mcp` carries one JSON-RPC message. A request is answered with `application/json`, or —
  for a client that accepts `text/event-stream`, on `tools/call` — with an event stream that
  opens once the call is admitted and carries progress notifications, keep-alive comments (so
  proxies and clients do not give up on a person who takes minutes to answer) and the response.
  Notifications and responses from the client get 202.
* `DELETE /mcp` ends the `Mcp-Session-Id` it names: its calls in flight are cancelled and the id
  is answered 404 from then on. `GET /mcp` without `Last-Event-ID` is 405: uibus sends nothing
  unasked.
* Resumability (the MCP spec's "Resumability and Redelivery"): a call's event stream starts with
  a priming event (an `id:`, no data) and every event has an id, `<stream>.<n>`, unique across
  streams. A client whose stream broke sends `GET /mcp` with `Last-Event-ID` (and the POST's
  `Mcp-Session-Id` and `Authorization`) and gets exactly the events after it, once, in order, then
  the rest of the call live. A broken stream is not a cancellation: the call goes on for
  `RESUME_S` without a reader (then it is cancelled, as a client that left), and a finished
  stream is kept as long for a client that lost its last events. The events come from the
  stream's replay log (uibus.edge.transports.sse, bounded in bytes): an id older than it keeps gets
  the call's JSON-RPC error (`DATA_LOSS`) as the resumed stream's one event and the call is
  cancelled; an id of no stream kept here (ended longer ago, before a restart) is 404 — never a
  silent hole. With replicas (a replicated bus) a stream is also kept in the session's log and
  followed on the bus (uibus.edge.transports.mcp_resume), so the GET may reach any replica: one
  that does not run the call replays the missed events from the log, then the rest live.

Every message runs through the handler pipeline as `/mcp/<method>`, so the token, the session
binding (`x-uibus-session`), limits, metrics (transport `mcp`) and error policy are the ones of
every other transport. Input that is no JSON-RPC message goes to the pipeline as `Rejected`.
Statuses are JSON-RPC errors whose `data.status` names the gRPC status; at the HTTP level a call
refused for its token is 401/403 (MCP's authorization rules), input that is not a message is
400 (or 429 over the size limit), and every answered request is 200 — never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from typing import Any

import grpc

from uibus.edge.calls import CallContext, Outcome, Rejected, drive, unary
from uibus.edge.calls.acting import client_named
from uibus.edge.mcp import era, protocol
from uibus.edge.mcp.protocol import Call, InvalidParams, Message, ProtocolError
from uibus.edge.mcp.server import McpServer
from uibus.edge.transports import sse
from uibus.edge.transports.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    refuse,
    respond,
    wait_disconnect,
)
from uibus.edge.transports.grpcweb import client_of, metadata_of, peer_of
from uibus.edge.transports.mcp_exchange import Exchange, dump, refuse_call
from uibus.edge.transports.mcp_resume import RemoteResume, SharedStream, auth_hash
from uibus.infra.errors import UibusError
from uibus.infra.json_input import PoisonedJson, check_json, load_json
from uibus.infra.session import session_from_metadata
from uibus.infra.tasks import cancel_and_wait

PATH = "/mcp"
KEEPALIVE_S = 15.0
RESUME_S = 30.0  # a call whose stream broke waits this long for a resume; an ended stream is kept as long
MAX_STREAMS = 1024  # ended streams kept for a late resume (the oldest go first past it)
MAX_REPLAY_BYTES = 64 * 1024 * 1024  # sent events all calls' streams keep for a resume (each at most 1 MiB)
MAX_CLIENTS = 4096  # MCP sessions whose client's name (initialize's clientInfo) is kept, for the audit log


class McpHttp:
    def __init__(self, server: McpServer, max_body: int = 4 * 1024 * 1024, keepalive_s: float = KEEPALIVE_S) -> None:
        self.server = server
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.resume_s = RESUME_S
        self.replay_bytes = sse.REPLAY_BYTES  # of events each call's stream keeps for a client resuming it
        self.streams: dict[str, Exchange] = {}  # calls' event streams, by the stream part of their ids
        self.replay = sse.Replay(MAX_REPLAY_BYTES)  # their replay logs, together: the oldest streams' go first
        # With replicas, streams are also kept in the session log and followed on the bus (mcp_resume)
        self.bus = server.core.bus
        self.log = server.core.feed.log
        # Each MCP session's client as it named itself in initialize (the audit log's `client` of its
        # later calls); this replica's sessions only, the oldest forgotten first: then the user-agent.
        self.clients: OrderedDict[str, str] = OrderedDict()

    def _sweep(self) -> None:
        """Forgets the streams of calls that ended more than `resume_s` ago (and the oldest ended
        ones past MAX_STREAMS), and those of ended sessions."""
        now = time.monotonic()
        ended = [k for k, x in self.streams.items() if x.ended_at is not None]
        for key in ended:
            x = self.streams[key]
            if (now - x.ended_at > self.resume_s or len(self.streams) > MAX_STREAMS  # type: ignore[operator]
                    or (x.session_id is not None and self.server.ended(x.session_id))):
                del self.streams[key]
                if x.stream is not None:
                    self.replay.remove(x.stream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await refuse(scope, send, 404, f"{PATH} is not a WebSocket endpoint (POST JSON-RPC to it)\n")
            return
        method = scope["method"]
        self._sweep()
        if method == "POST":
            await self._post(scope, receive, send)
        elif method == "DELETE":
            await self._delete(scope, receive, send)
        elif method == "GET" and header(scope, b"last-event-id").strip():
            await self._resume(scope, receive, send)
        else:
            await respond(send, 405, dump(protocol.error(None, "UNIMPLEMENTED", f"{method} {PATH} is not served: "
                                                          "POST a JSON-RPC message, DELETE to end a session, or GET "
                                                          "with Last-Event-ID to resume a call's event stream",
                                                          protocol.INVALID_REQUEST)),
                          "application/json", [(b"allow", b"GET, POST, DELETE")])

    # ---- POST: one JSON-RPC message ------------------------------------------------------------

    def _read(self, scope: Scope, body: bytes) -> tuple[Message | Rejected, Any, protocol.Envelope | None]:
        """The message, or why there is none; the id to answer with (None when unknown); and, for a
        request of the stateless era, its envelope (checked against the routing headers)."""
        read, ident = self._message(scope, body)
        if not isinstance(read, Message) or not read.is_request:
            return read, ident, None
        version = header(scope, b"mcp-protocol-version").strip()
        if not era.is_modern(read.method, read.params, version):
            return read, ident, None
        try:
            return read, ident, era.envelope(read.method or "", read.params, _routing(scope))
        except era.EraError as exc:
            return Rejected(exc), ident, None

    def _message(self, scope: Scope, body: bytes) -> tuple[Message | Rejected, Any]:
        """The message, or why there is none; and the id to answer with (None when unknown)."""
        content_type = header(scope, b"content-type").split(";")[0].strip().lower()
        if content_type != "application/json":
            # Also what keeps a web page from posting here without a CORS preflight.
            return Rejected(ProtocolError(f"POST {PATH} takes Content-Type: application/json (a JSON-RPC message), "
                                          f"not {content_type or 'none'}")), None
        try:
            value = load_json(body, "the body")
        except PoisonedJson as exc:
            return self._poisoned(exc)
        except UibusError as exc:
            return Rejected(protocol.ParseError(str(exc))), None
        try:
            message = protocol.parse_message(value)
        except ProtocolError as exc:
            return Rejected(exc), None
        return message, message.id

    @staticmethod
    def _poisoned(exc: PoisonedJson) -> tuple[Rejected, Any]:
        """JSON that parsed but cannot be kept (uibus.infra.json_input): inside `params` it is the
        request's invalid params (-32602, answered with its id, which is sound); anywhere else the
        message itself is invalid (-32600; an id that is the poison cannot be echoed)."""
        if exc.path[:1] == ("params",) and isinstance(exc.value, dict):
            with contextlib.suppress(UibusError):  # the id is poisoned too, or the message is none
                message = protocol.parse_message(exc.value)
                check_json(message.id, "id")
                if message.is_request:
                    return Rejected(InvalidParams(str(exc))), message.id
        return Rejected(ProtocolError(str(exc))), None

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, self.max_body)
        except ClientGone:
            return
        except BodyTooLarge as exc:
            request: Message | Rejected = Rejected(exc)
            ident: Any = None
            envelope = None
        else:
            request, ident, envelope = self._read(scope, body)
        # the stateless era has no sessions: a modern request's Mcp-Session-Id means nothing
        session_id = None if envelope is not None else header(scope, b"mcp-session-id").strip() or None
        message = request if isinstance(request, Message) else None
        starting = message is not None and message.method == "initialize"
        accepts_events = "text/event-stream" in header(scope, b"accept")
        if message is not None and message.method == "subscriptions/listen" and envelope and not accepts_events:
            await respond(send, 406, dump(protocol.error(ident, "INVALID_ARGUMENT", "subscriptions/listen answers "
                                                          "with an event stream: send Accept: text/event-stream",
                                                          protocol.INVALID_REQUEST)), "application/json")
            return
        if session_id is not None and self.server.ended(session_id) and not starting:
            await respond(send, 404, dump(protocol.error(ident, "NOT_FOUND", f"MCP session {session_id[:64]} has "
                                                          "ended: initialize a new one", protocol.INVALID_REQUEST)),
                          "application/json")
            return
        handler = self.server.handler(message)
        streamable = (message is not None and message.is_request and accepts_events
                      and message.method in ("tools/call", "subscriptions/listen"))
        call = Call(message or Message(None), session_id, streamable, envelope)
        posted_gone = asyncio.ensure_future(wait_disconnect(receive))
        exchange = Exchange(send, ident, streamable, self.keepalive_s, call,
                             request.error if isinstance(request, Rejected) else None, posted_gone)
        exchange.authorization = header(scope, b"authorization")
        exchange.registry = self.streams
        exchange.replay_bytes, exchange.replay = self.replay_bytes, self.replay
        exchange.share = self._sharing(scope, exchange) if envelope is None else None  # resumable: today's only
        exchange.modern = envelope is not None

        async def gone() -> None:
            """The client went away: at once when no event stream was open; else once no reader has
            resumed the stream for `resume_s` (a broken stream is not a cancellation). At once
            when the stream was cut."""
            cut = asyncio.ensure_future(exchange.was_cut.wait())
            try:
                await asyncio.wait((posted_gone, cut), return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(cut)
            if exchange.streaming:
                await exchange.abandoned(self.resume_s)

        metadata = metadata_of(scope)
        if message is not None and envelope is not None:  # trace context in _meta joins uibus's traces
            sent = {key for key, _ in metadata}
            metadata += tuple(pair for pair in era.trace_context(message.params) if pair[0] not in sent)
        ctx = CallContext(metadata, peer_of(scope), "mcp", route=PATH)
        ctx.client = self._client(scope, message, envelope, session_id)
        try:
            outcome = await drive(handler, request if message is None else call, ctx, exchange, gone=gone,
                                  within=lambda: self.server.tracking(session_id, ident))
            if outcome is Outcome.CANCELLED and not exchange.done:  # by the client's notifications/cancelled
                await exchange.cancelled()
        finally:
            await exchange.close()
            await cancel_and_wait(posted_gone)
        if call.new_session:  # initialize: its clientInfo names the session's client from now on
            self.clients[call.new_session] = ctx.client
            while len(self.clients) > MAX_CLIENTS:
                self.clients.popitem(last=False)

    def _client(self, scope: Scope, message: Message | None, envelope: Any, session_id: str | None) -> str:
        """Who the audit log names as the call's client: the clientInfo of the request's envelope
        (the stateless era), of initialize, or of the session's initialize; else the user-agent."""
        agent = client_of(scope)
        if envelope is not None:
            return client_named(envelope.client, agent)
        if message is not None and message.method == "initialize":
            return client_named(message.params.get("clientInfo"), agent)
        return self.clients.get(session_id, agent) if session_id else agent

    def _sharing(self, scope: Scope, exchange: Exchange) -> Any:
        """With replicas: what makes the call's stream followable from any replica (its events
        to the session log and the bus), given the stream's name; None alone (nothing to share)."""
        if not self.bus.replicated:
            return None
        try:
            session = session_from_metadata(metadata_of(scope))
        except UibusError:  # the pipeline refuses the call for it; nothing will stream
            return None

        def share(name: str) -> SharedStream:
            head = {"sid": exchange.session_id, "auth": auth_hash(exchange.authorization), "rid": exchange.ident,
                    "replica": self.bus.replica_id}
            return SharedStream(self.bus, self.log, session, name, head)
        return share

    # ---- GET with Last-Event-ID: resume a call's event stream ----------------------------------

    async def _resume(self, scope: Scope, receive: Receive, send: Send) -> None:
        last = header(scope, b"last-event-id").strip()
        session_id = header(scope, b"mcp-session-id").strip() or None

        async def not_found() -> None:
            await respond(send, 404, dump(protocol.error(None, "NOT_FOUND", f"no event stream of this session has "
                          f"event {last[:80]!r}: its call ended more than {self.resume_s:g} s ago, its session was "
                          "deleted, or it was served before a restart", protocol.INVALID_REQUEST)),
                          "application/json")

        found = self.streams.get(last.rpartition(".")[0])
        if found is None and self.bus.replicated:  # the call may run on another replica
            await self._resume_elsewhere(scope, receive, send, last, session_id, not_found)
            return
        if (found is None or found.stream is None or found.session_id != session_id
                or found.authorization != header(scope, b"authorization")):
            await not_found()
            return
        stream = found.stream
        if not await stream.take_over():  # the reader it lost, if the server has not seen it go yet
            await respond(send, 409, dump(protocol.error(None, "ABORTED", "this event stream already has a reader",
                                                          protocol.INVALID_REQUEST)), "application/json")
            return
        try:
            stream.resume(last)
        except sse.TooOld as exc:  # said, and the call ends: its client can no longer have all it sent
            await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
            error = protocol.error(found.ident, "DATA_LOSS", f"{exc}; the call was cancelled")
            await send({"type": "http.response.body", "body": sse.frame(dump(error), None, "message")})
            found.cut()
            return
        except sse.ResumeError as exc:
            await respond(send, 404, dump(protocol.error(None, "NOT_FOUND", str(exc), protocol.INVALID_REQUEST)),
                          "application/json")
            return
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
            await found.read(send, gone)
        finally:
            await cancel_and_wait(gone)

    async def _resume_elsewhere(self, scope: Scope, receive: Receive, send: Send, last: str, session_id: str | None,
                                not_found: Any) -> None:
        """A resume of a stream this replica does not hold: from the session log, then live from
        the bus, while the call runs on another replica (uibus.edge.transports.mcp_resume)."""
        try:
            session = session_from_metadata(metadata_of(scope))
        except UibusError:
            await not_found()
            return
        await RemoteResume(self.bus, self.log, self.resume_s, self.keepalive_s).serve(
            session, last, session_id, header(scope, b"authorization"), send, wait_disconnect(receive), not_found,
            lambda ident, status, message: dump(protocol.error(ident, status, message)))

    # ---- DELETE: end a session -----------------------------------------------------------------

    async def _delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = header(scope, b"mcp-session-id").strip() or None
        if session_id is None:
            await respond(send, 400, dump(protocol.error(None, "INVALID_ARGUMENT", f"DELETE {PATH} ends the session "
                                                          "its Mcp-Session-Id header names; none was sent",
                                                          protocol.INVALID_REQUEST)), "application/json")
            return
        ctx = CallContext(metadata_of(scope), peer_of(scope), "mcp", route=PATH)
        await unary(self.server.handlers[protocol.path_of("delete")], Call(Message("delete"), session_id), ctx)
        code, details = ctx.status()
        if code == grpc.StatusCode.OK:
            self.clients.pop(session_id, None)
            await respond(send, 204, b"")
        else:
            await refuse_call(send, None, code, details, None)


def _routing(scope: Scope) -> dict[str, str]:
    """The routing headers, lower-cased, each sent once (a header sent twice is refused: readers of
    the first and of the last copy would route one request two ways)."""
    seen: dict[str, str] = {}
    for raw_key, raw_value in scope["headers"]:
        key = raw_key.decode("latin-1").lower()
        if key in era.ROUTING_HEADERS:
            if key in seen:
                raise era.EraError(era.HEADER_MISMATCH, f"the {key} header appears more than once")
            seen[key] = raw_value.decode("latin-1").strip()
    return seen
