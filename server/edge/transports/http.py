"""Runs the HTTP port's ASGI app with uvicorn as a task on the running loop (the grpc.aio server's
loop), as an async context manager: entering binds the port, leaving stops it within the grace.

The port is exposed to whoever can reach it, so every connection is bounded, not just requests:

* TLS (HTTPS/WSS) whenever a certificate is configured, and with `--tls-client-ca` a client
  certificate signed by that CA is required (the gRPC port does the same, see uibus.app);
* a request's headers must be complete within `--http-header-timeout-seconds` of the connection
  (or of the first byte of a later request on a kept-alive one): uvicorn's h11 protocol has no such
  timer, so a silent or slow (slowloris) client held its connection forever;
* an idle kept-alive connection closes after `--http-idle-seconds` (uvicorn's keep-alive timer);
* at most `--http-max-connections` are open (WebSockets and streams included); one more is
  answered 503 and closed at once, so a flood cannot starve the loop or the file descriptors;
* WebSockets are pinged (`--ws-ping-seconds`), and closed when a ping goes unanswered.

With `uibus serve --workers N` the parent binds the HTTP port once and every worker serves on
that one listening socket (`HttpServer(..., sock=)`), as uvicorn's own `--workers` does, rather
than each binding it with SO_REUSEPORT: port 0 gets one real port for all of them, a taken port
fails once in the parent, no other process of the same user can join the port, and a worker that
stops (or dies) leaves no connections queued on a listener of its own — the others keep
accepting from the shared queue. (gRPC cannot take a socket, so its port uses SO_REUSEPORT.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Generator
from dataclasses import dataclass
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from uibus.edge.transports.asgi import ASGIApp, Message, Receive, Scope, Send, respond
from uibus.edge.transports.browser import BrowserPolicy
from uibus.edge.transports.routes import Routes, build
from uibus.infra.config import Config, address
from uibus.infra.errors import ConfigError
from uibus.infra.logs import Throttle

log = logging.getLogger("uibus.web")

_REFUSED_BODY = b"too many open connections\n"
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def read_pem(path: str, flag: str) -> bytes:
    """A PEM file's bytes. One that cannot be read is a ConfigError naming the flag that set it,
    which `uibus serve` prints as one line, rather than an OSError deep inside a server start."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path}: {exc.strerror or exc}") from None


