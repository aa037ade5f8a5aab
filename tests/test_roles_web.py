"""The page offers only what a person's role allows (docs/security/roles.md), in real headless
Chromium against a real server: an observer's page shows the session's dialog but no answer buttons,
no input box and no stop; an approver's page shows the buttons and its answer closes the dialog; a
participant sees the buttons of a dialog addressed to them alone; an invite link signs a person into
the session with its role."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import shots, start_app
from tests.test_roles import Calls, team_config
from uibus.app import App
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext

WITHIN = 10_000  # ms


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    app = await start_app(team_config(tmp_path))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def _page(browser: Any, app: App, token: str, session: str = "team-a-1", hash_extra: str = "") -> Any:
    page = await browser.new_page(viewport={"width": 1100, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    await page.goto(f"http://127.0.0.1:{app.http_port}/?session={session}#token={token}{hash_extra}")
    await page.wait_for_selector('#status[data-state="live"]', timeout=WITHIN)
    return page


async def test_an_observer_sees_no_answer_buttons_and_no_input(app: App, browser: Any, tmp_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        calls = Calls(channel)
        assert await calls.create("alice", "team-a-1") == grpc.StatusCode.OK
        confirm = channel.unary_unary("/uibus.v1.ExtensionUiService/Confirm",
                                      request_serializer=ext.ConfirmRequest.SerializeToString,
                                      response_deserializer=ext.DialogResult.FromString)
        md = (("authorization", "Bearer robot"), ("x-uibus-session", "team-a-1"))
        asked = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="Push to main?"), metadata=md))

        observer = await _page(browser, app, "bob")
        await observer.wait_for_selector('body[data-role="observer"]', timeout=WITHIN)
        card = '.dialog[data-kind="confirm"]'
        await observer.wait_for_selector(f'{card}[data-answerable="no"] h3:text("Push to main?")', timeout=WITHIN)
        assert not await observer.is_visible(f"{card} button")  # no answer buttons
        assert not await observer.is_visible("#input") and not await observer.is_visible("#chat")
        assert not await observer.is_visible("#stop") and not await observer.is_visible("#mode")
        await observer.screenshot(path=str(shots(tmp_path) / "roles-observer.png"))

        approver = await _page(browser, app, "dan")
        await approver.wait_for_selector('body[data-role="approver"]', timeout=WITHIN)
        await approver.wait_for_selector(f'{card}[data-answerable="yes"] button:text("Yes")', timeout=WITHIN)
        assert await approver.is_visible("#input")
        await approver.click(f'{card} button:text("Yes")')
        assert (await asyncio.wait_for(asked, 5)).confirmed
        await observer.wait_for_selector(card, state="detached", timeout=WITHIN)  # closed for everyone

        # A participant (by invite): not offered a permission question, but one addressed to them.
        invite = await calls.invite("alice", "team-a-1", "participant")
        part = await _page(browser, app, "cara", "team-b-1", f"&invite={invite.token}")
        await part.wait_for_function("() => new URLSearchParams(location.search).get('session') === 'team-a-1'",
                                     timeout=WITHIN)  # the invite link switched it to the session
        await part.wait_for_selector('body[data-role="participant"]', timeout=WITHIN)
        assert "invite=" not in part.url  # the token leaves the address bar
        assert await part.is_visible("#input") and not await part.is_visible("#stop")
        general = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="Deploy?"), metadata=md))
        mine = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="Which branch?", addressee="person:cara"),
                                             metadata=md))
        await part.wait_for_selector('.dialog[data-answerable="no"] h3:text("Deploy?")', timeout=WITHIN)
        await part.wait_for_selector('.dialog[data-answerable="yes"] h3:text("Which branch?")', timeout=WITHIN)
        await part.click('.dialog[data-answerable="yes"] button:text("No")')
        assert not (await asyncio.wait_for(mine, 5)).confirmed
        assert not general.done()
        general.cancel()
        for page in (observer, approver, part):
            assert page.errors == [], (page.url, page.errors)
            await page.close()
