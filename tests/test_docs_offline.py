"""The docs site works offline and reads well: built from mkdocs.yml, nothing in it loads from another
host (the architecture page's Mermaid is docs-site/'s pinned npm bundle, fonts are the system's),
and a name in a reference table is never broken mid-word.

Two views of "offline": the built files (no HTML attribute but a prose link, no CSS and no script
names another host, but for the known, unused fallbacks listed below), and the pages in real headless
Chromium with every request to a host other than loopback blocked and recorded: the diagram must be
drawn as SVG and nothing may have been asked of the outside.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.conftest import REPO, require, shots
from tests.support import needs

MERMAID_BUNDLE = REPO / "docs-site" / "node_modules" / "mermaid" / "dist" / "mermaid.min.js"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
EXTERNAL = re.compile(r"""https?://[A-Za-z0-9][A-Za-z0-9.-]*\.[A-Za-z]{2,}[^\s"'`)<>\\]*""")

# A script names many URLs it never fetches (licence comments, links in error messages, XML namespace
# names such as http://www.w3.org/2000/svg). A URL that looks fetched — a CDN's, a font service's or an
# API's host, or a path to a script, style, font or data file — must be one of these, each with why it
# is not fetched here. A new one (a Material or Mermaid upgrade) fails the test until it is read.
FETCHED_HOSTS = re.compile(r"(^|\.)(unpkg\.com|jsdelivr\.net|cdnjs\.cloudflare\.com|googleapis\.com|gstatic\.com|"
                           r"esm\.sh|skypack\.dev|fontawesome\.com|typekit\.net|api\.github\.com|bootstrapcdn\.com)$")
FETCHED_PATHS = re.compile(r"\.(m?js|css|woff2?|ttf|otf|eot|json|wasm|png|svg|gif|jpe?g|webp)$", re.IGNORECASE)
JS_KNOWN: dict[str, str] = {
    "https://unpkg.com/mermaid@11/": "Material's fallback when no global `mermaid` exists; the site loads "
                                     "its own first (the browser test sees no request)",
    "https://unpkg.com/resize-observer-polyfill": "Material's, only where the browser has no ResizeObserver",
    "https://api.github.com/": "Material's repository facts, only with `repo_url` (mkdocs.yml has none: asserted)",
}


def _looks_fetched(url: str) -> bool:
    parts = urlsplit(url)
    if parts.hostname == "github.com" and "/blob/" in parts.path:
        return False  # a source file's page (HTML), cited in a comment
    return bool(FETCHED_HOSTS.search(parts.hostname or "") or FETCHED_PATHS.search(parts.path))


