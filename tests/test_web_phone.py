"""The page in headless Chromium at a desktop (1280 × 800) and a phone (390 × 844), with the real pi
in a worktree behind it (web/README.md): what a first hour on either screen needs.

* Icons are inline SVG: the attach button (once an emoji, an empty box without an emoji font) and
  every icon button carry an `<svg>` and no glyph of their own.
* Every panel is reachable: on the phone the Workspaces diff and the Events list open in a drawer
  (#panels) and lie on the screen; on the desktop they are a column, shown at once.
* The message box's placeholder fits its box (measured in the box's own font).
* One heading for a reply: the reply sent from the page is headed with the agent's name, live and
  after a reload (replayed from the session's log).
* A visible connecting state: until the stream's first event the page shows "Connecting…" with a
  spinner (the stream is held back by the browser's request routing), then live.

Screenshots at both sizes go to $UIBUS_SCREENSHOTS (CI keeps them) when set.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, shots
from tests.pikit import Reply, hosting, scripted_model
from tests.test_workspaces import make_repo, need_pi, worktree_pi
from uibus.infra.config import Config

pytestmark = [pytest.mark.timeout(180), pytest.mark.node]
SIZES = {"desktop": (1280, 800), "phone": (390, 844)}

# Every button's own text must be words: a symbol or emoji glyph there needs a font the machine may lack.
_GLYPHS = r"/[\u2190-\u2bff\u00d7\u2715\u2716\u{1f000}-\u{1faff}\ufe0f]/u"
_ICONS_JS = f"""() => [...document.querySelectorAll('button')].filter(b => b.offsetParent !== null ||
  b.closest('aside')).map(b => ({{id: b.id || b.className, text: b.textContent,
  svg: !!b.querySelector('svg'), glyph: {_GLYPHS}.test(b.textContent)}}))"""
_PLACEHOLDER_JS = """() => {
  const box = document.getElementById('input'), s = getComputedStyle(box);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = `${s.fontStyle} ${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
  return {text: box.placeholder, width: ctx.measureText(box.placeholder).width,
          room: box.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight),
          scroll: box.scrollWidth, client: box.clientWidth};
}"""
_ON_SCREEN_JS = """sel => {
  const r = document.querySelector(sel).getBoundingClientRect();
  const style = getComputedStyle(document.querySelector(sel));
  return r.width > 0 && r.height > 0 && r.left >= 0 && r.right <= innerWidth + 0.5 && r.top < innerHeight
    && style.visibility === 'visible';
}"""


async def _on_screen(page: Any, selector: str) -> bool:
    return bool(await page.evaluate(_ON_SCREEN_JS, selector))


@pytest.mark.parametrize("size", list(SIZES))
async def test_the_page_on_a_desktop_and_a_phone(config: Config, tmp_path: Path, browser: Any, size: str) -> None:
    need_pi()
    repo = make_repo(tmp_path)
    width, height = SIZES[size]
    out = shots(tmp_path)
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "from the page\n"})),
                     Reply(text="Wrote the note."))
        async with hosting(config, tmp_path, [worktree_pi(tmp_path, model, repo)],
                           workspaces_dir=str(tmp_path / "spaces"), http_port=free_port()) as app:
            context = await browser.new_context(viewport={"width": width, "height": height})
            page = await context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            try:
                # ---- connecting: the stream held back, the page says so ----
                gate = asyncio.Event()

                async def held(route: Any) -> None:
                    await gate.wait()
                    await route.continue_()

                await page.route("**/uibus.v1.WebviewService/Subscribe", held)
                await page.goto(f"http://127.0.0.1:{app.http_port}/?session=phone-{size}")
                await page.wait_for_selector('#status[data-state="connecting"]', timeout=10_000)
                await asyncio.sleep(0.3)  # well past any first event, had the stream been let through
                assert await page.get_attribute("#messages", "data-state") == "connecting"
                shown = await page.evaluate("getComputedStyle(document.getElementById('messages'), '::after').content")
                assert shown == '"Connecting…"'
                assert await page.evaluate(
                    "getComputedStyle(document.getElementById('messages'), '::before').animationName") == "spin"
                await page.screenshot(path=str(out / f"page-{size}-connecting.png"))
                gate.set()
                await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
                assert await page.get_attribute("#messages", "data-state") == "live"
                await page.unroute("**/uibus.v1.WebviewService/Subscribe")

                # ---- icons: SVG, no glyphs ----
                assert await page.locator("#attach svg.icon").count() == 1
                assert (await page.text_content("#attach") or "").strip() == ""
                buttons = await page.evaluate(_ICONS_JS)
                assert not [b for b in buttons if b["glyph"]], buttons
                for b in buttons:
                    if not b["text"].strip():
                        assert b["svg"], f"an empty button without an icon: {b}"

                # ---- the placeholder fits its box ----
                box = await page.evaluate(_PLACEHOLDER_JS)
                assert box["text"] and box["width"] <= box["room"], box
                assert box["scroll"] <= box["client"], box
                if size == "desktop":
                    assert "Enter to send" in box["text"]  # the long hint, where there is room for it

                # ---- a reply from the page, headed with the agent's name ----
                await page.wait_for_function(
                    "() => [...document.querySelectorAll('#agent option')].some(o => o.value === 'pi')", timeout=10_000)
                await page.fill("#input", "write the note")
                await page.press("#input", "Enter")
                reply = "#messages .msg.agent.done"
                await page.wait_for_selector(reply, timeout=60_000)
                assert await page.text_content(f"{reply} > header") == "pi"
                assert (await page.text_content(f"{reply} .body") or "").strip() == "Wrote the note."
                # the session's copy of the reply (the page's stream may bring it after the chat ended) is
                # this bubble, not a second one
                await page.wait_for_selector(f'{reply}[data-ts][data-say="text"]', timeout=10_000)
                assert await page.locator('#messages .msg[data-say="text"]').count() == 1

                # ---- the side panel: Workspaces (with the diff) and Events ----
                if size == "phone":
                    assert not await _on_screen(page, "#events")  # closed: off the screen
                    await page.click("#panels")
                    await page.wait_for_function("() => document.getElementById('side').classList.contains('open')")
                    await asyncio.sleep(0.3)  # the drawer's slide
                else:
                    assert not await page.is_visible("#panels")
                row = '#workspaces .ws-row[data-agent="pi"]'
                await page.wait_for_selector(row, timeout=10_000)
                assert await page.locator(f"{row} .ws-open svg.icon").count() == 1  # the branch icon
                await page.click(f"{row} .ws-open")
                await page.wait_for_selector("#workspace-diff .ws-diff", timeout=10_000)
                assert "+from the page" in (await page.text_content("#workspace-diff .ws-diff") or "")
                for panel in ("#workspaces", "#workspace-diff", "#events"):
                    assert await _on_screen(page, panel), f"{panel} is not on the {size}'s screen"
                await page.screenshot(path=str(out / f"page-{size}-panels.png"))
                if size == "phone":
                    await page.click("#panels-close")
                    await page.wait_for_function(
                        "() => getComputedStyle(document.getElementById('side')).visibility === 'hidden'")
                assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
                await page.screenshot(path=str(out / f"page-{size}.png"))

                # ---- after a reload: the same reply, the same heading ----
                await page.reload()
                await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
                replayed = '#messages .msg[data-say="text"]'
                await page.wait_for_selector(replayed, timeout=10_000)
                assert await page.locator(replayed).count() == 1
                assert await page.text_content(f"{replayed} > header") == "pi"
                assert await page.get_attribute(replayed, "data-agent") == "pi"
                assert (await page.text_content(f"{replayed} .body") or "").strip() == "Wrote the note."
                assert await page.text_content('#messages .msg[data-say="user_feedback"] > header') == "you"
                assert not errors, errors
            finally:
                await context.close()
