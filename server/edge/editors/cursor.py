"""Where an editor's view of a session stands in the session log, as ACP carries it in `_meta`
(namespaced keys, which ACP reserves `_meta` for):

* `uibus/seq` on a `session/update` (in the notification's `_meta`): the log position of the
  message the update comes from; on the answers to session/load, resume and prompt: the
  highest position the editor has been shown (its own turn's messages stream from the call, so
  the prompt's answer is where it learns how far they went);
* `uibus/since` in session/resume's `_meta`: the cursor, the highest `uibus/seq` the editor has;
  the log's events after it are replayed before the answer. The v2 draft's `replayFrom:
  {"type": "start"}` is the cursor 0 (all the log keeps);
* `uibus/gap: true` in session/resume's answer `_meta`: the cursor was below the log's floor
  (retention dropped events after it), so the replay was the session's recent history, whole.
"""

from __future__ import annotations

from typing import Any

from uibus.infra.jsonrpc import INVALID_PARAMS, RpcError
from uibus.infra.session import MAX_SINCE

SEQ_KEY = "uibus/seq"
CURSOR_KEY = "uibus/since"
GAP_KEY = "uibus/gap"


def cursor_of(params: dict[str, Any]) -> int | None:
    """session/resume's cursor: `_meta["uibus/since"]` (replay what the log holds after that seq),
    or the v2 draft's `replayFrom: {"type": "start"}` (all it keeps); None: no replay. Anything
    else is -32602, never a resume without the replay asked for."""
    meta = params.get("_meta")
    since = meta.get(CURSOR_KEY) if isinstance(meta, dict) else None
    start = params.get("replayFrom")
    if since is not None:
        if isinstance(since, str) and since.isdigit() and len(since) <= 18:
            since = int(since)
        if isinstance(since, bool) or not isinstance(since, int) or not 0 <= since <= MAX_SINCE:
            raise RpcError(INVALID_PARAMS, f"_meta.{CURSOR_KEY} must be a seq (a non-negative integer): the highest "
                                           f"_meta.{SEQ_KEY} the editor was shown")
        return since
    if start is None:
        return None
    if isinstance(start, dict) and start.get("type") == "start":
        return 0
    raise RpcError(INVALID_PARAMS, f"replayFrom {str(start)[:60]} is not supported: uibus replays from "
                                   f"{{\"type\": \"start\"}}, or from _meta.{CURSOR_KEY}")
