"""neuro-san's HTTP API on the HTTP port, served by the same AgentService/ConciergeService handlers.

`GET /api/v1/list`, `GET /api/v1/{agent}/function|connectivity`, `POST /api/v1/{agent}/streaming_chat`
(proto3 JSON in, `application/json-lines` out: one ChatResponse per line, each flushed as the
agent produces it). Requests are dispatched through the handler registry to
`/<agent>.AgentService/<Method>`, exactly the path a neuro-san gRPC client calls, so sessions,
chat context and the Chat → UI mirroring behave the same over both transports.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage

from uibus.pb.neuro_san.api.grpc import agent_pb2, concierge_pb2
from uibus.web.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    bearer_ok,
    read_body,
    respond_json,
    until_disconnect,
)
from uibus.web.context import HttpServicerContext
from uibus.web.grpcweb import Lookup, Observe, metadata_of, peer_of
from uibus.web.invoke import responses

PREFIX = "/api/v1/"
CONCIERGE_LIST = "/dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService/List"
_AGENT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNIMPLEMENTED: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# (HTTP method, request message type) of each agent endpoint.
_AGENT_ROUTES: dict[str, tuple[str, str, type[ProtoMessage]]] = {
    "function": ("GET", "Function", agent_pb2.FunctionRequest),
    "connectivity": ("GET", "Connectivity", agent_pb2.ConnectivityRequest),
    "streaming_chat": ("POST", "StreamingChat", agent_pb2.ChatRequest),
}


def to_json(message: ProtoMessage) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


def _error(code: grpc.StatusCode, details: str) -> dict[str, Any]:
    return {"error": details or code.name, "code": code.name}


class NeuroSanHttp:
    def __init__(self, lookup: Lookup, auth_token: str = "", max_body: int = 4 * 1024 * 1024,
                 observe: Observe | None = None) -> None:
        self.lookup = lookup
        self.auth_token = auth_token
        self.max_body = max_body
        self.observe: Callable[[str, str, float, str], None] = observe or (lambda *_: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = scope["path"][len(PREFIX):].split("/")
        method = scope["method"]
        if parts == ["list"]:
            if method != "GET":
                await respond_json(send, 405, {"error": "use GET /api/v1/list"})
                return
            rpc_path, request_type = CONCIERGE_LIST, concierge_pb2.ConciergeRequest
        elif len(parts) == 2 and parts[1] in _AGENT_ROUTES:
            agent, endpoint = parts
            verb, rpc, request_type = _AGENT_ROUTES[endpoint]
            if not _AGENT.fullmatch(agent):
                await respond_json(send, 400, {"error": f"agent name {agent[:40]!r} is invalid"})
                return
            if method != verb:
                await respond_json(send, 405, {"error": f"use {verb} {scope['path']}"})
                return
            rpc_path = f"/{agent}.AgentService/{rpc}"
        else:
            await respond_json(send, 404, {"error": f"no such API endpoint: {scope['path']}"})
            return

        metadata = metadata_of(scope)
        if self.auth_token and not bearer_ok(self.auth_token, dict(metadata).get("authorization")):
            await respond_json(send, 401, {"error": "missing or wrong bearer token (`authorization: Bearer <token>`)"})
            return
        handler = self.lookup(rpc_path, metadata)
        if handler is None:
            what = "the concierge service is not installed" if rpc_path == CONCIERGE_LIST else \
                f"no agent named {parts[0]!r}"
            await respond_json(send, 404, {"error": what})
            return
        request = request_type()
        try:
            body = await read_body(receive, self.max_body)
            if method == "POST" and body.strip():
                json_format.Parse(body, request)
        except ClientGone:
            return
        except BodyTooLarge as exc:
            await respond_json(send, 413, {"error": str(exc)})
            return
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            await respond_json(send, 400, {"error": f"request body is not a valid {request_type.__name__} "
                                                    f"in proto3 JSON: {exc}"})
            return

        ctx = HttpServicerContext(metadata, peer_of(scope))
        started = time.perf_counter()
        if handler.response_streaming:
            abandoned = await until_disconnect(self._stream(handler, request, ctx, send), receive)
        else:
            abandoned = await until_disconnect(self._unary(handler, request, ctx, send), receive)
        ctx.finish(cancelled=abandoned)
        code = grpc.StatusCode.CANCELLED if abandoned else ctx.status()[0]
        self.observe(rpc_path, code.name, time.perf_counter() - started, "http")

    async def _unary(self, handler: grpc.RpcMethodHandler, request: Any, ctx: HttpServicerContext,
                     send: Send) -> None:
        reply = None
        async with contextlib.aclosing(responses(handler, request, ctx)) as stream:
            async for message in stream:
                reply = message
        code, details = ctx.status()
        if code != grpc.StatusCode.OK or reply is None:
            await respond_json(send, _HTTP_STATUS.get(code, 500), _error(code, details))
            return
        data = to_json(reply).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _stream(self, handler: grpc.RpcMethodHandler, request: Any, ctx: HttpServicerContext,
                      send: Send) -> None:
        """One JSON line per response, flushed as produced.

        The status line waits for the first message, so a call that fails before replying gets a
        proper HTTP error; a failure after that can only be reported in-band, as a last
        `{"error": …}` line.
        """
        started = False
        async with contextlib.aclosing(responses(handler, request, ctx)) as stream:
            async for message in stream:
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"application/json-lines"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]})
                await send({"type": "http.response.body", "body": to_json(message).encode() + b"\n",
                            "more_body": True})
        code, details = ctx.status()
        if not started:
            if code == grpc.StatusCode.OK:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json-lines")]})
                await send({"type": "http.response.body", "body": b""})
            else:
                await respond_json(send, _HTTP_STATUS.get(code, 500), _error(code, details))
            return
        tail = b"" if code == grpc.StatusCode.OK else json.dumps(_error(code, details)).encode() + b"\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})
