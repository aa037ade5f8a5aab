"""Helpers shared by the extension-UI tests: stubs on a Connection's channel and UI streams."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import wait_for
from uibus import topics
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc
from uibus.services.ext_ui_dialogs import PendingDialogs


def ext(conn: Connection) -> extension_ui_pb2_grpc.ExtensionUiServiceStub:
    """The ExtensionUiService stub on `conn`'s channel (which carries the session metadata)."""
    return extension_ui_pb2_grpc.ExtensionUiServiceStub(conn.channel)


def dialogs_of(app: App) -> PendingDialogs:
    """The running service's pending-dialog registry (found through its shutdown hook)."""
    for hook in app.rt.on_shutdown:
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, PendingDialogs):
            return owner
    raise AssertionError("ExtensionUiService is not installed")


async def open_uis(app: App, conn: Connection, n: int, session: str = "default") -> list[Any]:
    """Opens `n` UI streams and waits until the server has subscribed every one."""
    before = app.bus.count(topics.EXTENSION_UI, session)
    streams = [ext(conn).Subscribe(pb.SubscribeRequest()) for _ in range(n)]
    await wait_for(lambda: app.bus.count(topics.EXTENSION_UI, session) == before + n, what="UI subscriptions")
    return streams


async def read(stream: Any, timeout: float = 2.0) -> pb.ExtensionUiEvent:
    return await asyncio.wait_for(stream.read(), timeout)
