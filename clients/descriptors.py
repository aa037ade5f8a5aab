"""What `uibus call` can call: every service uibus serves, found by name, never from a hand list.

Two sources, in this order:

* the generated modules under `uibus.pb` — all of them, found by walking the package — whose
  import registers their files in protobuf's default descriptor pool: every service the server is
  built from (cline.*, uibus.v1.*, neuro-san's), so a new proto is callable without touching this
  file;
* the server's reflection (what grpcurl reads), for the services a server makes at run time:
  neuro-san's `<agent>.AgentService`, one per configured agent. Its files go into a private pool,
  so what a server says never changes what this process's own messages mean.

A name that matches nothing is a `LookupError` naming the closest methods there are.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from grpc_reflection.v1alpha import reflection_pb2

REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
REFLECTION_TIMEOUT_S = 10.0
MAX_REFLECTED = 256  # services a server's reflection is asked for files of, at most
CLOSE = 5  # close matches an unknown name's error lists


@dataclass(frozen=True)
class Method:
    """One callable method: its path, its message classes, and whether it streams."""

    path: str  # /pkg.Service/Method
    request: type[Message]
    response: type[Message]
    server_streaming: bool
    client_streaming: bool
    pool: Any  # the descriptor pool its messages come from (for Any fields in JSON)


@cache
def local_services() -> tuple[ServiceDescriptor, ...]:
    """Every service of the generated modules (imported here, which registers them)."""
    import uibus.pb as root

    found: dict[str, ServiceDescriptor] = {}
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(info.name)
        for service in module.DESCRIPTOR.services_by_name.values():
            found[service.full_name] = service
    return tuple(sorted(found.values(), key=lambda s: s.full_name))


def split(name: str) -> tuple[str, str]:
    """(service, method) of `pkg.Service/Method`, `Service/Method`, `pkg.Service.Method` (grpcurl's
    form) or a bare `Method` (service "")."""
    name = name.strip().lstrip("/")
    if "/" in name:
        service, _, method = name.rpartition("/")
        return service, method
    service, _, method = name.rpartition(".")
    return service, method


def _matches(services: tuple[ServiceDescriptor, ...] | list[ServiceDescriptor], name: str) -> list[MethodDescriptor]:
    service_name, method_name = split(name)
    found = []
    for service in services:
        if service_name and service_name not in (service.name, service.full_name):
            continue
        method = service.methods_by_name.get(method_name)
        if method is not None:
            found.append(method)
    return found


def _path(method: MethodDescriptor) -> str:
    return f"{method.containing_service.full_name}/{method.name}"


def _method(desc: MethodDescriptor, pool: Any) -> Method:
    return Method(path="/" + _path(desc),
                  request=message_factory.GetMessageClass(desc.input_type),
                  response=message_factory.GetMessageClass(desc.output_type),
                  server_streaming=desc.server_streaming, client_streaming=desc.client_streaming, pool=pool)


def close_matches(name: str, methods: list[MethodDescriptor]) -> list[str]:
    """The methods whose name is nearest `name`, as `pkg.Service/Method`, best first."""
    forms: dict[str, str] = {}
    for m in methods:
        full = _path(m)
        for form in (full, f"{m.containing_service.name}/{m.name}", m.name):
            forms.setdefault(form.lower(), full)
    query = name.strip().lstrip("/").lower()
    picked: list[str] = []
    for form in difflib.get_close_matches(query, list(forms), n=CLOSE * 3, cutoff=0.6):
        if forms[form] not in picked:
            picked.append(forms[form])
    _, method = split(query)
    for form, full in forms.items():  # the method named in another service, or part of a longer name
        if method and method in form.rpartition("/")[2] and full not in picked:
            picked.append(full)
    return picked[:CLOSE]


class Reflected:
    """The services a server's reflection names that this process has no module for."""

    def __init__(self) -> None:
        self.pool = descriptor_pool.DescriptorPool()
        self.services: list[ServiceDescriptor] = []
        self.error = ""  # why the server could not be asked ("" when it was)

    async def load(self, channel: grpc.aio.Channel) -> Reflected:
        known = {s.full_name for s in local_services()}
        call = channel.stream_stream(REFLECTION,
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        try:
            listed = [r async for r in call(iter([reflection_pb2.ServerReflectionRequest(list_services="*")]),
                                            timeout=REFLECTION_TIMEOUT_S)]
            names = [s.name for r in listed for s in r.list_services_response.service if s.name not in known]
            names = names[:MAX_REFLECTED]
            if not names:
                return self
            asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in names]
            files = [r async for r in call(iter(asks), timeout=REFLECTION_TIMEOUT_S)]
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
            return self
        protos: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        for r in files:
            for raw in r.file_descriptor_response.file_descriptor_proto:
                fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
                protos.setdefault(fdp.name, fdp)
        for file_name in protos:
            try:
                self._add(file_name, protos)
            except (KeyError, TypeError, ValueError):
                continue  # a file whose dependencies the server left out, or that clashes: its services stay unknown
        for n in names:
            try:
                self.services.append(self.pool.FindServiceByName(n))
            except KeyError:
                continue  # the server named a service its reflection has no file for
        return self

    def _add(self, name: str, protos: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
        """Adds file `name` after its dependencies (the server's, else this process's own copy)."""
        try:
            self.pool.FindFileByName(name)
            return
        except KeyError:
            pass
        fdp = protos.get(name)
        if fdp is None:
            fdp = descriptor_pb2.FileDescriptorProto()
            descriptor_pool.Default().FindFileByName(name).CopyToProto(fdp)  # KeyError: not ours either
        for dependency in fdp.dependency:
            self._add(dependency, protos)
        self.pool.Add(fdp)


async def find(channel: grpc.aio.Channel, name: str) -> Method:
    """The method `name` names, among uibus's own services, else among those the server's
    reflection names; LookupError (with the nearest names) when none or several match."""
    local = local_services()
    found = _matches(local, name)
    reflected: Reflected | None = None
    if not found:
        reflected = await Reflected().load(channel)
        found = _matches(reflected.services, name)
    if len(found) > 1:
        raise LookupError(f"{name!r} is ambiguous: name its service, one of: " + ", ".join(_path(m) for m in found))
    if found:
        method = found[0]
        pool = reflected.pool if reflected is not None else descriptor_pool.Default()
        return _method(method, pool)
    everything = [m for s in (*local, *(reflected.services if reflected else ())) for m in s.methods]
    near = close_matches(name, everything)
    message = f"no uibus method is called {name!r}"
    if near:
        message += "; close: " + ", ".join(near)
    else:
        services = sorted({m.containing_service.full_name for m in everything})
        message += "; services: " + ", ".join(services)
    if reflected is not None and reflected.error:
        message += f" (the server's reflection could not be asked: {reflected.error})"
    raise LookupError(message)
