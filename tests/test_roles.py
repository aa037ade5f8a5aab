"""Roles per session (docs/security/roles.md), on real servers over real gRPC and HTTP: the creator of
a session is its owner; a tenant's people hold their tenant-wide role on its sessions, others none;
invites are signed, expire, can be revoked and cannot be forged; a role change takes effect at once;
listings show a person only sessions they hold a role on; a dialog addressed to `approver` is
answered by an approver alone, on either of two replicas on one real redis-server, and stays open
for them. Persons come from tokens-file lines (`person=`, `role=`), as a provider's would."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.conftest import Reader, free_port, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from uibus.app import App
from uibus.domain.members import CACHE_S
from uibus.infra.auth import parse_tokens_file
from uibus.infra.config import Config
from uibus.infra.errors import ConfigError
from uibus.pb.cline import ui_pb2  # noqa: F401  (the host proto's imports)
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import host_pb2
from uibus.pb.uibus.v1 import sessions_pb2 as spb
from uibus.pb.uibus.v1 import team_pb2 as tpb

__all__ = ["redis_server"]

TOKENS = """\
alice (team-a) team-a-* person=alice role=participant   # creates sessions: owner of those
bob   (team-a) team-a-* person=bob role=observer
cara  (team-b) team-b-* person=cara role=participant    # another tenant
dan   (team-a) team-a-* person=dan role=approver
robot (team-a) team-a-*                                 # a machine: owner of team-a-*, as before roles
watcher (team-a) team-a-* role=observer                 # a machine that only reads
"""
OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED


class Calls:
    """Unary calls to one app, as a given token on a given session."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def __call__(self, path: str, request: Any, reply: Any, token: str, session: str) -> tuple[Any, Any]:
        """(status code, reply or details)."""
        call = self.channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                                        response_deserializer=reply.FromString)
        try:
            return OK, await call(request, metadata=(("authorization", f"Bearer {token}"),
                                                     ("x-uibus-session", session)))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()

    async def team(self, method: str, request: Any, reply: Any, token: str, session: str = "") -> tuple[Any, Any]:
        return await self(f"/uibus.v1.TeamService/{method}", request, reply, token, session or "default")

    async def create(self, token: str, session: str) -> Any:
        return (await self("/uibus.v1.SessionService/CreateSession", spb.CreateSessionRequest(), spb.SessionEntry,
                           token, session))[0]

    async def delete(self, token: str, session: str) -> Any:
        return await self("/uibus.v1.SessionService/DeleteSession", spb.DeleteSessionRequest(),
                          spb.DeleteSessionReply, token, session)

    async def publish(self, token: str, session: str) -> Any:
        """A participant's act: publishing into the session's UIs (HostService/SetTheme)."""
        return (await self("/uibus.v1.HostService/SetTheme", host_pb2.TextEvent(text="{}"), host_pb2.PublishReply,
                           token, session))[0]

    async def role(self, token: str, session: str) -> str:
        code, who = await self.team("WhoAmI", tpb.WhoAmIRequest(), tpb.WhoAmIReply, token, session)
        assert code == OK, who
        return str(who.role)

    async def listed(self, token: str) -> list[str]:
        code, got = await self("/uibus.v1.SessionService/ListSessions", spb.ListSessionsRequest(), spb.SessionList,
                               token, "default")
        assert code == OK, got
        return sorted(s.session for s in got.sessions)

    async def invite(self, token: str, session: str, role: str, ttl: int = 0) -> Any:
        code, invite = await self.team("CreateInvite", tpb.CreateInviteRequest(role=role, ttl_seconds=ttl), tpb.Invite,
                                       token, session)
        assert code == OK, invite
        return invite

    async def accept(self, token: str, invite_token: str) -> tuple[Any, Any]:
        return await self.team("AcceptInvite", tpb.AcceptInviteRequest(token=invite_token), tpb.AcceptInviteReply,
                               token)


def team_config(tmp_path: Path, **changes: Any) -> Config:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    return Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / "s.db"),
                  tokens_file=str(tokens), grace_seconds=1.0, **changes)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    app = await start_app(team_config(tmp_path))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


@pytest.fixture
async def calls(app: App) -> AsyncIterator[Calls]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        yield Calls(channel)


