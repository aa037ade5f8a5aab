"""uibus.v1.TeamService: who may do what on a session — the caller's role (WhoAmI), the session's
members and invites (uibus.domain.members), over gRPC and, through the one pipeline, every transport.

The pipeline's roles table (uibus.edge.calls.roles) lets only a session's owners manage its members
and invites; WhoAmI and AcceptInvite are sessionless (any valid token: the invite names its session,
and "you hold no role here" is an answer a page needs, not an error). The caller's grant comes from
the pipeline (`grant_of`), which alone reads tokens; this module only carries the session across.

`install` makes the pipeline's role check read the members: a person's role on a session is the
stronger of their tenant-wide role and the one the session's members give them, and a person whose
call creates a session becomes its owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from uibus.domain.history import ChatHistory
from uibus.domain.members import Members
from uibus.domain.sessions import META
from uibus.edge.calls.roles import RoleCheck, tenant_role
from uibus.infra.audit import NoAudit, Recorder
from uibus.infra.auth import Grant
from uibus.infra.errors import FailedPrecondition, NotFound
from uibus.infra.roles import APPROVER, OBSERVER, OWNER, PARTICIPANT
from uibus.infra.session import session_of
from uibus.infra.store import Store
from uibus.pb.uibus.v1 import team_pb2 as pb
from uibus.pb.uibus.v1 import team_pb2_grpc

INVITE_PATH = "/invite/"  # the page's link: /invite/<token>
# What a UI offers, and the least role each needs (the roles table's, for the page's WhoAmI).
NEEDS = {"read": OBSERVER, "chat": PARTICIPANT, "answer": APPROVER, "steer": OWNER, "delete": OWNER,
         "invite": OWNER}

GrantOf = Callable[[Any], "Grant | None"]  # call metadata -> the caller's grant (None: no tokens)


def install(members: Members, tenant_of: Callable[[str], str]) -> RoleCheck:
    """The pipeline's role check over the sessions' members (uibus.edge.calls.roles.RoleCheck).
    `tenant_of(session)`: whose a session without a members record is (uibus.infra.auth.Tokens.tenant)."""
    async def role_of(grant: Grant, session: str) -> str | None:
        if not grant.person:
            return await tenant_role(grant, session)
        return await members.role_of(session, grant.person, grant.tenant, grant.role, grant.allows(session),
                                     tenant_of(session))

    async def claim(grant: Grant, session: str) -> None:
        await members.claim(session, grant.person, grant.tenant)
    return RoleCheck(role_of, claim)


def session_exists(store: Store, history: ChatHistory) -> Callable[[str], Any]:
    """Whether a session already holds something (CreateSession's record, or a chat): a person's
    creating call on it makes no owner."""
    async def exists(session: str) -> bool:
        return await store.get(session, META) is not None or bool(await history.read(session, last=1))
    return exists


def _invite(invite: Any) -> pb.Invite:
    token = getattr(invite, "token", "")
    return pb.Invite(id=invite.id, session=invite.session, role=invite.role, expires_at_ms=int(invite.expires * 1000),
                     created_by=invite.by, token=token, link=INVITE_PATH + token if token else "")


class TeamService(team_pb2_grpc.TeamServiceServicer):
    def __init__(self, members: Members, roles: Callable[[], RoleCheck], grant_of: GrantOf,
                 audit: Recorder | None = None) -> None:
        """`roles()`: the pipeline's role check now; `grant_of(metadata)`: the caller's grant;
        `audit`: where invites and role changes are recorded (uibus.infra.audit)."""
        self.members = members
        self.roles = roles
        self.grant_of = grant_of
        self.audit: Recorder = audit if audit is not None else NoAudit()

    async def WhoAmI(self, request: pb.WhoAmIRequest, context: grpc.aio.ServicerContext) -> pb.WhoAmIReply:
        session = session_of(context)
        grant = self.grant_of(context.invocation_metadata())
        if grant is None:  # no tokens: every caller may do everything, as before roles
            return pb.WhoAmIReply(session=session, role=OWNER, needs=NEEDS)
        role = await self.roles().role_of(grant, session) if grant.person or grant.role != OWNER else (
            OWNER if grant.allows(session) else None)
        return pb.WhoAmIReply(person=grant.person, tenant=grant.tenant, session=session, role=role or "",
                              needs=NEEDS)

    async def ListMembers(self, request: pb.ListMembersRequest, context: grpc.aio.ServicerContext) -> pb.MemberList:
        record = await self.members.record(session_of(context))
        if record is None:
            return pb.MemberList()
        return pb.MemberList(tenant=record.tenant, members=[pb.Member(person=p, role=r)
                                                            for p, r in sorted(record.members.items())])

    async def SetRole(self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext) -> pb.Member:
        session = session_of(context)
        await self.members.set_role(session, request.person, request.role)
        await self.audit.record("role.set", session=session, person=request.person, role=request.role)
        return pb.Member(person=request.person, role=request.role)

    async def RemoveMember(self, request: pb.RemoveMemberRequest,
                           context: grpc.aio.ServicerContext) -> pb.RemoveMemberReply:
        session = session_of(context)
        if not await self.members.remove(session, request.person):
            raise NotFound(f"{request.person[:80]!r} is no member of session {session!r}")
        await self.audit.record("role.set", session=session, person=request.person, role="")
        return pb.RemoveMemberReply()

    async def CreateInvite(self, request: pb.CreateInviteRequest, context: grpc.aio.ServicerContext) -> pb.Invite:
        session = session_of(context)
        grant = self.grant_of(context.invocation_metadata())
        by = (grant.person or grant.name) if grant is not None else ""
        invite = await self.members.create_invite(session, request.role, float(request.ttl_seconds), by)
        await self.audit.record("invite.create", session=session, invite=invite.id, role=invite.role,
                                expires=int(invite.expires))
        return _invite(invite)

    async def ListInvites(self, request: pb.ListInvitesRequest, context: grpc.aio.ServicerContext) -> pb.InviteList:
        return pb.InviteList(invites=[_invite(i) for i in await self.members.invites(session_of(context))])

    async def RevokeInvite(self, request: pb.RevokeInviteRequest,
                           context: grpc.aio.ServicerContext) -> pb.RevokeInviteReply:
        session = session_of(context)
        await self.members.revoke(session, request.id)
        await self.audit.record("invite.revoke", session=session, invite=request.id)
        return pb.RevokeInviteReply()

    async def AcceptInvite(self, request: pb.AcceptInviteRequest,
                           context: grpc.aio.ServicerContext) -> pb.AcceptInviteReply:
        grant = self.grant_of(context.invocation_metadata())
        if grant is None or not grant.person:
            raise FailedPrecondition("only a person accepts an invite: sign in, or use a token that names a person "
                                     "(a tokens-file line with person=<id>)")
        invite = await self.members.accept(request.token, grant.person)
        await self.audit.record("invite.accept", session=invite.session, invite=invite.id, role=invite.role)
        role = await self.roles().role_of(grant, invite.session)
        return pb.AcceptInviteReply(session=invite.session, role=role or invite.role)


SERVICE = pb.DESCRIPTOR.services_by_name["TeamService"].full_name


def add_to(registry: Any, members: Members, roles: Callable[[], RoleCheck], grant_of: GrantOf,
           audit: Recorder | None = None) -> str:
    team_pb2_grpc.add_TeamServiceServicer_to_server(TeamService(members, roles, grant_of, audit), registry)
    return SERVICE
