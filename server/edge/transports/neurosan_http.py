"""neuro-san's HTTP API on the HTTP port, served by the same AgentService/ConciergeService handlers.

`GET /api/v1/list`, `GET /api/v1/{agent}/function|connectivity`, `POST /api/v1/{agent}/streaming_chat`
(proto3 JSON in, `application/json-lines` out: one ChatResponse per line, each flushed as the
agent produces it). Requests are dispatched through the handler registry to
`/<agent>.AgentService/<Method>`, exactly the path a neuro-san gRPC client calls, so sessions,
chat context, the Chat → UI mirroring and every policy of the pipeline (token, store outages,
failures, metrics) behave the same over both transports. A body that is not the request in proto3
JSON, or is over the size limit, goes to the handler as `Rejected`, so the pipeline answers it.
Failures are answered with the HTTP status of their gRPC status and `{"error", "code"}`.

`GET /api/v1/docs`, the OpenAPI description of all this (uibus.edge.transports.openapi), is the route
table's (uibus.edge.transports.routes), open without a token like /healthz: it is the same for
everyone and reveals only message schemas.
"""

from __future__ import annotations

import re

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage

from uibus.edge.calls import CallContext, Metadata, Sink, drive
from uibus.edge.transports.asgi import (
    Receive,
    Scope,
    Send,
    error_body,
    http_status,
    read_request,
    respond_json,
    wait_disconnect,
    wrong_method,
)
from uibus.edge.transports.grpcweb import Lookup, client_of, metadata_of, peer_of
from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import dump_json_bytes, load_json
from uibus.infra.proto_check import enum_spellings
from uibus.pb.neuro_san.api.grpc import agent_pb2, concierge_pb2

PREFIX = "/api/v1/"
CONCIERGE_LIST = "/dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService/List"
_AGENT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# (HTTP method, request message type) of each agent endpoint.
_AGENT_ROUTES: dict[str, tuple[str, str, type[ProtoMessage]]] = {
    "function": ("GET", "Function", agent_pb2.FunctionRequest),
    "connectivity": ("GET", "Connectivity", agent_pb2.ConnectivityRequest),
    "streaming_chat": ("POST", "StreamingChat", agent_pb2.ChatRequest),
}


def to_json(message: ProtoMessage) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


def _parse(request_type: type[ProtoMessage], body: bytes) -> ProtoMessage:
    """The request from its proto3 JSON. `load_json` bounds the nesting first, so a deep body is a
    400 that says so rather than whatever the recursion limit breaks on the way."""
    request = request_type()
    if body.strip():
        what = f"the body (a {request_type.__name__} in proto3 JSON)"
        data = load_json(body, what)
        if not isinstance(data, dict):  # ParseDict would take "" (or [] ...) as an empty message
            raise InvalidArgument(f"{what} must be a JSON object, not {type(data).__name__}")
        enum_spellings(data, request_type.DESCRIPTOR, what)
        json_format.ParseDict(data, request)
    return request


class NeuroSanHttp:
    def __init__(self, lookup: Lookup, max_body: int = 4 * 1024 * 1024) -> None:
        self.lookup = lookup
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = scope["path"][len(PREFIX):].split("/")
        method = scope["method"]
        if parts == ["list"]:
            if method != "GET":
                await wrong_method(send, method, scope["path"], "GET")
                return
            rpc_path, request_type = CONCIERGE_LIST, concierge_pb2.ConciergeRequest
            route = f"{PREFIX}list"
        elif len(parts) == 2 and parts[1] in _AGENT_ROUTES:
            agent, endpoint = parts
            verb, rpc, request_type = _AGENT_ROUTES[endpoint]
            if not _AGENT.fullmatch(agent):
                await respond_json(send, 400, {"error": f"agent name {agent[:40]!r} is invalid"})
                return
            if method != verb:
                await wrong_method(send, method, scope["path"], verb)
                return
            rpc_path = f"/{agent}.AgentService/{rpc}"
            route = f"{PREFIX}{{agent}}/{endpoint}"
        else:
            await respond_json(send, 404, {"error": f"no such API endpoint: {scope['path']}"})
            return

        metadata = metadata_of(scope)
        handler = self.lookup(rpc_path, metadata)
        if handler is None:
            await respond_json(send, 404, {"error": "the concierge service is not installed", "code": "UNIMPLEMENTED"})
            return
        request = await read_request(receive, self.max_body,
                                     lambda b: _parse(request_type, b if method == "POST" else b""),
                                     f"body (a {request_type.__name__} in proto3 JSON)")
        if request is None:  # the client went away
            return

        ctx = CallContext(metadata, peer_of(scope), "http", route=route)
        ctx.client = client_of(scope)
        sink: Sink = _Lines(send) if handler.response_streaming else _Json(send)
        await drive(handler, request, ctx, sink, gone=lambda: wait_disconnect(receive))


class _Json:
    """A unary answer: the reply as one JSON body, or the failure at its HTTP status."""

    headers_after = None

    def __init__(self, send: Send) -> None:
        self.send = send
        self.data: bytes | None = None

    @staticmethod
    def encode(message: ProtoMessage) -> bytes:
        return to_json(message).encode()

    async def start(self) -> None:
        pass  # the status line waits for the reply

    async def message(self, data: bytes) -> None:
        self.data = data

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        if code != grpc.StatusCode.OK or self.data is None:
            await respond_json(self.send, http_status(code), error_body(code, details))
            return
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(self.data)).encode())]})
        await self.send({"type": "http.response.body", "body": self.data})


class _Lines:
    """A stream: one JSON line per response, flushed as produced.

    The status line waits for the first message, so a call that fails before replying gets a
    proper HTTP error; a failure after that can only be reported in-band, as a last
    `{"error": …}` line.
    """

    headers_after = None

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    @staticmethod
    def encode(message: ProtoMessage) -> bytes:
        return to_json(message).encode() + b"\n"

    async def start(self) -> None:
        pass  # the status line waits for the first message

    async def message(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json-lines"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        if not self.started:
            if code == grpc.StatusCode.OK:
                await self.send({"type": "http.response.start", "status": 200,
                                 "headers": [(b"content-type", b"application/json-lines")]})
                await self.send({"type": "http.response.body", "body": b""})
            else:
                await respond_json(self.send, http_status(code), error_body(code, details))
            return
        tail = b"" if code == grpc.StatusCode.OK else dump_json_bytes(error_body(code, details)) + b"\n"
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})
