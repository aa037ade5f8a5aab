#!/usr/bin/env python3
"""The smallest agent that speaks pi's RPC mode, for `backend = "rpc"` (examples/pi-agent.toml).

A template for hosting your own agent behind uibus: JSON lines on stdin/stdout, split on "\\n"
only. It answers `get_state` (uibus's start-up handshake), runs a `prompt` as one agent run —
`agent_start`, a few `message_update` text deltas, `agent_end` — and, for a prompt that starts with
"ask", opens an `extension_ui_request` confirm and waits for the `extension_ui_response` with its
id (every UI of the uibus session shows it). `abort` ends the run at once. It exits at the end of
its input, as an RPC agent must (so it never outlives uibus). Standard library only.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from queue import Queue
from typing import Any

_write = threading.Lock()
answers: dict[str, Queue[dict[str, Any]]] = {}
aborted = threading.Event()


def out(obj: dict[str, Any]) -> None:
    with _write:
        sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
        sys.stdout.flush()


def ask(title: str, message: str) -> bool:
    ident = str(uuid.uuid4())
    answers[ident] = Queue()
    out({"type": "extension_ui_request", "id": ident, "method": "confirm", "title": title, "message": message,
         "timeout": 60000})
    answer = answers[ident].get()
    del answers[ident]
    return bool(answer.get("confirmed"))


def run(text: str) -> None:
    aborted.clear()
    out({"type": "agent_start"})
    reply = f"You said: {text}"
    if text.startswith("ask"):
        reply += " (you said yes)" if ask("Go ahead?", text) else " (you said no)"
    for word in reply.split(" "):
        if aborted.is_set():
            break
        out({"type": "message_update", "assistantMessageEvent": {"type": "text_delta", "delta": word + " "}})
    out({"type": "agent_end", "messages": []})


for line in sys.stdin:
    line = line.rstrip("\r\n")
    if not line:
        continue
    msg = json.loads(line)
    kind, ident = msg.get("type"), msg.get("id")
    if kind == "get_state":
        out({"type": "response", "id": ident, "command": "get_state", "success": True, "data": {}})
    elif kind == "prompt":
        out({"type": "response", "id": ident, "command": "prompt", "success": True})
        threading.Thread(target=run, args=(msg.get("message", ""),), daemon=True).start()
    elif kind == "abort":
        aborted.set()
        for queue in answers.values():
            queue.put({"cancelled": True})
        out({"type": "response", "id": ident, "command": "abort", "success": True})
    elif kind == "extension_ui_response" and ident in answers:
        answers[ident].put(msg)
    elif ident is not None:
        out({"type": "response", "id": ident, "command": kind, "success": False, "error": f"unknown command {kind}"})
