"""Client JSON in and out: one reader for every place JSON from outside comes in, one writer for
every place uibus writes JSON to a client.

The reader (`load_json`) bounds the nesting: the C parser raises RecursionError on deep input
(about 1000 levels), and code that recurses over a parsed value (proto3 JSON, `json.dumps`) would
raise it later, where it kills a WebSocket or a call instead of answering.

It also refuses JSON that parses but poisons what uibus does with it later:

* a lone surrogate (`"\\ud800"`): RFC 8259's grammar allows the escape, but no UTF-8 encodes it,
  so the first reply, store write or protobuf field that carries the string fails — on every
  later read of a stored value, for every client;
* `NaN`, `Infinity`, `-Infinity` (Python's parser takes them; they are not JSON), and numbers a
  double cannot hold (`1e400` parses as infinity; a 400-digit integer no JavaScript peer can
  read): written back they are not JSON, and they overflow whatever converts them.

So nothing poisonous gets past the door or into the store, and `PoisonedJson` names the field
(`params.arguments.key`) so the caller learns what to fix. The check is the one pass over the
parsed value that the depth bound needs anyway; strings are looked at only when the text has a
surrogate escape (or raw non-ASCII that could hold one), paths are worked out only for a refusal.

The writer (`dump_json`) emits RFC 8259 JSON only: a non-finite number or a string UTF-8 cannot
encode raises ValueError there, in the writer, instead of reaching a client as something its
`JSON.parse` throws on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from uibus.infra.errors import InvalidArgument

MAX_DEPTH = 64  # nested arrays/objects; real payloads (themes, frames, chat contexts) use a handful
# The largest integer taken: what a double can still approximate (any peer can read it as a number).
MAX_INT = 2**1024 - 1
# A lone surrogate can only come from a \\uD800-\\uDFFF escape, or (in text that is not ASCII) a raw
# one: text with neither, nearly all of it, skips the per-string check.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_DEEP = "deep"


class PoisonedJson(InvalidArgument):
    """Parsed JSON holding a value uibus cannot keep or write back (see the module docstring).

    `path` is where: keys and indexes from the top (`("params", "arguments", "key")`), and
    `value` the parsed document, so a protocol can still answer by what is sound in it (the
    JSON-RPC id of a request whose params are poisoned)."""

    def __init__(self, message: str, path: tuple[str | int, ...], value: Any) -> None:
        super().__init__(message)
        self.path = path
        self.value = value


class _Bad:
    """A number token the parser handed over that is no finite double (kept to report its path)."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token


