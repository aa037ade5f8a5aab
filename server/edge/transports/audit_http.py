"""The audit log (uibus.v1.AuditService) on the HTTP API:

* `GET /api/audit?session=&person=&act=&since=&until=&after=&limit=` — List, one JSON object
  (`{"entries": [...], "next_after": …}`);
* `GET /api/audit/export?…` (the same filters) — every matching entry, one JSON line each, exactly as
  stored (so each line's `hash` can be checked elsewhere: SHA-256 of its canonical JSON);
* `GET /api/audit/verify` — Verify.

`session=` reads that one session's entries (the call names it as `x-uibus-session`, so its
owner may); without it, every session's (a token that may use all sessions). `since`/`until` take
milliseconds since the epoch or an RFC 3339 time (`2025-01-31T12:00:00Z`). Each request is a call
through the handler registry and the one driver, so the token, the role, errors and metrics are the
pipeline's; failures answer `{"error", "code"}` at the HTTP status of their gRPC status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import parse_qs

from uibus.edge.calls import CallContext, Metadata, Sink, drive
from uibus.edge.transports.asgi import Receive, Scope, Send, refuse, respond_json, wait_disconnect, wrong_method
from uibus.edge.transports.grpcweb import Lookup, client_of, metadata_of, peer_of
from uibus.edge.transports.neurosan_http import _Json, _Lines
from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import dump_json
from uibus.infra.session import SESSION_KEY
from uibus.pb.uibus.v1 import audit_pb2 as pb

PATH = "/api/audit"
SERVICE = "/uibus.v1.AuditService/"
_RPCS = {"": "List", "export": "Export", "verify": "Verify"}


def _time_ms(name: str, text: str) -> int:
    if not text:
        return 0
    if text.isdigit():
        return int(text)
    try:
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        raise InvalidArgument(f"{name}={text[:40]!r}: give milliseconds since the epoch or an RFC 3339 time "
                              "(2025-01-31T12:00:00Z)") from None


def _number(name: str, text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise InvalidArgument(f"{name}={text[:40]!r}: not a whole number")
    return int(text)


def request_of(query: dict[str, list[str]]) -> pb.ListAuditRequest:
    def one(key: str) -> str:
        return (query.get(key) or [""])[0]
    return pb.ListAuditRequest(all_sessions=not one("session"), person=one("person"), act=one("act"),
                               since_ms=_time_ms("since", one("since")), until_ms=_time_ms("until", one("until")),
                               after=_number("after", one("after")), limit=_number("limit", one("limit")))


class _Export(_Lines):
    """Each entry as its stored JSON, one line each."""

    @staticmethod
    def encode(message: Any) -> bytes:
        return message.json.encode() + b"\n"


class AuditHttp:
    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await refuse(scope, send, 404, dump_json({"error": f"no WebSocket endpoint at {scope['path']}"}),
                         "application/json")
            return
        rest = scope["path"][len(PATH):].strip("/")
        if rest not in _RPCS:
            await respond_json(send, 404, {"error": f"no such audit endpoint: {scope['path']} (GET {PATH}, "
                                                    f"GET {PATH}/export, GET {PATH}/verify)"})
            return
        if scope["method"] not in ("GET", "HEAD"):
            await wrong_method(send, scope["method"], scope["path"], "GET")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            request: Any = pb.VerifyAuditRequest() if rest == "verify" else request_of(query)
        except InvalidArgument as exc:
            await respond_json(send, 400, {"error": str(exc), "code": "INVALID_ARGUMENT"})
            return
        metadata: Metadata = metadata_of(scope)
        session = (query.get("session") or [""])[0]
        if session:  # the call is about that session: the pipeline checks the caller may read it
            metadata = (*((k, v) for k, v in metadata if k != SESSION_KEY), (SESSION_KEY, session))
        handler = self.lookup(SERVICE + _RPCS[rest], metadata)
        if handler is None:
            await respond_json(send, 404, {"error": "the audit API is not installed", "code": "UNIMPLEMENTED"})
            return
        ctx = CallContext(metadata, peer_of(scope), "http")
        ctx.client = client_of(scope)
        sink: Sink = _Export(send) if rest == "export" else _Json(send)
        await drive(handler, request, ctx, sink, gone=lambda: wait_disconnect(receive))

