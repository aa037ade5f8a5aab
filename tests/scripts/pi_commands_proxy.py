"""The real pi, with its `get_commands` answer replaced (tests/test_pi_slash.py): `python
pi_commands_proxy.py MODE pi-command…` runs pi and passes every line both ways unchanged, except pi's
answer to `get_commands`, which becomes, by MODE:

* `none`: `{"success": true, "data": {}}` — a pi that answers without a command list;
* `claim=a,b`: a list naming `a` and `b` extension commands, though pi has no such commands — an
  agent whose list is wrong, so that uibus takes a model prompt for a command and must still give
  the run its turn.

Everything else — the prompts, the runs, the model requests — is pi's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading


def main() -> int:
    mode, command = sys.argv[1], sys.argv[2:]
    pi = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    assert pi.stdin is not None and pi.stdout is not None
    asked: set[str] = set()  # ids of our get_commands
    claimed = mode.removeprefix("claim=").split(",") if mode.startswith("claim=") else []
    lock = threading.Lock()

    def inbound() -> None:
        for line in sys.stdin.buffer:
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict):
                with lock:
                    if message.get("type") == "get_commands":
                        asked.add(str(message.get("id")))
            pi.stdin.write(line)  # type: ignore[union-attr]
            pi.stdin.flush()  # type: ignore[union-attr]
        pi.stdin.close()  # type: ignore[union-attr]

    threading.Thread(target=inbound, daemon=True).start()
    for line in pi.stdout:
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        with lock:
            ours = isinstance(message, dict) and message.get("type") == "response" and str(message.get("id")) in asked
        if ours:
            data = {"commands": [{"name": n, "source": "extension"} for n in claimed]} if claimed else {}
            line = (json.dumps({**message, "data": data}) + "\n").encode()  # type: ignore[dict-item]
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
    return pi.wait()


if __name__ == "__main__":
    sys.exit(main())
