"""The webview page in a real headless Chromium (Debian's, driven by Python playwright).

A host publishes over native gRPC; the page, connected back over gRPC-Web to the server that
served it, must show each update within a second. Closing the page must leave no subscription.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import shots, wait_for
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.domain.feed import UI_STREAMS
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

# Every UiService subscription + the extension-UI feed, all multiplexed by the page's one
# WebviewService.Subscribe stream (the sessions listing is no bus subscription).
STREAMS_PER_PAGE = len(UI_STREAMS) + 1
WITHIN = 1000  # ms: each published update must be on screen within a second


async def _shown_within(page: Any, js: str, arg: Any, what: str) -> float:
    start = time.monotonic()
    try:
        await page.wait_for_function(js, arg=arg, timeout=WITHIN)
    except Exception as exc:
        raise AssertionError(f"{what} was not shown within {WITHIN} ms") from exc
    return (time.monotonic() - start) * 1000


async def test_page_shows_host_updates_live_and_cleans_up(web: App, web_connect: Callable[..., Connection],
                                                          browser: Any, tmp_path: Path) -> None:
    conn = web_connect("b1").host
    page = await browser.new_page(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"http://127.0.0.1:{web.http_port}/?session=b1&client=tab-1")
    await wait_for(lambda: web.bus.count(session="b1") == STREAMS_PER_PAGE, timeout=5, what="page subscribed")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)

    timings = {}
    theme = json.dumps({"name": "Solarized Light", "type": "light",
                        "colors": {"editor.background": "#fdf6e3", "editor.foreground": "#586e75",
                                   "button.background": "#268bd2", "sideBar.background": "#eee8d5"}})
    await conn.SetTheme(host_pb2.TextEvent(text=theme))
    timings["theme"] = await _shown_within(page, "t => document.body.dataset.theme === t", theme, "the theme")
    bg = await page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert bg == "rgb(253, 246, 227)"

    ts = 1_700_000_000_000
    for i, text in enumerate(["Hel", "Hello, wor", "Hello, world! This message grew in place."]):
        await conn.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text,
                                                             partial=i < 2))
        timings[f"partial{i}"] = await _shown_within(
            page, "([ts, t]) => document.querySelector(`[data-ts='${ts}'] .text`)?.textContent === t",
            [str(ts), text], f"partial message #{i}")
    assert await page.locator(f"[data-ts='{ts}']").count() == 1  # replaced in place, not appended
    assert "partial" not in (await page.get_attribute(f"[data-ts='{ts}']", "class") or "")

    await conn.PublishAddToInput(host_pb2.TextEvent(text="from the host"))
    timings["add_to_input"] = await _shown_within(
        page, "t => document.getElementById('input').value.includes(t)", "from the host", "add-to-input text")
    await conn.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_HISTORY))
    timings["button"] = await _shown_within(
        page, "() => !!document.querySelector('#events [data-event=\"history button clicked\"]')", None,
        "the history button event")
    await page.evaluate("document.activeElement.blur()")
    await conn.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="tab-1"))
    timings["focus"] = await _shown_within(page, "() => document.activeElement?.id === 'input'", None,
                                           "the focus request")
    print("\nshown after publish (ms):", {k: round(v) for k, v in timings.items()})
    await page.screenshot(path=str(shots(tmp_path) / "webview.png"))
    assert not errors, errors

    await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the page closed")


async def test_get_webview_html_is_the_served_page(web: App, web_connect: Callable[..., Connection]) -> None:
    import httpx

    html = (await web_connect("x").ui.getWebviewHtml(common_pb2.EmptyRequest())).value
    async with httpx.AsyncClient() as client:
        served = (await client.get(f"http://127.0.0.1:{web.http_port}/")).text
    assert html == served and "createGrpcWebTransport" not in html[:2000] and "<script>" in html


async def test_chat_with_an_agent_from_the_page(web: App, browser: Any, tmp_path: Path) -> None:
    """Needs the chat service (AgentService/ConciergeService handlers) merged in."""
    page = await browser.new_page()
    await page.goto(f"http://127.0.0.1:{web.http_port}/?session=chat1")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
    await page.wait_for_function("() => document.querySelectorAll('#agent option[value]:not([value=\"\"])').length"
                                 " > 0", timeout=5000)
    for turn, text in enumerate(["Hello agent, my name is Ada.", "What is my name?"]):
        await page.fill("#input", text)
        await page.press("#input", "Enter")
        reply = page.locator(".msg.agent").nth(turn)
        await reply.locator(".text").wait_for(timeout=5000)
        await page.wait_for_function(
            "n => document.querySelectorAll('.msg.agent.done').length > n", arg=turn, timeout=10_000)
        assert await reply.get_attribute("class") and "error" not in (await reply.get_attribute("class") or "")
        assert (await reply.locator(".text").text_content() or "").strip()
    assert "my name is Ada" in (await page.locator(".msg.agent").nth(1).text_content() or "")  # context kept
    await page.screenshot(path=str(shots(tmp_path) / "chat.png"))
    # Reloaded: the conversation comes back from the server, each question once, in order.
    await page.reload()
    await page.wait_for_function("() => document.querySelectorAll('#messages .msg').length >= 4", timeout=5000)
    users = await page.evaluate("[...document.querySelectorAll('#messages .msg.user .text')].map(e => e.textContent)")
    assert users == ["Hello agent, my name is Ada.", "What is my name?"], users
    await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the page closed")


async def test_page_answers_extension_ui_dialogs(web: App, browser: Any, tmp_path: Path) -> None:
    import asyncio

    import grpc

    from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
    from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

    page = await browser.new_page(viewport={"width": 1100, "height": 700})
    await page.goto(f"http://127.0.0.1:{web.http_port}/?session=dlg")
    await wait_for(lambda: web.bus.count(session="dlg") == STREAMS_PER_PAGE, timeout=5, what="page subscribed")
    md = (("x-uibus-session", "dlg"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{web.port}") as ch:
        agent = ext_grpc.ExtensionUiServiceStub(ch)
        await agent.SetStatus(ext.SetStatusRequest(key="build", text="building…"), metadata=md)
        await agent.SetWidget(ext.SetWidgetRequest(key="todo", lines=["1. parse", "2. test"]), metadata=md)
        await page.wait_for_selector('#statuses [data-key="build"]:text("building…")', timeout=WITHIN)
        await page.wait_for_selector('#widgets [data-key="todo"]', timeout=WITHIN)

        confirm = asyncio.ensure_future(agent.Confirm(ext.ConfirmRequest(title="Deploy now?", message="to prod"),
                                                      metadata=md))
        await page.wait_for_selector('.dialog[data-kind="confirm"] h3:text("Deploy now?")', timeout=WITHIN)
        await page.click('.dialog[data-kind="confirm"] button:text("Yes")')
        result = await asyncio.wait_for(confirm, 5)
        assert result.outcome == ext.DIALOG_OUTCOME_ANSWERED and result.confirmed
        await page.wait_for_selector('.dialog[data-kind="confirm"]', state="detached", timeout=WITHIN)

        select = asyncio.ensure_future(agent.Select(ext.SelectRequest(title="Pick one", options=["red", "blue"]),
                                                    metadata=md))
        await page.wait_for_selector('.dialog[data-kind="select"]', timeout=WITHIN)
        await page.click('.dialog[data-kind="select"] button:text("blue")')
        assert (await asyncio.wait_for(select, 5)).value == "blue"

        text = asyncio.ensure_future(agent.Input(ext.InputRequest(title="Your name?", placeholder="name"),
                                                 metadata=md))
        await page.fill('.dialog[data-kind="input"] input', "Ada")
        await page.click('.dialog[data-kind="input"] button:text("OK")')
        assert (await asyncio.wait_for(text, 5)).value == "Ada"

        # a dialog that times out disappears from the page (the server tells every UI)
        timed = asyncio.ensure_future(agent.Editor(ext.EditorRequest(title="Edit", prefill="x = 1", timeout_ms=600),
                                                   metadata=md))
        await page.wait_for_selector('.dialog[data-kind="editor"]', timeout=WITHIN)
        await page.screenshot(path=str(shots(tmp_path) / "dialog.png"))
        result = await asyncio.wait_for(timed, 5)
        assert result.outcome == ext.DIALOG_OUTCOME_TIMED_OUT
        await page.wait_for_selector('.dialog[data-kind="editor"]', state="detached", timeout=WITHIN)
    await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the page closed")


async def test_page_with_tokens_signs_in_from_the_fragment_or_the_form(web_config: Any, browser: Any,
                                                                     tmp_path: Path) -> None:
    """With tenant tokens the page asks for one: `/#token=T` (the fragment never reaches a server and
    leaves the address bar at once) or the sign-in form; the page then sends it on every call, and
    a reload in the same tab keeps working."""
    from dataclasses import replace

    from tests.conftest import start_app

    tokens = tmp_path / "tokens"
    tokens.write_text("team-a-token team-a-*\n")
    app = await start_app(replace(web_config, tokens_file=str(tokens)))
    try:
        base = f"http://127.0.0.1:{app.http_port}"
        context = await browser.new_context()
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        await page.goto(f"{base}/?session=team-a-1#token=team-a-token")
        await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
        await wait_for(lambda: app.bus.count(session="team-a-1") == STREAMS_PER_PAGE, timeout=5,
                       what="signed-in page subscribed")
        assert await page.evaluate("location.hash") == ""  # the token left the address bar
        await page.reload()
        await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
        await page.close()

        fresh = await (await browser.new_context()).new_page()  # a new tab: nothing remembered
        await fresh.goto(f"{base}/?session=team-a-2")
        await fresh.fill("#token", "wrong-token")
        await fresh.click("#login button")
        await fresh.wait_for_selector('#why:text("refused")', timeout=5000)
        await fresh.fill("#token", "team-a-token")
        await fresh.click("#login button")
        await fresh.wait_for_selector('#status[data-state="live"]', timeout=5000)
        await wait_for(lambda: app.bus.count(session="team-a-2") == STREAMS_PER_PAGE, timeout=5,
                       what="page signed in from the form subscribed")
        await fresh.close()
        assert not errors, errors
        await wait_for(lambda: app.bus.count() == 0, timeout=5, what="subscriptions removed after the pages closed")
        await context.close()
    finally:
        await app.aclose(grace=0.5)


async def _open(browser: Any, app: App, query: str, errors: list[str]) -> Any:
    page = await browser.new_page(viewport={"width": 1100, "height": 700})
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"http://127.0.0.1:{app.http_port}/?{query}")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
    return page


async def _texts(page: Any) -> list[str]:
    return [t.strip() for t in await page.locator("#messages .msg .text").all_text_contents()]


async def test_page_opened_later_shows_the_session_so_far(web: App, web_connect: Callable[..., Connection],
                                                          browser: Any, tmp_path: Path) -> None:
    """The issue's must-show: what was published before the page opened (messages, a light theme,
    an extension-UI status) is on the page when it loads, and again after a reload, once each."""
    from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
    from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

    conn = web_connect("early")
    ts = 1_700_000_000_000
    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                              text="first, before the page", partial=True))
    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                              text="first, before the page opened"))
    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts + 1, type=ui_pb2.ASK,
                                                              ask=ui_pb2.FOLLOWUP, text="second: what next?"))
    await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind": "light"}'))
    await ext_grpc.ExtensionUiServiceStub(conn.channel).SetStatus(ext.SetStatusRequest(key="build", text="green"),
                                                                  metadata=(("x-uibus-session", "early"),))
    want = ["first, before the page opened", "second: what next?"]

    errors: list[str] = []
    page = await _open(browser, web, "session=early", errors)
    for attempt in ("load", "reload"):
        await page.wait_for_function("n => document.querySelectorAll('#messages .msg').length >= n", arg=2,
                                     timeout=WITHIN)
        assert await _texts(page) == want, attempt
        assert await page.evaluate("document.documentElement.dataset.kind") == "light"
        assert await page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
        await page.wait_for_selector('#statuses [data-key="build"]:text("green")', timeout=WITHIN)
        if attempt == "load":
            await page.screenshot(path=str(shots(tmp_path) / "on-load.png"))
            await page.reload()
            await page.wait_for_selector('#status[data-state="live"]', timeout=5000)

    # then live, after the replay: a new message is appended, not mixed into the history
    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts + 2, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                              text="third, live"))
    await _shown_within(page, "() => document.querySelectorAll('#messages .msg').length === 3", None, "the live one")
    assert await _texts(page) == [*want, "third, live"]
    assert not errors, errors
    await page.close()


async def test_page_opened_after_a_chat_shows_it(web: App, web_connect: Callable[..., Connection],
                                                 browser: Any) -> None:
    """A chat turn made over native gRPC before the page opened: the question (kept by the server,
    not published) and its reply (mirrored to the session's partial messages) are on the page when
    it loads, in that order."""
    from tests.chatkit import answer

    reply = await answer(web_connect("chatted"), "hello_world", "hi from grpc")
    assert reply.text
    errors: list[str] = []
    page = await _open(browser, web, "session=chatted", errors)
    await page.wait_for_function("t => [...document.querySelectorAll('#messages .msg .text')]"
                                 ".some(e => e.textContent === t)", arg=reply.text, timeout=WITHIN)
    shown = await page.evaluate("[...document.querySelectorAll('#messages .msg')].map(e => "
                                "[e.classList.contains('user'), e.querySelector('.text').textContent])")
    assert shown == [[True, "hi from grpc"], [False, reply.text]], shown
    assert not errors, errors
    await page.close()


async def test_page_theme_kind_switches_the_palette(web: App, web_connect: Callable[..., Connection],
                                                    browser: Any) -> None:
    """`kind` (or `type`) picks the page's palette; a theme's explicit colors win over it."""
    host = web_connect("kinds").host
    errors: list[str] = []
    page = await _open(browser, web, "session=kinds", errors)
    bg = "getComputedStyle(document.body).backgroundColor"
    for theme, want in ((('{"kind": "hc"}'), "rgb(0, 0, 0)"),
                        ('{"kind": "light"}', "rgb(255, 255, 255)"),
                        ('{"kind": "dark"}', "rgb(30, 31, 36)"),
                        ('{"type": "high-contrast-light"}', "rgb(255, 255, 255)"),
                        ('{"kind": "light", "colors": {"editor.background": "#102030"}}', "rgb(16, 32, 48)")):
        await host.SetTheme(host_pb2.TextEvent(text=theme))
        await _shown_within(page, "t => document.body.dataset.theme === t", theme, f"theme {theme}")
        assert await page.evaluate(bg) == want, theme
    assert await page.evaluate("getComputedStyle(document.body).color") == "rgb(31, 35, 40)"  # light's foreground
    assert not errors, errors
    await page.close()


async def test_page_as_tab_gets_tab_typed_clicks(web: App, browser: Any) -> None:
    """`?provider=TAB`: docs/getting-started.md's `uibus publish button history TAB` reaches the page
    (and a SIDEBAR-typed click does not)."""
    import asyncio
    import sys

    errors: list[str] = []
    page = await _open(browser, web, "session=tabbed&provider=TAB", errors)
    assert await page.text_content("#provider") == "TAB"
    await wait_for(lambda: web.bus.count(session="tabbed") == STREAMS_PER_PAGE, timeout=5, what="page subscribed")
    uibus = str(Path(sys.executable).parent / "uibus")
    for provider in ("SIDEBAR", "TAB"):
        proc = await asyncio.create_subprocess_exec(uibus, "publish", "button", "history", provider, "--session",
                                                    "tabbed", "--target", f"127.0.0.1:{web.port}")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    await _shown_within(page, "() => !!document.querySelector('#events [data-event=\"history button clicked\"]')",
                        None, "the TAB-typed history click")
    await page.wait_for_timeout(200)
    assert await page.locator('#events [data-event="history button clicked"]').count() == 1  # not the SIDEBAR one
    assert not errors, errors
    await page.close()


async def test_favicon(web: App, browser: Any) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        for path in ("/favicon.ico", "/favicon.svg"):
            r = await client.get(f"http://127.0.0.1:{web.http_port}{path}")
            assert r.status_code == 200 and r.headers["content-type"] == "image/svg+xml", path
            assert r.text.startswith("<svg")
    errors: list[str] = []
    page = await _open(browser, web, "session=icon", errors)
    href = await page.evaluate("document.querySelector('link[rel=icon]').href")
    assert href == f"http://127.0.0.1:{web.http_port}/favicon.svg"
    assert (await page.request.get(href)).status == 200
    await page.close()


async def test_an_mcp_agent_asks_the_person_at_the_page(web: App, browser: Any, tmp_path: Path) -> None:
    """Any agent that speaks MCP reaches the person at the browser page: its `ask_user` is a dialog
    on the page, the click is the tool's result, and an agent tool's chat turn shows on the page."""
    import asyncio

    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    page = await browser.new_page(viewport={"width": 1100, "height": 700})
    await page.goto(f"http://127.0.0.1:{web.http_port}/?session=mcp-page")
    await wait_for(lambda: web.bus.count(session="mcp-page") == STREAMS_PER_PAGE, timeout=5, what="page subscribed")
    async with httpx2.AsyncClient(headers={"x-uibus-session": "mcp-page"}) as http, \
            Client(streamable_http_client(f"http://127.0.0.1:{web.http_port}/mcp", http_client=http)) as mcp:
        asked = asyncio.ensure_future(mcp.call_tool("ask_user", {"title": "Ship it?", "options": ["ship", "wait"]}))
        await page.wait_for_selector('.dialog[data-kind="select"] h3:text("Ship it?")', timeout=WITHIN)
        await page.click('.dialog[data-kind="select"] button:text("wait")')
        result = await asyncio.wait_for(asked, 5)
        assert result.content[0].text == "wait" and result.structured_content["outcome"] == "answered"
        await page.wait_for_selector('.dialog[data-kind="select"]', state="detached", timeout=WITHIN)

        reply = await mcp.call_tool("hello_world", {"user_message": {"text": "hello from an MCP agent"}})
        await page.wait_for_function(
            "t => [...document.querySelectorAll('#messages .msg .text')].some(e => e.textContent === t)",
            arg=reply.content[0].text, timeout=5000)
        await page.screenshot(path=str(shots(tmp_path) / "mcp-dialog.png"))
    await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the page closed")


async def test_page_renders_what_a_coding_agent_says(web: App, web_connect: Callable[..., Connection],
                                                     browser: Any, tmp_path: Path) -> None:
    """The SAY kinds a coding agent publishes while it works, each shown as its own block (found by
    `data-say` and `data-ts`): TEXT as sanitized markdown (raw HTML in it never runs), REASONING
    collapsed, a command and its growing output, a tool's ClineSayTool JSON, an error."""
    host = web_connect("says").host
    errors: list[str] = []
    page = await _open(browser, web, "session=says", errors)
    await wait_for(lambda: web.bus.count(session="says") == STREAMS_PER_PAGE, timeout=5, what="page subscribed")
    ts = 1_800_000_000_000

    async def say(n: int, kind: int, text: str, partial: bool = False) -> str:
        await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts + n, type=ui_pb2.SAY, say=kind, text=text,
                                                             partial=partial))
        return f"#messages [data-ts='{ts + n}']"

    async def shows(sel: str, inner: str, text: str, what: str) -> None:
        await _shown_within(page, "([s, t]) => document.querySelector(s)?.textContent === t", [f"{sel} {inner}", text],
                            what)

    # REASONING: partial, then final; collapsed all along, growing in place.
    thinking = await say(0, ui_pb2.REASONING, "The test fails because", partial=True)
    await shows(thinking, "details .text", "The test fails because", "partial reasoning")
    assert "partial" in (await page.get_attribute(thinking, "class") or "")
    reasoning = "The test fails because `a` is off by one; fix src/a.ts."
    await say(0, ui_pb2.REASONING, reasoning)
    await shows(thinking, "details .text", reasoning, "final reasoning")
    assert await page.get_attribute(thinking, "data-say") == "reasoning"
    assert "partial" not in (await page.get_attribute(thinking, "class") or "")
    assert await page.evaluate("s => document.querySelector(s + ' details').open", thinking) is False
    assert await page.text_content(f"{thinking} details > summary") == "Reasoning"
    assert not await page.locator(f"{thinking} details .text").is_visible()

    # TOOL_SAY: ClineSayTool JSON, its content collapsed; a diff; text that is not JSON stays text.
    content = "export const a = 2;\n"
    read = await say(1, ui_pb2.TOOL_SAY, json.dumps({"tool": "readFile", "path": "src/a.ts", "content": content}))
    await shows(read, ".tool-name", "readFile", "the tool")
    assert await page.get_attribute(read, "data-say") == "tool"
    assert await page.text_content(f"{read} .tool-path") == "src/a.ts"
    assert await page.text_content(f"{read} details[data-field='content'] pre") == content
    assert await page.evaluate("s => document.querySelector(s + ' details').open", read) is False
    diff = "@@ -1 +1 @@\n-export const a = 2;\n+export const a = 1;"
    edit = await say(2, ui_pb2.TOOL_SAY, json.dumps({"tool": "editedExistingFile", "path": "src/a.ts", "diff": diff}))
    await shows(edit, ".tool-name", "editedExistingFile", "the edit")
    assert await page.text_content(f"{edit} details[data-field='diff'] pre") == diff
    assert await page.locator(f"{edit} .diff .add").all_text_contents() == ["+export const a = 1;"]
    assert await page.locator(f"{edit} .diff .del").all_text_contents() == ["-export const a = 2;"]
    odd = await say(3, ui_pb2.TOOL_SAY, "not JSON: <b>{tool")
    await shows(odd, ".text", "not JSON: <b>{tool", "a tool message that is not JSON")
    assert await page.locator(f"{odd} b, {odd} .tool-name").count() == 0

    # COMMAND_SAY and its output, which grows (each update is the whole output so far).
    command = "npm test -- --run 'a.test.ts' && echo <ok>"
    cmd = await say(4, ui_pb2.COMMAND_SAY, command)
    await shows(cmd, "pre.command code", command, "the command")
    assert await page.get_attribute(cmd, "data-say") == "command"
    assert await page.evaluate("s => getComputedStyle(document.querySelector(s + ' pre.command'), '::before')"
                               ".content", cmd) == '"$ "'
    first, second = "> vitest --run a.test.ts\n", "> vitest --run a.test.ts\n\n ✓ a.test.ts (2 tests) 3ms\n"
    out = await say(5, ui_pb2.COMMAND_OUTPUT_SAY, first, partial=True)
    await shows(out, "pre.output", first, "the output so far")
    await say(5, ui_pb2.COMMAND_OUTPUT_SAY, second)
    await shows(out, "pre.output", second, "the whole output")
    assert await page.get_attribute(out, "data-say") == "command_output"
    assert await page.evaluate("s => getComputedStyle(document.querySelector(s + ' pre.output')).fontFamily",
                               out) != await page.evaluate("getComputedStyle(document.body).fontFamily")

    # ERROR
    failure = "Command failed with exit code 1: <stderr>"
    err = await say(6, ui_pb2.ERROR, failure)
    await shows(err, ".text", failure, "the error")
    assert await page.get_attribute(err, "data-say") == "error"
    assert "error" in (await page.get_attribute(err, "class") or "").split()
    assert await page.evaluate("s => getComputedStyle(document.querySelector(s + ' .text')).color", err) \
        == "rgb(248, 81, 73)"

    # TEXT: markdown, sanitized: the HTML in it is neutralised, links open safely.
    markdown = ("Fixed: the **off-by-one** in `a`.\n\n- changed src/a.ts\n- ran the tests\n\n"
                "```ts\nexport const a = 1 < 2;\n```\n\n"
                '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
                '<a href="javascript:window.__pwned=3">click</a> See [the docs](https://example.com/docs).')
    text = await say(7, ui_pb2.TEXT, markdown)
    await shows(text, ".text strong", "off-by-one", "the markdown reply")
    assert await page.get_attribute(text, "data-say") == "text"
    assert await page.locator(f"{text} .text ul > li").all_text_contents() == ["changed src/a.ts", "ran the tests"]
    assert await page.text_content(f"{text} .text pre > code") == "export const a = 1 < 2;\n"
    assert await page.get_attribute(f"{text} .text pre > code", "class") == "language-ts"
    assert await page.text_content(f"{text} .text p > code") == "a"
    link = page.locator(f"{text} .text a[href='https://example.com/docs']")
    assert await link.get_attribute("target") == "_blank"
    assert "noopener" in (await link.get_attribute("rel") or "").split()
    # the image (if kept) has loaded or failed by now, so an onerror would have run
    await page.wait_for_function("() => [...document.querySelectorAll('#messages img')].every(i => i.complete)",
                                 timeout=WITHIN)
    scripted = page.locator(f"{text} .text a", has_text="click")  # kept without its javascript: href
    if await scripted.count():
        await scripted.click()
        await page.wait_for_timeout(100)
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    assert await page.evaluate("""() => [...document.querySelectorAll('#messages *')].filter(e =>
        e.tagName === 'SCRIPT' || [...e.attributes].some(a => a.name.startsWith('on')
        || /^\\s*javascript:/i.test(a.value))).length""") == 0

    # one block per ts, in the order published, none duplicated
    shown = await page.evaluate("[...document.querySelectorAll('#messages [data-ts]')].map(e => [e.dataset.ts,"
                                " e.dataset.say])")
    assert shown == [[str(ts + n), kind] for n, kind in enumerate(
        ["reasoning", "tool", "tool", "tool", "command", "command_output", "error", "text"])], shown
    # a click opens the collapsed blocks (and they stay open as nothing replaces them)
    await page.click(f"{thinking} summary")
    await page.click(f"{edit} summary")
    assert await page.locator(f"{thinking} details .text").is_visible()
    await page.set_viewport_size({"width": 1100, "height": 1200})
    await page.screenshot(path=str(shots(tmp_path) / "agent-says.png"))
    assert not errors, errors
    await page.close()
    await wait_for(lambda: web.bus.count() == 0, timeout=5, what="subscriptions removed after the page closed")


