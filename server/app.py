"""Assembly and lifecycle: one process, one event loop, one grpc.aio server (plus HTTP later).

`App` builds the shared runtime (config, bus, store), installs every service, and owns the one
graceful-shutdown path: health NOT_SERVING → optional drain → end every bus stream → stop the
server within the grace period → close the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from server import reflection, topics
from server.auth import BearerTokenInterceptor
from server.bus import Bus
from server.config import Config
from server.services import host, ui
from server.services.common import Runtime
from server.store import Store, open_store
from uibus_pb.cline import ui_pb2, ui_pb2_grpc
from uibus_pb.uibus.v1 import host_pb2, host_pb2_grpc

log = logging.getLogger("uibus")
HEALTH = "grpc.health.v1.Health"

Installer = Callable[[grpc.aio.Server, Runtime], list[str]]


def _install_ui(server: grpc.aio.Server, rt: Runtime) -> list[str]:
    ui_pb2_grpc.add_UiServiceServicer_to_server(ui.UiService(rt), server)
    host_pb2_grpc.add_HostServiceServicer_to_server(host.HostService(rt), server)
    return [ui_pb2.DESCRIPTOR.services_by_name["UiService"].full_name,
            host_pb2.DESCRIPTOR.services_by_name["HostService"].full_name]


# Each installer adds its servicers and returns the full names it serves (for health/reflection).
INSTALLERS: list[Installer] = [_install_ui]


class App:
    def __init__(self, config: Config, store: Store | None = None) -> None:
        self.config = config
        self.bus = Bus(config.queue_size, config.max_streams_per_session, topics.POLICIES)
        self.store = store or open_store(config.store, config.redis_url)
        self.rt = Runtime(config, self.bus, self.store)
        self.health = HealthServicer()
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ],
        )
        self.service_names: list[str] = []
        for install in INSTALLERS:
            self.service_names += install(self.server, self.rt)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names += reflection.enable(self.server, [*self.service_names, HEALTH])
        self.port = 0
        self._stopping = False

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
        for name in ["", *self.service_names, HEALTH]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"fields": {"grpc": f"{cfg.host}:{self.port}", "tls": bool(cfg.tls_cert),
                                              "store": cfg.redis_url or cfg.store}})

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
        await self.server.stop(grace)
        await self.store.close()
        log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()
