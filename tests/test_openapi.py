"""`GET /api/v1/docs` and the proto → JSON Schema generator behind it, checked against reality.

The document is only worth serving if what the server really sends matches it: every answer of a
live server over real HTTP (list, function, connectivity, MINIMAL and MAXIMAL chat streams, error
bodies) is validated against the schema the document names for that path and status. The
generator's contract (uibus.infra.proto_schema) is checked both ways: MessageToDict output validates,
and what the schema accepts ParseDict accepts.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    empty_pb2,
    field_mask_pb2,
    json_format,
    message_factory,
    struct_pb2,
    text_format,
    timestamp_pb2,
    wrappers_pb2,
)
from google.protobuf.message import Message
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.conftest import free_port, running
from uibus.edge.transports import neurosan_http, openapi, sessions_http
from uibus.infra import session
from uibus.infra.config import Config
from uibus.infra.proto_schema import SchemaBook, standalone
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2, concierge_pb2, mime_data_pb2

AGENT = "hello_world"  # the built-in local agent
DOC_URI = "urn:uibus:openapi"


# --- helpers: the schema the document names for an answer ----------------------------------------

def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")


def response_schema(doc: dict[str, Any], path: str, method: str, status: int,
                    media: str = "application/json") -> Draft202012Validator:
    """A validator for the body the document declares for `status` of `method path` (its
    `default` response when the status is not listed, the shared MethodNotAllowed response when
    the path has no such method), resolving `$ref`s within the document."""
    if method not in doc["paths"][path]:
        assert status == 405
        pointer = "/components/responses/MethodNotAllowed"
        response = doc["components"]["responses"]["MethodNotAllowed"]
    else:
        responses = doc["paths"][path][method]["responses"]
        key = str(status) if str(status) in responses else "default"
        pointer = f"/paths/{_escape(path)}/{method}/responses/{key}"
        response = responses[key]
    if "$ref" in response:  # a shared response (components/responses)
        pointer = response["$ref"].removeprefix("#")
        response = doc["components"]["responses"][pointer.rsplit("/", 1)[1]]
    assert media in response["content"], (path, method, status, list(response["content"]))
    pointer += f"/content/{_escape(media)}/schema"
    registry: Registry = Registry().with_resource(DOC_URI, Resource.from_contents(doc, DRAFT202012))
    return Draft202012Validator({"$ref": f"{DOC_URI}#{pointer}"}, registry=registry)


def assert_valid(validator: Draft202012Validator, instance: Any) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, (errors, json.dumps(instance)[:500])


# --- over real HTTP ------------------------------------------------------------------------------

async def chat_lines(http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> list[dict]:
    async with http.stream("POST", f"/api/v1/{AGENT}/streaming_chat", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"] == "application/json-lines"
        return [json.loads(line) async for line in resp.aiter_lines() if line.strip()]


async def test_every_answer_matches_the_document(web_http: httpx.AsyncClient) -> None:
    resp = await web_http.get("/api/v1/docs")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    doc = resp.json()
    validate_openapi(doc)
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "uibus — neuro-san HTTP API"
    assert resp.content == openapi.document_json()  # built once, served as cached

    listed = (await web_http.get("/api/v1/list")).json()
    assert AGENT in [a["agent_name"] for a in listed["agents"]]
    assert_valid(response_schema(doc, "/api/v1/list", "get", 200), listed)
    for endpoint in ("function", "connectivity"):
        r = await web_http.get(f"/api/v1/{AGENT}/{endpoint}")
        assert r.status_code == 200
        assert_valid(response_schema(doc, f"/api/v1/{{agent_name}}/{endpoint}", "get", 200), r.json())

    chat = "/api/v1/{agent_name}/streaming_chat"
    lines_schema = response_schema(doc, chat, "post", 200, "application/json-lines")
    headers = {"x-uibus-session": "openapi", "user_id": "u1", "request_id": "r1"}
    minimal = await chat_lines(web_http, {"user_message": {"type": "HUMAN", "text": "hi"}}, headers)
    maximal = await chat_lines(web_http, {
        "user_message": {"type": "HUMAN", "text": "again"},
        "chat_context": minimal[-1]["response"]["chat_context"],
        "chat_filter": {"chat_filter_type": "MAXIMAL"}, "sly_data": {"chunks": 3, "delay_ms": 0, "a": [1, None]},
    }, headers)
    assert len(minimal) == 1 and len(maximal) > 3 and "request" in maximal[0]  # MAXIMAL echoes the request
    for line in minimal + maximal:
        assert_valid(lines_schema, line)

    errors = [
        ("get", "/api/v1/no_such_agent/function", "/api/v1/{agent_name}/function", None, 404),
        ("post", "/api/v1/no_such_agent/streaming_chat", chat, {"user_message": {"text": "hi"}}, 404),
        ("post", f"/api/v1/{AGENT}/streaming_chat", chat, b"{not json", 400),
        ("post", f"/api/v1/{AGENT}/streaming_chat", chat, {"no_such_field": 1}, 400),
        ("post", f"/api/v1/{AGENT}/streaming_chat", chat, {"chat_filter": {"chat_filter_type": 9}}, 400),
        ("get", f"/api/v1/{AGENT}/streaming_chat", chat, None, 405),
        ("get", "/api/v1/bad%20name/function", "/api/v1/{agent_name}/function", None, 400),
        ("post", "/api/v1/docs", "/api/v1/docs", b"", 405),
    ]
    for method, url, path, body, status in errors:
        content = body if isinstance(body, bytes) else None
        r = await web_http.request(method.upper(), url, content=content, json=None if content is not None else body)
        assert r.status_code == status, (url, r.status_code, r.text)
        assert_valid(response_schema(doc, path, method, status), r.json())


async def test_every_sessions_api_answer_matches_the_document(web_http: httpx.AsyncClient) -> None:
    doc = (await web_http.get("/api/v1/docs")).json()
    base = openapi.SESSIONS_PATH
    on = {"x-uibus-session": "openapi-sessions"}

    def check(path: str, method: str, r: httpx.Response, media: str = "application/json") -> Any:
        assert r.headers["content-type"] == media, (path, r.status_code, r.text)
        body = r.json() if media == "application/json" else [json.loads(x) for x in r.text.splitlines() if x]
        for item in body if isinstance(body, list) else [body]:
            assert_valid(response_schema(doc, path, method, r.status_code, media), item)
        return body

    created = check(f"{base}/CreateSession", "post", await web_http.post(
        f"{base}/CreateSession", json={"title": "documented", "agent": AGENT}, headers=on))
    assert created["session"] == "openapi-sessions" and created["title"] == "documented"
    await chat_lines(web_http, {"user_message": {"text": "hi"}}, on)  # a turn: the entry names its agent
    listed = check(base, "get", await web_http.get(base, params={"prefix": "openapi-"}))
    assert [s["session"] for s in listed["sessions"]] == ["openapi-sessions"]
    async with web_http.stream("GET", f"{base}/watch", params={"prefix": "openapi-"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json-lines"
        first = json.loads(await anext(resp.aiter_lines()))
    assert_valid(response_schema(doc, f"{base}/watch", "get", 200, "application/json-lines"), first)
    assert check(f"{base}/StopTurn", "post", await web_http.post(
        f"{base}/StopTurn", json={"agent": AGENT}, headers=on)) == {}  # nothing ran: `stopped` false (absent)
    errors = [  # a local agent never runs as a hosted agent: nothing live to steer (404); bad bodies; methods
        ("post", "SetMode", {"agent": AGENT, "mode_id": "plan"}, 404),
        ("post", "NewConversation", {"agent": AGENT}, 404),
        ("post", "SetMode", {"mode_id": "plan"}, 400),
        ("post", "SetModel", {"no_such_field": 1}, 400),
        ("get", "CreateSession", None, 405),
        ("post", "", None, 405),
    ]
    for method, rpc, body, status in errors:
        path = f"{base}/{rpc}" if rpc else base
        r = await web_http.request(method.upper(), path, json=body, headers=on)
        assert r.status_code == status, (path, r.status_code, r.text)
        check(path, method, r)
    assert check(f"{base}/DeleteSession", "post", await web_http.post(f"{base}/DeleteSession", headers=on)) == {}
    gone = await web_http.post(f"{base}/DeleteSession", headers=on)
    assert gone.status_code == 404 and check(f"{base}/DeleteSession", "post", gone)["code"] == "NOT_FOUND"


@pytest.fixture
def token_config(config: Config, tmp_path: Path) -> Config:
    """Tokens on (an operator's, and a tenant's for `team-a-*` sessions) and a small message limit."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tenant-token team-a-*\n")
    return replace(config, http_port=free_port(), auth_token="tok", tokens_file=str(tokens),
                   max_message_bytes=256 * 1024, chat_context_bytes=64 * 1024)


