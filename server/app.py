"""Assembly and lifecycle: one process, one event loop, one grpc.aio server (plus HTTP later).

`App` builds the shared runtime (config, bus, store), installs every service, and owns the one
graceful-shutdown path: health NOT_SERVING → optional drain → end every bus stream → stop the
server within the grace period → close the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from uibus import reflection, topics
from uibus.auth import BearerTokenInterceptor
from uibus.bus import Bus
from uibus.codebolt import service as codebolt_service
from uibus.config import Config
from uibus.pb.cline import ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc
from uibus.services import agent, extension_ui, host, ui, webview
from uibus.services.common import Runtime
from uibus.store import Store, open_store
from uibus.web.metrics import Metrics, instrument
from uibus.web.server import HttpServer, start_http

log = logging.getLogger("uibus")
HEALTH = "grpc.health.v1.Health"



class Registry:
    """Stands in for the grpc.aio server while services install, and remembers their handlers.

    The HTTP side (gRPC-Web, neuro-san HTTP API) dispatches to the very same method handlers
    in-process through `lookup`, so both transports share servicers, validation and behaviour.
    """

    def __init__(self, server: grpc.aio.Server, wrap: Wrap | None = None) -> None:
        self.server = server
        self._wrap = wrap
        self._generic: list[grpc.GenericRpcHandler] = []
        self._methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)
        wrap = self._wrap
        self.server.add_generic_rpc_handlers([_Wrapped(h, wrap) for h in handlers] if wrap else handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler
        wrap = self._wrap
        if wrap:
            handlers = {name: wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
        self.server.add_registered_method_handlers(service, handlers)

    def lookup(self, method: str, metadata: Sequence[tuple[str, str | bytes]] = ()) -> grpc.RpcMethodHandler | None:
        """The handler gRPC would run for `method` (a `/package.Service/Method` path)."""
        handler = self._methods.get(method)
        if handler is not None:
            return handler
        details = _CallDetails(method, tuple(metadata))
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None


Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


class _Wrapped(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are wrapped once per path (then cached), so the
    native server pays the wrapping cost once, not per call. `lookup` sees the unwrapped ones."""

    _CACHE_LIMIT = 4096  # paths are chosen by callers (e.g. unknown agents): keep the cache bounded

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Wrap) -> None:
        self._inner = inner
        self._wrap = wrap
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._cache.get(method)
        if handler is None:
            raw = self._inner.service(details)
            if raw is None:
                return None
            handler = self._wrap(method, raw)
            if len(self._cache) < self._CACHE_LIMIT:
                self._cache[method] = handler
        return handler


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


Installer = Callable[[Registry, Runtime], list[str]]


def _install_ui(server: Registry, rt: Runtime) -> list[str]:
    ui_pb2_grpc.add_UiServiceServicer_to_server(ui.UiService(rt), server)
    host_pb2_grpc.add_HostServiceServicer_to_server(host.HostService(rt), server)
    return [ui_pb2.DESCRIPTOR.services_by_name["UiService"].full_name,
            host_pb2.DESCRIPTOR.services_by_name["HostService"].full_name]


# Each installer adds its servicers and returns the full names it serves (for health/reflection).
INSTALLERS: list[Installer] = [_install_ui, extension_ui.install, agent.install, webview.install,
                               codebolt_service.install]  # CodeBoltService + the /agent-to-app WebSocket


def _make_bus(config: Config) -> Bus:
    """In-process bus, or with a Redis URL one that spans every replica sharing that Redis."""
    if config.redis_url:
        from uibus.redis_bus import ReplicatedBus

        return ReplicatedBus(config.redis_url, config.queue_size, config.max_streams_per_session, topics.POLICIES,
                             presence_kinds=(topics.HOST_REQUEST,))  # openUrl asks "is any host listening?"
    return Bus(config.queue_size, config.max_streams_per_session, topics.POLICIES)


class App:
    def __init__(self, config: Config, store: Store | None = None) -> None:
        self.config = config
        self.bus = _make_bus(config)
        self.store = store or open_store(config.store, config.redis_url)
        self.rt = Runtime(config, self.bus, self.store)
        self.health = HealthServicer()
        self.metrics = Metrics(self.bus, self.rt.gauges)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if config.auth_token:
            interceptors.append(BearerTokenInterceptor(config.auth_token))
        if config.redis_url:  # a networked store can be down: say UNAVAILABLE, not UNKNOWN
            from uibus.unavailable import StoreUnavailableInterceptor

            interceptors.append(StoreUnavailableInterceptor())
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ],
        )
        self.registry = Registry(self.server, wrap=instrument(self.metrics))
        self.service_names: list[str] = []
        for install in INSTALLERS:
            self.service_names += install(self.registry, self.rt)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.registry)  # type: ignore[arg-type]
        self.service_names += reflection.enable(self.registry, [*self.service_names, HEALTH])  # type: ignore[arg-type]
        self.port = 0
        self.http: HttpServer | None = None
        self.http_port = 0  # the bound HTTP port (0 = no HTTP server)
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """True from the moment shutdown starts (readiness probes fail from then on)."""
        return self._stopping

    async def start(self) -> None:
        cfg = self.config
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])  # noqa: ASYNC240
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        await self.server.start()
        await self.bus.start()
        if cfg.http_port:
            self.http = await start_http(self)
            self.http_port = self.http.port
        for name in ["", *self.service_names, HEALTH]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"fields": {"grpc": f"{cfg.host}:{self.port}", "http": self.http_port,
                                              "tls": bool(cfg.tls_cert), "store": cfg.redis_url or cfg.store}})

    async def stop(self, grace: float | None = None) -> None:
        """The graceful-shutdown switch; safe to call more than once."""
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.grace_seconds if grace is None else grace
        log.info("shutting down", extra={"fields": {"grace_s": grace, "open_streams": self.bus.count()}})
        await self.health.enter_graceful_shutdown()
        if self.config.drain_seconds > 0:
            await asyncio.sleep(self.config.drain_seconds)
        self.bus.close()
        for hook in self.rt.on_shutdown:
            hook()
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace), self.http.stop())
        else:
            await self.server.stop(grace)
        await self.bus.stop()
        await self.store.close()
        log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()
