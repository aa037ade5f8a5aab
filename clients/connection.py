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
from google.protobuf import json_format, symbol_database
from google.protobuf.descriptor import MethodDescriptor

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

    async def call_json(self, method: str, request_json: str = "{}") -> AsyncIterator[str]:
        """Calls any method uibus serves by name (`scrollToSettings`, `cline.UiService/openUrl`)
        with a JSON request, yielding each response as JSON (one for unary, many for streams)."""
        desc = find_method(method)
        db = symbol_database.Default()
        req_cls = db.GetSymbol(desc.input_type.full_name)
        resp_cls = db.GetSymbol(desc.output_type.full_name)
        request = json_format.Parse(request_json or "{}", req_cls())
        path = f"/{desc.containing_service.full_name}/{desc.name}"
        kw = {"request_serializer": req_cls.SerializeToString, "response_deserializer": resp_cls.FromString}
        if desc.server_streaming:
            call = self.channel.unary_stream(path, **kw)(request)
            async for resp in call:
                yield to_json(resp)
        else:
            yield to_json(await self.channel.unary_unary(path, **kw)(request))


def to_json(message: Any) -> str:
    """One compact JSON line with every field, zero values included: a reader of `uibus publish` or
    `uibus call …/GetStats` sees `{"subscribers": 0}`, not `{}` that looks like a missing reply."""
    import json

    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=False,
                                                always_print_fields_with_no_presence=True),
                      separators=(",", ":"))


# Generated modules whose services `call_json` can reach; missing ones are skipped.
SERVICE_MODULES = (
    "uibus.pb.cline.ui_pb2",
    "uibus.pb.uibus.v1.host_pb2",
    "uibus.pb.uibus.v1.extension_ui_pb2",
    "uibus.pb.uibus.v1.codebolt_pb2",
    "uibus.pb.neuro_san.api.grpc.agent_pb2",
    "uibus.pb.neuro_san.api.grpc.concierge_pb2",
)


def find_method(name: str) -> MethodDescriptor:
    """Finds `Service/Method`, `pkg.Service/Method` or a bare method name among uibus's services."""
    import importlib

    service_name, _, method_name = name.rpartition("/")
    matches = []
    for module_name in SERVICE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for service in module.DESCRIPTOR.services_by_name.values():
            if service_name and service_name not in (service.name, service.full_name):
                continue
            method = service.methods_by_name.get(method_name)
            if method is not None:
                matches.append(method)
    if not matches:
        raise LookupError(f"no uibus method is called {name!r}")
    if len(matches) > 1:
        raise LookupError(f"{name!r} is ambiguous: " + ", ".join(
            f"{m.containing_service.full_name}/{m.name}" for m in matches))
    return matches[0]
