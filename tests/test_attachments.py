"""Attachments (ChatMessage.mime_data) reach a hosted agent in its protocol's words: an image as
an ACP `image` content block; what the agent does not take (an ACP agent without embeddedContext,
pi given anything but an image) is refused with a clear answer, and the agent stays usable."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import Agent, request
from tests.hostkit import fixture_and_pi
from tests.pikit import Model, Reply, turn_of
from tests.test_acp_agent import fixture_log
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.neuro_san.api.grpc import mime_data_pb2

pytestmark = [pytest.mark.timeout(90), pytest.mark.node]
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx"
                       "0gAAAABJRU5ErkJggg==")


@pytest.fixture
async def hosted(config: Config, tmp_path: Path) -> AsyncIterator[tuple[App, Model]]:
    async with fixture_and_pi(config, tmp_path) as hosted:
        yield hosted


async def send(conn: Connection, agent: str, text: str, *files: tuple[str, bytes]) -> Any:
    req = request(text)
    req.user_message.mime_data.extend(mime_data_pb2.MimeData(mime_type=m, mime_bytes=b) for m, b in files)
    return [r async for r in Agent(conn, agent).StreamingChat(req)][-1].response


async def test_an_image_reaches_the_acp_agent_as_a_content_block(hosted: tuple[App, Model], tmp_path: Path) -> None:
    app, _ = hosted
    async with Connection(f"127.0.0.1:{app.port}", session="attach") as conn:
        assert (await send(conn, "acp", "look", ("image/png", PNG))).text == "Turn 1: look"
        attached = [e["attached"] for e in fixture_log(tmp_path) if "attached" in e]
        assert attached == [[{"type": "image", "mimeType": "image/png", "bytes": len(base64.b64encode(PNG))}]]
        refused = await send(conn, "acp", "read this", ("text/plain", b"notes"))
        assert refused.text == ("Error from acp: acp takes no attached files (its promptCapabilities.embeddedContext "
                                "is not true); send the message without the text/plain file")
        assert (await turn_of(conn, "acp", "still here"))[-1].response.text == "Turn 2: still here"


async def test_pi_takes_images_only(hosted: tuple[App, Model]) -> None:
    app, model = hosted
    model.script(Reply(text="Fine."))
    async with Connection(f"127.0.0.1:{app.port}", session="attach-pi") as conn:
        refused = await send(conn, "pi", "read this", ("application/pdf", b"%PDF-1.4"))
        assert refused.text == ("Error from pi: pi takes images only, not a application/pdf file; send the "
                                "message without it")
        assert (await turn_of(conn, "pi", "hello"))[-1].response.text == "Fine."