def server_tls(cert: str, key: str, client_ca: str = "", cert_flag: str = "--tls-cert",
               key_flag: str = "--tls-key") -> ssl.SSLContext:
    """The server side of TLS for `cert`/`key`; with `client_ca`, clients must present a certificate
    that CA signed (mTLS). Built here rather than by uvicorn so that every bad file is a ConfigError
    naming its flag (uvicorn would fail later, inside the server task, without saying which)."""
    read_pem(cert, cert_flag)
    read_pem(key, key_flag)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(cert_flag, f"{cert} and {key_flag} {key} are not a PEM certificate chain and its "
                                     f"private key: {exc.reason or exc}") from None
    if client_ca:
        read_pem(client_ca, "--tls-client-ca")
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as exc:
            raise ConfigError("--tls-client-ca", f"{client_ca} is not a PEM CA bundle: {exc.reason or exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["http/1.1"])
    return context


def body_deadline(app: ASGIApp, seconds: float) -> ASGIApp:
    """`app` with a deadline on every HTTP request's body (--http-body-timeout-seconds): the body
    must have arrived whole within `seconds` of the request. Past it the app reads a disconnect (every
    door treats that as the client gone) and the client gets 408, so a body sent a byte at a time
    (slowloris) holds a connection no longer than this. One place for every route, as the header
    timeout is; what comes after the body (a stream's wait for the client to go) is not bounded."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        whole = timed_out = started = False

        async def receive_body() -> Message:
            nonlocal whole, timed_out
            if whole or timed_out:
                return await receive() if whole else {"type": "http.disconnect"}
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await app(scope, receive_body, sending)
        if timed_out and not started:
            await respond(send, 408, f"the request body did not arrive within {seconds:g} s "
                                     "(--http-body-timeout-seconds)\n", headers=[(b"connection", b"close")])

    return guarded


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds one HTTP connection (see the module docstring)."""

    header_timeout: float
    max_connections: int


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol plus the header timeout and the connection cap, hooked in at the
    smallest points: the connection's start, each chunk of data, and its end.

    The header timer runs while h11 waits for a request (`their_state` IDLE): armed when the
    connection is made or the first byte of a later request arrives, cancelled once h11 has read a
    request's headers (a request, or a WebSocket upgrade, is under way). uvicorn's own keep-alive
    timer only starts after a response, so a connection that never sends a byte had no bound at all.
    The cap counts uvicorn's shared `connections` set, which holds WebSockets too.
    """

    limits: ClassVar[Limits]
    _header_timer: asyncio.TimerHandle | None = None
    _refusal_log: ClassVar[Throttle] = Throttle(burst=1, window_s=10.0)  # a flood must not flood the log

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of a later request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # headers complete (or the request failed and the connection is closing)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request came: say why it is dropped
            self.transport.write(_TIMED_OUT)
        self.transport.close()

    def _refuse(self) -> None:
        skipped = self._refusal_log.allow()
        if skipped is not None:
            fields: dict[str, object] = {"reason": "too many open connections", "limit": self.limits.max_connections}
            if skipped:
                fields["not_logged_before"] = skipped
            log.warning("HTTP connection refused", extra={"fields": fields})
        self.transport.write(_REFUSED)
        self.transport.close()


def _protocol(limits: Limits) -> type[H11Protocol]:
    """A protocol class bound to `limits` (uvicorn builds protocols from a class and its own config)."""

    class Protocol(_GuardedH11):
        pass

    Protocol.limits = limits
    return Protocol


class _RefusedUpgradeNoise(logging.Filter):
    """Drops uvicorn's "ASGI callable returned without completing handshake." error, which it logs
    (at ERROR) for every WebSocket upgrade answered with an HTTP response instead of an accept: its
    sans-io protocol never marks that response as the handshake's end. uibus refuses upgrades that
    way on purpose (a wrong path, token, Host or Origin), so the line only ever says "refused", and a
    browser page retrying a refused socket in a loop must not fill the log with errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


logging.getLogger("uvicorn.error").addFilter(_RefusedUpgradeNoise())


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tls_timeout: float) -> None:
        super().__init__(config)
        self.tls_timeout = tls_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The process's signal handling belongs to `uibus serve` (graceful gRPC + HTTP stop);
        # uvicorn must not install its own handlers or re-raise signals afterwards.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Binds as uvicorn does for a host and port (lifespan is off), or serves on the one listening
        socket given (a worker's, see the module docstring), with two differences: a bind failure is
        an OSError naming the port, where uvicorn logs it and calls sys.exit; and the TLS handshake
        and shutdown are bounded by the header timeout, where asyncio allows 60 and 30 s (the
        protocol, and so its header timer, only starts once the handshake is done)."""
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop)

        tls: dict[str, float] = {}
        if config.ssl is not None:
            tls = {"ssl_handshake_timeout": self.tls_timeout, "ssl_shutdown_timeout": self.tls_timeout}
        where = {"sock": sockets[0]} if sockets else {"host": config.host, "port": config.port}
        try:
            server = await asyncio.get_running_loop().create_server(
                create_protocol, **where, ssl=config.ssl, backlog=config.backlog, **tls)  # type: ignore[arg-type]
        except OSError as exc:  # the whole message is the one line `uibus serve` prints (exit 1)
            why = os.strerror(exc.errno).lower() if exc.errno else str(exc)  # asyncio's strerror repeats the address
            raise OSError(f"--http-port: cannot listen on {address(config.host, config.port)}: {why}") from None
        self.servers = [server]
        self.started = True


class HttpServer:
    def __init__(self, routes: Routes, config: Config, sock: socket.socket | None = None) -> None:
        """Serves `routes` on `config.http_port` (or on `sock`, a listening socket, when given), with
        TLS when `--http-tls-cert` or `--tls-cert` is set (a bad certificate file is a ConfigError
        from here, before anything is bound)."""
        self._sock = sock
        # Other parts that live on the HTTP port add themselves to `routes.mounts`, each served by the
        # route its path has in the one route table (uibus.edge.transports.routes.TABLE).
        self.routes = routes
        self.policy = BrowserPolicy.from_config(config)
        frames = f"frame-ancestors {self.policy.frame_ancestors()}".encode()
        routes.page_headers = [(b"content-security-policy", frames), (b"x-content-type-options", b"nosniff")]
        app: ASGIApp = body_deadline(build(routes, self.policy), config.http_body_timeout_seconds)
        if config.http_tls_cert:
            tls = server_tls(config.http_tls_cert, config.http_tls_key, config.tls_client_ca, "--http-tls-cert",
                             "--http-tls-key")
        elif config.tls_cert:
            tls = server_tls(config.tls_cert, config.tls_key, config.tls_client_ca)
        else:
            tls = None
        ping = config.ws_ping_seconds or None  # 0 turns pings off
        limits = Limits(config.http_header_timeout_seconds, config.http_max_connections)
        uv_config = uvicorn.Config(
            app, host=config.host, port=config.http_port, http=_protocol(limits), ws="websockets-sansio",
            lifespan="off", log_config=None, access_log=False, log_level="warning", server_header=False,
            # Both are typed int but only ever handed to call_later/wait_for: fractions work.
            timeout_graceful_shutdown=max(config.grace_seconds, 0.1), timeout_keep_alive=config.http_idle_seconds,
            ws_ping_interval=ping, ws_ping_timeout=config.ws_ping_timeout_seconds if ping else None,
            ssl_context_factory=None if tls is None else lambda _config, _default: tls)
        self.server = _EmbeddedServer(uv_config, config.http_header_timeout_seconds)
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
            await self.server.serve([self._sock] if self._sock is not None else None)
        except SystemExit as exc:  # uvicorn exits the process on a start-up failure it only logs
            raise OSError(f"the HTTP server on port {self.server.config.port} could not start") from exc

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
        # The server task ends by itself now; only a cancel of our caller may cut the wait short
        # (and propagates). An OSError it ended with was reported when it happened.
        await asyncio.wait((self._task,))
        if not self._task.cancelled() and not isinstance(self._task.exception(), OSError | None):
            self._task.result()

