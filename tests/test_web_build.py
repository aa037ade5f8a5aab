"""The committed page (server/static/index.html) is what web/'s sources build to, byte for byte.

The page is committed so that running uibus needs no Node; this keeps it from drifting from
web/src and protos/ (an edit there without a rebuild, or a rebuild from other sources). The build
writes into a temporary file (web/build.mjs reads UIBUS_PAGE_OUT), never over the committed page.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, require, require_binary

WEB = REPO / "web"
PAGE = REPO / "server" / "static" / "index.html"


@pytest.mark.node
def test_committed_page_is_the_build_of_its_sources(tmp_path: Path) -> None:
    npm = require_binary("npm")
    require("web/'s packages (bash .ci/setup, or `cd web && npm ci`)",
            (WEB / "node_modules" / "esbuild").is_dir() and (WEB / "node_modules" / "@bufbuild" / "buf").is_dir(),
            "node")
    out = tmp_path / "index.html"
    done = subprocess.run([npm, "run", "build"], cwd=WEB, env={**os.environ, "UIBUS_PAGE_OUT": str(out)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"npm run build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert out.read_bytes() == PAGE.read_bytes(), (
        "server/static/index.html is not what web/ builds to: run `cd web && npm run build` and commit the page")