def test_tokens_file_person_and_role_words() -> None:
    grants = list(parse_tokens_file(TOKENS, "tokens").values())
    assert [(g.person, g.role) for g in grants] == [("alice", "participant"), ("bob", "observer"),
                                                   ("cara", "participant"), ("dan", "approver"), ("", "owner"),
                                                   ("", "observer")]
    for line, why in (("t * role=boss", "role='boss' is not a role"), ("t * role=owner role=observer", "one role="),
                      ("t * person=a person=b", "one person="), ("t person=a", "at least one session pattern")):
        with pytest.raises(ConfigError) as caught:
            parse_tokens_file(f"# head\n{line}\n", "f")
        assert "f: line 2" in caught.value.what and why in caught.value.what, caught.value.what


async def test_creator_is_owner_and_a_tenant_holds_its_tenant_wide_role(calls: Calls) -> None:
    assert await calls.create("alice", "team-a-1") == OK
    assert await calls.role("alice", "team-a-1") == "owner"  # created it: owner, above her tenant-wide participant
    assert await calls.role("bob", "team-a-1") == "observer"  # her tenant: his tenant-wide role
    assert await calls.role("cara", "team-a-1") == ""  # another tenant's person: none
    assert await calls.role("robot", "team-a-1") == "owner"  # a machine's token: as before roles
    code, why = await calls.delete("bob", "team-a-1")
    assert code == DENIED and "needs the role owner on session 'team-a-1'" in why and "holds observer" in why, why
    code, why = await calls.delete("cara", "team-a-1")
    assert code == DENIED and "holds no role" in why, why
    assert await calls.publish("bob", "team-a-1") == DENIED  # an observer reads only
    assert await calls.publish("watcher", "team-a-1") == DENIED  # so does a machine holding observer
    assert await calls.publish("cara", "team-a-1") == DENIED
    assert await calls.publish("alice", "team-a-1") == OK
    # A session someone else made first is not claimed by a person's later call: no owner made there.
    assert await calls.create("robot", "team-a-2") == OK
    assert await calls.create("alice", "team-a-2") == OK
    assert await calls.role("alice", "team-a-2") == "participant"
    assert (await calls.delete("alice", "team-a-1"))[0] == OK


async def test_listings_show_a_person_only_sessions_they_hold_a_role_on(app: App, calls: Calls) -> None:
    for token, session in (("alice", "team-a-1"), ("cara", "team-b-1"), ("robot", "team-a-9")):
        assert await calls.create(token, session) == OK
    assert await calls.listed("bob") == ["team-a-1", "team-a-9"]
    assert await calls.listed("cara") == ["team-b-1"]
    invite = await calls.invite("alice", "team-a-1", "observer")
    assert (await calls.accept("cara", invite.token))[0] == OK
    assert await calls.listed("cara") == ["team-a-1", "team-b-1"]
    # WatchSessions (its first list) and MCP's resources/list filter the same way.
    watch = calls.channel.unary_stream("/uibus.v1.SessionService/WatchSessions",
                                       request_serializer=spb.ListSessionsRequest.SerializeToString,
                                       response_deserializer=spb.SessionList.FromString)
    stream = watch(spb.ListSessionsRequest(), metadata=(("authorization", "Bearer cara"),))
    first = await asyncio.wait_for(stream.read(), 5)
    stream.cancel()
    assert sorted(s.session for s in first.sessions) == ["team-a-1", "team-b-1"]
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", json={
            "jsonrpc": "2.0", "id": 1, "method": "resources/list", "params": {}},
            headers={"authorization": "Bearer bob", "accept": "application/json, text/event-stream"})
    assert "result" in r.json(), r.text
    assert sorted(res["name"] for res in r.json()["result"]["resources"]) == ["team-a-1", "team-a-9"], r.text


