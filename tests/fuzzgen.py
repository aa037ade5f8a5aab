"""hypothesis strategies for the fuzz suite (tests/test_fuzz.py): hostile input that is *almost*
right, which is what finds bugs past the parsers.

* `json_text`: JSON *text*, built as text so it can hold what a Python value cannot be dumped
  to: lone-surrogate escapes (`"\\ud800"`), `NaN`/`Infinity` tokens, `1e400`, 400-digit
  integers — next to ordinary strings, numbers and nesting;
* `envelope`: an object of known keys (each absent, typical, or anything) — so a handler gets
  past its first check and meets the hostile value where it matters;
* `proto_message`: a protobuf message of a given type with random fields set, doubles NaN and
  infinite included, enums outside their values, Structs holding anything a double can be;
* `proto_noise` / `grpc_web_body`: protobuf-shaped bytes and gRPC-Web framing that lies.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
# Strings: mostly any Unicode text, one in four with lone surrogates mixed in.
TEXT = st.one_of(st.text(max_size=24), st.text(max_size=24), st.text(max_size=24),
                 st.text(alphabet=st.one_of(st.characters(), SURROGATES), min_size=1, max_size=24))
# A string that surely holds a lone surrogate, somewhere in ordinary text.
POISON_TEXT = st.tuples(st.text(max_size=8), SURROGATES, st.text(max_size=8)).map("".join)
# Number tokens JSON text may carry, legal or not, that Python's parser takes.
NUMBER_TOKENS = ("1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" + "0" * 400, "-" + "9" * 320, "1e30",
                 "1e308", "-0", "0.5", "2.5e-42", "4294967296", "9223372036854775808", "-2147483649", "1e-400")


def strict_json(text: str | bytes) -> Any:
    """RFC 8259 JSON only, as a browser's or codeboltjs' JSON.parse reads it (Python's parser also
    takes NaN and Infinity): what every reply of uibus must be."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON (RFC 8259 has no NaN or Infinity)")
    return json.loads(text, parse_constant=refuse)


def _dump(value: Any) -> str:
    return json.dumps(value)  # ensure_ascii: a lone surrogate becomes its \\udxxx escape


def scalar_text() -> st.SearchStrategy[str]:
    return st.one_of(
        TEXT.map(_dump),
        st.integers(-(10**30), 10**30).map(str),
        st.floats().map(_dump),  # NaN, Infinity, -Infinity as Python writes them
        st.sampled_from(NUMBER_TOKENS),
        st.sampled_from(("true", "false", "null", '""', "0", "1", "-1")),
    )


def json_text(keys: Sequence[str] = (), max_leaves: int = 10) -> st.SearchStrategy[str]:
    key = st.one_of(st.sampled_from(tuple(keys)), TEXT).map(_dump) if keys else TEXT.map(_dump)

    def nest(kids: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.lists(kids, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
            st.lists(st.tuples(key, kids), max_size=4).map(
                lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"),
        )
    return st.recursive(scalar_text(), nest, max_leaves=max_leaves)


@st.composite
def envelope(draw: st.DrawFn, fields: Mapping[str, st.SearchStrategy[str]],
             anything: st.SearchStrategy[str] | None = None, extra_keys: Sequence[str] = (),
             required: Sequence[str] = ()) -> str:
    """A JSON object (as text) of known keys, each a typical value (the strategy given, as JSON
    text) or absent (never the `required` ones) — and, half of the time, one of them (or a key of
    its own) anything at all.
    One hostile value in an otherwise sound message is what gets past a handler's first checks to
    where the value matters."""
    wild = anything if anything is not None else json_text(extra_keys)
    parts: dict[str, str] = {}
    for key, typical in fields.items():
        if key in required or draw(st.integers(0, 2)):  # two in three: present
            parts[_dump(key)] = draw(typical)
    focus = draw(st.integers(0, 2 * len(fields) + 1))  # about half the time, nothing wild at this level
    if focus < len(fields):
        parts[_dump(list(fields)[focus])] = draw(wild)
    elif focus == len(fields):
        parts[draw(TEXT.map(_dump))] = draw(wild)
    return "{" + ",".join(f"{k}:{v}" for k, v in parts.items()) + "}"


def quoted(*values: str) -> st.SearchStrategy[str]:
    return st.sampled_from(values).map(_dump)


def big_string(*sizes: int) -> st.SearchStrategy[str]:
    """A long string value (as JSON text): state and replies that approach the frame limit."""
    return st.sampled_from(sizes).map(lambda n: _dump("x" * n))


# ---- protobuf ------------------------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
SMALL_INTS = st.one_of(st.integers(-3, 20), st.sampled_from((2**31 - 1, -(2**31), 10**6, 10**9)))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.one_of(SMALL_INTS.filter(lambda n: low <= n <= high), st.integers(low, high))
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(min_size=1, max_size=24), st.text(max_size=24),
                         st.sampled_from(("", "default", "a" * 300, "hello_world", "s1")))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=24)
    if kind == FieldDescriptor.TYPE_ENUM:
        defined = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(defined), st.sampled_from(defined), st.sampled_from(defined),
                         st.integers(-5, 300))  # mostly defined: an undefined one is refused at once
    raise AssertionError(f"no strategy for field type {kind}")


