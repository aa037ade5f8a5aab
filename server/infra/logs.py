"""Structured logs: one JSON object per line on stderr, so operators can ship them as they are.

With tracing on (uibus.infra.telemetry), a line written while a span is current carries its `trace_id`
and `span_id`, so a log backend joins lines to traces."""

from __future__ import annotations

import json
import logging
import sys
import time

from uibus.infra import telemetry


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, object] | None = None) -> None:
        """`static`: fields on every line (a worker of `uibus serve --workers` adds its index)."""
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if telemetry.tracer is not None:  # tracing on: the line names the span it was written in
            ids = telemetry.ids()
            if ids is not None:
                entry.update(ids)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(level: str, **static: object) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(static))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Throttle:
    """At most `burst` log lines per `window_s` for one reason, then one line saying how many
    were left out: a client sending garbage in a loop, a store failing every call or a connection
    flood cannot flood the log. One instance per reason."""

    def __init__(self, burst: int = 10, window_s: float = 10.0) -> None:
        self.burst = burst
        self.window_s = window_s
        self._start = 0.0
        self._count = 0
        self._skipped = 0

    def allow(self) -> int | None:
        """None to skip this line; else how many were skipped before it (to mention)."""
        now = time.monotonic()
        if now - self._start >= self.window_s:
            skipped, self._skipped = self._skipped, 0
            self._start, self._count = now, 1
            return skipped
        if self._count < self.burst:
            self._count += 1
            return 0
        self._skipped += 1
        return None
