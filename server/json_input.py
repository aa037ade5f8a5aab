"""Client JSON, parsed within a depth bound: one reader for every place JSON from outside comes in.

The C parser raises RecursionError on deep input (about 1000 levels), and code that recurses over
a parsed value (proto3 JSON, `json.dumps`) would raise it later, where it kills a WebSocket or a
call instead of answering. So every entry point (CodeBolt frames, neuro-san HTTP bodies, the
theme, upstream agents' events) reads through `load_json`, which answers InvalidArgument instead.
"""

from __future__ import annotations

import json
from typing import Any

from uibus.errors import InvalidArgument

MAX_DEPTH = 64  # nested arrays/objects; real payloads (themes, frames, chat contexts) use a handful


def load_json(text: str | bytes, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Client JSON, parsed: `InvalidArgument` names `what` when it is not JSON or nests deeper than
    `max_depth` arrays/objects. Never RecursionError: the C parser raises that on deep input (about
    1000 levels), and a handler or encoder that recurses over a value (proto3 JSON, `json.dumps`)
    would raise it later, where it kills a WebSocket instead of answering. The depth check is an
    explicit stack, linear in the size of the value."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"{what} is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # also UnicodeDecodeError, for bytes that are not UTF-8/16/32
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise InvalidArgument(f"{what} is nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value
