"""An agent's file edits shown as changes: ACP `diff` content and pi's edit/write tool arguments
become Cline's editedExistingFile / newFileCreated ClineSayTool with a real unified diff (context
lines, hunks), checked on the functions and end to end with the ACP fixture at a webview."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.conftest import free_port, require, wait_for
from tests.pikit import hosting, turn_of
from tests.test_acp_agent import ACP_DIR, fixture_agent
from uibus.agents.diffs import MAX_LINES, stats, unified
from uibus.agents.views import acp_tool, pi_tool
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc

OLD = "".join(f"line {i}\n" for i in range(1, 301))
NEW = OLD.replace("line 150\n", "line one-fifty\n")


def test_a_one_line_change_in_300_lines_is_one_hunk_with_context() -> None:
    diff = unified("src/big.txt", OLD, NEW)
    lines = diff.splitlines()
    assert lines[:3] == ["--- a/src/big.txt", "+++ b/src/big.txt", "@@ -147,7 +147,7 @@"]
    assert lines[3:] == [" line 147", " line 148", " line 149", "-line 150", "+line one-fifty", " line 151",
                         " line 152", " line 153"]
    assert stats(diff) == (1, 1)


def test_a_new_file_and_a_missing_newline_and_a_huge_diff() -> None:
    assert unified("a.txt", None, "x\ny").splitlines() == [
        "--- /dev/null", "+++ b/a.txt", "@@ -0,0 +1,2 @@", "+x", "+y", "\\ No newline at end of file"]
    huge = unified("h.txt", None, "".join(f"{i}\n" for i in range(MAX_LINES * 2)))
    assert len(huge.splitlines()) == MAX_LINES + 1 and huge.endswith("more lines of this diff not shown")


def test_pi_edit_and_write_tools() -> None:
    edit = json.loads(pi_tool("edit", {"path": "big.txt", "edits": [
        {"oldText": "a\nb\nc\n", "newText": "a\nB\nc\n"}, {"oldText": "z", "newText": "zz"}]}, None))
    assert edit["tool"] == "editedExistingFile" and edit["path"] == "big.txt"
    assert edit["diff"].splitlines() == [
        "--- a/big.txt", "+++ b/big.txt", "@@ -1,3 +1,3 @@", " a", "-b", "+B", " c",
        "--- a/big.txt", "+++ b/big.txt", "@@ -1 +1 @@", "-z", "\\ No newline at end of file", "+zz",
        "\\ No newline at end of file"]
    legacy = json.loads(pi_tool("edit", {"path": "f", "oldText": "1\n", "newText": "2\n"}, None))
    assert legacy["diff"].splitlines()[2:] == ["@@ -1 +1 @@", "-1", "+2"]
    write = json.loads(pi_tool("write", {"path": "new.md", "content": "# hi\n"}, None))
    assert write == {"tool": "newFileCreated", "path": "new.md", "content": "# hi\n",
                     "diff": "--- /dev/null\n+++ b/new.md\n@@ -0,0 +1 @@\n+# hi"}


def test_acp_tool_with_diff_content() -> None:
    call = {"title": "Edit", "kind": "edit", "status": "completed", "locations": [{"path": "/w/big.txt"}],
            "output": unified("/w/big.txt", OLD, NEW) + "\n"}
    assert json.loads(acp_tool(call))["tool"] == "editedExistingFile"
    created = dict(call, output=unified("/w/n.txt", None, "a\nb\n") + "\n")
    body = json.loads(acp_tool(created))
    assert body["tool"] == "newFileCreated" and body["content"] == "a\nb"


@pytest.mark.node
@pytest.mark.timeout(60)
async def test_an_acp_edit_reaches_the_webview_as_a_line_diff(config: Config, tmp_path: Path) -> None:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    async with hosting(config, tmp_path, [fixture_agent(tmp_path)], http_port=free_port()) as app, \
            Connection(f"127.0.0.1:{app.port}", session="diffs") as conn:
        webview = ui_pb2_grpc.UiServiceStub(conn.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
        await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "diffs") == 1, what="webview")
        await turn_of(conn, "acp", "diff")
        tools: dict[int, ui_pb2.ClineMessage] = {}
        async with asyncio.timeout(10):
            while len({m.ts for m in tools.values() if not m.partial}) < 2:
                m = await webview.read()
                if m.say == ui_pb2.TOOL_SAY:
                    tools[m.ts] = m
        edit, created = (json.loads(m.text) for _, m in sorted(tools.items()))
        assert edit["tool"] == "editedExistingFile" and edit["path"] == "/work/notes.txt"
        assert "\n-line 15\n+line fifteen\n" in edit["diff"] and "@@ -12,7 +12,7 @@" in edit["diff"]
        assert stats(edit["diff"]) == (1, 1)
        assert created["tool"] == "newFileCreated" and created["content"] == "hello\nworld"
        webview.cancel()


def test_an_agents_image_shows_inline_when_small_and_is_named_when_not() -> None:
    from uibus.agents.attachments import INLINE_IMAGE_B64, image_markdown

    assert image_markdown("image/png", "iVBORw0KGgo=") == "\n![image](data:image/png;base64,iVBORw0KGgo=)\n"
    assert image_markdown("image/svg+xml", "PHN2Zz4=") == "\n[image: image/svg+xml, 6 bytes]\n"  # no SVG inline
    big = "A" * (INLINE_IMAGE_B64 + 4)
    assert image_markdown("image/png", big).startswith("\n[image: image/png, ")
    assert image_markdown("image/png", "a)b") == "\n[image: image/png, 2 bytes]\n"  # not base64: never markdown
