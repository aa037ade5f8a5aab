"""The OpenAPI 3.1 description of neuro-san's HTTP API as uibus serves it, for `GET /api/v1/docs`.

neuro-san (0.7) serves its own description at that path, so a client, Swagger UI, a code
generator or an API gateway pointed at uibus finds one where it looks. The message schemas are
generated from the protobuf descriptors (uibus.infra.proto_schema), so they follow the .proto files;
the paths, headers and error answers are written here after uibus.edge.transports.neurosan_http,
whose behaviour tests/test_openapi.py checks against this document over real HTTP.

The document is static: it names no agents (listing them may need a token, while the document is
open like /healthz and reveals only schemas), so it is built once and its bytes are cached.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import grpc

from uibus import version
from uibus.domain.sessions import MAX_TITLE_CHARS
from uibus.edge.transports.asgi import http_status
from uibus.infra.proto_schema import SchemaBook
from uibus.infra.session import SESSION_KEY
from uibus.pb.neuro_san.api.grpc import agent_pb2, concierge_pb2
from uibus.pb.uibus.v1 import sessions_pb2

DOCS_PATH = "/api/v1/docs"
# What neurosan_http and uibus.infra.session accept (tests/test_openapi.py checks they agree).
AGENT_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
SESSION_PATTERN = r"^[A-Za-z0-9._:@/+=-]{1,128}$"
PREFIX_PATTERN = r"^[A-Za-z0-9._:@/+=-]{0,128}$"  # the start of a session name (empty: every one)
_SCHEMAS = "#/components/schemas/"
_ERROR = {"$ref": _SCHEMAS + "Error"}
# The error answers an API call can get, by HTTP status; each lists the gRPC statuses it stands for.
_ERRORS = {
    400: ("BadRequest", "The request is invalid: the body is not the request message in proto3 JSON, "
                        "an enum value is undefined, the agent or session name is malformed."),
    401: ("Unauthenticated", "uibus runs with tokens and the call has no valid `authorization: Bearer` token."),
    403: ("PermissionDenied", "The token may not use this session."),
    404: ("NotFound", "No such agent (neuro-san answers an unknown agent with UNIMPLEMENTED too), or no such "
                      "session to delete."),
    429: ("ResourceExhausted", "A limit was hit: the body is over the message size limit, the user "
                               "message is over the chat context's budget, or the session store is full."),
    503: ("Unavailable", "uibus cannot serve the call right now: the store is failing, or it is shutting down."),
}


def _grpc_codes(status: int) -> str:
    return ", ".join(c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK and http_status(c) == status)


def _error_schema() -> dict[str, Any]:
    return {
        "title": "Error",
        "description": "A failed call, or the last line of a chat stream that failed after it started.",
        "type": "object",
        "properties": {
            "error": {"type": "string", "description": "What went wrong."},
            "code": {"type": "string", "enum": [c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK],
                     "description": "The gRPC status of the failure; absent when the request reached no "
                                    "handler (an unknown path, a wrong method, a malformed agent name)."},
        },
        "required": ["error"],
        "additionalProperties": False,
    }


def _json(schema: dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    return {media_type: {"schema": schema}}


def _operation(op_id: str, tag: str, summary: str, description: str, ok: dict[str, Any],
               parameters: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": ok}
    responses.update({str(status): {"$ref": f"#/components/responses/{name}"}
                      for status, (name, _) in sorted(_ERRORS.items())})
    responses["default"] = {"$ref": "#/components/responses/OtherError"}
    return {"tags": [tag], "operationId": op_id, "summary": summary, "description": description,
            "parameters": parameters, **more, "responses": responses}


SESSIONS_PATH = "/api/v1/sessions"
# The sessions API's POST endpoints (uibus.edge.transports.sessions_http): the request, the reply, what it does.
_SESSION_POSTS = {
    "CreateSession": (sessions_pb2.CreateSessionRequest, sessions_pb2.SessionEntry,
                      "Creates the caller's session (idempotent: an existing session is returned as it is, with "
                      "the title or agent of the request set where given)."),
    "DeleteSession": (sessions_pb2.DeleteSessionRequest, sessions_pb2.DeleteSessionReply,
                      "Deletes the caller's session: its hosted agents are closed, its waiting dialogs end, its "
                      "stored state goes, its agents' workspaces are removed (`workspaces_removed`; a branch with "
                      "commits beyond its base is kept and named in `branches_kept`). 404 (NOT_FOUND) when there "
                      "is no such session."),
    "StopTurn": (sessions_pb2.AgentRequest, sessions_pb2.StopTurnReply,
                 "Stops the turn `agent` runs now (pi `abort`, ACP `session/cancel`); `stopped` is false when "
                 "none was running."),
    "SetMode": (sessions_pb2.SetModeRequest, sessions_pb2.AgentState,
                "The agent's mode (ACP `session/set_mode`), for every UI of the session. 404 (NOT_FOUND) "
                "when the agent is not running in the session, 400 (FAILED_PRECONDITION) when it offers no "
                "modes, 400 (INVALID_ARGUMENT) for a mode it does not offer."),
    "SetModel": (sessions_pb2.SetModelRequest, sessions_pb2.AgentState,
                 "The agent's model (ACP `session/set_model`, pi `set_model`). 404 when the agent is not "
                 "running in the session, 400 when it offers no model choice or not this model."),
    "NewConversation": (sessions_pb2.AgentRequest, sessions_pb2.AgentState,
                        "A new conversation with the agent (pi `new_session`, ACP `session/new`); the old one "
                        "stays listed in `conversations`. 400 (FAILED_PRECONDITION) while a turn runs."),
    "GetWorkspaceDiff": (sessions_pb2.AgentRequest, sessions_pb2.WorkspaceDiff,
                         "What the workspace of `agent` (option workspace = \"worktree\": its own git worktree "
                         "and branch) changed against its base: the files and the unified diff, uncommitted and "
                         "untracked work included, cut at 256 KiB (`truncated`). 404 when it has none."),
    "ExportWorkspace": (sessions_pb2.ExportWorkspaceRequest, sessions_pb2.ExportWorkspaceReply,
                        "The work of `agent`'s workspace as a new branch of the base repository (`branch`, "
                        "else the workspace's own name): its branch, with uncommitted work committed on top; "
                        "nothing of the agent's runs. 400 for a bad name or no work, 409 (ALREADY_EXISTS) when "
                        "the branch exists, 404 when the agent has no workspace."),
}

_STEERING = ("StopTurn", "SetMode", "SetModel", "NewConversation", "GetWorkspaceDiff",
             "ExportWorkspace")  # name their agent


def _session_paths(book: SchemaBook, session: dict[str, Any]) -> dict[str, Any]:
    """The sessions API (uibus.v1.SessionService over HTTP, uibus.edge.transports.sessions_http)."""
    prefix = {"name": "prefix", "in": "query", "required": False,
              "schema": {"type": "string", "pattern": PREFIX_PATTERN},
              "description": "Only sessions whose name starts with this (empty: every session the token may use)."}
    listed = book.ref(sessions_pb2.SessionList.DESCRIPTOR)
    paths: dict[str, Any] = {
        # Listings cover every session the token may use: they take no session header.
        SESSIONS_PATH: {"get": _operation(
            "SessionService_ListSessions", "SessionService", "ListSessions",
            "The sessions the caller may use, most recently active first (at most 500): title, last "
            "activity, running agents, waiting dialogs, each hosted agent's state (modes, models, commands).",
            {"description": "The sessions.", "content": _json(listed)}, [prefix])},
        f"{SESSIONS_PATH}/watch": {"get": _operation(
            "SessionService_WatchSessions", "SessionService", "WatchSessions",
            "The same list, first at once and then again whenever it changes (a session appears or goes, "
            "a turn starts or ends, a dialog opens or closes, a title, mode or model changes).",
            {"description": "One SessionList in proto3 JSON per line, as long as the request stays open. "
                            "A failure after the first line is reported by a last line that is an `Error`.",
             "content": _json(listed, "application/json-lines")}, [prefix])},
    }
    for rpc, (request, reply, what) in _SESSION_POSTS.items():
        schema = book.ref(request.DESCRIPTOR)
        steers = rpc in _STEERING  # these name the agent they act on: required
        if steers:
            schema = {"allOf": [schema, {"required": ["agent"], "properties": {
                "agent": {"type": "string", "pattern": AGENT_NAME_PATTERN}}}]}
        elif rpc == "CreateSession":  # the bounds every door holds it to (uibus.domain.sessions)
            schema = {"allOf": [schema, {"properties": {
                "agent": {"pattern": r"^[A-Za-z0-9_.-]{0,128}$"}, "title": {"maxLength": MAX_TITLE_CHARS}}}]}
        paths[f"{SESSIONS_PATH}/{rpc}"] = {"post": _operation(
            f"SessionService_{rpc}", "SessionService", rpc, what + " On the session the header names.",
            {"description": f"The {reply.DESCRIPTOR.name}.", "content": _json(book.ref(reply.DESCRIPTOR))},
            [session],
            requestBody={"required": steers, "description": f"The {request.DESCRIPTOR.name} in proto3 JSON "
                         + ("(`agent` is required)." if steers else "(an empty body is the empty request)."),
                         "content": _json(schema)})}
    return paths


def document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document; `version` is uibus's (the API is neuro-san's)."""
    book = SchemaBook(_SCHEMAS, nullable=True)  # null is an absent field in proto3 JSON: accepted, so said
    agent = {"name": "agent_name", "in": "path", "required": True, "description": "The agent, as `list` names it.",
             "schema": {"type": "string", "pattern": AGENT_NAME_PATTERN}}
    session = {"$ref": "#/components/parameters/Session"}
    forwarded = [{"name": name, "in": "header", "required": False, "schema": {"type": "string"},
                  "description": f"neuro-san's `{name}` metadata, passed on to an upstream neuro-san agent."}
                 for name in ("user_id", "request_id")]

    # The agent descriptions and the list touch no session (uibus.edge.pipeline.SESSIONLESS_SUFFIXES):
    # they take no session header, and ignore one.
    def unary(schema: dict[str, Any], what: str) -> dict[str, Any]:
        return {"description": what, "content": _json(schema)}

    paths = {
        "/api/v1/list": {"get": _operation(
            "ConciergeService_List", "ConciergeService", "List",
            "The agents this server offers.",
            unary(book.ref(concierge_pb2.ConciergeResponse.DESCRIPTOR), "The agents."), [])},
        "/api/v1/{agent_name}/function": {"get": _operation(
            "AgentService_Function", "AgentService", "Function",
            "What the agent does, and the parameters and sly_data it takes.",
            unary(book.ref(agent_pb2.FunctionResponse.DESCRIPTOR), "The agent's function."), [agent])},
        "/api/v1/{agent_name}/connectivity": {"get": _operation(
            "AgentService_Connectivity", "AgentService", "Connectivity",
            "The agent network's internal connectivity, as far as the agent wants to tell.",
            unary(book.ref(agent_pb2.ConnectivityResponse.DESCRIPTOR), "The agent's connectivity."),
            [agent])},
        "/api/v1/{agent_name}/streaming_chat": {"post": _operation(
            "AgentService_StreamingChat", "AgentService", "StreamingChat",
            "One chat turn. The answer is the last AGENT_FRAMEWORK message; its `chat_context` continues "
            "the conversation when sent back in the next request. Without a `chat_context`, uibus "
            "continues the session's stored conversation with the agent. Without a user message (or "
            "its text), the answer is one empty ChatResponse and nothing else happens (neuro-san's "
            "contract), so an empty body is a request too.",
            {"description": "One ChatResponse in proto3 JSON per line, each sent as the agent produces it: "
                            "MINIMAL (the default) streams only the final answer, MAXIMAL every message. A "
                            "failure after the first line is reported by a last line that is an `Error` "
                            "object instead.",
             "content": _json(book.ref(agent_pb2.ChatResponse.DESCRIPTOR), "application/json-lines")},
            [agent, session, *forwarded],
            # What is accepted: proto3 has no required fields, and an empty body is an empty request.
            requestBody={"required": False, "description": "The ChatRequest in proto3 JSON (proto field names).",
                         "content": _json(book.ref(agent_pb2.ChatRequest.DESCRIPTOR))})},
        DOCS_PATH: {"get": {
            "tags": ["Docs"], "operationId": "OpenApiDocument", "summary": "This document",
            "description": "The OpenAPI description of this API; open without a token.", "security": [],
            "responses": {"200": unary({"type": "object"}, "The OpenAPI 3.1 document.")}}},
        **_session_paths(book, session),
    }
    if "Error" in book.defs:
        raise AssertionError("a message named Error would clash with the error schema")
    responses = {name: {"description": f"{text} gRPC status: {_grpc_codes(status)}.", "content": _json(_ERROR)}
                 for status, (name, text) in _ERRORS.items()}
    # Not a response of any operation (it answers a method the path does not have), but its body is an Error too.
    responses["MethodNotAllowed"] = {"description": "405: the path takes another HTTP method.",
                                     "content": _json(_ERROR)}
    responses["OtherError"] = {"description": "Any other failure, e.g. 500 (INTERNAL, UNKNOWN), 504 "
                                              "(DEADLINE_EXCEEDED), 409 (ABORTED).", "content": _json(_ERROR)}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "uibus — neuro-san HTTP API",
            "version": version,
            "description": "neuro-san's HTTP API, served by uibus with the same handlers as its gRPC "
                           "AgentService/ConciergeService. Messages are proto3 JSON with the .proto field "
                           f"names. `{SESSION_KEY}` picks the uibus session (default `default`); with tokens "
                           "configured, send `authorization: Bearer <token>`. Every error "
                           "answer, a 405 for a wrong method included, is an `Error` object. Beside it, "
                           f"uibus's sessions API (`{SESSIONS_PATH}`, uibus.v1.SessionService): the "
                           "sessions a token may use, and their hosted agents steered from any UI.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [{"name": "ConciergeService"}, {"name": "AgentService"}, {"name": "SessionService"},
                 {"name": "Docs"}],
        "paths": paths,
        "components": {
            "schemas": {**book.defs, "Error": _error_schema()},
            "responses": responses,
            "parameters": {"Session": {
                "name": SESSION_KEY, "in": "header", "required": False,
                "description": "The uibus session the call belongs to (`default` when absent).",
                "schema": {"type": "string", "pattern": SESSION_PATTERN}}},
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "Needed only when uibus runs with --auth-token or --tokens-file; a tenant's "
                               "token may use only its own sessions."}},
        },
        # Either no token (uibus runs without tokens) or a bearer token.
        "security": [{}, {"bearer": []}],
    }


@functools.cache
def document_json() -> bytes:
    """The document as served: built once, since it never changes while the process runs."""
    return json.dumps(document(version())).encode()
