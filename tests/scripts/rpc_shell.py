"""A stand-in agent for the limits tests (tests/test_agent_limits.py): it speaks just enough of pi's
RPC mode (answers get_state, runs prompts) and runs each prompt as a shell command — as a hostile
model steering a real agent would — answering with the command's exit status and the end of its
output. The command runs in a child (/bin/sh), as a real agent's bash tool does, bounded to 60 s.
"""

import json
import subprocess
import sys


def out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") == "get_state":
        out({"type": "response", "id": msg.get("id"), "command": "get_state", "success": True, "data": {}})
    elif msg.get("type") == "prompt":
        out({"type": "response", "id": msg.get("id"), "command": "prompt", "success": True})
        out({"type": "agent_start"})
        try:
            done = subprocess.run(["/bin/sh", "-c", msg["message"]], capture_output=True, timeout=60, check=False)
            text = f"exit {done.returncode}: " + (done.stdout + done.stderr).decode(errors="replace")[-2000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"failed: {exc}"
        out({"type": "message_update", "assistantMessageEvent": {"type": "text_delta", "delta": text}})
        out({"type": "agent_end", "messages": []})