async def test_page_reconnects_from_its_cursor_after_a_restart(web_config: Any, browser: Any) -> None:
    """The server restarts under an open page: the page reconnects with `x-uibus-since` (the seq of
    the last message it showed), gets exactly what was published while it was away, once, and no
    replay of what it already had."""
    from tests.conftest import running

    sent: list[dict[str, str]] = []
    errors: list[str] = []
    ts = 1_700_000_000_000
    async with running(web_config) as app, Connection(f"127.0.0.1:{app.port}", session="rc") as conn:
        page = await _open(browser, app, "session=rc", errors)
        page.on("request", lambda r: sent.append(r.headers) if r.url.endswith("WebviewService/Subscribe") else None)
        await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                  text="before the restart"))
        await _shown_within(page, "() => document.querySelectorAll('#messages .msg').length === 1", None, "the first")
        shown = await app.core.feed.log.read("rc")
        cursor = shown.head
    async with running(web_config) as app, Connection(f"127.0.0.1:{app.port}", session="rc") as conn:
        await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts + 1, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                  text="while the page was away"))
        await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
        await page.wait_for_function("() => document.querySelectorAll('#messages .msg').length === 2", timeout=5000)
        assert await _texts(page) == ["before the restart", "while the page was away"]
        assert any(h.get("x-uibus-since") == str(cursor) for h in sent), sent  # resumed, not a snapshot
        await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts + 2, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                  text="live again"))
        await _shown_within(page, "() => document.querySelectorAll('#messages .msg').length === 3", None, "live")
        assert await _texts(page) == ["before the restart", "while the page was away", "live again"]
        # While the server was down the page's other requests failed (its unary calls): nothing else.
        assert [e for e in errors if "Failed to fetch" not in e] == [], errors
        await page.close()
