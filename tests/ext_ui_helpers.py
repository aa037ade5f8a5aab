"""Helpers shared by the extension-UI tests: stubs on a Connection's channel and UI streams."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import wait_for
from tests.support import ext
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb


async def open_uis(app: App, conn: Connection, n: int, session: str = "default") -> list[Any]:
    """Opens `n` UI streams and waits until the server has subscribed every one."""
    before = app.bus.count(kinds.EXTENSION_UI, session)
    streams = [ext(conn).Subscribe(pb.SubscribeRequest()) for _ in range(n)]
    await wait_for(lambda: app.bus.count(kinds.EXTENSION_UI, session) == before + n, what="UI subscriptions")
    return streams


async def read(stream: Any, timeout: float = 2.0) -> pb.ExtensionUiEvent:
    return await asyncio.wait_for(stream.read(), timeout)
