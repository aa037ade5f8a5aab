"""A deliberately broken agent for the rpc backend's fault tests (tests/test_pi_agent.py): it speaks
just enough of pi's RPC mode to start (answers get_state) and then misbehaves as the prompt says:

* `garbage`: writes unparsable lines (one nested too deep to parse), a JSON array, an unknown
  event type and an unknown UI method, then a proper short run (`agent_start`, one text delta, `agent_end`);
* `long`: writes one line over any sane bound;
* `refuse`: answers the prompt `success: false`;
* `stderr`: floods stderr, then a proper run;
* `hang`: accepts the prompt and never runs it (nor answers `abort`).
With RPC_STUBBORN=1 in its environment it ignores SIGTERM and the end of its input, and starts a
child (`sleep`) in its process group: only a kill of the whole group stops them.
It is a test double for the fault paths only; the agent uibus is tested with is the real pi.
"""

import json
import os
import signal
import subprocess
import sys
import time

STUBBORN = os.environ.get("RPC_STUBBORN") == "1"
if STUBBORN:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "120"])


def out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run(text: str) -> None:
    out({"type": "agent_start"})
    out({"type": "message_update", "assistantMessageEvent": {"type": "text_delta", "delta": text}})
    out({"type": "agent_end", "messages": []})


for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") == "get_state":
        out({"type": "response", "id": msg.get("id"), "command": "get_state", "success": True, "data": {}})
    elif msg.get("type") == "prompt":
        text = msg["message"]
        if text == "refuse":
            out({"type": "response", "id": msg.get("id"), "command": "prompt", "success": False,
                 "error": "no model configured"})
            continue
        out({"type": "response", "id": msg.get("id"), "command": "prompt", "success": True})
        if text == "garbage":
            for _ in range(50):
                sys.stdout.write("this is not json\n")
            sys.stdout.write("[" * 100_000 + "]" * 100_000 + "\n")  # deeper than the parser recurses
            sys.stdout.write("[1, 2, 3]\n\n")
            out({"type": "surprise_event", "x": 1})
            out({"type": "extension_ui_request", "id": "u1", "method": "hologram"})
            run("survived garbage")
        elif text == "long":
            sys.stdout.write('{"type": "message_update", "pad": "' + "x" * (2 * 1024 * 1024) + '"}\n')
            sys.stdout.flush()
        elif text == "hang":
            pass
        elif text == "stderr":
            for i in range(2000):
                sys.stderr.write(f"noise {i} " + "y" * 500 + "\n")
            sys.stderr.flush()
            run("survived stderr")
        else:
            run(f"echo: {text}")

if STUBBORN:
    time.sleep(120)
