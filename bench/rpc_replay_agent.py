#!/usr/bin/env python3
"""An RPC-mode agent that replays one recorded pi turn as fast as it can write (bench/agents.py).

Why: pi writes each text delta as its own JSON line when the model's piece arrives, and each line
repeats the whole partial message twice, so two things set what uibus pays per piece for pi: the
lines' size and their pace (one line, one wake-up of uibus's event loop). This agent keeps pi's
exact bytes (the file given as argv[1], one turn captured from the real pi) and drops the pace:
it answers a `prompt` with that turn's events written back to back (a flush per line, as pi
does), so the pipe fills and uibus reads many lines per wake-up. `get_state` is answered, `abort`
acknowledged, any other command refused; it exits at the end of its input. Standard library only.
"""

from __future__ import annotations

import json
import sys

out = sys.stdout.buffer


def send(obj: dict[str, object]) -> None:
    out.write(json.dumps(obj).encode() + b"\n")
    out.flush()


def main() -> None:
    with open(sys.argv[1], "rb") as f:  # the turn's lines, its own prompt response left out
        turn = [line for line in f if line.strip() and json.loads(line).get("type") != "response"]
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        kind, ident = msg.get("type"), msg.get("id")
        if kind in ("get_state", "prompt", "abort"):
            send({"type": "response", "id": ident, "command": kind, "success": True, "data": {}})
            if kind == "prompt":
                for event in turn:
                    out.write(event)
                    out.flush()
        elif ident is not None:
            send({"type": "response", "id": ident, "command": kind, "success": False,
                  "error": f"unknown command {kind}"})


if __name__ == "__main__":
    main()
