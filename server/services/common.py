"""What every servicer needs: the shared runtime, and the one way to open a bus stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from uibus.bus import Bus, BusClosed, SubscriptionLimit
from uibus.config import Config
from uibus.store import Store


@dataclass
class Runtime:
    """The process-wide parts services share; built once by server.app."""

    config: Config
    bus: Bus
    store: Store
    # Called once when shutdown starts (after health turns NOT_SERVING, with the bus closed), so
    # services with their own long-running calls can end them cleanly within the grace period.
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)
    # ASGI apps that services put on the HTTP port, by path prefix (e.g. the CodeBolt WebSocket).
    http_mounts: dict[str, Any] = field(default_factory=dict)
    # Gauges a service exports on /metrics, read at scrape time: name -> (help text, reader).
    gauges: dict[str, tuple[str, Callable[[], float]]] = field(default_factory=dict)


async def stream_topic(bus: Bus, context: grpc.aio.ServicerContext, session: str, kind: str,
                       target: str = "", first: tuple[Any, ...] = ()) -> AsyncIterator[Any]:
    """Yields `first`, then every event of the topic until the stream ends.

    The subscription is registered here and removed in the `finally` beside it, which runs on
    client cancel, disconnect, deadline and shutdown alike.
    """
    try:
        sub = bus.subscribe(session, kind, target)
    except SubscriptionLimit as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except BusClosed as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    try:
        for item in first:
            yield item
        async for item in sub:
            yield item
    finally:
        bus.unsubscribe(sub)

