"""Assembly and lifecycle: one process, one event loop, one grpc.aio server and one HTTP server.

`App` owns every resource as a pair of setup and teardown, started in order and undone in
reverse: the store, the bus, the agents, each installer's services, then the servers. A start
that fails half way undoes what it started. Shutdown has two phases:

* `begin_shutdown()`: readiness fails and health turns NOT_SERVING (Watch streams see it), the
  optional drain passes, then new streams and dialogs are refused and the open ones end (every
  stream with status OK, every waiting dialog "shutdown", every CodeBolt wait answered);
* `aclose()`: the servers stop within the grace period, then everything else is closed in
  reverse order of its start, the store last; every teardown runs even when one fails.

Use it as `async with App(config) as app:`.

A worker of `uibus serve --workers N` is an App given its `Worker` (uibus.infra.worker_table): it shares
the gRPC port with the other workers (SO_REUSEPORT) and serves HTTP on the socket its parent bound;
its readiness, and so its health, also requires every other worker to be ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from uibus.agents.config import load_agents
from uibus.agents.limits import tenant_totals
from uibus.app.figures import figures
from uibus.app.installers import INSTALLERS
from uibus.app.page_signin import enter_identity, enter_signin
from uibus.domain.core import Core
from uibus.edge import reflection
from uibus.edge.calls.admission import admission_for
from uibus.edge.metrics import Metrics
from uibus.edge.pipeline import Pipeline
from uibus.edge.transports.http import HttpServer, read_pem, server_tls
from uibus.edge.transports.inprocess import Channel
from uibus.edge.transports.mcp_http import PATH as MCP_PATH
from uibus.edge.transports.routes import Routes
from uibus.edge.wiring import AppKey, Installer, Labelled, Registry, Setup
from uibus.infra import telemetry
from uibus.infra.audit_backends import audit_log_for
from uibus.infra.auth import Tokens
from uibus.infra.bus import Bus
from uibus.infra.config import Config, address, is_loopback, redacted
from uibus.infra.peers import OwnUserOnly
from uibus.infra.peers import available as peers_available
from uibus.infra.sqlite_store import SqliteStore
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks, cancel_and_wait
from uibus.infra.webview import webview_html
from uibus.infra.worker_table import Worker
from uibus.replicas.placement import Placement, placement_for, sharing_for
from uibus.replicas.quota_sharing import quotas_for

log = logging.getLogger("uibus")
HEALTH = "grpc.health.v1.Health"
CUT_S = 1.0  # after the grace: how long the turns cut by shutdown have to send their status
HEALTH_POLL_S = 0.5  # how often readiness is re-read besides store changes (the bus's connection has no event)
T = TypeVar("T")


def open_store(config: Config) -> Store:
    """Redis when a URL is given, else the SQLite file that this uibus alone serves (infra.store_lock)."""
    ttl_s, max_sessions = config.session_ttl_seconds, config.max_sessions
    if config.redis_url:
        from uibus.infra.redis import RedisStore

        return RedisStore(config.redis_url, ttl_s=ttl_s, max_sessions=max_sessions, cluster=config.redis_cluster)
    return SqliteStore(config.store, ttl_s=ttl_s, max_sessions=max_sessions,
                       serving={"grpc": address(config.host, config.port), "http": config.http_port})


def make_bus(config: Config) -> Bus:
    """In-process bus, or with a Redis URL one that spans every replica sharing that Redis."""
    if config.redis_url:
        from uibus.infra.redis import ReplicatedBus

        return ReplicatedBus(config.redis_url, config.queue_size, config.max_streams_per_session,
                             mailbox_bytes=config.mailbox_bytes, mailboxes_bytes=config.mailboxes_bytes,
                             shards=config.bus_shards, cluster=config.redis_cluster)
    return Bus(config.queue_size, config.max_streams_per_session, mailbox_bytes=config.mailbox_bytes,
               mailboxes_bytes=config.mailboxes_bytes)


def keepalive_options(config: Config) -> list[tuple[str, int]]:
    """Server-side HTTP/2 keepalive: a peer that is gone (or frozen) without closing its connection
    stops answering pings, and the connection is closed after the timeout, which ends its streams
    and frees their subscriptions — by default within 30 s, not hours.

    Pings go out only on connections that carry calls (an idle client costs nothing) and without
    data in between (a subscription can be silent for hours). Clients may ping as often as every
    10 s (grpc-js and grpc-go default to much less) without being told "too many pings".
    """
    if config.keepalive_seconds <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_seconds * 1000)),
        # grpc core (1.6x on) closes the transport on an unanswered ping after this, not after the
        # keepalive timeout alone (default one minute): both say how long a silent peer may take.
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ]


class Resources:
    """Teardowns in the order their setups ran. `aclose` undoes them in reverse and runs every one
    even when some fail (as aiohttp's cleanup contexts); the failures are logged and raised together."""

    def __init__(self) -> None:
        self._exits: list[tuple[str, Callable[[], Awaitable[Any]]]] = []

    async def enter(self, name: str, resource: AbstractAsyncContextManager[T]) -> T:
        value = await resource.__aenter__()
        self._exits.append((name, lambda: resource.__aexit__(None, None, None)))
        return value

    def callback(self, name: str, teardown: Callable[[], Awaitable[Any]]) -> None:
        self._exits.append((name, teardown))

    async def aclose(self) -> None:
        """Every teardown runs, in reverse, whatever the ones before it raised — a cancel included
        (as aiohttp's cleanup contexts): a cancelled shutdown still closes the agents, the bus and
        the store. Failures are logged and raised together at the end; a cancel is re-raised after
        the last teardown, ahead of any failure, since it was meant for the caller."""
        errors: list[Exception] = []
        cancelled: BaseException | None = None
        while self._exits:
            name, teardown = self._exits.pop()
            try:
                await teardown()
            except asyncio.CancelledError as exc:
                log.warning("teardown cancelled; the remaining teardowns still run", extra={"fields": {"part": name}})
                cancelled = cancelled or exc
            except Exception as exc:
                log.error("teardown failed", extra={"fields": {"part": name, "error": f"{type(exc).__name__}: {exc}"}})
                errors.append(exc)
            except BaseExceptionGroup as group:  # a part's own group holding a cancel
                cancels, rest = group.split(asyncio.CancelledError)
                if cancels is not None:
                    cancelled = cancelled or asyncio.CancelledError()
                if isinstance(rest, ExceptionGroup):
                    errors.append(rest)
                elif rest is not None:  # KeyboardInterrupt / SystemExit: not ours to hold back
                    raise rest from None
        if cancelled is not None:
            raise cancelled
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("several parts failed to close", errors)


class App:
    def __init__(self, config: Config, *, installers: Sequence[Installer] = INSTALLERS,
                 store: Store | None = None, worker: Worker | None = None) -> None:
        """`installers` are the parts to serve (uibus.app.installers.INSTALLERS by default); a `store`
        given here is used instead of the configured one, and closed with the app. `worker`: this
        app is one worker process of `uibus serve --workers` (see the module docstring)."""
        self.config = config
        self.worker = worker
        self._installers = tuple(installers)
        self._store = store
        self._resources = Resources()
        self.health = HealthServicer()
        self.core: Core | None = None
        self.placement: Placement | None = None  # built with the core (uibus.replicas.placement)
        self.registry: Registry | None = None
        self.metrics: Metrics | None = None
        self.tokens = Tokens()  # the tokens in force once started (see `reload_tokens`)
        self.own_user: OwnUserOnly | None = None  # no tokens on loopback: who may call (uibus.infra.peers)
        self.oidc: Any = None  # the identity provider (--oidc-issuer): its keys, its verifier
        self.service_names: list[str] = []
        self.port = 0  # the bound gRPC port
        self.http_port = 0  # the bound HTTP port (0 = no HTTP server)
        self.mcp_url = ""  # uibus's own MCP endpoint once the HTTP port listens (ACP agents are offered it)
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._setup: Setup | None = None
        self._grace = config.grace_seconds
        self._started = False
        self._stopping = False
        self._shutdown: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._health_watch: asyncio.Task[None] | None = None

    # ---- what a running app offers ------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """True from the moment shutdown begins (readiness probes fail from then on)."""
        return self._stopping

    def _dialog_wait(self, kind: str, outcome: str, seconds: float) -> None:
        """The human wait of a dialog, by kind and outcome, on /metrics (built after the core)."""
        if self.metrics is not None:
            self.metrics.dialog_wait(kind, outcome, seconds)

    def not_ready(self) -> str | None:
        """Why stateful calls would fail now, None when the app is ready: /readyz answers 503 with
        it and gRPC health is NOT_SERVING meanwhile. Liveness (/livez, /healthz) ignores it: a
        restart fixes neither a full disk nor a Redis that is down. A worker is ready only while
        every other worker is too: a probe reaches one of them, for connections that go to all."""
        reason = self._not_ready_here()
        if reason is None and self.worker is not None:
            reason = self.worker.others_not_ready()
        return reason

    def _not_ready_here(self) -> str | None:
        """Why this process alone is not ready (what a worker publishes to the others)."""
        if self._stopping:
            return "shutting down"
        if self.core is None:
            return "starting"
        if self.core.store.problem:
            return self.core.store.problem
        if getattr(self.core.bus, "connected", True) is False:  # a ReplicatedBus that lost Redis
            return "replication unavailable: Redis unreachable"
        return None

    @property
    def bus(self) -> Bus:
        return self._core().bus

    @property
    def store(self) -> Store:
        return self._core().store

    def _core(self) -> Core:
        if self.core is None:
            raise RuntimeError("the app has not started")
        return self.core

    def __getitem__(self, key: AppKey[T]) -> T:
        """What an installer provided under `key` (e.g. uibus.app.installers.CODEBOLT)."""
        if self._setup is None or key not in self._setup.provided:
            raise KeyError(f"{key!r} was not provided by this app's installers")
        return self._setup.provided[key]  # type: ignore[no-any-return]

    def reload_tokens(self) -> bool:
        """Re-reads `--tokens-file` (on SIGHUP): new calls use the new tokens at once; a file that
        cannot be read keeps the old ones (logged). True when the new tokens took effect."""
        return self.tokens.reload()

    def channel(self, metadata: Iterable[tuple[str, str | bytes]] = ()) -> Channel:
        """An in-process channel to this app (see uibus.edge.transports.inprocess)."""
        if self.registry is None:
            raise RuntimeError("the app has not started")
        return Channel(self.registry.lookup, metadata)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Starts every part in order; if one fails, what started is undone and the error raised."""
        if self._started:
            raise RuntimeError("an App starts once")
        self._started = True
        try:
            await self._start()
        except BaseException:
            try:
                await self._resources.aclose()
            except Exception as exc:  # already logged; the start failure is the one to raise
                log.debug("teardown after a failed start also failed", exc_info=exc)
            raise

    async def _start(self) -> None:
        cfg = self.config
        res = self._resources
        # First in, last out: every span of the app's life is exported at exit (in a thread: the
        # SDK's flush blocks). Off unless the OTEL_* environment configures it (uibus.infra.telemetry).
        if telemetry.acquire(None if self.worker is None else self.worker.index):
            res.callback("tracing", lambda: asyncio.to_thread(telemetry.release))
        store = await res.enter("store", self._store or open_store(cfg))
        audit = self.audit = await res.enter("audit log", audit_log_for(store, cfg.audit_retention_days))
        bus = await res.enter("bus", make_bus(cfg))
        agents = await res.enter("agents", load_agents(cfg.agents, protect=cfg.own_paths(),
                                                       workspaces_dir=cfg.workspaces_dir))
        if any(hasattr(b, "launcher") for b in agents.backends.values()):  # hosted agents: their tenants' totals
            tenant_totals(cfg)  # --quota-tenant-memory-mb, --quota-tenant-pids (uibus.agents.limits)
        # Agents' /mcp tokens minted here (never --auth-token), tenants named, their process shares counted.
        tokens = self.tokens = Tokens(cfg.auth_token, cfg.tokens_file, cfg.metrics_token)
        self.oidc = await enter_identity(res.enter, cfg, tokens)  # before `tokens.enabled`
        signin = await enter_signin(res.enter, cfg, store, tokens, self.oidc, getattr(self, "audit", None))  # page
        quotas = self.quotas = await res.enter("quotas", quotas_for(cfg, bus))  # shared on replicas
        # What other replicas must see of this one (shared store entries), when there are replicas.
        core = self.core = Core.build(cfg, bus, store, agents, tokens=tokens, quotas=quotas,
                                      mcp_url=lambda: self.mcp_url, observe_wait=self._dialog_wait,
                                      sharing=sharing_for(bus, store), audit=audit)
        # Where turns, steering calls and answers run: here, or at their agent's or dialog's replica.
        placement = self.placement = placement_for(core, lease_s=cfg.agent_lease_seconds)
        # Closed after the servers stop, before the agents' backends, the bus and the store: every
        # agent process is stopped while what it reports can still be written.
        # The agents' shared states are closed after the agent sessions (their removals are written),
        # the placement's hosting (leases, forwarded turns) before them (uibus.replicas.placement).
        await res.enter("agent state sharing", core.sharing.agent_states())
        await res.enter("agent sessions", core.agent_sessions)
        await res.enter("agent ownership and turn forwarding", placement.hosting())
        # Undone after the servers stop and before the store closes: the last states are written.
        res.callback("session log", self._flush_recent)
        gauges, counters = figures(core, agents, placement, self.not_ready)
        worker = self.worker
        labelled: Labelled = {}
        metrics = self.metrics = Metrics(bus, gauges, counters, labelled=labelled, store=store,
                                         worker=None if worker is None else {
                                             "index": str(worker.index), "pid": str(worker.pid)})
        metrics.registry.register(quotas)  # uibus_quota_refused_total / uibus_quota_in_use, by tenant
        # No token on a loopback bind: its own user's alone, told by the peer socket's uid (uibus.infra.peers).
        own_user = self.own_user = OwnUserOnly(cfg.host) if not tokens.enabled and is_loopback(cfg.host) else None
        if own_user is not None and not peers_available():
            own_user = self.own_user = None  # not Linux: no kernel table of socket owners to ask
            log.warning("this system cannot tell which user a loopback connection is from: every local user can "
                        "call this uibus; pass --auth-token to keep them out")
        pipeline = Pipeline(metrics, tokens, worker.headers if worker is not None else (), quotas, own_user)
        # Fair shares are between tenants: without tokens every caller is the one tenant `anonymous`.
        pipeline.admission = admission_for(cfg.tenant_concurrency * tokens.enabled,
                                           cfg.quota_calls_per_second * tokens.enabled, quotas)
        server = self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # A second server on a taken port must fail, not share it; workers share theirs on purpose
            # (the parent checked that nothing else listens there, and holds the port from the start).
            ("grpc.so_reuseport", 0 if worker is None else 1),
            *keepalive_options(cfg),
        ])
        registry = self.registry = Registry(server, pipeline)
        setup = self._setup = Setup(cfg, core, placement, registry, pipeline, gauges=gauges, counters=counters,
                                    labelled=labelled)
        for install in self._installers:
            await res.enter(getattr(install, "__name__", "installer"), install(setup))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registry)  # type: ignore[arg-type]
        names = [*setup.service_names, HEALTH]
        self.service_names = [*names, *reflection.enable(registry, names)]

        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert:
            # Checked as a pair first: gRPC would take a bad file and fail every handshake instead.
            server_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            client_ca = read_pem(cfg.tls_client_ca, "--tls-client-ca") if cfg.tls_client_ca else None
            creds = grpc.ssl_server_credentials(
                [(read_pem(cfg.tls_key, "--tls-key"), read_pem(cfg.tls_cert, "--tls-cert"))],
                root_certificates=client_ca, require_client_auth=client_ca is not None)  # mTLS with a CA
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if own_user is not None:  # the ports a caller's socket may be connected to (uibus.infra.peers)
            own_user.ports.update(p for p in (self.port, cfg.http_port) if p)
        await server.start()
        res.callback("servers", self._stop_servers)
        if cfg.http_port:
            routes = Routes(registry.lookup, metrics, webview_html, self.not_ready, cfg.max_message_bytes,
                            setup.mounts, tokens=tokens, own_user=own_user, oidc=self.oidc)
            routes.signin = signin
            self._http = HttpServer(routes, cfg, worker.http_socket if worker is not None else None)
            await self._http.start()
            self.http_port = self._http.port
            if own_user is not None:
                own_user.ports.add(self.http_port)
            if MCP_PATH in setup.mounts:  # hosted ACP agents are offered uibus's own MCP server
                host = "127.0.0.1" if cfg.host in ("", "0.0.0.0", "::", "localhost") else cfg.host
                host = f"[{host}]" if ":" in host else host
                scheme = "https" if cfg.tls_cert else "http"
                self.mcp_url = f"{scheme}://{host}:{self.http_port}{MCP_PATH}"
        serving = await self._set_health(self._publish_readiness() is None)
        self._health_watch = asyncio.create_task(self._watch_health(serving), name="uibus-health")
        res.callback("health", self._stop_health_watch)
        if cfg.redis_url and (worker is None or worker.index == 0):
            # A Redis without a password is every local process's (and agent's): said once, once started
            from uibus.infra.redis.conn import warn_if_open

            await warn_if_open(cfg.redis_url)
        log.info("serving", extra={"fields": {
            "grpc": f"{cfg.host}:{self.port}", "http": self.http_port, "tls": bool(cfg.tls_cert),
            "http_tls": bool(cfg.http_tls_cert or cfg.tls_cert), "mtls": bool(cfg.tls_client_ca),
            "store": redacted(cfg.redis_url) or cfg.store, **({} if worker is None else {"pid": worker.pid}),
            **({"tracing": tracing} if (tracing := telemetry.summary()) else {})}})

    async def _set_health(self, serving: bool) -> bool:
        """Sets "" and every service to SERVING or NOT_SERVING; never SERVING once shutdown began
        (HealthServicer also ignores every set after enter_graceful_shutdown)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            if self._stopping:
                break
            await self.health.set(name, status)
        return serving

    async def _watch_health(self, serving: bool) -> None:
        """Keeps gRPC health equal to readiness: woken by the store's health changes, and polled
        for the bus's connection; ends when shutdown begins (which owns health from then on)."""
        changed = asyncio.Event()
        self._core().store.on_change(changed.set)
        while not self._stopping:
            changed.clear()  # before reading: a change while health is being set wakes the next pass
            ready = self._publish_readiness() is None
            if ready != serving:
                serving = await self._set_health(ready)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), HEALTH_POLL_S)

    def _publish_readiness(self) -> str | None:
        """`not_ready()`, after writing this worker's own readiness to the table the workers share (so
        the others' health follows ours within a poll); the same as `not_ready()` outside workers."""
        if self.worker is None:
            return self._not_ready_here()
        here = self._not_ready_here()
        self.worker.mark(here is None)
        return here or self.worker.others_not_ready()

    async def _stop_health_watch(self) -> None:
        task, self._health_watch = self._health_watch, None
        await cancel_and_wait(task)

    async def _flush_recent(self) -> None:
        """Commits the session log's states still held in memory (at most the last write interval's),
        so a page opened after a restart shows them, and stops its writer; bounded, since a failing
        store must not hold up exit."""
        if self.core is None:
            return
        try:
            await asyncio.wait_for(self.core.feed.log.aclose(), self._grace)
        except TimeoutError:
            log.warning("session log not all written before exit", extra={"fields": {"within_s": self._grace}})

    async def _stop_servers(self) -> None:
        """Stops accepting calls, lets running ones finish within the grace period, cancels the rest.
        Hosted agent turns still running at the grace are cut by us first (AgentSessions.cut_turns),
        so their callers hear UNAVAILABLE saying the conversation is kept; gRPC's own cancel of what
        is left comes CUT_S later, once those statuses are sent."""
        stops: list[Awaitable[Any]] = []
        if self._server is not None:
            stops.append(self._server.stop(self._grace + CUT_S))
        if self._http is not None:
            stops.append(self._http.stop())
        cutter = Tasks("turns cut at shutdown")
        cutter.spawn(self._cut_turns_after_grace(), name="cut turns after the grace")
        try:
            await asyncio.gather(*stops)
        finally:
            await cutter.aclose()

    async def _cut_turns_after_grace(self) -> None:
        await asyncio.sleep(self._grace)
        if self.core is not None and (cut := self.core.agent_sessions.cut_turns()):
            log.info("turns cut off by shutdown", extra={"fields": {"turns": cut, "grace_s": self._grace}})

    async def begin_shutdown(self) -> None:
        """Phase one: NOT_SERVING, the drain, then no new work and every open stream ended."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._begin_shutdown())
        await asyncio.shield(self._shutdown)

    async def _begin_shutdown(self) -> None:
        self._stopping = True
        if self.worker is not None:
            self.worker.mark_down()  # the other workers stop reporting SERVING too
        log.info("shutting down", extra={"fields": {
            "grace_s": self._grace, "open_streams": self.core.bus.count() if self.core else 0}})
        await self.health.enter_graceful_shutdown()
        if self.config.drain_seconds > 0:
            await asyncio.sleep(self.config.drain_seconds)
        if self.core is not None:
            self.core.begin_shutdown()
        for hook in self._setup.shutdown_hooks if self._setup is not None else ():
            try:
                hook()
            except Exception as exc:
                log.error("shutdown hook failed", exc_info=exc, extra={"fields": {"hook": repr(hook)}})

    async def aclose(self, grace: float | None = None) -> None:
        """Phase two (after phase one, if it has not run): stop the servers within `grace` seconds
        (default: the config's), then close every part in reverse order. Safe to call twice."""
        if self._closing is None:
            if grace is not None:
                self._grace = grace
            self._closing = asyncio.ensure_future(self._aclose())
        await asyncio.shield(self._closing)

    async def _aclose(self) -> None:
        await self.begin_shutdown()
        await self._resources.aclose()
        log.info("stopped")
