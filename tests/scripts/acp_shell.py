"""A stand-in ACP agent for the token-scope tests (tests/test_agent_token_scope.py): it speaks just
enough of ACP over stdio (initialize, session/new, session/prompt) and runs each prompt as a shell
command — as a hostile model steering a real agent would — with what it was offered for uibus's
/mcp in its environment (MCP_URL, MCP_TOKEN, MCP_SESSION: a real agent holds them in its MCP
configuration), answering with the command's exit status and output.
"""

import json
import os
import subprocess
import sys

offered: dict[str, str] = {}


def out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    msg = json.loads(line)
    method, ident, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
    if method == "initialize":
        out({"jsonrpc": "2.0", "id": ident, "result": {
            "protocolVersion": params.get("protocolVersion", 1), "authMethods": [],
            "agentCapabilities": {"loadSession": False, "mcpCapabilities": {"http": True, "sse": False}}}})
    elif method == "session/new":
        for server in params.get("mcpServers") or []:
            headers = {h["name"]: h["value"] for h in server.get("headers") or []}
            offered = {"MCP_URL": server.get("url", ""),
                       "MCP_TOKEN": headers.get("authorization", "").removeprefix("Bearer "),
                       "MCP_SESSION": headers.get("x-uibus-session", "")}
        out({"jsonrpc": "2.0", "id": ident, "result": {"sessionId": "shell-1"}})
    elif method == "session/prompt":
        command = "".join(b.get("text", "") for b in params.get("prompt") or [] if b.get("type") == "text")
        try:
            done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, timeout=60, check=False,
                                  env={**os.environ, **offered})
            text = f"exit {done.returncode}: " + (done.stdout + done.stderr).decode(errors="replace")[-3000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"failed: {exc}"
        out({"jsonrpc": "2.0", "method": "session/update", "params": {
            "sessionId": params.get("sessionId"),
            "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}}})
        out({"jsonrpc": "2.0", "id": ident, "result": {"stopReason": "end_turn"}})
    elif ident is not None:
        out({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": f"{method} not supported"}})
