"""uibus's HTTP port as neuro-san 0.7 (its newest release: HTTP and MCP only, Python 3.12) sees it:
the real client library from .venv-neurosan07 (made by .ci/setup from tests/neurosan07/
requirements.lock), unmodified, against a uibus server process: its `McpServiceAgentSession`
(function, and two streaming_chat turns through `/mcp`), its sync and async HTTP sessions, and its
concierge session; and two of its sessions that name no uibus session, which must not share a
conversation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.conftest import REPO, free_port, require

NEUROSAN07_PY = REPO / ".venv-neurosan07" / "bin" / "python"
SCRIPT = Path(__file__).parent / "scripts" / "neurosan07_client.py"


async def test_the_real_neuro_san_07_mcp_and_http_clients_work_against_uibus(spawn):
    require(".venv-neurosan07 with neuro-san 0.7 on Python 3.12 (made by .ci/setup)", NEUROSAN07_PY.exists())
    port = str(free_port())
    server = spawn("--http-port", port)
    await server.wait_ready()
    proc = await asyncio.create_subprocess_exec(str(NEUROSAN07_PY), str(SCRIPT), "127.0.0.1", port, "hello_world",
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=REPO)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:  # the client hangs: end it rather than leave it running after the test
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()[-3000:]
    seen = json.loads(out.decode().strip().splitlines()[-1])

    # MCP: the agent is found in tools/list under its own name, described as the concierge lists it.
    assert seen["mcp_tool_name"] == "hello_world"
    assert "deterministic local agent" in seen["mcp_function"]["function"]["description"]
    for way in ("mcp", "http"):
        [first] = seen[f"{way}_first"]
        [second] = seen[f"{way}_second"]
        assert first["response"]["type"] == "AGENT_FRAMEWORK"
        assert 'You said: "my name is Ada"' in first["response"]["text"]
        # The second turn continued from the chat_context the client carried over.
        assert 'Earlier you said: "my name is Ada" (this is turn 2).' in second["response"]["text"], way
        messages = second["response"]["chat_context"]["chat_histories"][0]["messages"]
        assert [m["text"] for m in messages][0::2] == ["my name is Ada", "what is my name?"]
    assert "This is the start of our conversation." in seen["async"][-1]["response"]["text"]
    assert [a["agent_name"] for a in seen["list"]["agents"]] == ["hello_world"]
    # Clients that name no uibus session never see each other's conversation (docs/security.md).
    for way in ("http", "mcp"):
        first, second = (turn[-1]["response"] for turn in seen[f"unnamed_{way}"])
        assert "This is the start of our conversation." in first["text"], way
        assert "This is the start of our conversation." in second["text"] and "4321" not in json.dumps(second), way