async def test_invites_accept_expire_revoke_and_cannot_be_forged(calls: Calls) -> None:
    assert await calls.create("alice", "team-a-1") == OK
    # Only an owner invites.
    code, why = await calls.team("CreateInvite", tpb.CreateInviteRequest(role="owner"), tpb.Invite, "bob", "team-a-1")
    assert code == DENIED and "needs the role owner" in why
    invite = await calls.invite("alice", "team-a-1", "approver")
    assert invite.link == f"/invite/{invite.token}" and invite.session == "team-a-1" and invite.created_by == "alice"
    # Forged: the payload changed to grant owner, the signature kept; another session's key; garbage.
    payload, _, signature = invite.token.partition(".")
    import base64
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps({**claims, "r": "owner"}).encode()).rstrip(b"=").decode()
    code, why = await calls.accept("cara", f"{forged}.{signature}")
    assert code == DENIED and "signature does not verify" in why, why
    code, why = await calls.accept("cara", "not-an-invite")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not an invite token" in why
    assert await calls.role("cara", "team-a-1") == ""
    # A machine's token is no person: it cannot accept.
    code, why = await calls.accept("robot", invite.token)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "only a person" in why
    code, accepted = await calls.accept("cara", invite.token)
    assert code == OK and (accepted.session, accepted.role) == ("team-a-1", "approver")
    assert await calls.role("cara", "team-a-1") == "approver"
    assert await calls.publish("cara", "team-a-1") == OK
    # Listed (and revocable) until it expires or is revoked; a revoked one is refused.
    second = await calls.invite("alice", "team-a-1", "participant")
    code, listed = await calls.team("ListInvites", tpb.ListInvitesRequest(), tpb.InviteList, "alice", "team-a-1")
    assert code == OK and {i.id for i in listed.invites} == {invite.id, second.id}
    assert not any(i.token for i in listed.invites)  # never stored, never listed
    code, _ = await calls.team("RevokeInvite", tpb.RevokeInviteRequest(id=second.id), tpb.RevokeInviteReply, "alice",
                               "team-a-1")
    assert code == OK
    code, why = await calls.accept("bob", second.token)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "revoked" in why
    code, why = await calls.team("RevokeInvite", tpb.RevokeInviteRequest(id=second.id), tpb.RevokeInviteReply,
                                 "alice", "team-a-1")
    assert code == grpc.StatusCode.NOT_FOUND
    # Expiry: a one-second invite, accepted too late.
    short = await calls.invite("alice", "team-a-1", "owner", ttl=1)
    await asyncio.sleep(1.2)
    code, why = await calls.accept("bob", short.token)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in why, why
    assert await calls.role("bob", "team-a-1") == "observer"
    code, why = await calls.team("CreateInvite", tpb.CreateInviteRequest(role="king"), tpb.Invite, "alice", "team-a-1")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a role" in why


async def test_a_role_change_takes_effect_and_members_are_listed(calls: Calls) -> None:
    assert await calls.create("alice", "team-a-1") == OK
    assert await calls.publish("bob", "team-a-1") == DENIED
    code, _ = await calls.team("SetRole", tpb.SetRoleRequest(person="bob", role="participant"), tpb.Member, "alice",
                               "team-a-1")
    assert code == OK
    assert await calls.publish("bob", "team-a-1") == OK  # at once, on the replica that made the change
    code, members = await calls.team("ListMembers", tpb.ListMembersRequest(), tpb.MemberList, "alice", "team-a-1")
    assert code == OK and members.tenant == "team-a"
    assert [(m.person, m.role) for m in members.members] == [("alice", "owner"), ("bob", "participant")]
    code, _ = await calls.team("SetRole", tpb.SetRoleRequest(person="bob", role="owner"), tpb.Member, "bob",
                               "team-a-1")
    assert code == DENIED  # a participant cannot raise himself
    code, _ = await calls.team("RemoveMember", tpb.RemoveMemberRequest(person="bob"), tpb.RemoveMemberReply, "alice",
                               "team-a-1")
    assert code == OK
    assert await calls.publish("bob", "team-a-1") == DENIED  # back to his tenant-wide observer
    code, _ = await calls.team("RemoveMember", tpb.RemoveMemberRequest(person="bob"), tpb.RemoveMemberReply,
                               "alice", "team-a-1")
    assert code == grpc.StatusCode.NOT_FOUND
    code, why = await calls.team("SetRole", tpb.SetRoleRequest(person="bob", role="boss"), tpb.Member, "alice",
                                 "team-a-1")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a role" in why