async def test_docs_are_open_and_auth_and_limit_errors_match(token_config: Config) -> None:
    async with running(token_config) as app, httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as http:
        resp = await http.get("/api/v1/docs")  # no token needed, like /healthz
        assert resp.status_code == 200
        doc = resp.json()
        assert doc["paths"]["/api/v1/docs"]["get"]["security"] == []
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"

        chat = f"/api/v1/{AGENT}/streaming_chat"
        cases = [
            ({}, {"user_message": {"text": "hi"}}, 401),
            ({"authorization": "Bearer tenant-token", "x-uibus-session": "team-b"}, {"user_message": {"text": "hi"}},
             403),
            ({"authorization": "Bearer tok"}, {"user_message": {"text": "x" * 300_000}}, 429),
        ]
        for headers, body, status in cases:
            r = await http.post(chat, json=body, headers=headers)
            assert r.status_code == status, r.text
            assert r.json()["code"] in ("UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED")
            assert_valid(response_schema(doc, "/api/v1/{agent_name}/streaming_chat", "post", status), r.json())
        r = await http.get("/api/v1/list")
        assert r.status_code == 401
        assert_valid(response_schema(doc, "/api/v1/list", "get", 401), r.json())
        ok = await http.post(chat, json={"user_message": {"text": "hi"}},
                             headers={"authorization": "Bearer tenant-token", "x-uibus-session": "team-a-1"})
        assert ok.status_code == 200


