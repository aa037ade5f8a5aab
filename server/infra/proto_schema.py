"""JSON Schema (draft 2020-12, which OpenAPI 3.1 uses as is) of protobuf messages in proto3 JSON.

The HTTP API takes and returns messages in proto3 JSON, so its OpenAPI document and the MCP tool
input schemas describe exactly that form, generated from the descriptors rather than written by
hand (a hand-written schema drifts from the .proto the day a field is added).

The contract, checked by tests/test_openapi.py:

* whatever `json_format.MessageToDict(m, preserving_proto_field_name=True)` produces validates;
* whatever validates, `json_format.ParseDict` accepts, bar what a schema cannot check: the range
  of a quoted 64-bit integer, of a Timestamp or a Duration, and whether an Any's "@type" names a
  message ParseDict knows.

So the schema describes the canonical spellings, and leaves out a few that ParseDict also takes
because they only add noise to a reader (or to a model filling in a tool call): `null` for an
absent field, the lowerCamelCase JSON names, 32-bit integers and floats in quotes, enum numbers
in quotes. Unknown fields are refused (`additionalProperties: false`), as ParseDict refuses them.

Messages are definitions referred to by `$ref`, so recursive ones (ChatContext → ChatHistory →
ChatMessage → ChatContext) work; well-known types and enums are written inline, since they are
small and a reader understands `sly_data: {"type": "object"}` at a glance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_INT32 = {"minimum": -(2**31), "maximum": 2**31 - 1}
_UINT32 = {"minimum": 0, "maximum": 2**32 - 1}
_FLOAT_MAX = 3.4028234663852886e38  # the largest finite float32: ParseDict refuses more for a `float`
# 64-bit integers are strings in proto3 JSON (a JavaScript number loses precision past 2^53); a
# plain integer is accepted too. `pattern` applies to the string form, the bounds to the number.
_INT64 = {"type": ["string", "integer"], "format": "int64", "pattern": r"^-?[0-9]+$",
          "minimum": -(2**63), "maximum": 2**63 - 1}
_UINT64 = {"type": ["string", "integer"], "format": "uint64", "pattern": r"^[0-9]+$",
           "minimum": 0, "maximum": 2**64 - 1}
# Base64, standard or URL-safe alphabet, padding optional (ParseDict takes all of these;
# MessageToDict writes the standard alphabet with padding). A lone trailing character is no byte.
_BYTES = {"type": "string", "contentEncoding": "base64",
          "pattern": r"^(?:[A-Za-z0-9+/_-]{4})*(?:[A-Za-z0-9+/_-]{2,3})?=*$"}
_NON_FINITE = ["NaN", "Infinity", "-Infinity"]

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32", **_INT32},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32", **_INT32},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32", **_INT32},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "uint32", **_UINT32},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "format": "uint32", **_UINT32},
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FIXED64: _UINT64,
    FieldDescriptor.TYPE_DOUBLE: {"anyOf": [{"type": "number"}, {"enum": _NON_FINITE}], "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"anyOf": [{"type": "number", "minimum": -_FLOAT_MAX, "maximum": _FLOAT_MAX},
                                           {"enum": _NON_FINITE}], "format": "float"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: _BYTES,
}
# Map keys are always JSON strings: the key type only constrains their spelling.
_KEY_PATTERNS: dict[int, str] = {
    FieldDescriptor.TYPE_BOOL: "^(?:true|false)$",
    **{t: r"^-?[0-9]+$" for t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
                                   FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_INT64,
                                   FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64)},
    **{t: r"^[0-9]+$" for t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32,
                                 FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64)},
}


def _wrapper(scalar: int) -> Callable[[], dict[str, Any]]:
    return lambda: copy.deepcopy(_SCALARS[scalar])


# The well-known types whose JSON form is not an object of their fields (json_format's
# _WKTJSONMETHODS and wrappers), each as it is written.
_WELL_KNOWN: dict[str, Callable[[], dict[str, Any]]] = {
    "google.protobuf.Struct": lambda: {"type": "object"},
    "google.protobuf.Value": lambda: {},  # any JSON value
    "google.protobuf.ListValue": lambda: {"type": "array"},
    "google.protobuf.Timestamp": lambda: {
        "type": "string", "format": "date-time",
        # RFC 3339 as ParseDict reads it: upper-case T, Z or an offset, at most 9 fraction digits.
        "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
                   r"(?:Z|[+-][0-9]{2}:[0-9]{2})$"},
    # Not JSON Schema's "duration" format, which is ISO 8601 ("PT1S"): protobuf writes "1.5s".
    "google.protobuf.Duration": lambda: {"type": "string", "pattern": r"^-?[0-9]+(?:\.[0-9]{1,9})?s$"},
    # Comma-separated paths in lowerCamelCase (ParseDict refuses an underscore in them).
    "google.protobuf.FieldMask": lambda: {"type": "string", "pattern": r"^(?:[A-Za-z0-9.]+(?:,[A-Za-z0-9.]+)*)?$"},
    # "@type" names the packed message, whose fields sit beside it; {} is an empty Any.
    "google.protobuf.Any": lambda: {"type": "object", "properties": {"@type": {"type": "string"}},
                                    "anyOf": [{"required": ["@type"]}, {"maxProperties": 0}]},
    "google.protobuf.Empty": lambda: {"type": "object", "additionalProperties": False},
    "google.protobuf.DoubleValue": _wrapper(FieldDescriptor.TYPE_DOUBLE),
    "google.protobuf.FloatValue": _wrapper(FieldDescriptor.TYPE_FLOAT),
    "google.protobuf.Int64Value": _wrapper(FieldDescriptor.TYPE_INT64),
    "google.protobuf.UInt64Value": _wrapper(FieldDescriptor.TYPE_UINT64),
    "google.protobuf.Int32Value": _wrapper(FieldDescriptor.TYPE_INT32),
    "google.protobuf.UInt32Value": _wrapper(FieldDescriptor.TYPE_UINT32),
    "google.protobuf.BoolValue": _wrapper(FieldDescriptor.TYPE_BOOL),
    "google.protobuf.StringValue": _wrapper(FieldDescriptor.TYPE_STRING),
    "google.protobuf.BytesValue": _wrapper(FieldDescriptor.TYPE_BYTES),
}


def _enum(enum: EnumDescriptor) -> dict[str, Any]:
    """An enum by its value names, or by the numbers it defines: ParseDict takes any number for an
    open enum, but uibus refuses a request holding one it does not define
    (uibus.infra.proto_check.undefined_enum), so the schema says what is accepted."""
    if enum.full_name == "google.protobuf.NullValue":
        return {"enum": [None, "NULL_VALUE", 0]}  # written as JSON null
    names = [v.name for v in enum.values]
    numbers = {"type": "integer", "enum": sorted({v.number for v in enum.values})}
    return {"title": enum.name, "anyOf": [{"type": "string", "enum": names}, numbers]}


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.has_options
            and field.message_type.GetOptions().map_entry)


class SchemaBook:
    """Definitions of messages by name, each added once with everything it refers to.

    One book per document, so a message used in many places is defined once and every use is a
    `$ref` to it. `ref_prefix` is where the definitions will live in that document:
    `"#/$defs/"` for a standalone JSON Schema, `"#/components/schemas/"` for OpenAPI.
    """

    def __init__(self, ref_prefix: str, nullable: bool = False) -> None:
        """`nullable`: every field may also be JSON null, which ParseDict takes as the field being
        absent (proto3 JSON's rule): for a document that must say exactly what is accepted (the
        HTTP API's, which fuzzers hold to it); left out where it is only noise (MCP tool schemas)."""
        self.prefix = ref_prefix
        self.nullable = nullable
        self.defs: dict[str, dict[str, Any]] = {}
        self._names: dict[str, str] = {}  # full name → definition name
        self._referenced: set[str] = set()  # definition names some definition refers to

    def ref(self, descriptor: Descriptor) -> dict[str, Any]:
        """`{"$ref": …}` to the message's definition, adding it (and what it refers to) if new."""
        return {"$ref": self.prefix + self._define(descriptor)}

    def _define(self, descriptor: Descriptor) -> str:
        name = self._names.get(descriptor.full_name)
        if name is not None:
            return name
        # The short name reads best; a second message of that name (another package) gets its full name.
        name = descriptor.name if descriptor.name not in self.defs else descriptor.full_name
        self._names[descriptor.full_name] = name
        schema: dict[str, Any] = {"title": name}
        self.defs[name] = schema  # before its fields, so a recursive reference finds it
        wkt = _WELL_KNOWN.get(descriptor.full_name)
        schema.update(wkt() if wkt else self._message(descriptor))
        return name

    def _use(self, descriptor: Descriptor) -> dict[str, Any]:
        """A field's message type: well-known types inline, others by reference."""
        wkt = _WELL_KNOWN.get(descriptor.full_name)
        if wkt:
            return wkt()
        name = self._define(descriptor)
        self._referenced.add(name)
        return {"$ref": self.prefix + name}

    def _message(self, descriptor: Descriptor) -> dict[str, Any]:
        properties = {f.name: self._field(f) for f in descriptor.fields}
        if self.nullable:
            properties = {name: {"anyOf": [prop, {"type": "null"}]} for name, prop in properties.items()}
        schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        required = [f.name for f in descriptor.fields if f.is_required]  # proto2 `required`
        if required:
            schema["required"] = required
        # ParseDict refuses two members of one oneof in the same object.
        pairs = [{"required": [a.name, b.name]} for oneof in descriptor.oneofs
                 for i, a in enumerate(oneof.fields) for b in oneof.fields[i + 1:]]
        if pairs:
            schema["not"] = {"anyOf": pairs}
        return schema

    def _field(self, field: FieldDescriptor) -> dict[str, Any]:
        if _is_map(field):
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            schema: dict[str, Any] = {"type": "object", "additionalProperties": self._single(value)}
            if key.type in _KEY_PATTERNS:
                schema["propertyNames"] = {"pattern": _KEY_PATTERNS[key.type]}
            return schema
        if field.is_repeated:
            return {"type": "array", "items": self._single(field)}
        return self._single(field)

    def _single(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            return self._use(field.message_type)
        if field.type == FieldDescriptor.TYPE_ENUM:
            return _enum(field.enum_type)
        return copy.deepcopy(_SCALARS[field.type])  # its own copy: a caller may edit the schema it gets


def standalone(descriptor: Descriptor, required: Sequence[str] = ()) -> dict[str, Any]:
    """A self-contained JSON Schema of one message (what an MCP tool's `inputSchema` must be).

    The message's own properties are at the top level (MCP wants `"type": "object"` and
    `"properties"` there); what it refers to is in `$defs`, including its own definition when it
    refers to itself. `required` names fields this use needs though proto3 has no required
    fields (a chat turn needs `user_message`), so the shared definition stays as the .proto says.
    """
    book = SchemaBook("#/$defs/")
    name = book._define(descriptor)
    top: dict[str, Any] = {"$schema": JSON_SCHEMA_DIALECT, **book.defs[name]}
    unknown = [f for f in required if f not in descriptor.fields_by_name]
    if unknown:
        raise ValueError(f"{descriptor.full_name} has no field {', '.join(unknown)}")
    if required:
        top["required"] = sorted({*top.get("required", ()), *required}, key=list(descriptor.fields_by_name).index)
    defs = {k: v for k, v in book.defs.items() if k != name or name in book._referenced}
    if defs:
        top["$defs"] = defs
    return copy.deepcopy(top)  # the caller may edit it: no dict shared between the top and $defs
