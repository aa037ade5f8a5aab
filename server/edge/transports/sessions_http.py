"""The sessions API (uibus.v1.SessionService) on the HTTP API, beside neuro-san's endpoints:

* `GET  /api/v1/sessions[?prefix=…]` — ListSessions, one JSON object;
* `GET  /api/v1/sessions/watch[?prefix=…]` — WatchSessions, `application/json-lines`;
* `POST /api/v1/sessions/{CreateSession|DeleteSession|StopTurn|SetMode|SetModel|NewConversation|
  GetWorkspaceDiff|ExportWorkspace}`
  — the request in proto3 JSON (empty body: the empty request), on the session named by the
  `x-uibus-session` header, as every uibus call.

Each is dispatched through the handler registry to `/uibus.v1.SessionService/<Method>` and run by
the one call driver, so the token, the tenant's sessions, errors and metrics are the pipeline's,
exactly as over gRPC; failures answer with the HTTP status of their gRPC status and
`{"error", "code"}` (the same framing as neuro-san's endpoints, uibus.edge.transports.neurosan_http).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from google.protobuf.message import Message as ProtoMessage

from uibus.edge.calls import CallContext, Sink, drive
from uibus.edge.transports.asgi import (
    Receive,
    Scope,
    Send,
    read_request,
    refuse,
    respond_json,
    wait_disconnect,
    wrong_method,
)
from uibus.edge.transports.grpcweb import Lookup, client_of, metadata_of, peer_of
from uibus.edge.transports.neurosan_http import _Json, _Lines, _parse
from uibus.infra.json_input import dump_json
from uibus.pb.uibus.v1 import sessions_pb2 as pb

PATH = "/api/v1/sessions"
SERVICE = "/uibus.v1.SessionService/"
_POSTS: dict[str, type[ProtoMessage]] = {
    "CreateSession": pb.CreateSessionRequest, "DeleteSession": pb.DeleteSessionRequest,
    "StopTurn": pb.AgentRequest, "SetMode": pb.SetModeRequest, "SetModel": pb.SetModelRequest,
    "NewConversation": pb.AgentRequest, "GetWorkspaceDiff": pb.AgentRequest,
    "ExportWorkspace": pb.ExportWorkspaceRequest,
}


class SessionsHttp:
    def __init__(self, lookup: Lookup, max_body: int = 4 * 1024 * 1024) -> None:
        self.lookup = lookup
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # an upgrade is refused as one (an HTTP answer to it would be a 500)
            await refuse(scope, send, 404, dump_json({"error": f"no WebSocket endpoint at {scope['path']}"}),
                         "application/json")
            return
        rest = scope["path"][len(PATH):].strip("/")
        method = scope["method"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        request: Any
        if rest in ("", "watch"):
            if method not in ("GET", "HEAD"):
                await wrong_method(send, method, scope["path"], "GET")
                return
            rpc = "WatchSessions" if rest else "ListSessions"
            listing = pb.ListSessionsRequest(prefix=(query.get("prefix") or [""])[0])
        elif rest in _POSTS:
            if method != "POST":
                await wrong_method(send, method, scope["path"], "POST")
                return
            rpc = rest
        else:
            await respond_json(send, 404, {"error": f"no such sessions endpoint: {scope['path']} (GET {PATH}, "
                                                    f"GET {PATH}/watch, POST {PATH}/{{{'|'.join(_POSTS)}}})"})
            return
        metadata = metadata_of(scope)
        handler = self.lookup(SERVICE + rpc, metadata)
        if handler is None:
            await respond_json(send, 404, {"error": "the sessions API is not installed", "code": "UNIMPLEMENTED"})
            return
        kind = _POSTS.get(rpc)
        if kind is None:  # a GET: its request is in the query string (a body is read and dropped)
            request = await read_request(receive, self.max_body, lambda _body: listing)
        else:
            request = await read_request(receive, self.max_body, lambda body: _parse(kind, body),
                                         f"body (a {kind.__name__} in proto3 JSON)")
        if request is None:  # the client went away
            return
        ctx = CallContext(metadata, peer_of(scope), "http")
        ctx.client = client_of(scope)
        sink: Sink = _Lines(send) if handler.response_streaming else _Json(send)
        await drive(handler, request, ctx, sink, gone=lambda: wait_disconnect(receive))
