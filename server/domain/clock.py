"""The one ClineMessage timestamp clock of an app.

A webview identifies a message by its `ts` and replaces a message with an equal one, so two
messages of a session must never share a ts. Every side that shows a message (chat turns, the
CodeBolt gateway) takes its ts from this one clock, which is strictly increasing.
"""

from __future__ import annotations

import time


class TsClock:
    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        """Unix milliseconds, later than every ts this clock gave before."""
        self._last = max(int(time.time() * 1000), self._last + 1)
        return self._last
