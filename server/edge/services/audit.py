"""uibus.v1.AuditService: reading the audit log (uibus.infra.audit) — List, Export, Verify.

Who reads what: the pipeline has already checked the call's session (`x-uibus-session`) against
the caller's token, and for a person their role on it (AuditService needs `owner`: the table in
docs/security/roles.md); a call about its own session reads that session's entries. Every
session's entries (`all_sessions`) and Verify (the whole chain; process-wide in
uibus.edge.calls.access) need a token that may use every session: `sees_all` says whether the
caller's does (always, without tokens: uibus's own user).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf import struct_pb2

from uibus.infra.audit import AuditLog, Query
from uibus.infra.errors import InvalidArgument, PermissionDenied
from uibus.infra.session import session_of
from uibus.pb.uibus.v1 import audit_pb2 as pb
from uibus.pb.uibus.v1 import audit_pb2_grpc

SeesAll = Callable[[Any], bool]  # the call's metadata -> may it read every session's entries


def entry_pb(entry: dict[str, Any]) -> pb.AuditEntry:
    detail = struct_pb2.Struct()
    detail.update(entry.get("detail") or {})
    return pb.AuditEntry(seq=entry["seq"], time=entry["time"], act=entry["act"], who=entry["who"],
                         person=entry.get("person", ""), tenant=entry.get("tenant", ""), door=entry.get("door", ""),
                         client=entry.get("client", ""), session=entry.get("session", ""), detail=detail,
                         prev=entry["prev"], hash=entry["hash"],
                         json=json.dumps(entry, sort_keys=True, ensure_ascii=False))


class AuditService(audit_pb2_grpc.AuditServiceServicer):
    def __init__(self, audit: AuditLog, sees_all: SeesAll) -> None:
        self.audit = audit
        self.sees_all = sees_all

    def _query(self, request: pb.ListAuditRequest, context: grpc.aio.ServicerContext) -> Query:
        if request.limit < 0 or request.after < 0 or request.since_ms < 0 or request.until_ms < 0:
            raise InvalidArgument("limit, after, since_ms and until_ms must not be negative")
        if request.until_ms and request.until_ms <= request.since_ms:
            raise InvalidArgument(f"until_ms ({request.until_ms}) must be after since_ms ({request.since_ms})")
        own = session_of(context)
        if request.all_sessions:
            if not self.sees_all(context.invocation_metadata()):
                raise PermissionDenied("every session's audit entries need a token that may use all sessions (`*`); "
                                       f"this one may read session {own!r}'s: leave all_sessions off")
            session = request.session
        else:
            if request.session and request.session != own:
                raise InvalidArgument(f"session {request.session!r} is not this call's session ({own!r}): name it in "
                                      "x-uibus-session, or set all_sessions with a token that may use every session")
            session = own
        return Query(session=session, person=request.person, act=request.act, since_ms=request.since_ms,
                     until_ms=request.until_ms, after=request.after, limit=request.limit or 100)

    async def List(self, request: pb.ListAuditRequest, context: grpc.aio.ServicerContext) -> pb.AuditPage:
        query = self._query(request, context)
        entries = await self.audit.list(query)
        page = pb.AuditPage(entries=[entry_pb(e) for e in entries])
        if len(entries) >= query.limit:
            page.next_after = entries[-1]["seq"]
        return page

    async def Export(self, request: pb.ListAuditRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AuditEntry]:
        async for entry in self.audit.export(self._query(request, context)):
            yield entry_pb(entry)

    async def Verify(self, request: pb.VerifyAuditRequest, context: grpc.aio.ServicerContext) -> pb.VerifyAuditReply:
        count, broken = await self.audit.verify()
        if broken is None:
            return pb.VerifyAuditReply(ok=True, entries=count)
        return pb.VerifyAuditReply(ok=False, entries=count, broken_seq=broken.seq, why=broken.why)


SERVICE = pb.DESCRIPTOR.services_by_name["AuditService"].full_name


def add_to(registry: Any, audit: AuditLog, sees_all: SeesAll) -> str:
    audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditService(audit, sees_all), registry)
    return SERVICE
