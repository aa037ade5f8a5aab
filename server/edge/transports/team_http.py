"""uibus.v1.TeamService on the HTTP API (docs/security/roles.md):

* `GET    /api/sessions/<name>/whoami` — WhoAmI;
* `GET    /api/sessions/<name>/members` — ListMembers;
* `POST   /api/sessions/<name>/members` `{"person", "role"}` — SetRole (adds or changes);
* `DELETE /api/sessions/<name>/members?person=<id>` — RemoveMember;
* `GET    /api/sessions/<name>/invites` — ListInvites;
* `POST   /api/sessions/<name>/invites` `{"role", "ttl_seconds"}` — CreateInvite (its token and link);
* `DELETE /api/sessions/<name>/invites?id=<id>` — RevokeInvite;
* `POST   /api/invites/accept` `{"token"}` — AcceptInvite.

The session is the path's (a session name may hold `/`: the last segment names the endpoint); the
call is dispatched through the handler registry and run by the one call driver with the session as
its `x-uibus-session`, so the token, the roles and errors are the pipeline's, as over gRPC.
"""

from __future__ import annotations

import html
from typing import Any
from urllib.parse import parse_qs, quote

from google.protobuf.message import Message as ProtoMessage

from uibus.edge.calls import CallContext, drive
from uibus.edge.transports.asgi import (
    Receive,
    Scope,
    Send,
    read_request,
    refuse,
    respond,
    respond_json,
    wait_disconnect,
)
from uibus.edge.transports.grpcweb import Lookup, metadata_of, peer_of
from uibus.edge.transports.neurosan_http import _Json, _parse
from uibus.infra.json_input import dump_json
from uibus.infra.session import SESSION_KEY
from uibus.pb.uibus.v1 import team_pb2 as pb

SESSIONS_PATH = "/api/sessions"
INVITES_PATH = "/api/invites"
SERVICE = "/uibus.v1.TeamService/"
# (endpoint, HTTP method) -> (rpc, request type, query parameter that fills the request's field)
_ROUTES: dict[tuple[str, str], tuple[str, type[ProtoMessage], str]] = {
    ("whoami", "GET"): ("WhoAmI", pb.WhoAmIRequest, ""),
    ("members", "GET"): ("ListMembers", pb.ListMembersRequest, ""),
    ("members", "POST"): ("SetRole", pb.SetRoleRequest, ""),
    ("members", "DELETE"): ("RemoveMember", pb.RemoveMemberRequest, "person"),
    ("invites", "GET"): ("ListInvites", pb.ListInvitesRequest, ""),
    ("invites", "POST"): ("CreateInvite", pb.CreateInviteRequest, ""),
    ("invites", "DELETE"): ("RevokeInvite", pb.RevokeInviteRequest, "id"),
    ("accept", "POST"): ("AcceptInvite", pb.AcceptInviteRequest, ""),
}


INVITE_LINK = "/invite/"  # the page's invite link, /invite/<token>: answered by `invite_link`


async def invite_link(scope: Scope, receive: Receive, send: Send) -> None:
    """`GET /invite/<token>`: a page that moves on to the page with the token in the fragment
    (`/#invite=<token>`, which never reaches a server again), where it is accepted as whoever is signed
    in (web/src/roles.ts). The same for everyone (no token needed to be told where to go)."""
    target = html.escape("/#invite=" + quote(scope["path"][len(INVITE_LINK):], safe=""))
    page = (f'<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0; url={target}"><title>uibus invite</title>'
            f'<p>Opening the invite… <a href="{target}">continue</a></p>\n')
    await respond(send, 200, page, "text/html; charset=utf-8",
                  [(b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer")])


class TeamHttp:
    def __init__(self, lookup: Lookup, prefix: str = SESSIONS_PATH, max_body: int = 1024 * 1024) -> None:
        """`prefix`: where it is mounted, SESSIONS_PATH or INVITES_PATH (one instance each)."""
        self.lookup = lookup
        self.prefix = prefix
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await refuse(scope, send, 404, dump_json({"error": f"no WebSocket endpoint at {scope['path']}"}),
                         "application/json")
            return
        path: str = scope["path"]
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        rest = scope["path"][len(self.prefix) + 1:]
        if self.prefix == INVITES_PATH:
            session, endpoint = "", rest
            fits = endpoint == "accept"
        else:
            session, _, endpoint = rest.rpartition("/")
            fits = bool(session) and endpoint != "accept"
        route = _ROUTES.get((endpoint, method)) if fits else None
        if route is None:
            known = "|".join(sorted({e for e, _ in _ROUTES} - {"accept"}))
            exists = fits and any(e == endpoint for e, _ in _ROUTES)
            await respond_json(send, 405 if exists else 404, {
                "error": f"no such team endpoint: {method} {path} ({SESSIONS_PATH}/<session>/{{{known}}}, "
                         f"POST {INVITES_PATH}/accept)", "code": "UNIMPLEMENTED" if exists else "NOT_FOUND"})
            return
        rpc, kind, field = route
        metadata = metadata_of(scope)
        if session:
            metadata = (*[(k, v) for k, v in metadata if k != SESSION_KEY], (SESSION_KEY, session))
        handler = self.lookup(SERVICE + rpc, metadata)
        if handler is None:
            await respond_json(send, 404, {"error": "the team API is not installed", "code": "UNIMPLEMENTED"})
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        request: Any = await read_request(receive, self.max_body, lambda body: _parse(kind, body),
                                          f"body (a {kind.__name__} in proto3 JSON)")
        if request is None:  # the client went away
            return
        if field and query.get(field) and hasattr(request, field):
            setattr(request, field, query[field][0])
        await drive(handler, request, CallContext(metadata, peer_of(scope), "http"), _Json(send),
                    gone=lambda: wait_disconnect(receive))