# --- the document and the generator, without a server -------------------------------------------

def test_document_names_what_the_server_enforces() -> None:
    doc = openapi.document("9.9.9")
    validate_openapi(doc)
    assert doc["info"]["version"] == "9.9.9"
    assert openapi.AGENT_NAME_PATTERN == f"^{neurosan_http._AGENT.pattern}$"
    assert openapi.SESSION_PATTERN == f"^{session._VALID.pattern}$"
    chat = doc["paths"]["/api/v1/{agent_name}/streaming_chat"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    assert chat["requestBody"]["required"] is False  # an empty body is an empty request: one empty answer
    for path in ("/api/v1/list", "/api/v1/{agent_name}/function"):  # calls about no session take no session header
        assert "#/components/parameters/Session" not in {p.get("$ref") for p in doc["paths"][path]["get"]["parameters"]}
    assert {p.get("name") or p["$ref"] for p in chat["parameters"]} >= {
        "agent_name", "#/components/parameters/Session", "user_id", "request_id"}
    assert doc["components"]["parameters"]["Session"]["name"] == "x-uibus-session"
    for status in ("400", "401", "403", "404", "429", "503"):
        assert status in chat["responses"]
    sessions = doc["paths"][openapi.SESSIONS_PATH]["get"]  # a listing is of every session the token may use
    assert "#/components/parameters/Session" not in {p.get("$ref") for p in sessions["parameters"]}
    assert sessions["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SessionList"}
    for rpc in sessions_http._POSTS:  # every endpoint the HTTP API serves is documented
        post = doc["paths"][f"{openapi.SESSIONS_PATH}/{rpc}"]["post"]
        assert {p.get("$ref") for p in post["parameters"]} == {"#/components/parameters/Session"}
    assert set(sessions_http._POSTS) == set(openapi._SESSION_POSTS)
    schemas = doc["components"]["schemas"]
    assert all(s["title"] == name for name, s in schemas.items())
    assert {"ChatRequest", "ChatResponse", "ChatMessage", "ChatContext", "ChatHistory", "Error"} <= set(schemas)


CHAT_REQUEST = standalone(agent_pb2.ChatRequest.DESCRIPTOR, required=["user_message"])
CONTEXT = {"chat_histories": [{"origin": [{"tool": AGENT, "instantiation_index": 1}], "messages": [
    {"type": "HUMAN", "text": "hi"}, {"type": "AI", "text": "hello", "structure": {"k": [1, "x"]}},
    {"type": "AGENT_FRAMEWORK", "text": "nested", "chat_context": {"chat_histories": []}}]}]}


@pytest.mark.parametrize("request_dict", [
    {"user_message": {"type": "HUMAN", "text": "hi"}},
    {"user_message": {"type": "HUMAN", "text": "hi"}, "chat_context": CONTEXT,
     "chat_filter": {"chat_filter_type": "MAXIMAL"}, "sly_data": {"a": 1}},
    {"user_message": {"type": 2, "text": "by number", "mime_data": [{"mime_type": "image/png", "mime_bytes": "iVBO"}],
                      "sly_data": {}}, "chat_filter": {"chat_filter_type": 1}},
])
def test_chat_request_schema_accepts_what_clients_send(request_dict: dict[str, Any]) -> None:
    Draft202012Validator.check_schema(CHAT_REQUEST)
    assert CHAT_REQUEST["type"] == "object" and "user_message" in CHAT_REQUEST["properties"]
    assert_valid(Draft202012Validator(CHAT_REQUEST), request_dict)
    json_format.ParseDict(request_dict, agent_pb2.ChatRequest())  # and so does ParseDict


@pytest.mark.parametrize("request_dict", [
    {"user_message": 5},
    {},  # the tool needs a user message
    {"user_message": {"text": 5}},
    {"user_message": {"type": "SHOUT"}},
    {"user_message": {"text": "hi"}, "sly_data": []},
    {"user_message": {"text": "hi"}, "usr_message": {}},
    {"user_message": {"text": "hi", "mime_data": [{"mime_bytes": "a"}]}},  # one base64 character is no byte
    {"user_message": {"text": "hi"},
     "chat_context": {"chat_histories": [{"origin": [{"instantiation_index": 2**31}]}]}},
    # An open enum's undefined number: ParseDict takes it, uibus refuses it (check_request).
    {"user_message": {"text": "open enum", "type": 57}},
    {"user_message": {"text": "hi"}, "chat_context": {"chat_histories": [{"messages": [{"type": 2632}]}]}},
])
def test_chat_request_schema_rejects_what_is_not_a_request(request_dict: dict[str, Any]) -> None:
    assert not Draft202012Validator(CHAT_REQUEST).is_valid(request_dict)


def _chat_response() -> agent_pb2.ChatResponse:
    response = agent_pb2.ChatResponse()
    json_format.ParseDict({"request": {"user_message": {"text": "q"}, "chat_filter": {"chat_filter_type": "MAXIMAL"}},
                           "response": {"type": "AGENT_FRAMEWORK", "text": "a", "chat_context": CONTEXT,
                                        "origin": [{"tool": AGENT}], "tool_result_origin": [{"tool": "t"}],
                                        "sly_data": {"n": None, "f": 1.5}}}, response)
    response.response.mime_data.add(mime_type="application/octet-stream", mime_bytes=bytes(range(256)))
    return response


def _real_messages() -> list[Message]:
    function = agent_pb2.FunctionResponse()
    function.function.description = "d"
    function.function.parameters.update({"type": "object", "properties": {"x": {"type": "string"}}})
    connectivity = agent_pb2.ConnectivityResponse(connectivity_info=[
        agent_pb2.ConnectivityInfo(origin=AGENT, tools=["a", "b"], display_as="llm_agent")])
    connectivity.metadata.update({"m": True})
    return [
        _chat_response(), function, connectivity, agent_pb2.ChatRequest(),
        concierge_pb2.ConciergeResponse(agents=[concierge_pb2.AgentInfo(agent_name="a", description="d", tags=["t"])]),
        mime_data_pb2.MimeData(mime_bytes=b"\xfb\xff"),
    ]


@pytest.mark.parametrize("message", _real_messages(), ids=lambda m: m.DESCRIPTOR.name)
def test_message_to_dict_validates(message: Message) -> None:
    as_dict = json_format.MessageToDict(message, preserving_proto_field_name=True)
    schema = standalone(message.DESCRIPTOR)
    Draft202012Validator.check_schema(schema)
    assert_valid(Draft202012Validator(schema), as_dict)
    # and the OpenAPI document's definition of it, where it has one
    doc = openapi.document("0")
    if message.DESCRIPTOR.name in doc["components"]["schemas"]:
        registry: Registry = Registry().with_resource(DOC_URI, Resource.from_contents(doc, DRAFT202012))
        ref = {"$ref": f"{DOC_URI}#/components/schemas/{message.DESCRIPTOR.name}"}
        assert_valid(Draft202012Validator(ref, registry=registry), as_dict)


def test_recursive_and_self_referencing_messages() -> None:
    ctx = standalone(chat_pb2.ChatContext.DESCRIPTOR)
    assert ctx["$defs"]["ChatContext"]["properties"] == ctx["properties"]  # reached again via ChatMessage
    assert "ChatMessage" in ctx["$defs"] and "$defs" not in ctx["$defs"]["ChatContext"]
    assert "ChatRequest" not in CHAT_REQUEST["$defs"]  # nothing refers back to the top
    assert "required" not in CHAT_REQUEST["$defs"]["ChatMessage"]
    with pytest.raises(ValueError, match="no field"):
        standalone(agent_pb2.ChatRequest.DESCRIPTOR, required=["nope"])


# --- every kind of field, on a message built for the purpose --------------------------------------

_KITCHEN = """
name: "uibus_test/kitchen.proto" package: "uibus_test" syntax: "proto3"
dependency: ["google/protobuf/any.proto", "google/protobuf/duration.proto", "google/protobuf/empty.proto",
             "google/protobuf/field_mask.proto", "google/protobuf/struct.proto",
             "google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"]
message_type {
  name: "Kitchen"
  field { name: "i32" number: 1 type: TYPE_INT32 label: LABEL_OPTIONAL }
  field { name: "i64" number: 2 type: TYPE_INT64 label: LABEL_OPTIONAL }
  field { name: "u32" number: 3 type: TYPE_UINT32 label: LABEL_OPTIONAL }
  field { name: "u64" number: 4 type: TYPE_UINT64 label: LABEL_OPTIONAL }
  field { name: "s64" number: 5 type: TYPE_SINT64 label: LABEL_OPTIONAL }
  field { name: "f64" number: 6 type: TYPE_FIXED64 label: LABEL_OPTIONAL }
  field { name: "dbl" number: 7 type: TYPE_DOUBLE label: LABEL_REPEATED }
  field { name: "flt" number: 8 type: TYPE_FLOAT label: LABEL_REPEATED }
  field { name: "flag" number: 9 type: TYPE_BOOL label: LABEL_OPTIONAL }
  field { name: "blob" number: 10 type: TYPE_BYTES label: LABEL_OPTIONAL }
  field { name: "mood" number: 11 type: TYPE_ENUM type_name: ".uibus_test.Kitchen.Mood" label: LABEL_OPTIONAL }
  field { name: "labels" number: 12 type: TYPE_MESSAGE type_name: ".uibus_test.Kitchen.LabelsEntry"
          label: LABEL_REPEATED }
  field { name: "by_id" number: 13 type: TYPE_MESSAGE type_name: ".uibus_test.Kitchen.ByIdEntry"
          label: LABEL_REPEATED }
  field { name: "by_flag" number: 14 type: TYPE_MESSAGE type_name: ".uibus_test.Kitchen.ByFlagEntry"
          label: LABEL_REPEATED }
  field { name: "at" number: 15 type: TYPE_MESSAGE type_name: ".google.protobuf.Timestamp" label: LABEL_OPTIONAL }
  field { name: "took" number: 16 type: TYPE_MESSAGE type_name: ".google.protobuf.Duration" label: LABEL_OPTIONAL }
  field { name: "mask" number: 17 type: TYPE_MESSAGE type_name: ".google.protobuf.FieldMask" label: LABEL_OPTIONAL }
  field { name: "anys" number: 18 type: TYPE_MESSAGE type_name: ".google.protobuf.Any" label: LABEL_REPEATED }
  field { name: "nothing" number: 19 type: TYPE_MESSAGE type_name: ".google.protobuf.Empty" label: LABEL_OPTIONAL }
  field { name: "list" number: 20 type: TYPE_MESSAGE type_name: ".google.protobuf.ListValue" label: LABEL_OPTIONAL }
  field { name: "values" number: 21 type: TYPE_MESSAGE type_name: ".google.protobuf.Value" label: LABEL_REPEATED }
  field { name: "i64w" number: 22 type: TYPE_MESSAGE type_name: ".google.protobuf.Int64Value" label: LABEL_OPTIONAL }
  field { name: "strw" number: 23 type: TYPE_MESSAGE type_name: ".google.protobuf.StringValue" label: LABEL_OPTIONAL }
  field { name: "blobw" number: 24 type: TYPE_MESSAGE type_name: ".google.protobuf.BytesValue" label: LABEL_OPTIONAL }
  field { name: "child" number: 25 type: TYPE_MESSAGE type_name: ".uibus_test.Kitchen" label: LABEL_OPTIONAL }
  field { name: "pick_text" number: 26 type: TYPE_STRING label: LABEL_OPTIONAL oneof_index: 0 }
  field { name: "pick_null" number: 27 type: TYPE_ENUM type_name: ".google.protobuf.NullValue" label: LABEL_OPTIONAL
          oneof_index: 0 }
  field { name: "pick_msg" number: 28 type: TYPE_MESSAGE type_name: ".uibus_test.ChatMessage" label: LABEL_OPTIONAL
          oneof_index: 0 }
  nested_type { name: "LabelsEntry" options { map_entry: true }
    field { name: "key" number: 1 type: TYPE_STRING label: LABEL_OPTIONAL }
    field { name: "value" number: 2 type: TYPE_STRING label: LABEL_OPTIONAL } }
  nested_type { name: "ByIdEntry" options { map_entry: true }
    field { name: "key" number: 1 type: TYPE_INT64 label: LABEL_OPTIONAL }
    field { name: "value" number: 2 type: TYPE_MESSAGE type_name: ".uibus_test.ChatMessage" label: LABEL_OPTIONAL } }
  nested_type { name: "ByFlagEntry" options { map_entry: true }
    field { name: "key" number: 1 type: TYPE_BOOL label: LABEL_OPTIONAL }
    field { name: "value" number: 2 type: TYPE_ENUM type_name: ".uibus_test.Kitchen.Mood" label: LABEL_OPTIONAL } }
  enum_type { name: "Mood" value { name: "MOOD_UNKNOWN" number: 0 } value { name: "HAPPY" number: 1 } }
  oneof_decl { name: "pick" }
}
message_type { name: "ChatMessage" field { name: "note" number: 1 type: TYPE_STRING label: LABEL_OPTIONAL } }
"""
_STRICT = """
name: "uibus_test/strict.proto" package: "uibus_test.v2" syntax: "proto2"
message_type {
  name: "Strict"
  field { name: "name" number: 1 type: TYPE_STRING label: LABEL_REQUIRED }
  field { name: "level" number: 2 type: TYPE_ENUM type_name: ".uibus_test.v2.Level" label: LABEL_OPTIONAL }
}
enum_type { name: "Level" value { name: "LOW" number: 1 } value { name: "HIGH" number: 5 } }
"""


@pytest.fixture(scope="module")
def pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for module in (any_pb2, duration_pb2, empty_pb2, field_mask_pb2, struct_pb2, timestamp_pb2, wrappers_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    for text in (_KITCHEN, _STRICT):
        pool.AddSerializedFile(text_format.Parse(text, descriptor_pb2.FileDescriptorProto()).SerializeToString())
    return pool


def _kitchen(pool: descriptor_pool.DescriptorPool) -> Message:
    kitchen = message_factory.GetMessageClass(pool.FindMessageTypeByName("uibus_test.Kitchen"))()
    json_format.ParseDict({
        "i32": -(2**31), "i64": str(-(2**63)), "u32": 2**32 - 1, "u64": str(2**64 - 1), "s64": 5, "f64": "7",
        "dbl": [1.5, "NaN", "Infinity", "-Infinity", 0], "flt": [3.4e38, -1.25, "NaN"], "flag": True,
        "blob": "+/8=", "mood": "HAPPY", "labels": {"a": "b"}, "by_id": {"-3": {"note": "n"}},
        "by_flag": {"true": "HAPPY", "false": 1}, "at": "2024-02-29T12:00:00.123456789+01:00",
        "took": "-1.500s", "mask": "a.bC,d", "anys": [{}, {"@type": "type.googleapis.com/google.protobuf.Duration",
                                                      "value": "3s"}],
        "nothing": {}, "list": [1, "a", None, {"x": []}], "values": [None, True, {"k": "v"}, [1]],
        "i64w": "9", "strw": "", "blobw": "", "child": {"child": {"i32": 1}}, "pick_null": None,
    }, kitchen)
    return kitchen


def test_every_field_kind_round_trips(pool: descriptor_pool.DescriptorPool) -> None:
    kitchen = _kitchen(pool)
    schema = standalone(kitchen.DESCRIPTOR)
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    as_dict = json_format.MessageToDict(kitchen, preserving_proto_field_name=True)
    assert as_dict["pick_null"] is None and as_dict["i64"] == str(-(2**63)) and math.isnan(float(as_dict["dbl"][1]))
    assert_valid(validator, as_dict)
    assert "Kitchen" in schema["$defs"]  # it contains itself (child)

    def parses(instance: dict[str, Any]) -> bool:
        try:
            json_format.ParseDict(instance, type(kitchen)())
            return True
        except json_format.ParseError:
            return False

    # Both ways: what the schema accepts ParseDict accepts, and these it refuses ParseDict refuses too.
    for instance, ok in [
        ({"i64": 12}, True), ({"i64": "12"}, True), ({"u64": "-1"}, False), ({"i32": 2**31}, False),
        ({"i32": 1.5}, False), ({"flag": "true"}, False), ({"dbl": ["nan"]}, False), ({"flt": [1e39]}, False),
        ({"blob": "YQ"}, True), ({"blob": "YW-_"}, True), ({"blob": "Y"}, False), ({"mood": "SAD"}, False),
        ({"mood": 99}, False), ({"mood": 1}, True), ({"by_id": {"x": {}}}, False),
        ({"by_flag": {"yes": "HAPPY"}}, False),
        ({"at": "2024-01-01T00:00:00Z"}, True), ({"at": "2024-01-01T00:00:00"}, False), ({"took": "1s"}, True),
        ({"took": "1S"}, False), ({"mask": "a_b"}, False), ({"anys": [{"value": 1}]}, False),
        ({"nothing": {"x": 1}}, False), ({"list": {}}, False), ({"values": [1, "x"]}, True),
        ({"i64w": "5"}, True), ({"strw": 5}, False), ({"pick_text": "a", "pick_msg": {}}, False),
        ({"pick_msg": {"note": "n"}}, True), ({"unknown": 1}, False),
    ]:
        assert validator.is_valid(instance) is ok, instance
        assert not ok or parses(instance), instance


def test_names_titles_collisions_and_proto2(pool: descriptor_pool.DescriptorPool) -> None:
    book = SchemaBook("#/components/schemas/")
    assert book.ref(chat_pb2.ChatMessage.DESCRIPTOR) == {"$ref": "#/components/schemas/ChatMessage"}
    assert book.ref(pool.FindMessageTypeByName("uibus_test.ChatMessage")) == {
        "$ref": "#/components/schemas/uibus_test.ChatMessage"}  # another package's ChatMessage
    assert book.ref(chat_pb2.ChatMessage.DESCRIPTOR) == {"$ref": "#/components/schemas/ChatMessage"}  # added once
    assert all(schema["title"] == name for name, schema in book.defs.items())

    strict = standalone(pool.FindMessageTypeByName("uibus_test.v2.Strict"))
    assert strict["required"] == ["name"]
    level = strict["properties"]["level"]["anyOf"]
    assert level == [{"type": "string", "enum": ["LOW", "HIGH"]}, {"type": "integer", "enum": [1, 5]}]  # closed enum
