"""The webview page served by `GET /` and `UiService.getWebviewHtml`.

The built page ships as package data in server/static/ (see web/README for how it is built);
until it has been built, a small self-contained page still gives a browser something true.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

_FALLBACK = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>uibus</title></head>
<body><h1>uibus</h1><p>The webview bundle is not built in this install.</p></body></html>
"""


@cache
def webview_html() -> str:
    page = resources.files("uibus").joinpath("static/index.html")
    return page.read_text(encoding="utf-8") if page.is_file() else _FALLBACK