@pytest.fixture(scope="module")
@needs("node")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` makes it from mkdocs.yml, in a temporary directory."""
    require("docs-site's npm packages (.ci/setup: npm ci --prefix docs-site)", MERMAID_BUNDLE.is_file(), "node")
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out),
                          "--config-file", str(REPO / "mkdocs.yml")], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def _external(url: str) -> bool:
    """An absolute or scheme-relative URL of a host other than loopback."""
    url = url.strip()
    parts = urlsplit("http:" + url if url.startswith("//") else url)
    return parts.scheme.lower() in ("http", "https", "ws", "wss") and parts.hostname not in LOOPBACK


class _Loads(HTMLParser):
    """Every URL a page would load or send to (anything but an <a href>), with where it was."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in = tag if tag in ("script", "style") else None
        for name, value in attrs:
            if not value or (tag == "a" and name == "href"):
                continue
            if name in ("src", "href", "action", "formaction", "poster", "data", "background", "manifest"):
                urls = [value]
            elif name == "srcset":
                urls = [part.split()[0] for part in value.split(",") if part.split()]
            elif name == "style" or (tag == "meta" and name == "content"):
                urls = EXTERNAL.findall(value)
            else:
                continue
            self.found += [f"<{tag} {name}={u!r}>" for u in urls if _external(u)]

    def handle_data(self, data: str) -> None:
        if self._in is not None:  # an inline script's or style's own URLs
            self.found += [f"inline <{self._in}>: {u}" for u in EXTERNAL.findall(data) if _external(u)]

    def handle_endtag(self, tag: str) -> None:
        self._in = None


def test_built_site_loads_nothing_from_another_host(site: Path) -> None:
    """No page, stylesheet or script of the built site loads from another host; a link in the prose
    (<a href>) is the only place another host may be named, and vendored scripts only the URLs listed
    in JS_KNOWN."""
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert config["theme"].get("font") == "false", "theme.font: false (else every page asks Google Fonts)"
    assert "repo_url" not in config, "repo_url makes Material ask api.github.com: see JS_KNOWN"
    bad: list[str] = []
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        parser = _Loads()
        parser.feed(page.read_text())
        bad += [f"{page.relative_to(site)}: {what}" for what in parser.found]
    sheets = sorted(site.rglob("*.css"))
    for sheet in sheets:
        text = sheet.read_text()
        urls = re.findall(r"""url\(\s*['"]?([^'")\s]+)""", text) + re.findall(r"""@import\s+['"]([^'"]+)""", text)
        bad += [f"{sheet.relative_to(site)}: {u}" for u in urls if _external(u)]
    scripts = sorted(site.rglob("*.js"))
    allowed_used: set[str] = set()
    for script in scripts:
        for url in sorted(set(EXTERNAL.findall(script.read_text(errors="replace")))):
            if not _external(url) or not _looks_fetched(url):
                continue
            hit = next((known for known in JS_KNOWN if url.startswith(known)), None)
            if hit is None:
                bad.append(f"{script.relative_to(site)}: {url}")
            else:
                allowed_used.add(hit)
    assert not bad, "the built site names other hosts outside prose links:\n" + "\n".join(bad[:50])
    assert len(pages) > 30 and sheets and len(scripts) >= 3, (len(pages), sheets, scripts)
    assert (site / "assets/javascripts/mermaid.min.js").stat().st_size > 1_000_000  # the real bundle
    # The allow-list stays honest: a listed URL no file has any longer is removed.
    stale = set(JS_KNOWN) - allowed_used
    assert not stale, f"JS_KNOWN lists URLs no script contains any more: {sorted(stale)}"


def test_the_loads_check_finds_what_it_must() -> None:
    """The scanners themselves: a font sheet, a CDN script and a preconnect are found; links are not;
    a script's CDN URL looks fetched, a licence link does not."""
    parser = _Loads()
    parser.feed('<link rel="preconnect" href="https://fonts.gstatic.com"><script src="https://unpkg.com/x.js">'
                '</script><script>import("https://cdn.example.org/m.mjs")</script><a href="https://gvisor.dev">g</a>'
                '<img src="../assets/a.png"><link href="http://127.0.0.1:8000/x.css" rel="stylesheet">')
    assert [f.split("'")[1] if "'" in f else f for f in parser.found] == [
        "https://fonts.gstatic.com", "https://unpkg.com/x.js", "inline <script>: https://cdn.example.org/m.mjs"]
    assert _looks_fetched("https://cdn.jsdelivr.net/npm/katex/dist/katex.min.css")
    assert _looks_fetched("https://fonts.googleapis.com/css?family=Roboto")
    assert not _looks_fetched("http://www.mozilla.org/MPL/") and not _looks_fetched("https://chevrotain.io/docs/x.html")


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on loopback (a plain static server, as any host would serve it)."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
async def offline(browser: Any) -> AsyncIterator[tuple[Any, list[str]]]:
    """A browser context in which every request to a host other than loopback is refused and recorded."""
    context = await browser.new_context()
    outside: list[str] = []

    async def gate(route: Any) -> None:
        url = route.request.url
        if urlsplit(url).scheme in ("http", "https", "ws", "wss") and urlsplit(url).hostname not in LOOPBACK:
            outside.append(url)
            await route.abort("internetdisconnected")
        else:
            await route.continue_()

    await context.route("**/*", gate)
    context.on("websocket", lambda ws: outside.append(ws.url) if urlsplit(ws.url).hostname not in LOOPBACK else None)
    try:
        yield context, outside
    finally:
        await context.close()


async def _shadow_svg(page: Any) -> str:
    """The outer HTML of the first <svg> under the page's Mermaid host, found through its shadow root
    (Material renders each diagram into a *closed* one, which page scripts cannot open; the DevTools
    protocol's pierce can)."""
    cdp = await page.context.new_cdp_session(page)
    root = (await cdp.send("DOM.getDocument", {"depth": -1, "pierce": True}))["root"]

    def find(node: dict[str, Any], inside_host: bool) -> int | None:
        attrs = node.get("attributes", [])
        host = inside_host or (node.get("nodeName") == "DIV" and "mermaid" in
                               dict(zip(attrs[::2], attrs[1::2], strict=True)).get("class", "").split())
        if host and node.get("nodeName", "").lower() == "svg":
            return int(node["nodeId"])
        for child in [*node.get("shadowRoots", []), *node.get("children", [])]:
            found = find(child, host)
            if found is not None:
                return found
        return None

    node_id = find(root, False)
    assert node_id is not None, "no <svg> in the diagram's host"
    html: str = (await cdp.send("DOM.getOuterHTML", {"nodeId": node_id}))["outerHTML"]
    await cdp.detach()
    return html


async def test_architecture_diagram_is_drawn_offline(served: str, offline: tuple[Any, list[str]],
                                                     tmp_path: Path) -> None:
    """The architecture page's Mermaid block becomes an SVG diagram with the outside unreachable, and
    no page visited asks another host for anything (fonts, scripts, styles)."""
    context, outside = offline
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    for path in ("/", "/getting-started/", "/reference/cli/"):
        await page.goto(served + path, wait_until="networkidle")
    await page.goto(served + "/architecture/", wait_until="networkidle")
    try:  # Material replaces the <pre class="mermaid"> by a <div class="mermaid"> host once it is drawn
        await page.wait_for_function("() => !document.querySelector('pre.mermaid') && "
                                     "document.querySelector('div.mermaid')?.getBoundingClientRect().height > 200",
                                     timeout=20_000)
    except Exception as exc:
        shown = await page.evaluate("document.querySelector('.mermaid')?.outerHTML.slice(0, 300)")
        raise AssertionError(f"the diagram was not drawn (requests refused: {outside}; errors: {errors}); "
                             f"the page shows {shown!r}") from exc
    await page.locator("div.mermaid").scroll_into_view_if_needed()
    await page.screenshot(path=str(shots(tmp_path) / "docs-architecture.png"))
    svg = await _shadow_svg(page)
    assert svg.startswith("<svg") and "edge/pipeline" in svg and "the call driver" in svg, svg[:500]
    assert not outside, f"the docs site asked other hosts: {outside}"
    assert not errors, errors


async def test_reference_names_stay_on_one_line(served: str, offline: tuple[Any, list[str]],
                                                tmp_path: Path) -> None:
    """On a phone-wide page, every space-free name in the CLI reference's tables (flags, env vars) is
    drawn on one line, where the browser would otherwise break `--http-port` after `--http-`. The
    same measure with the rule switched off shows breaks, so it measures what it claims."""
    context, outside = offline
    page = await context.new_page()
    await page.set_viewport_size({"width": 390, "height": 844})
    await page.goto(served + "/reference/cli/", wait_until="networkidle")
    measure = """() => [...document.querySelectorAll('td code')]
        .filter(c => !/\\s/.test(c.textContent))
        .map(c => [c.textContent, c.getClientRects().length])"""
    names = await page.evaluate(measure)
    broken = [name for name, lines in names if lines != 1]
    assert len(names) > 100 and not broken, f"{len(names)} names; broken across lines: {broken}"
    assert any(name == "`--http-port`".strip("`") for name, _ in names)
    await page.screenshot(path=str(shots(tmp_path) / "docs-cli-390.png"))
    await page.add_style_tag(content=".md-typeset code.uibus-name { white-space: normal !important }")
    unruled = [name for name, lines in await page.evaluate(measure) if lines != 1]
    assert unruled, "without the rule no name breaks at 390 px: the measure proves nothing"
    assert not outside, outside