async def test_the_http_api(app: App, calls: Calls) -> None:
    assert await calls.create("alice", "team-a-1") == OK
    base = f"http://127.0.0.1:{app.http_port}"
    alice, cara = {"authorization": "Bearer alice"}, {"authorization": "Bearer cara"}
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{base}/api/sessions/team-a-1/whoami", headers=alice)
        assert r.status_code == 200 and r.json()["role"] == "owner", r.text
        r = await http.post(f"{base}/api/sessions/team-a-1/invites", json={"role": "participant"}, headers=alice)
        assert r.status_code == 200 and r.json()["link"].startswith("/invite/"), r.text
        token = r.json()["token"]
        r = await http.post(f"{base}/api/sessions/team-a-1/invites", json={"role": "owner"}, headers=cara)
        assert r.status_code == 403 and r.json()["code"] == "PERMISSION_DENIED", r.text
        r = await http.post(f"{base}/api/invites/accept", json={"token": token}, headers=cara)
        assert r.status_code == 200 and r.json() == {"session": "team-a-1", "role": "participant"}, r.text
        r = await http.get(f"{base}/api/sessions/team-a-1/members", headers=alice)
        assert r.json()["members"] == [{"person": "alice", "role": "owner"}, {"person": "cara", "role": "participant"}]
        r = await http.post(f"{base}/api/sessions/team-a-1/members", json={"person": "cara", "role": "approver"},
                            headers=alice)
        assert r.status_code == 200, r.text
        r = await http.delete(f"{base}/api/sessions/team-a-1/members", params={"person": "cara"}, headers=alice)
        assert r.status_code == 200, r.text
        r = await http.get(f"{base}/api/sessions/team-a-1/whoami", headers=cara)
        assert r.status_code == 200 and r.json().get("role", "") == "", r.text
        r = await http.get(f"{base}/api/sessions/team-a-1/invites", headers=alice)
        (listed,) = r.json()["invites"]
        r = await http.delete(f"{base}/api/sessions/team-a-1/invites", params={"id": listed["id"]}, headers=alice)
        assert r.status_code == 200, r.text
        r = await http.get(f"{base}/api/sessions/team-a-1/nothing", headers=alice)
        assert r.status_code == 404 and "no such team endpoint" in r.json()["error"]
        r = await http.post(f"{base}/api/sessions/team-a-1/members", content=b"{not json", headers=alice)
        assert r.status_code == 400, r.text


# ---- dialogs addressed to a role, across two replicas ----

async def _answer(channel: grpc.aio.Channel, token: str, session: str, answer: ext.RespondRequest) -> tuple[Any, str]:
    respond = channel.unary_unary("/uibus.v1.ExtensionUiService/Respond",
                                  request_serializer=ext.RespondRequest.SerializeToString,
                                  response_deserializer=ext.RespondReply.FromString)
    try:
        await respond(answer, metadata=(("authorization", f"Bearer {token}"), ("x-uibus-session", session)))
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