def _struct_value(depth: int) -> st.SearchStrategy[Any]:
    leaf = st.one_of(st.none(), st.booleans(), st.floats(), st.sampled_from((math.nan, math.inf, -math.inf)),
                     st.text(max_size=12))
    if depth <= 0:
        return leaf
    kid = _struct_value(depth - 1)
    return st.one_of(leaf, st.lists(kid, max_size=3), st.dictionaries(st.text(max_size=8), kid, max_size=3))


def _set_value(target: struct_pb2.Value, value: Any) -> None:
    if value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, float):
        target.number_value = value  # NaN and the infinities included: valid protobuf
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, list):
        target.list_value.SetInParent()
        for item in value:
            _set_value(target.list_value.values.add(), item)
    else:
        target.struct_value.SetInParent()
        for key, item in value.items():
            _set_value(target.struct_value.fields[key], item)


@st.composite
def proto_message(draw: st.DrawFn, descriptor: Descriptor, message_class: Any, depth: int = 3) -> Message:
    """A message of `message_class` with a random subset of its fields set (recursively)."""
    message = message_class()
    _fill(draw, message, descriptor, depth)
    return message


def _fill(draw: st.DrawFn, message: Message, descriptor: Descriptor, depth: int) -> None:
    name = descriptor.full_name
    if name == "google.protobuf.Struct":
        for key, value in draw(st.dictionaries(st.text(max_size=8), _struct_value(2), min_size=1, max_size=3)).items():
            _set_value(message.fields[key], value)  # type: ignore[attr-defined]
        return
    if name == "google.protobuf.Value":
        _set_value(message, draw(_struct_value(2)))  # type: ignore[arg-type]
        return
    if name == "google.protobuf.ListValue":
        for value in draw(st.lists(_struct_value(1), max_size=3)):
            _set_value(message.values.add(), value)  # type: ignore[attr-defined]
        return
    if name.startswith("google.protobuf.") or depth <= 0:
        return  # other well-known types (Timestamp, Any, …): left empty
    for field in descriptor.fields:
        if not draw(st.integers(0, 3)):  # three in four fields set
            continue
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            entry = field.message_type
            if entry.GetOptions().map_entry:
                key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
                for key in draw(st.lists(_scalar(key_field), max_size=2)):
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        _fill(draw, value[key], value_field.message_type, depth - 1)
                    else:
                        value[key] = draw(_scalar(value_field))
            elif field.is_repeated:
                for _ in range(draw(st.integers(0, 2))):
                    _fill(draw, value.add(), field.message_type, depth - 1)
            else:
                value.SetInParent()
                _fill(draw, value, field.message_type, depth - 1)
        elif field.is_repeated:
            value.extend(draw(st.lists(_scalar(field), max_size=3)))
        else:
            setattr(message, field.name, draw(_scalar(field)))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def proto_noise(depth: int = 2) -> st.SearchStrategy[bytes]:
    """Protobuf-shaped bytes: fields 1..20 of every wire type, lengths that sometimes lie,
    nested messages, invalid UTF-8, NaN and infinite doubles."""
    doubles = st.sampled_from((math.nan, math.inf, -math.inf, 0.0, 1.5, 1e308)).map(lambda d: struct.pack("<d", d))
    leaf = st.one_of(
        st.tuples(st.integers(1, 20), st.integers(0, 2**64)).map(lambda t: _varint(t[0] << 3) + _varint(t[1])),
        st.tuples(st.integers(1, 20), doubles).map(lambda t: _varint(t[0] << 3 | 1) + t[1]),
        st.tuples(st.integers(1, 20), st.binary(max_size=8)).map(
            lambda t: _varint(t[0] << 3 | 2) + _varint(len(t[1])) + t[1]),
        st.tuples(st.integers(1, 20), st.integers(0, 40), st.binary(max_size=8)).map(  # a lying length
            lambda t: _varint(t[0] << 3 | 2) + _varint(t[1]) + t[2]),
        st.tuples(st.integers(1, 20), st.binary(min_size=4, max_size=4)).map(lambda t: _varint(t[0] << 3 | 5) + t[1]),
        st.integers(0, 255).map(lambda b: bytes([b])),  # a stray byte (groups, bad tags, truncation)
    )

    def nest(kids: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
        return st.tuples(st.integers(1, 20), st.lists(kids, max_size=3).map(b"".join)).map(
            lambda t: _varint(t[0] << 3 | 2) + _varint(len(t[1])) + t[1])
    return st.lists(st.recursive(leaf, nest, max_leaves=8), max_size=4).map(b"".join)


def grpc_web_frame(payloads: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    honest = payloads.map(lambda p: struct.pack(">BI", 0, len(p)) + p)
    lying = st.tuples(st.sampled_from((0, 1, 0x80, 0x7F, 0xFF)), st.integers(0, 2**32 - 1), payloads).map(
        lambda t: struct.pack(">BI", t[0], t[1]) + t[2])
    truncated = st.binary(max_size=4)  # less than a frame header (b"\x00\x00\x00" among them)
    return st.one_of(honest, honest, lying, truncated)


def grpc_web_body(payloads: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Zero or more frames, honest or lying, sometimes followed by trailing garbage."""
    return st.tuples(st.lists(grpc_web_frame(payloads), max_size=3).map(b"".join), st.binary(max_size=3)).map(
        lambda t: t[0] + t[1])
