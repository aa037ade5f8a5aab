"""The envelope: what one replica tells the others through Redis pub/sub, and how it is read.

One JSON header line `[origin, session, kind, target, key, type, trace, version]`, a newline, and
the payload. `trace` is the W3C traceparent of the publish span (uibus.infra.telemetry; null when the
publish was not traced), so the replica that delivers it continues the trace; `version` is the wire
protocol its sender speaks (`PROTOCOL`).

Versions, and why the header may be shorter (docs/operations.md, "Which versions may run together"):

* 1, uibus 0.1.0 and before: `[origin, session, kind, target, key, type]`, plus the traceparent as
  a seventh field when traced. Such a replica counts a header of any other length as bad, so a
  replica that hears a live version-1 peer sends exactly this form (`encode(..., version=1)`),
  and the version is then implicit.
* 2: the eighth field. Control envelopes (hello, who, presence) carry the sender's version in their
  `key` slot, which version 1 sends as null and ignores, so every replica announces its version
  in a form every other replica reads.

A reader takes what it knows from a longer header and ignores the rest (a newer sender's additions),
so a newer envelope it can partly read is never dropped.
Protobuf items travel as their serialized bytes with the message's full name (`type`), resolved
on the receiving side through the default descriptor pool; JSON-able plain items travel as JSON
(`type` ""). Control envelopes have a `type` starting with "!": a presence announcement (payload:
`[[session, kind, count], …]`), a hello ("this replica listens") and a who ("who listens?"), the
last two with the sender's shard count in the session field.

Its own module because both ends must agree on it byte for byte, and because everything read here
comes from another process: `decode` checks the shape and every field's type, so a malformed or
hostile envelope is one `BadEnvelope` (counted by the bus), never an exception in a listener.
Plain `json.loads`, not uibus.infra.json_input: what a replica sends was read through that at the door
already, and this path runs per event on every replica, so one parse is all it pays.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

PROTOCOL = 2  # the wire protocol this code speaks (the module docstring says what each version adds)
LEGACY = 1  # uibus 0.1.0's: no version field, at most seven header fields
MAX_FIELDS = 32  # a longer header is not a newer version's, just garbage
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
    version: int = LEGACY  # the sender's wire protocol (LEGACY when its header did not say)


def encode(origin: str, session: str, kind: str, target: str | None, key: Hashable, item: Any,
           trace: str | None = None, version: int = PROTOCOL) -> bytes | None:
    """The envelope of one event, or None when the item or the key has no wire form (neither a
    protobuf message nor JSON-able; a key JSON cannot carry). `trace`: the publish's traceparent;
    `version`: the form to write, LEGACY while a live replica reads no other (uibus.infra.redis.presence)."""
    if isinstance(item, Message):
        type_name, payload = item.DESCRIPTOR.full_name, item.SerializeToString()
    else:
        try:
            type_name, payload = JSON_ITEM, json.dumps(item, separators=_SEP).encode()
        except (TypeError, ValueError):
            return None
    try:
        fields = [origin, session, kind, target, key, type_name]
        if version > LEGACY:
            fields += (trace, version)
        elif trace is not None:
            fields.append(trace)
        head = json.dumps(fields, separators=_SEP)
    except (TypeError, ValueError):
        return None
    return head.encode() + b"\n" + payload


def control(origin: str, shards: int, what: str) -> bytes:
    """A hello or a who, with the sender's shard count in the session field (replicas that
    disagree on it would each listen where the others do not publish) and its protocol version in
    the key slot (which version 1 ignores)."""
    return json.dumps([origin, str(shards), "", None, PROTOCOL, what], separators=_SEP).encode() + b"\n"


def presence(origin: str, entries: list[tuple[str, str, int]]) -> bytes:
    """An announcement of this replica's subscriber counts, `(session, kind, count)` each; the
    sender's protocol version in the key slot, as in `control`."""
    head = json.dumps([origin, "", "", None, PROTOCOL, PRESENCE], separators=_SEP).encode()
    return head + b"\n" + json.dumps(entries, separators=_SEP).encode()


def decode(data: bytes) -> Envelope:
    """The envelope's header read and checked (the payload is left as bytes); BadEnvelope when
    any part is not what a replica sends."""
    head, _, payload = data.partition(b"\n")
    try:
        fields = json.loads(head)
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nesting built to exhaust the stack
        raise BadEnvelope(f"header is not JSON: {exc}") from exc
    if type(fields) is not list or not 6 <= len(fields) <= MAX_FIELDS:
        raise BadEnvelope("header is not a list of six fields or more")
    origin, session, kind, target, key, type_name = fields[:6]
    trace = fields[6] if len(fields) > 6 else None
    if not (trace is None or type(trace) is str):
        raise BadEnvelope("the traceparent is not a string")
    version = fields[7] if len(fields) > 7 else LEGACY
    if type(version) is not int or version < LEGACY:
        raise BadEnvelope("the protocol version is not a positive number")
    if not (type(origin) is str and type(session) is str and type(kind) is str and type(type_name) is str
            and (target is None or type(target) is str)):
        raise BadEnvelope("a header field has the wrong type")
    try:
        key = _hashable(key)
    except RecursionError as exc:
        raise BadEnvelope("key nested too deep") from exc
    if type_name.startswith("!") and type(key) is int and key > LEGACY:
        version = key  # a control envelope's version rides in its key slot (see `control`)
    return Envelope(origin, session, kind, target, key, type_name, payload, trace, version)


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
