"""The page's audit view (web/src/audit.ts) in a real headless Chromium: a person approves an
agent's question on the page, and the page's Audit view lists that approval with the person, the
door (grpc-web) and the question; its filters narrow the list. The view is offered only to those who
may read the session's audit (the owner, an all-sessions token): an approver's page never shows
it and says why."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import shots, start_app
from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

pytestmark = pytest.mark.timeout(60)

TOKENS = {"alice": "alice-page-token-3c9e1a", "bob": "bob-page-token-8d2f4b", "agent": "agent-page-token-51e0aa",
          "admin": "admin-page-token-7b6c5d"}
TOKENS_FILE = f"""\
{TOKENS['alice']}  (team)  day-*  person=alice
{TOKENS['bob']}    (team)  day-*  person=bob  role=approver
{TOKENS['agent']}  (team)  day-*
{TOKENS['admin']}  *
"""
SESSION = "day-1"


@pytest.fixture
async def team(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    path = tmp_path / "tokens"
    path.write_text(TOKENS_FILE)
    app = await start_app(replace(web_config, tokens_file=str(path)))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def _page(browser: Any, app: App, who: str, errors: list[str]) -> Any:
    page = await browser.new_page(viewport={"width": 1280, "height": 800})
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"http://127.0.0.1:{app.http_port}/?session={SESSION}#token={TOKENS[who]}")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
    return page


async def test_an_approval_on_the_page_is_in_its_audit_view(team: App, browser: Any, tmp_path: Path) -> None:
    errors: list[str] = []
    alice = await _page(browser, team, "alice", errors)
    await alice.wait_for_selector("#audit-toggle", state="visible", timeout=5000)  # the owner may read it

    agent_md = (("authorization", f"Bearer {TOKENS['agent']}"), ("x-uibus-session", SESSION))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{team.port}") as ch:
        agent = ext_grpc.ExtensionUiServiceStub(ch)
        asked = asyncio.ensure_future(agent.Confirm(ext.ConfirmRequest(title="Push to main?", message="3 commits"),
                                                    metadata=agent_md))
        await alice.wait_for_selector('.dialog[data-kind="confirm"] h3:text("Push to main?")', timeout=5000)
        await alice.click('.dialog[data-kind="confirm"] button:text("Yes")')
        assert (await asyncio.wait_for(asked, 5)).confirmed is True
        denied = asyncio.ensure_future(agent.Confirm(ext.ConfirmRequest(title="Delete the cache?"), metadata=agent_md))
        await alice.wait_for_selector('.dialog[data-kind="confirm"] h3:text("Delete the cache?")', timeout=5000)
        await alice.click('.dialog[data-kind="confirm"] button:text("No")')
        assert (await asyncio.wait_for(denied, 5)).confirmed is False

    await alice.click("#audit-toggle")
    row = alice.locator('#audit-view tr[data-act="dialog.approve"]')
    await row.wait_for(timeout=5000)
    assert await row.get_attribute("data-who") == "alice"
    assert (await row.locator(".a-door").text_content()) == "grpc-web"
    what = await row.locator(".a-what").text_content() or ""
    assert "Push to main? — 3 commits" in what and "approved" in what, what
    deny = alice.locator('#audit-view tr[data-act="dialog.deny"]')
    assert "Delete the cache?" in (await deny.locator(".a-what").text_content() or "")
    # newest first
    assert await alice.eval_on_selector_all("#audit-view tbody tr", "rows => rows.map(r => r.dataset.act)") == [
        "dialog.deny", "dialog.approve"]
    await alice.screenshot(path=str(shots(tmp_path) / "audit-view.png"))

    # the filters: by act, by person, by time
    await alice.select_option("#audit-act", "dialog.approve")
    await alice.wait_for_function("() => document.querySelectorAll('#audit-view tbody tr').length === 1", timeout=5000)
    await alice.select_option("#audit-act", "")
    await alice.fill("#audit-person", "bob")
    await alice.press("#audit-person", "Enter")
    await alice.wait_for_selector('#audit-note:text("No entries match.")', timeout=5000)
    await alice.fill("#audit-person", "alice")
    await alice.press("#audit-person", "Enter")
    await alice.wait_for_function("() => document.querySelectorAll('#audit-view tbody tr').length === 2", timeout=5000)
    await alice.fill("#audit-since", "2999-01-01T00:00")
    await alice.wait_for_selector('#audit-note:text("No entries match.")', timeout=5000)
    await alice.close()

    # an all-sessions token is offered it too; an approver is not, and the page says why
    admin = await _page(browser, team, "admin", errors)
    await admin.wait_for_selector("#audit-toggle", state="visible", timeout=5000)
    await admin.close()
    bob = await _page(browser, team, "bob", errors)
    await bob.wait_for_selector('#events [data-event="audit hidden"]', timeout=5000)
    assert "not yours to read" in (await bob.locator('#events [data-event="audit hidden"]').text_content() or "")
    assert await bob.locator("#audit-toggle").is_hidden()
    assert await bob.get_attribute("#audit-note", "data-refused") == "PermissionDenied"
    await bob.close()
    assert not errors, errors