def path_text(what: str, path: tuple[str | int, ...]) -> str:
    """`what` and a path inside it as one name: `the body: params.arguments[0].key`."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
            continue
        # The name as the client can read it: a key may be the poison itself, or as long as a frame.
        name = step[:64].encode("utf-8", "backslashreplace").decode() + ("…" if len(step) > 64 else "")
        out += f".{name}" if out else name
    return f"{what}: {out}" if out else what


def _poison(item: Any, strings: bool = True) -> str | None:
    """Why a parsed leaf (or key) cannot be kept, None when it can."""
    if isinstance(item, _Bad):
        return f"{item.token} is not JSON (RFC 8259 has no NaN or Infinity): numbers must be finite"
    if isinstance(item, float) and not math.isfinite(item):
        return ("a number beyond a double's range (it reads as infinity) is not a number uibus can hold: "
                "numbers must be finite")
    if isinstance(item, int) and not isinstance(item, bool) and not -MAX_INT <= item <= MAX_INT:
        return f"a {len(str(abs(item)))}-digit integer is beyond a double's range: numbers must be within it"
    if strings and isinstance(item, str) and _SURROGATE.search(item):
        return ("a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which UTF-8 "
                "cannot encode: send the character itself, or a surrogate pair")
    return None


def _walk(value: Any, max_depth: int) -> Iterator[tuple[tuple[str | int, ...], Any, int]]:
    """Every node with its path and depth, without recursion (linear in the size of the value)."""
    stack: list[tuple[tuple[str | int, ...], Any, int]] = [((), value, 1)]
    while stack:
        path, item, depth = stack.pop()
        yield path, item, depth
        if isinstance(item, dict):
            if depth > max_depth:
                continue
            for key, child in item.items():
                yield (*path, key), key, depth  # the key itself, checked like a string
                stack.append(((*path, key), child, depth + 1))
        elif isinstance(item, list) and depth <= max_depth:
            stack.extend(((*path, i), child, depth + 1) for i, child in enumerate(item))


def _scan(value: Any, max_depth: int, strings: bool) -> str | None:
    """One pass over a parsed value: `_DEEP`, "poison" (something `_poison` refuses), or None.
    No paths here (building them costs on every node); the rare refusal walks again for its path.
    `strings`: whether strings need a look at all (a surrogate could be in the text)."""
    if not isinstance(value, dict | list):
        return None if _poison(value, strings) is None else "poison"
    isfinite = math.isfinite
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return _DEEP
        if type(item) is dict:
            if strings and any(_SURROGATE.search(key) for key in item):
                return "poison"
            children: Any = item.values()
        else:
            children = item
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is float:
                if not isfinite(child):
                    return "poison"
            elif kind is int:
                if not -MAX_INT <= child <= MAX_INT:
                    return "poison"
            elif kind is str:
                if strings and _SURROGATE.search(child):
                    return "poison"
            elif kind is _Bad:
                return "poison"
    return None


def load_json(text: str | bytes, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Client JSON, parsed: `InvalidArgument` names `what` when it is not JSON, nests deeper than
    `max_depth` arrays/objects, or holds what uibus cannot keep (`PoisonedJson`, naming the field).
    Never RecursionError, never a value that fails later in a writer or a converter. The check is
    one pass over the parsed value (the depth bound needs that pass anyway), in C but for it."""
    if isinstance(text, bytes | bytearray):
        try:  # strictly: json.loads would decode with surrogatepass and let encoded surrogates through
            text = bytes(text).decode(json.detect_encoding(text))
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"{what} is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_Bad)  # NaN, Infinity: kept as markers, refused below
    except RecursionError:
        raise InvalidArgument(f"{what} is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # also an integer past Python's digit limit
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None
    strings = _SURROGATE_ESCAPE.search(text) is not None or (not text.isascii() and _SURROGATE.search(text) is not None)
    found = _scan(value, max_depth, strings)
    if found is None:
        return value
    if found == _DEEP:
        raise InvalidArgument(f"{what} is nested deeper than {max_depth} levels")
    for path, item, _depth in _walk(value, max_depth):
        why = _poison(item, strings)
        if why is not None:
            raise PoisonedJson(f"{path_text(what, path)}: {why}", path, _clean(value))
    raise AssertionError("unreachable: _scan and _poison disagree")  # pragma: no cover


def _clean(value: Any) -> Any:
    """`value` with the parser's markers for bad numbers as None: what a caller may still look at."""
    if isinstance(value, _Bad):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def check_json(value: Any, what: str, max_depth: int = MAX_DEPTH) -> None:
    """InvalidArgument when an already-parsed value (from a protobuf Struct, say) holds what
    `load_json` refuses: a non-finite number or a lone surrogate, or nests too deep."""
    for path, item, depth in _walk(value, max_depth):
        if depth > max_depth and isinstance(item, dict | list):
            raise InvalidArgument(f"{what} is nested deeper than {max_depth} levels")
        why = _poison(item)
        if why is not None:
            raise PoisonedJson(f"{path_text(what, path)}: {why}", path, None)


def dump_json(value: Any, compact: bool = True) -> str:
    """RFC 8259 JSON text of `value` (one line). ValueError for a non-finite number; a string that
    UTF-8 cannot encode fails where the text is encoded (`dump_json_bytes` does both at once)."""
    return json.dumps(value, separators=(",", ":") if compact else None, ensure_ascii=False, allow_nan=False)


def dump_json_bytes(value: Any) -> bytes:
    """`dump_json` as UTF-8: ValueError (UnicodeEncodeError) for a lone surrogate, here and not in
    a client's parser."""
    return dump_json(value).encode()
