"""The envelope: what one replica tells the others through Redis pub/sub, and how it is read.

One JSON header line `[origin, session, kind, target, key, type]`, a newline, and the payload.
With tracing on (uibus.telemetry), an event published inside a traced call has a seventh header
field, the W3C traceparent of its publish span, so the replica that delivers it continues the
trace; without tracing the envelope is exactly the six fields.
Protobuf items travel as their serialized bytes with the message's full name (`type`), resolved
on the receiving side through the default descriptor pool; JSON-able plain items travel as JSON
(`type` ""). Control envelopes have a `type` starting with "!": a presence announcement (payload:
`[[session, kind, count], …]`), a hello ("this replica listens") and a who ("who listens?"), the
last two with the sender's shard count in the session field.

Its own module because both ends must agree on it byte for byte, and because everything read here
comes from another process: `decode` checks the shape and every field's type, so a malformed or
hostile envelope is one `BadEnvelope` (counted by the bus), never an exception in a listener.
Plain `json.loads`, not uibus.json_input: what a replica sends was read through that at the door
already, and this path runs per event on every replica, so one parse is all it pays.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

JSON_ITEM = ""  # type of an envelope whose payload is a JSON value, not a protobuf
PRESENCE = "!presence"  # type of a subscription-count announcement
HELLO = "!hello"  # type of "this replica is subscribed" (after each (re)subscribe, and each heartbeat)
WHO = "!who"  # type of "who is subscribed?": every replica whose channels all are says hello
_SEP = (",", ":")


class BadEnvelope(ValueError):
    """An envelope that cannot be read: not ours, damaged, or from an incompatible version."""


@dataclass(frozen=True, slots=True)
class Envelope:
    origin: str  # the replica that sent it
    session: str  # for a hello or a who: the sender's shard count
    kind: str
    target: str | None
    key: Hashable
    type: str  # a protobuf message's full name, JSON_ITEM, or a control type ("!…")
    payload: bytes
    trace: str | None = None  # the publisher's W3C traceparent, when it was traced


def encode(origin: str, session: str, kind: str, target: str | None, key: Hashable, item: Any,
           trace: str | None = None) -> bytes | None:
    """The envelope of one event, or None when the item or the key has no wire form (neither a
    protobuf message nor JSON-able; a key JSON cannot carry). `trace`: the publish's traceparent."""
    if isinstance(item, Message):
        type_name, payload = item.DESCRIPTOR.full_name, item.SerializeToString()
    else:
        try:
            type_name, payload = JSON_ITEM, json.dumps(item, separators=_SEP).encode()
        except (TypeError, ValueError):
            return None
    try:
        fields = [origin, session, kind, target, key, type_name]
        if trace is not None:
            fields.append(trace)
        head = json.dumps(fields, separators=_SEP)
    except (TypeError, ValueError):
        return None
    return head.encode() + b"\n" + payload


def control(origin: str, shards: int, what: str) -> bytes:
    """A hello or a who, with the sender's shard count in the session field: replicas that
    disagree on it would each listen where the others do not publish."""
    return json.dumps([origin, str(shards), "", None, None, what], separators=_SEP).encode() + b"\n"


def presence(origin: str, entries: list[tuple[str, str, int]]) -> bytes:
    """An announcement of this replica's subscriber counts, `(session, kind, count)` each."""
    head = json.dumps([origin, "", "", None, None, PRESENCE], separators=_SEP).encode()
    return head + b"\n" + json.dumps(entries, separators=_SEP).encode()


def decode(data: bytes) -> Envelope:
    """The envelope's header read and checked (the payload is left as bytes); BadEnvelope when
    any part is not what a replica sends."""
    head, _, payload = data.partition(b"\n")
    try:
        fields = json.loads(head)
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nesting built to exhaust the stack
        raise BadEnvelope(f"header is not JSON: {exc}") from exc
    if type(fields) is not list or not 6 <= len(fields) <= 7:
        raise BadEnvelope("header is not a list of six (or seven, with a traceparent)")
    origin, session, kind, target, key, type_name = fields[:6]
    trace = fields[6] if len(fields) == 7 else None
    if not (trace is None or type(trace) is str):
        raise BadEnvelope("the traceparent is not a string")
    if not (type(origin) is str and type(session) is str and type(kind) is str and type(type_name) is str
            and (target is None or type(target) is str)):
        raise BadEnvelope("a header field has the wrong type")
    try:
        key = _hashable(key)
    except RecursionError as exc:
        raise BadEnvelope("key nested too deep") from exc
    return Envelope(origin, session, kind, target, key, type_name, payload, trace)


def _hashable(key: Any) -> Hashable:
    """A key as published: JSON turned its tuples into lists, and nothing else JSON makes is one."""
    if type(key) is list:
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        raise BadEnvelope("a key is an object")
    return key  # type: ignore[no-any-return]


def decode_presence(payload: bytes) -> list[tuple[str, str, int]]:
    """The `(session, kind, count)` entries of an announcement; BadEnvelope when malformed."""
    try:
        entries = json.loads(payload)
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadEnvelope(f"presence is not JSON: {exc}") from exc
    if type(entries) is not list:
        raise BadEnvelope("presence is not a list")
    out: list[tuple[str, str, int]] = []
    for entry in entries:
        if not (type(entry) is list and len(entry) == 3 and type(entry[0]) is str and type(entry[1]) is str
                and type(entry[2]) is int):
            raise BadEnvelope("a presence entry is not [session, kind, count]")
        out.append((entry[0], entry[1], entry[2]))
    return out


class Items:
    """Turns an envelope's payload back into the item published; caches each protobuf class."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Message]] = {}

    def item(self, envelope: Envelope) -> Any:
        """The item; BadEnvelope for JSON that does not parse, an unknown message type or bytes
        that are not that message."""
        try:
            if envelope.type == JSON_ITEM:
                return json.loads(envelope.payload)
            return self._message_class(envelope.type).FromString(envelope.payload)
        except (ValueError, TypeError, KeyError, DecodeError, RecursionError) as exc:
            raise BadEnvelope(f"payload of {envelope.type or 'JSON'} not readable: {exc}") from exc

    def _message_class(self, full_name: str) -> type[Message]:
        cls = self._classes.get(full_name)
        if cls is None:
            descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)  # KeyError if unknown
            cls = self._classes[full_name] = message_factory.GetMessageClass(descriptor)
        return cls
