"""The page open in several tabs of one browser: three desktop tabs and a phone-sized one, in one
browser context, so they share Chromium's pool of six HTTP/1.1 connections to the server, as the
tabs of a person's browser do. Each tab follows its session over one stream, so all four are live
and an answer tapped in the last one opened reaches the agent that asked. Real headless Chromium
against a real uibus on loopback over plain HTTP/1.1."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from tests.conftest import shots, wait_for
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.quotas import ANONYMOUS
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

PHONE_UA = ("Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) "
            "Chrome/120.0.0.0 Mobile Safari/537.36")
SESSION = "tabs"
GRPC_WEB = ("Service/",)  # every gRPC-Web call's path: /<package>.<Name>Service/<Method>


class OpenRequests:
    """A tab's gRPC-Web requests still open (started, neither finished nor failed): a stream holds
    its HTTP/1.1 connection for as long as it is open, so these are the connections it keeps."""

    def __init__(self, page: Any) -> None:
        self.open: dict[Any, str] = {}
        page.on("request", self._started)
        page.on("requestfinished", self._ended)
        page.on("requestfailed", self._ended)

    def _started(self, request: Any) -> None:
        if request.method == "POST" and any(p in request.url for p in GRPC_WEB):
            self.open[request] = request.url.rsplit("/", 2)[-2] + "/" + request.url.rsplit("/", 1)[-1]

    def _ended(self, request: Any) -> None:
        self.open.pop(request, None)

    def methods(self) -> list[str]:
        return sorted(self.open.values())


async def test_three_tabs_and_a_phone_in_one_browser_each_live_on_one_connection(
        web: App, web_connect: Callable[..., Connection], browser: Any, tmp_path: Path) -> None:
    context = await browser.new_context(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    pages: list[Any] = []
    phone_cdp: Any = None
    requests: list[OpenRequests] = []
    url = f"http://127.0.0.1:{web.http_port}/?session={SESSION}"
    try:
        for i in range(4):
            page = await context.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            requests.append(OpenRequests(page))
            if i == 3:  # a phone: its viewport, touch and user agent (one context: the same connection pool)
                await page.set_viewport_size({"width": 390, "height": 844})
                cdp = phone_cdp = await context.new_cdp_session(page)
                await cdp.send("Emulation.setDeviceMetricsOverride",
                               {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True})
                await cdp.send("Emulation.setTouchEmulationEnabled", {"enabled": True})
                await cdp.send("Emulation.setUserAgentOverride", {"userAgent": PHONE_UA})
            try:
                await page.goto(url, timeout=10_000)
                await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
            except Exception as exc:
                raise AssertionError(f"tab {i + 1} did not load or go live: the connections it needs are held "
                                     f"by the tabs before it (their open requests: {[r.methods() for r in requests]})"
                                     ) from exc
            pages.append(page)
        phone = pages[-1]
        assert "Android" in await phone.evaluate("navigator.userAgent")
        assert await phone.evaluate("innerWidth") == 390

        # Each tab holds one long-lived connection: its one stream, counted in the browser and on the
        # server (each open stream holds the tenant's `streams` quota; the listing a `watches` one).
        await wait_for(lambda: web.quotas.in_use("streams", ANONYMOUS) == 4, timeout=5,
                       what=f"one stream per tab on the server (open: {web.quotas.in_use('streams', ANONYMOUS)})")
        await asyncio.sleep(0.5)  # the unary calls of the page's start (initializeWebview, the agents) are done
        per_tab = [r.methods() for r in requests]
        assert per_tab == [["uibus.v1.WebviewService/Subscribe"]] * 4, per_tab
        assert web.quotas.in_use("streams", ANONYMOUS) == 4
        assert web.quotas.in_use("watches", ANONYMOUS) == 4  # every tab's control room follows the listing
        for page in pages:  # the control room lists the session (the listing came over the one stream)
            await page.wait_for_selector(f'#session-list li[data-session="{SESSION}"]', state="attached",
                                         timeout=5000)

        # Every tab is live: a message published shows in each.
        conn = web_connect(SESSION)
        ts = 1_700_000_000_123
        await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                  text="to every tab"))
        for i, page in enumerate(pages):
            try:
                await page.wait_for_selector(f"[data-ts='{ts}']", timeout=3000)
            except Exception as exc:
                raise AssertionError(f"tab {i + 1} did not show the message") from exc

        # An agent asks; every tab shows the dialog; a tap on Yes in the last tab opened answers it.
        md = (("x-uibus-session", SESSION),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{web.port}") as ch:
            asking = asyncio.ensure_future(ext_grpc.ExtensionUiServiceStub(ch).Confirm(
                ext.ConfirmRequest(title="Ship it?", message="from any tab"), metadata=md))
            for page in pages:
                await page.wait_for_selector('.dialog[data-kind="confirm"] h3:text("Ship it?")', timeout=3000)
            await phone.screenshot(path=str(shots(tmp_path) / "tabs-phone-dialog.png"))
            box = await phone.locator('.dialog[data-kind="confirm"] button:text("Yes")').bounding_box()
            assert box is not None and box["height"] >= 44  # a finger-sized target
            point = {"x": box["x"] + box["width"] / 2, "y": box["y"] + box["height"] / 2}
            for kind, points in (("touchStart", [point]), ("touchEnd", [])):  # a tap, as a finger makes it
                await phone_cdp.send("Input.dispatchTouchEvent", {"type": kind, "touchPoints": points})
            result = await asyncio.wait_for(asking, 5)
            assert result.outcome == ext.DIALOG_OUTCOME_ANSWERED and result.confirmed
            for page in pages:  # answered: gone from every tab
                await page.wait_for_selector('.dialog[data-kind="confirm"]', state="detached", timeout=3000)
        assert [r.methods() for r in requests] == [["uibus.v1.WebviewService/Subscribe"]] * 4
        assert not errors, errors
    finally:
        await context.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the tabs closed")
    await wait_for(lambda: web.quotas.in_use("streams", ANONYMOUS) == 0, timeout=5, what="every stream ended")


async def test_a_tab_resumes_messages_and_extension_ui_from_one_cursor(web_config: Any, browser: Any) -> None:
    """The server restarts under an open tab: its one stream reconnects with `x-uibus-since` set to
    the highest seq it had — here an extension-UI status's, newer than its last message, as both
    are stamped in the one session log — and gets what it missed of both, once, not a snapshot."""
    from tests.conftest import running

    sent: list[dict[str, str]] = []
    session = "resume-tab"
    md = (("x-uibus-session", session),)
    context = await browser.new_context(viewport={"width": 1100, "height": 700})
    try:
        async with running(web_config) as app, Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            page = await context.new_page()
            page.on("request", lambda r: sent.append(r.headers) if r.url.endswith("WebviewService/Subscribe")
                    else None)
            await page.goto(f"http://127.0.0.1:{app.http_port}/?session={session}")
            await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                      text="before"))
            await page.wait_for_selector("[data-ts='1']", timeout=3000)
            agent = ext_grpc.ExtensionUiServiceStub(conn.channel)
            await agent.SetStatus(ext.SetStatusRequest(key="build", text="one"), metadata=md)
            await page.wait_for_selector('#statuses [data-key="build"]:text("one")', timeout=3000)
            shown = await app.core.feed.log.read(session)
            cursor = shown.head
            assert cursor > max(e.seq for e in shown.entries if e.kind == "message")  # the status's seq
        async with running(web_config) as app, Connection(f"127.0.0.1:{app.port}", session=session) as conn:
            agent = ext_grpc.ExtensionUiServiceStub(conn.channel)
            await agent.SetStatus(ext.SetStatusRequest(key="build", text="two"), metadata=md)
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=2, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                      text="while away"))
            asking = asyncio.ensure_future(agent.Confirm(ext.ConfirmRequest(title="Still there?"), metadata=md))
            await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
            await page.wait_for_selector("[data-ts='2']", timeout=5000)
            await page.wait_for_selector('#statuses [data-key="build"]:text("two")', timeout=5000)
            await page.wait_for_selector('.dialog[data-kind="confirm"]', timeout=5000)
            assert any(h.get("x-uibus-since") == str(cursor) for h in sent), (cursor, sent)  # resumed
            await asyncio.sleep(0.3)  # anything shown twice would be by now
            assert await page.locator("#messages .msg").count() == 2
            assert await page.locator("#statuses [data-key]").count() == 1
            assert await page.locator(".dialog").count() == 1
            await page.click('.dialog button:text("Yes")')
            assert (await asyncio.wait_for(asking, 5)).confirmed
    finally:
        await context.close()
