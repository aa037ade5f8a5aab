"""What installers wire into an app: the handler registry, HTTP mounts, gauges, shutdown hooks.

An installer is an async context manager factory taking a `Setup`: it registers its services
(through the registry, so every handler passes the pipeline), mounts what it serves on the HTTP
port, and yields while the app runs; whatever follows its `yield` is its teardown, run in
reverse order of installation when the app closes (or when a later start-up step fails).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from uibus.domain.core import Core
from uibus.edge.pipeline import Pipeline
from uibus.infra.config import Config
from uibus.replicas.placement import Placement

T = TypeVar("T")
Gauges = dict[str, tuple[str, Callable[[], float]]]
# Counters with one label: name -> (help, label name, read() -> {label value: count}).
Labelled = dict[str, tuple[str, str, Callable[[], Mapping[str, float]]]]


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class _Wrapped(grpc.GenericRpcHandler):
    """A generic handler whose method handlers pass the pipeline, wrapped once per path (then
    cached, so the native server pays for wrapping once, not per call)."""

    _CACHE_LIMIT = 4096  # paths are chosen by callers (e.g. unknown agents): keep the cache bounded

    def __init__(self, inner: grpc.GenericRpcHandler, pipeline: Pipeline) -> None:
        self._inner = inner
        self._pipeline = pipeline
        # A generic handler may name its paths for metrics (e.g. every unknown agent as one label).
        self._label: Callable[[str], str] = getattr(inner, "label", lambda method: method)
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._cache.get(method)
        if handler is None:
            raw = self._inner.service(details)
            if raw is None:
                return None
            handler = self._pipeline.wrap(method, raw, self._label(method))
            if len(self._cache) < self._CACHE_LIMIT:
                self._cache[method] = handler
        return handler


class Registry:
    """Every method uibus serves, by path, each handler wrapped once by the pipeline.

    It offers grpc's registration API, so generated `add_XServicer_to_server(servicer, registry)`
    works, and hands the same wrapped handlers to the grpc.aio server and, through `lookup`, to
    the transports that dispatch by path (gRPC-Web, the neuro-san HTTP API, in-process channels).
    """

    def __init__(self, server: grpc.aio.Server, pipeline: Pipeline) -> None:
        self._server = server
        self.pipeline = pipeline
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[_Wrapped] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        wrapped = [_Wrapped(h, self.pipeline) for h in handlers]
        self._generic.extend(wrapped)
        self._server.add_generic_rpc_handlers(wrapped)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: self.pipeline.wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
        for name, handler in wrapped.items():
            self._methods[f"/{service}/{name}"] = handler
        self._server.add_registered_method_handlers(service, wrapped)

    def lookup(self, method: str, metadata: Sequence[tuple[str, str | bytes]] = ()) -> grpc.RpcMethodHandler | None:
        """The (wrapped) handler gRPC would run for `method`, a `/package.Service/Method` path."""
        handler = self._methods.get(method)
        if handler is not None:
            return handler
        details = _CallDetails(method, tuple(metadata))
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None


class AppKey(Generic[T]):
    """A typed name for something an installer provides (`app[key]`), as aiohttp's AppKey."""

    def __init__(self, name: str, kind: type[T]) -> None:
        self.name = name
        self.kind = kind

    def __repr__(self) -> str:
        return f"AppKey({self.name!r}, {self.kind.__name__})"


@dataclass
class Setup:
    """What one app's installers share while it starts."""

    config: Config
    core: Core
    placement: Placement  # where turns, steering calls and answers run (the services ask it)
    registry: Registry
    pipeline: Pipeline
    mounts: dict[str, Any] = field(default_factory=dict)  # ASGI apps on the HTTP port, by path prefix
    gauges: Gauges = field(default_factory=dict)
    counters: Gauges = field(default_factory=dict)
    labelled: Labelled = field(default_factory=dict)
    shutdown_hooks: list[Callable[[], None]] = field(default_factory=list)
    service_names: list[str] = field(default_factory=list)
    provided: dict[AppKey[Any], Any] = field(default_factory=dict)

    def serve(self, *names: str) -> None:
        """Names services for health checks and reflection."""
        self.service_names.extend(names)

    def mount(self, prefix: str, app: Any) -> None:
        """Serves the ASGI `app` at `prefix` (and below it) on the HTTP port."""
        self.mounts[prefix] = app

    def gauge(self, name: str, help_: str, read: Callable[[], float]) -> None:
        """A gauge on /metrics, read at scrape time."""
        self.gauges[name] = (help_, read)

    def counter(self, name: str, help_: str, read: Callable[[], float]) -> None:
        """A counter on /metrics (`name` ends in `_total`), read at scrape time from a plain int the
        owner increments: nothing runs per event."""
        self.counters[name] = (help_, read)

    def labelled_counter(self, name: str, help_: str, label: str, read: Callable[[], Mapping[str, float]]) -> None:
        """A counter with one label on /metrics, read at scrape time from plain ints the owner keeps
        (the owner bounds the label's values)."""
        self.labelled[name] = (help_, label, read)

    def on_shutdown(self, hook: Callable[[], None]) -> None:
        """Runs `hook` when shutdown begins (health NOT_SERVING, after the drain), so long calls
        can end cleanly within the grace period."""
        self.shutdown_hooks.append(hook)

    def provide(self, key: AppKey[T], value: T) -> None:
        self.provided[key] = value


Installer = Callable[[Setup], AbstractAsyncContextManager[Any]]
