"""A typed asyncio client for uibus: the UI side (cline.UiService) and the host side
(uibus.v1.HostService), with the session and token carried on every call.

Usage::

    async with Connection("localhost:26040", session="s1") as conn:
        await conn.host.SetTheme(host_pb2.TextEvent(text='{"dark": true}'))
        async for msg in conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest()):
            ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import json_format

from uibus.clients import descriptors
from uibus.pb.cline import ui_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2_grpc

SESSION_KEY = "x-uibus-session"


class _Metadata:
    """Adds the session (and bearer token) to every call, unless the call sets its own."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self._metadata:
            if key not in md:
                md.add(key, value)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files an interceptor under the first call type it implements, so one class per type.
class _UnaryUnary(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class Connection:
    """One channel to a uibus server with stubs for each service, bound to one session."""

    def __init__(self, target: str = "localhost:26040", session: str = "default", token: str = "",
                 tls: bool = False) -> None:
        self.target = target
        self.session = session
        metadata = [(SESSION_KEY, session)]
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        md = tuple(metadata)
        interceptors = [cls(md) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
        if tls:
            self.channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(),
                                                   interceptors=interceptors)
        else:
            self.channel = grpc.aio.insecure_channel(target, interceptors=interceptors)
        self.ui = ui_pb2_grpc.UiServiceStub(self.channel)
        self.host = host_pb2_grpc.HostServiceStub(self.channel)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def call_json(self, method: str, request_json: str = "{}",
                        metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[str]:
        """Calls any method uibus serves by name (`scrollToSettings`, `cline.UiService/openUrl`,
        `hello_world.AgentService/StreamingChat`: uibus.clients.descriptors) with a JSON request,
        yielding each response as JSON (one for unary, many for streams); LookupError for a name
        that matches no method (or several), saying the nearest ones."""
        found = await descriptors.find(self.channel, method)
        if found.client_streaming:
            raise LookupError(f"{found.path[1:]} takes a stream of requests; uibus call sends one")
        request = json_format.Parse(request_json or "{}", found.request(), descriptor_pool=found.pool)
        kw = {"request_serializer": found.request.SerializeToString, "response_deserializer": found.response.FromString}
        if found.server_streaming:
            call = self.channel.unary_stream(found.path, **kw)(request, metadata=metadata or None)
            async for resp in call:
                yield to_json(resp)
        else:
            yield to_json(await self.channel.unary_unary(found.path, **kw)(request, metadata=metadata or None))


def to_json(message: Any) -> str:
    """One compact JSON line with every field, zero values included: a reader of `uibus publish` or
    `uibus call …/GetStats` sees `{"subscribers": 0}`, not `{}` that looks like a missing reply."""
    import json

    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=False,
                                                always_print_fields_with_no_presence=True),
                      separators=(",", ":"))

