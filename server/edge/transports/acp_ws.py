"""`/acp` on the HTTP port: remote ACP over the SDK's WebSocket transport (`createWebSocketStream`
of @agentclientprotocol/sdk: one JSON-RPC message per text frame), so an editor that speaks remote
ACP needs no local command. Framing only, around the same `Editor` `uibus acp` runs. Plain HTTP
requests on the same route are ACP's Streamable HTTP (`createHttpStream`: uibus.edge.transports.acp_http),
with the same query, policy and tokens.

Mounted behind the browser policy (Host, Origin) like every route. The upgrade needs a token when
tokens are configured (`Authorization: Bearer`, as the SDK's `headers` option sends it), which the
HTTP port's route table checks (uibus.edge.transports.routes); each call
the editor's sessions make then passes the pipeline with that token, through the app's in-process
channel (the call driver), so a session-bound token reaches only its sessions. `?agent=NAME`
chooses the agent a prompt runs (default: the server's default agent), `?prefix=` how the sessions
`session/new` makes are named (default `acp-`; a tenant's token needs its own, e.g. `team-a-`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import parse_qs

import grpc

from uibus.edge.editors.account import Identity
from uibus.edge.editors.agent import DEFAULT_PREFIX, Editor, check_prefix
from uibus.edge.editors.uplink import Uplink
from uibus.edge.transports.acp_http import AcpHttp
from uibus.edge.transports.asgi import GRANT, Receive, Scope, Send, error_body, header, refuse
from uibus.edge.transports.grpcweb import Lookup, client_of, metadata_of, peer_of
from uibus.edge.transports.inprocess import Channel
from uibus.infra.auth import Tokens
from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import dump_json
from uibus.infra.quotas import ANONYMOUS, QuotaExceeded, Quotas
from uibus.infra.session import SESSION_KEY

PATH = "/acp"
REVOKED = 4401  # the close code of a socket whose token a reload revoked (4000-4999: the application's)


class SocketGone(Exception):
    """The editor's socket closed while a message was being written."""


class AcpWebSocket:
    def __init__(self, lookup: Lookup, tokens: Tokens, max_message_bytes: int = 0,
                 quotas: Quotas | None = None) -> None:
        """`max_message_bytes`: --max-message-bytes, on every call an editor's messages make (a
        prompt's images and blobs included), as over gRPC. `quotas`: a tenant's `acp_connections`
        counts its WebSockets and HTTP connections together."""
        self.lookup = lookup
        self.tokens = tokens
        self.max_message_bytes = max_message_bytes
        self.quotas = quotas if quotas is not None else Quotas()
        self.open: set[Editor] = set()
        self._sockets: dict[asyncio.Task[Any], str] = {}  # each socket's task -> its Authorization
        self._revoked: set[asyncio.Task[Any]] = set()
        self.http = AcpHttp(lookup, tokens, max_message_bytes, self.quotas)
        tokens.on_reload.append(self.revoke)

    def revoke(self) -> None:
        """Ends the sockets (and HTTP connections) whose token a reload removed: closed 4401."""
        for task, authorization in list(self._sockets.items()):
            if task not in self._revoked and self.tokens.revoked(authorization):
                self._revoked.add(task)
                task.cancel("its token was revoked")
        self.http.revoke()

    def count(self) -> int:
        return len(self.open) + self.http.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        agent = (query.get("agent") or [""])[0]
        if scope["type"] == "websocket" and (await receive())["type"] != "websocket.connect":
            return
        try:
            prefix = check_prefix((query.get("prefix") or [DEFAULT_PREFIX])[0])
        except InvalidArgument as exc:
            await refuse(scope, send, 400, dump_json(error_body(grpc.StatusCode.INVALID_ARGUMENT, f"prefix: {exc}")),
                         "application/json")
            return
        if scope["type"] != "websocket":  # ACP's Streamable HTTP (the SDK's createHttpStream)
            await self.http(scope, receive, send, agent=agent, prefix=prefix)
            return
        grant = scope.get(GRANT)  # the route table's gate took the token (uibus.edge.transports.routes)
        try:
            lease = self.quotas.hold("acp_connections", grant.tenant if grant is not None else ANONYMOUS)
        except QuotaExceeded as exc:
            await refuse(scope, send, 429, dump_json(error_body(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))),
                         "application/json")
            return
        task = asyncio.current_task()
        assert task is not None
        self._sockets[task] = header(scope, b"authorization")
        try:
            with lease:
                await self._serve(scope, receive, send, agent, prefix)
        except asyncio.CancelledError:
            if task not in self._revoked:
                raise
            if task.cancelling() == 1:
                task.uncancel()
            with contextlib.suppress(Exception):  # the socket may be gone already
                await send({"type": "websocket.close", "code": REVOKED, "reason": "UNAUTHENTICATED: the token was "
                                                                                 "revoked"})
        finally:
            self._sockets.pop(task, None)
            self._revoked.discard(task)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, agent: str, prefix: str) -> None:
        metadata = tuple((k, v) for k, v in metadata_of(scope) if k != SESSION_KEY)  # each call names its own

        async def write(text: str) -> None:
            try:
                await send({"type": "websocket.send", "text": text})
            except Exception as exc:  # uvicorn raises its own disconnect errors / OSError
                raise SocketGone from exc

        async def frame() -> str | bytes | None:
            """The next message: one text (or binary) frame; None once the socket closed."""
            while True:
                event = await receive()
                kind = event["type"]
                if kind == "websocket.disconnect":
                    return None
                if kind == "websocket.receive":
                    data = event.get("text")
                    return data if data is not None else event.get("bytes") or b""

        await send({"type": "websocket.accept"})
        channel = Channel(self.lookup, metadata, peer_of(scope), self.max_message_bytes, door="acp",
                          client=client_of(scope))
        grant = scope.get(GRANT)
        editor = Editor(Uplink(channel, agent), write, prefix=prefix,
                        identity=Identity(grant is not None, grant.tenant if grant is not None else None))
        self.open.add(editor)
        try:
            await editor.serve(frame)  # the one receive loop (uibus.infra.peer), and the editor's end
        finally:
            self.open.discard(editor)
