"""Protobuf requests that decode but cannot become JSON: refused in the pipeline's decoding step.

`google.protobuf.Value.number_value` is a double, so a native or gRPC-Web client can send a
Struct (neuro-san's `sly_data`, a chat context's structures) holding NaN or an infinity: valid
protobuf, but proto3 JSON has no spelling for it inside a Struct. Stored (the session's chat
context), written to the HTTP API or MCP, or mirrored to a webview, it fails there, as INTERNAL
or a cut-off stream, for every later reader. So it is INVALID_ARGUMENT before any handler runs,
naming the field, like every other request that cannot be taken.

Only message types that can reach a Struct, Value or ListValue get a checker (worked out once
per type from the descriptors), so the Cline and extension-UI calls pay nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from uibus.infra.errors import InvalidArgument

_STRUCT = "google.protobuf.Struct"
_VALUE = "google.protobuf.Value"
_LIST = "google.protobuf.ListValue"
_DYNAMIC = (_STRUCT, _VALUE, _LIST)


def _held(field: FieldDescriptor, value: Any, where: str, item: Message) -> list[tuple[str, Any]]:
    """The messages a message-typed field of `item` holds, each with its path: a map's message
    values, a repeated field's elements, or the one message when it is set."""
    if field.message_type.GetOptions().map_entry:
        return [(f"{where}[{k!r}]", v) for k, v in value.items()] if _target(field) is not field.message_type else []
    if field.is_repeated:
        return [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return [(where, value)] if item.HasField(field.name) else []


def _message_fields(descriptor: Descriptor) -> list[FieldDescriptor]:
    return [f for f in descriptor.fields if f.type == FieldDescriptor.TYPE_MESSAGE]


def _target(field: FieldDescriptor) -> Descriptor:
    """The message a field holds: a map's value type, or the field's own."""
    message = field.message_type
    if message.GetOptions().map_entry:
        value = message.fields_by_name["value"]
        return value.message_type if value.type == FieldDescriptor.TYPE_MESSAGE else message
    return message


@functools.cache
def _reaching(root: Descriptor) -> dict[str, tuple[FieldDescriptor, ...]]:
    """For every message type reachable from `root`: its fields that can lead to a Struct (types
    that lead nowhere are absent). A fixed point, since messages nest in cycles (ChatContext →
    ChatHistory → ChatMessage → ChatContext)."""
    types: dict[str, Descriptor] = {}
    todo = [root]
    while todo:
        descriptor = todo.pop()
        if descriptor.full_name in types or descriptor.full_name in _DYNAMIC:
            continue
        types[descriptor.full_name] = descriptor
        todo.extend(_target(f) for f in _message_fields(descriptor))
    leads = set(_DYNAMIC)
    changed = True
    while changed:
        changed = False
        for name, descriptor in types.items():
            if name not in leads and any(_target(f).full_name in leads for f in _message_fields(descriptor)):
                leads.add(name)
                changed = True
    return {name: tuple(f for f in _message_fields(d) if _target(f).full_name in leads)
            for name, d in types.items() if name in leads}


def json_checker(message_class: Any) -> Callable[[Message], Message] | None:
    """A check for requests of `message_class` (raises InvalidArgument naming the field, returns the
    request), or None when the type cannot hold a Struct (or is no protobuf message class)."""
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    if not isinstance(descriptor, Descriptor):
        return None
    fields = _reaching(descriptor)
    if descriptor.full_name not in fields:
        return None

    def check(request: Message) -> Message:
        why = non_finite(request, fields)
        if why is not None:
            raise InvalidArgument(why)
        return request
    return check


def non_finite(message: Message, fields: dict[str, tuple[FieldDescriptor, ...]] | None = None) -> str | None:
    """Why `message` cannot become JSON (the first Struct number that is NaN or infinite, by its
    field path), or None. An explicit stack: a Struct nests as deep as the client sent it."""
    reaching = fields if fields is not None else _reaching(message.DESCRIPTOR)
    stack: list[tuple[str, Any]] = [("", message)]
    while stack:
        path, item = stack.pop()
        name = item.DESCRIPTOR.full_name
        if name == _STRUCT:
            stack.extend((f"{path}.{key}", value) for key, value in item.fields.items())
        elif name == _LIST:
            stack.extend((f"{path}[{i}]", value) for i, value in enumerate(item.values))
        elif name == _VALUE:
            kind = item.WhichOneof("kind")
            if kind == "number_value" and not math.isfinite(item.number_value):
                return (f"{path.lstrip('.')} is {item.number_value}: a Struct number must be finite "
                        "(JSON has no NaN or Infinity)")
            if kind == "struct_value":
                stack.append((path, item.struct_value))
            elif kind == "list_value":
                stack.append((path, item.list_value))
        else:
            for field in reaching.get(name, ()):
                stack.extend(_held(field, getattr(item, field.name), f"{path}.{field.name}", item))
    return None


def undefined_enum(message: Message) -> str | None:
    """The first enum field (by path) holding a number its enum does not define, or None.

    Open enums keep such numbers, so protobuf takes them; where uibus publishes a schema of the
    request (the HTTP API, the MCP tools), the schema lists the defined values, and a request
    outside it is refused rather than silently carried (uibus.domain.chat.check_request)."""
    stack: list[tuple[str, Message]] = [("", message)]
    while stack:
        path, item = stack.pop()
        if item.DESCRIPTOR.full_name in _DYNAMIC:
            continue
        for field, value in item.ListFields():
            where = f"{path}.{field.name}" if path else field.name
            if field.type == FieldDescriptor.TYPE_ENUM:
                numbers = value if field.is_repeated else [value]
                for number in numbers:
                    if field.enum_type.values_by_number.get(number) is None:
                        names = ", ".join(v.name for v in field.enum_type.values)
                        return f"{where}={number} is not a {field.enum_type.name} (one of: {names})"
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                stack.extend(_held(field, value, where, item))
    return None


def enum_spellings(data: Any, descriptor: Descriptor, what: str) -> None:
    """InvalidArgument when proto3 JSON spells an enum other than by a name it defines or an
    integer: ParseDict also takes `2.5e-42` (as 0), `true` and `"5"`, which the published schema
    (uibus.infra.proto_schema) does not, and a float silently becoming a different value is a bug to
    report, not a request to run. Called on the parsed JSON before ParseDict."""
    stack: list[tuple[str, Any, Descriptor]] = [("", data, descriptor)]
    while stack:
        path, item, message = stack.pop()
        if not isinstance(item, dict) or message.full_name.startswith("google.protobuf."):
            continue
        by_json = {f.json_name: f for f in message.fields}
        for key, value in item.items():
            field = message.fields_by_name.get(key) or by_json.get(key)
            if field is None or value is None:
                continue  # ParseDict refuses an unknown name; null is an absent field
            where = f"{path}.{key}" if path else key
            if field.type == FieldDescriptor.TYPE_ENUM:
                for i, one in enumerate(value if field.is_repeated and isinstance(value, list) else [value]):
                    ok = (isinstance(one, str) and one in field.enum_type.values_by_name) or (
                        isinstance(one, int) and not isinstance(one, bool))
                    if not ok:
                        at = f"{where}[{i}]" if field.is_repeated else where
                        names = ", ".join(v.name for v in field.enum_type.values)
                        raise InvalidArgument(f"{what}: {at} must be a {field.enum_type.name} name ({names}) or "
                                              f"its number, not {str(one)[:40]!r}")
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target = _target(field)
                if field.message_type.GetOptions().map_entry:
                    if target is not field.message_type and isinstance(value, dict):
                        stack.extend((f"{where}[{k!r}]", v, target) for k, v in value.items())
                elif field.is_repeated and isinstance(value, list):
                    stack.extend((f"{where}[{i}]", v, target) for i, v in enumerate(value))
                else:
                    stack.append((where, value, target))
