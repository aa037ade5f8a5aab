"""MkDocs hook (mkdocs.yml `hooks:`): the docs site's Mermaid from npm instead of a CDN, and names in
table cells that do not break mid-word.

Material for MkDocs draws ```mermaid blocks with the global `mermaid` when a page already defines
one, and fetches mermaid@11 from unpkg.com only when none is defined; offline, that fetch fails and
the diagram stays raw text. So the browser bundle of the `mermaid` package pinned by
docs-site/package-lock.json (installed by `.ci/setup`: `npm ci --prefix docs-site --ignore-scripts`)
is added to the site as MERMAID, which mkdocs.yml's `extra_javascript` loads after Material's bundle
and before the page's DOMContentLoaded, when Material looks for it. tests/test_docs_offline.py
builds the site and shows the diagram drawn with every request to another host blocked.

A browser may break a line after any hyphen, so a narrow table column showed `--http-` / `port`. A
code span with no space in a table cell is one name (a flag, an env var, a metric, a method): it gets
class NAME, which docs/assets/stylesheets/extra.css keeps on one line (copying it still gives the real
name, unlike U+2011 hyphens). Code with spaces (a message, a command) may still wrap.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

HERE = Path(__file__).resolve().parent
BUNDLE = HERE / "node_modules" / "mermaid" / "dist" / "mermaid.min.js"
MERMAID = "assets/javascripts/mermaid.min.js"  # the site path mkdocs.yml's extra_javascript names
NAME = "uibus-name"  # the class of an unbreakable name (extra.css)
_CELL = re.compile(r"<t([dh])\b([^>]*)>(.*?)</t\1>", re.DOTALL)  # cells do not nest in Markdown tables
_BARE_CODE = re.compile(r"<code>([^<\s]+)</code>")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds the pinned Mermaid bundle to the site; a build without it fails (a site that would
    fetch, or show raw text, is not built quietly)."""
    if not BUNDLE.is_file():
        raise PluginError(f"{BUNDLE} is missing: run  npm ci --prefix docs-site --ignore-scripts  "
                          "(the docs site serves Mermaid itself, from docs-site/package-lock.json)")
    files.append(File.generated(config, MERMAID, abs_src_path=str(BUNDLE)))
    return files


def _mark_names(cell: re.Match[str]) -> str:
    body = _BARE_CODE.sub(lambda m: f'<code class="{NAME}">{m.group(1)}</code>', cell.group(3))
    return f"<t{cell.group(1)}{cell.group(2)}>{body}</t{cell.group(1)}>"


def on_page_content(html: str, page: Page, **_: object) -> str:
    """Marks every space-free code span in a table cell as a name (see the module's docstring)."""
    return _CELL.sub(_mark_names, html)
