"""The page as the control room, in headless Chromium at a desktop and a 390×844 phone viewport,
against the real ACP fixture agent: the session list with live status, switching without a
reload, a dialog in a hidden session raising the title count and a browser notification (granted
through the permission API) whose click opens that session, Stop of a turn another client started,
the mode picker reaching the agent, a diff rendered. Screenshots: control-*.png."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request
from tests.conftest import free_port, require, shots, wait_for
from tests.pikit import hosting
from tests.test_acp_agent import ACP_DIR, fixture_agent, fixture_log
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]

# Records every notification the page raises (the real one is still created).
NOTES = """
(() => {
  const Real = window.Notification;
  if (!Real) return;
  window.__notes = [];
  window.Notification = class extends Real {
    constructor(title, options) { super(title, options); window.__notes.push({ title, body: options && options.body });
                                   window.__lastNote = this; }
  };
})();
"""


@pytest.fixture
async def acp_web(config: Config, tmp_path: Path) -> AsyncIterator[App]:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    # "aardvark" is listed first (a page defaults to it), so opening on "acp" is a choice
    agents = [fixture_agent(tmp_path, name="aardvark"), fixture_agent(tmp_path)]
    async with hosting(config, tmp_path, agents, http_port=free_port()) as app:
        yield app


async def open_page(browser: Any, app: App, session: str, width: int, height: int) -> tuple[Any, Any]:
    context = await browser.new_context(viewport={"width": width, "height": height})
    origin = f"http://127.0.0.1:{app.http_port}"
    await context.grant_permissions(["notifications"], origin=origin)
    await context.add_init_script(NOTES)
    page = await context.new_page()
    await page.goto(f"{origin}/?session={session}")
    await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
    return context, page


async def test_desktop_two_sessions_attention_stop_mode_and_diff(acp_web: App, browser: Any, tmp_path: Path) -> None:
    app = acp_web
    async with Connection(f"127.0.0.1:{app.port}", session="alpha") as alpha, \
            Connection(f"127.0.0.1:{app.port}", session="beta") as beta:
        api_a = sessions_pb2_grpc.SessionServiceStub(alpha.channel)
        await api_a.CreateSession(pb.CreateSessionRequest(title="Alpha work"))
        await sessions_pb2_grpc.SessionServiceStub(beta.channel).CreateSession(pb.CreateSessionRequest(title="Beta"))
        context, page = await open_page(browser, app, "alpha", 1200, 900)
        try:
            await page.wait_for_selector('#session-list li[data-session="beta"]', timeout=10_000)
            assert await page.text_content('#session-list li.current .s-title') == "Alpha work"

            # A turn in alpha started by another client: the dot says running, Stop ends it.
            call = Agent(alpha, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            await asyncio.wait_for(call.read(), 30)
            running = '#session-list li[data-session="alpha"][data-status="running"]'
            await page.wait_for_selector(running, timeout=10_000)
            await page.wait_for_function("() => [...document.querySelectorAll('#agent option')].some(o => o.value"
                                         " === 'acp')", timeout=10_000)
            await page.select_option("#agent", "acp")
            await page.wait_for_selector("#stop:not([hidden])", timeout=10_000)
            await page.click("#stop")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
            await wait_for(lambda: any("cancelled" in e for e in fixture_log(tmp_path)), timeout=10,
                           what="session/cancel at the agent")
            await page.wait_for_selector("#stop[hidden]", state="attached", timeout=10_000)

            # The mode picker (the agent offers modes) and a diff, from the page's own chat.
            await page.fill("#input", "diff")
            await page.press("#input", "Enter")
            await page.wait_for_selector('[data-say="tool"] .diff .add', timeout=30_000)
            adds = await page.locator('[data-say="tool"] .diff .add').all_text_contents()
            assert "+line fifteen" in adds
            assert "-line 15" in await page.locator('[data-say="tool"] .diff .del').all_text_contents()
            assert await page.locator('[data-say="tool"] .diff .hunk').count() >= 1
            await page.wait_for_selector("#mode:not([hidden])", timeout=10_000)
            await page.select_option("#mode", "plan")
            await wait_for(lambda: any(e.get("session/set_mode", {}).get("modeId") == "plan"
                                       for e in fixture_log(tmp_path)), timeout=10, what="session/set_mode")
            await page.fill("#input", "/te")
            await page.wait_for_selector('#commands button:text("/test")', timeout=5000)

            # A dialog in beta, which this page does not show: title count and a notification.
            await page.click("body")  # a user gesture (the permission is asked on the first one)
            asking = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(beta.channel).Confirm(
                ext.ConfirmRequest(title="Deploy to prod?")))
            await page.wait_for_function("() => document.title.startsWith('(1) ')", timeout=10_000)
            await page.wait_for_function("() => (window.__notes || []).length === 1", timeout=10_000)
            note = await page.evaluate("() => window.__notes[0]")
            assert note["body"] == "Deploy to prod?" and "Beta" in note["title"]
            await page.wait_for_selector('#session-list li[data-session="beta"][data-status="waiting"] .count',
                                         timeout=5000)
            await page.screenshot(path=str(shots(tmp_path) / "control-desktop.png"), full_page=True)
            # Its click opens beta (no reload) with the dialog focused; one click answers it.
            await page.evaluate("() => window.__lastNote.onclick()")
            await page.wait_for_selector('.dialog[data-kind="confirm"]', timeout=10_000)
            assert "session=beta" in page.url and await page.text_content("#session") == "beta"
            assert await page.evaluate("() => document.activeElement?.closest('.dialog') !== null")
            await page.click('.dialog button:text("Yes")')
            assert (await asyncio.wait_for(asking, 10)).confirmed is True
            await page.wait_for_function("() => !document.title.startsWith('(')", timeout=10_000)
            assert await page.evaluate("() => performance.getEntriesByType('navigation').length") == 1
        finally:
            await context.close()


async def test_phone_drawer_no_horizontal_scroll_and_one_tap_answers(acp_web: App, browser: Any,
                                                                     tmp_path: Path) -> None:
    app = acp_web
    async with Connection(f"127.0.0.1:{app.port}", session="phone-b") as other:
        await sessions_pb2_grpc.SessionServiceStub(other.channel).CreateSession(
            pb.CreateSessionRequest(title="A long title for the other session on a small screen"))
        context, page = await open_page(browser, app, "phone-a", 390, 844)
        try:
            await page.fill("#input", "diff")
            await page.press("#input", "Enter")
            await page.wait_for_selector('[data-say="tool"] .diff', timeout=30_000)
            assert await page.evaluate("() => document.documentElement.scrollWidth") <= 390
            drawer = "() => document.querySelector('#sessions').getBoundingClientRect().right"
            assert await page.evaluate(drawer) <= 0  # the session list is a drawer, closed, off screen
            await page.click("#menu")
            await page.wait_for_function(f"() => ({drawer})() > 200", timeout=5000)
            await page.wait_for_selector('#session-list li[data-session="phone-b"]', timeout=5000)
            await page.screenshot(path=str(shots(tmp_path) / "control-phone-drawer.png"))
            await page.click('#session-list li[data-session="phone-b"]')
            await page.wait_for_function("() => document.querySelector('#session').textContent === 'phone-b'")
            await page.wait_for_function(f"() => ({drawer})() <= 0", timeout=5000)  # the drawer closed
            asking = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(other.channel).Select(
                ext.SelectRequest(title="Which branch?", options=["main", "dev"])))
            await page.wait_for_selector('.dialog[data-kind="select"]', timeout=10_000)
            assert await page.evaluate("() => document.documentElement.scrollWidth") <= 390
            box = await page.locator('.dialog button:text("dev")').bounding_box()
            assert box is not None and box["height"] >= 44  # a finger-sized target
            await page.screenshot(path=str(shots(tmp_path) / "control-phone.png"))
            await page.click('.dialog button:text("dev")')  # one tap
            assert (await asyncio.wait_for(asking, 10)).value == "dev"
        finally:
            await context.close()


async def test_an_image_attached_on_the_page_reaches_the_agent(acp_web: App, browser: Any, tmp_path: Path) -> None:
    import base64

    png = tmp_path / "dot.png"
    png.write_bytes(base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx"
                                     "0gAAAABJRU5ErkJggg=="))
    context, page = await open_page(browser, acp_web, "attach-page", 1100, 800)
    try:
        await page.wait_for_function("() => [...document.querySelectorAll('#agent option')].some(o => o.value"
                                     " === 'acp')", timeout=10_000)
        await page.select_option("#agent", "acp")
        await page.set_input_files("#file", str(png))
        await page.wait_for_selector('#attachments .attachment:text("dot.png")', timeout=5000)
        await page.fill("#input", "what is this?")
        await page.press("#input", "Enter")
        await page.wait_for_function("() => document.querySelector('.msg.agent.done .text')?.textContent"
                                     ".includes('Turn 1: what is this?')", timeout=30_000)
        attached = [e["attached"] for e in fixture_log(tmp_path) if "attached" in e]
        assert attached == [[{"type": "image", "mimeType": "image/png",
                              "bytes": len(base64.b64encode(png.read_bytes()))}]]
        assert await page.is_hidden("#attachments")  # sent with the message, then cleared
        # Another page of this session opens on the agent it talks to (not the first agent listed).
        other = await context.new_page()
        await other.goto(page.url)
        await other.wait_for_function("() => document.querySelector('#agent').value === 'acp'", timeout=10_000)
        first = await other.evaluate("() => document.querySelector('#agent option').value")
        assert first != "acp"  # so it was chosen, not defaulted
    finally:
        await context.close()


async def test_the_page_catches_up_after_the_background_once(acp_web: App, browser: Any) -> None:
    """A phone's browser cuts the page's streams in the background (window.stop() does the same
    here): back in the foreground it reconnects and shows what happened meanwhile — a message and a
    waiting dialog — each once, beside what it showed before."""
    from uibus.pb.cline import ui_pb2
    from uibus.pb.uibus.v1 import host_pb2_grpc

    app = acp_web
    context, page = await open_page(browser, app, "bg", 390, 844)
    hidden = "h => { Object.defineProperty(document, 'hidden', {value: h, configurable: true}); " \
             "document.dispatchEvent(new Event('visibilitychange')); }"
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="bg") as conn:
            host = host_pb2_grpc.HostServiceStub(conn.channel)
            say = ui_pb2.ClineMessage(ts=1_800_000_000_001, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="before")
            await host.PublishPartialMessage(say)
            await page.wait_for_selector("[data-ts='1800000000001']", timeout=10_000)
            await page.evaluate(hidden, True)
            await page.evaluate("() => window.stop()")  # the streams are cut
            await page.wait_for_selector('#status[data-state="down"], #status[data-state="connecting"]',
                                         timeout=5000)
            later = ui_pb2.ClineMessage(ts=1_800_000_000_002, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="while away")
            await host.PublishPartialMessage(later)
            asking = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(conn.channel).Confirm(
                ext.ConfirmRequest(title="Still there?")))
            await page.evaluate(hidden, False)
            await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
            await page.wait_for_selector("[data-ts='1800000000002']", timeout=10_000)
            await page.wait_for_selector('.dialog[data-kind="confirm"]', timeout=10_000)
            await asyncio.sleep(0.5)  # anything shown twice would be by now
            assert await page.locator("[data-ts='1800000000001']").count() == 1
            assert await page.locator("[data-ts='1800000000002']").count() == 1
            assert await page.locator(".dialog").count() == 1
            await page.click('.dialog button:text("Yes")')
            assert (await asyncio.wait_for(asking, 10)).confirmed is True
    finally:
        await context.close()