async def test_a_dialog_addressed_to_approver_on_two_replicas(tmp_path: Path, redis_server: RedisProcess) -> None:
    config = team_config(tmp_path, redis_url=redis_server.url)
    apps = [await start_app(replace(config, http_port=0, store=str(tmp_path / f"{i}.db"))) for i in range(2)]
    try:
        await wait_for(lambda: all(a.bus.connected for a in apps), what="both replicas on redis")
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") for a in apps]
        a = Calls(channels[0])
        assert await a.create("alice", "team-a-1") == OK
        # The agent (a machine token) asks on replica A; a participant on each replica cannot answer.
        invite = await a.invite("alice", "team-a-1", "participant")
        assert (await a.accept("cara", invite.token))[0] == OK
        # A role change made on A holds on B within the members cache's second (CACHE_S).
        b = Calls(channels[1])
        assert await b.publish("bob", "team-a-1") == DENIED
        await a.team("SetRole", tpb.SetRoleRequest(person="bob", role="participant"), tpb.Member, "alice", "team-a-1")
        changed = asyncio.get_running_loop().time()
        while await b.publish("bob", "team-a-1") != OK:
            assert asyncio.get_running_loop().time() - changed < CACHE_S + 0.5, "not seen on replica B in time"
            await asyncio.sleep(0.05)
        await a.team("RemoveMember", tpb.RemoveMemberRequest(person="bob"), tpb.RemoveMemberReply, "alice", "team-a-1")
        subscribe = channels[1].unary_stream("/uibus.v1.ExtensionUiService/Subscribe",
                                             request_serializer=ext.SubscribeRequest.SerializeToString,
                                             response_deserializer=ext.ExtensionUiEvent.FromString)
        ui = Reader(subscribe(ext.SubscribeRequest(), metadata=(("authorization", "Bearer bob"),
                                                                 ("x-uibus-session", "team-a-1"))))
        confirm = channels[0].unary_unary("/uibus.v1.ExtensionUiService/Confirm",
                                          request_serializer=ext.ConfirmRequest.SerializeToString,
                                          response_deserializer=ext.DialogResult.FromString)
        asked = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="rm -rf build?", timeout_ms=20_000),
                                              metadata=(("authorization", "Bearer robot"),
                                                        ("x-uibus-session", "team-a-1"))))
        event = await ui.next()
        dialog = event.request.id
        assert event.request.confirm.title == "rm -rf build?"  # an observer reads it (and is not offered to answer)
        yes = ext.RespondRequest(id=dialog, confirmed=True)
        for channel in channels:  # held on A; on B the check reads the dialog's shared record
            for token in ("cara", "bob"):
                code, why = await _answer(channel, token, "team-a-1", yes)
                assert code == DENIED, (token, why)
            code, why = await _answer(channel, "cara", "team-a-1", yes)
            assert "addressed to the role approver" in why and "holds participant" in why, why
        assert not asked.done()  # still open, for the right person
        code, _ = await _answer(channels[1], "dan", "team-a-1", yes)  # an approver of team-a, on replica B
        assert code == OK
        result = await asyncio.wait_for(asked, 5)
        assert result.confirmed and result.outcome == ext.DIALOG_OUTCOME_ANSWERED
        # Addressed to one person: only they answer, whatever role others hold (the owner included).
        asked = asyncio.ensure_future(confirm(ext.ConfirmRequest(title="push?", addressee="person:cara"),
                                              metadata=(("authorization", "Bearer robot"),
                                                        ("x-uibus-session", "team-a-1"))))
        while (event := await ui.next()).WhichOneof("event") != "request":
            pass
        code, why = await _answer(channels[1], "alice", "team-a-1", ext.RespondRequest(id=event.request.id,
                                                                                       confirmed=True))
        assert code == DENIED and "addressed to 'cara' alone" in why, why
        code, _ = await _answer(channels[1], "cara", "team-a-1", ext.RespondRequest(id=event.request.id,
                                                                                    confirmed=False))
        assert code == OK and not (await asyncio.wait_for(asked, 5)).confirmed
        bad = await _answer(channels[0], "robot", "team-a-1", ext.RespondRequest(id="x", cancelled=True))
        assert bad[0] == grpc.StatusCode.NOT_FOUND
        code = None
        try:
            await confirm(ext.ConfirmRequest(title="t", addressee="king"),
                          metadata=(("authorization", "Bearer robot"), ("x-uibus-session", "team-a-1")))
        except grpc.aio.AioRpcError as exc:
            code, why = exc.code(), exc.details()
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "addressee 'king'" in why
        for channel in channels:
            await channel.close()
    finally:
        for app in apps:
            await app.aclose(grace=0.5)


async def test_invites_and_role_changes_are_in_the_audit_log(app: App, calls: Calls) -> None:
    from uibus.infra.audit import AuditLog, Query
    log = app.core.audit
    assert isinstance(log, AuditLog)
    assert await calls.create("alice", "team-a-1") == OK
    invite = await calls.invite("alice", "team-a-1", "approver")
    assert (await calls.accept("cara", invite.token))[0] == OK
    await calls.team("SetRole", tpb.SetRoleRequest(person="bob", role="participant"), tpb.Member, "alice", "team-a-1")
    await calls.team("RevokeInvite", tpb.RevokeInviteRequest(id=(await calls.invite("alice", "team-a-1", "owner")).id),
                     tpb.RevokeInviteReply, "alice", "team-a-1")
    entries = await log.list(Query(session="team-a-1", limit=50))
    acts = [(e["act"], e.get("person", e["who"]), e["detail"].get("role")) for e in entries
            if e["act"].startswith(("invite.", "role."))]
    assert acts == [("invite.create", "alice", "approver"), ("invite.accept", "cara", "approver"),
                    ("role.set", "alice", "participant"), ("invite.create", "alice", "owner"),
                    ("invite.revoke", "alice", None)], acts
    assert all(invite.token not in str(e) for e in entries)  # never a token value
