"""schemathesis hooks for the fuzz suite (tests/test_fuzz.py loads them with SCHEMATHESIS_HOOKS).

`POST /api/v1/{agent}/streaming_chat` answers `application/json-lines`, which schemathesis cannot
read by itself: without this, its response checks would skip the one streaming operation. Every
line must be RFC 8259 JSON (no NaN/Infinity: a browser's JSON.parse refuses them); the first line,
a ChatResponse, is what the document's response schema is checked against.
"""

from __future__ import annotations

from typing import Any

import schemathesis

from tests.fuzzgen import strict_json


@schemathesis.deserializer("application/json-lines")
def json_lines(ctx: Any, response: Any) -> Any:
    lines = [line for line in response.content.split(b"\n") if line.strip()]
    values = [strict_json(line) for line in lines]
    return values[0] if values else {}
