"""Today's Cline webview: the six cline.UiService RPCs upstream added later, driven by
the pinned grpc-js client (tests/grpcjs/today.js) against a real server; the host side goes
through HostService as a real host does; /metrics and an OTLP receiver show trackIntent counted
and traced."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from dataclasses import replace

import pytest

from tests.conftest import REPO, free_port, require, running
from tests.support import scrape_text
from tests.test_tracing import PARENT_ID, TRACE_ID, TRACEPARENT, http_receiver, otlp_http  # noqa: F401
from uibus.infra.config import Config
from uibus.pb.cline import ui_pb2

pytestmark = pytest.mark.timeout(90)


def test_the_enums_and_fields_upstream_added_are_there() -> None:
    """Additive: the original revision's numbers stay; upstream's new values and ClineMessage's seq/epoch exist."""
    assert ui_pb2.ClineSay.Value("COMPACTION") == 37 and ui_pb2.ClineSay.Value("INFO") == 26
    assert ui_pb2.ClineSay.Value("TASK_PROGRESS") == 27
    assert ui_pb2.ClineAsk.Value("REPORT_BUG") == 15 and ui_pb2.ClineAsk.Value("SUMMARIZE_TASK") == 16
    fields = ui_pb2.ClineMessage.DESCRIPTOR.fields_by_name
    assert (fields["seq"].number, fields["epoch"].number) == (24, 25)
    intent = ui_pb2.IntentEvent.DESCRIPTOR.fields_by_name
    assert [intent[n].number for n in ("action", "source", "has_text", "has_images", "has_files",
                                        "has_active_task", "text_length")] == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.node
async def test_the_six_rpcs_of_todays_cline_with_grpc_js(config: Config, otlp_http: None,  # noqa: F811
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    node = shutil.which("node")
    here = REPO / "tests" / "grpcjs"
    require("the pinned @grpc/grpc-js (bash .ci/setup)", node is not None and (
        here / "node_modules" / "@grpc" / "grpc-js").is_dir(), "node")
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with running(replace(config, http_port=free_port())) as app:
            proc = await asyncio.create_subprocess_exec(node, str(here / "today.js"), f"127.0.0.1:{app.port}",
                                                        "today", TRACEPARENT, stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            seen = json.loads(out)
            assert "error" not in seen, seen
            for rpc in ("subscribeToWorktreesButtonClicked", "subscribeToMarketplaceButtonClicked"):
                assert seen[rpc] == {"subscribers": 1, "msg": {}}, rpc
            assert seen["subscribeToShowWebview"] == {"subscribers": 1, "msg": {"preserve_editor_focus": True}}
            assert seen["openWalkthrough"] == {"reply": {}, "request": "open_walkthrough"}
            assert seen["openWalkthroughUnheard"] == "FAILED_PRECONDITION"
            assert seen["setTerminalExecutionMode"] == {
                "reply": {"key": "terminalExecutionModeSet", "value": "backgroundExec"},
                "told": {"mode": "backgroundExec"}}
            assert seen["stateAfterBackground"] == "backgroundExec"
            assert seen["setTerminalExecutionModeOff"] == {"key": "terminalExecutionModeSet",
                                                           "value": "vscodeTerminal"}
            assert seen["stateAfterTerminal"] == "vscodeTerminal"
            assert seen["trackIntent"] == {}
            assert seen["trackIntentTooLong"] == "INVALID_ARGUMENT"
            text = await scrape_text(app)
            for action, n in (("new_task_clicked", 1), ("prompt_submitted", 1), ("other", 1)):
                assert f'uibus_cline_intents_total{{action="{action}"}} {n}.0' in text, text
    intents = [s for s in got.spans if s.name.endswith("cline.UiService/trackIntent")]
    assert len(intents) == 4
    (intent,) = [s for s in intents if s.attributes.get("uibus.intent.action") == "prompt_submitted"]
    assert (intent.trace_id, intent.parent_id) == (TRACE_ID, PARENT_ID)
    assert intent.attributes["uibus.intent.action"] == "prompt_submitted"
    assert intent.attributes["uibus.intent.text_length"] == 42
    assert intent.attributes["uibus.intent.has_files"] is True
