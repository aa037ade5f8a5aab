"""What the tests of ACP's `session/resume` from a cursor share (tests/test_stream_resume.py,
tests/test_resume_matrix.py): the pinned SDKs' presence, a prompt's params, and the session-log
positions (`_meta` `uibus/seq`) of the updates an editor saw, so both read a resume the same way."""

from __future__ import annotations

import shutil
from typing import Any

from tests.conftest import REPO, require
from tests.test_acp_serve import EditorProc

SDKS = REPO / "tests" / "acp" / "node_modules"


def need(sdk: str) -> None:
    """`sdk` (an npm package of tests/acp) and node here, else skipped (failed in CI)."""
    require(f"node and the pinned {sdk} (npm ci --prefix tests/acp)",
            shutil.which("node") is not None and (SDKS / sdk / "package.json").exists(), "node")


def seqs_of(ed: EditorProc, session: str, start: int = 0) -> list[int | None]:
    """The `uibus/seq` of each session/update of `session` `ed` saw from event `start` on (None
    when an update carried none)."""
    return [e["params"].get("_meta", {}).get("uibus/seq") for e in ed.events[start:]
            if e["ev"] == "update" and e["params"]["sessionId"] == session]


def prompt(session: str, text: str) -> dict[str, Any]:
    """session/prompt's params: `text` as the one content block."""
    return {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
