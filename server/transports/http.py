"""Runs the HTTP port's ASGI app with uvicorn as a task on the running loop (the grpc.aio server's
loop), as an async context manager: entering binds the port, leaving stops it within the grace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator

import uvicorn

from uibus.transports.asgi import ASGIApp
from uibus.transports.routes import Routes, build

log = logging.getLogger("uibus.web")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The process's signal handling belongs to `uibus serve` (graceful gRPC + HTTP stop);
        # uvicorn must not install its own handlers or re-raise signals afterwards.
        yield


class HttpServer:
    def __init__(self, routes: Routes, cors_origins: str, host: str, port: int, grace: float) -> None:
        # Other parts that live on the HTTP port add themselves to `routes.mounts`.
        self.routes = routes
        app: ASGIApp = build(routes, cors_origins)
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_config=None, access_log=False,
                                log_level="warning", timeout_graceful_shutdown=max(grace, 0.1),
                                server_header=False)
        self.server = _EmbeddedServer(config)
        self.port = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Returns once the port is bound; raises OSError when it cannot be."""
        self._task = asyncio.ensure_future(self._serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # re-raises the bind failure
                raise OSError(f"HTTP server did not start on port {self.server.config.port}")
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    async def _serve(self) -> None:
        try:
            await self.server.serve()
        except SystemExit as exc:  # uvicorn exits the process when the port is taken
            raise OSError(f"cannot bind HTTP port {self.server.config.port} (is it in use?)") from exc

    async def __aenter__(self) -> HttpServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stops accepting, lets open responses finish within the grace period, then cancels them."""
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await self._task

