"""A real OpenID Connect provider's access tokens (npm oidc-provider, tests/oidckit.py) as bearer
tokens on every door — gRPC, gRPC-Web, the HTTP API, the CodeBolt WebSocket, /acp and /mcp — beside
the tokens file's; and every kind of bad token refused at every door, saying why: expired, another
issuer's (a second provider), another audience's, a forged signature, `alg: none`, HS256.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import OctKey
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tests.conftest import free_port, running
from tests.oidckit import OidcProvider, oidc_provider
from tests.test_policy_matrix import Outcome, via_grpc, via_grpc_web, via_http, via_websocket
from uibus.app import App
from uibus.infra.config import Config, InvalidConfig
from uibus.infra.errors import ConfigError
from uibus.pb.uibus.v1 import sessions_pb2 as spb
from uibus.pb.uibus.v1 import team_pb2 as tpb

pytestmark = pytest.mark.node
AUD = "https://uibus.test/mcp"  # the resource uibus is at, as the provider's tokens name it
MACHINE = "machine-token"


@dataclass
class Tokens:
    alice: str
    bob: str
    expired: str
    foreign: str
    wrong_audience: str


@pytest.fixture(scope="module")
def idp() -> Iterator[OidcProvider]:
    with oidc_provider(resource=AUD) as provider:
        yield provider


@pytest.fixture(scope="module")
def tokens(idp: OidcProvider) -> Tokens:
    with oidc_provider(resource=AUD) as other:  # another issuer, with its own keys, same accounts and audience
        foreign = other.token("alice")
    expired = idp.token("alice", ttl=1)
    made = Tokens(idp.token("alice"), idp.token("bob"), expired, foreign,
                  idp.token("alice", resource="https://elsewhere.example/mcp"))
    exp = json.loads(base64.urlsafe_b64decode(expired.split(".")[1] + "=="))["exp"]
    time.sleep(max(0.0, exp + 1.1 - time.time()))  # past it (the apps here allow no leeway)
    return made


def forged(token: str) -> str:
    """The token with its signature's bytes changed (its claims untouched)."""
    head, body, sig = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(sig + "=="))
    raw[10] ^= 0xFF
    return f"{head}.{body}.{base64.urlsafe_b64encode(bytes(raw)).rstrip(b'=').decode()}"


def claims_of(token: str) -> dict[str, object]:
    return json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))  # type: ignore[no-any-return]


def unsigned(token: str) -> str:
    """The same claims with `alg: none` and no signature."""
    head = base64.urlsafe_b64encode(b'{"alg":"none","typ":"at+jwt"}').rstrip(b"=").decode()
    return f"{head}.{token.split('.')[1]}."


def hs256(token: str) -> str:
    """The same claims signed HS256 with a key anyone could know (the public key confusion attack's form)."""
    return jwt.encode({"alg": "HS256"}, claims_of(token), OctKey.import_key(b"x" * 32))


def bad_tokens(t: Tokens) -> dict[str, tuple[str, str]]:
    """Each bad token and the words its refusal must say."""
    return {"expired": (t.expired, "expired at"),
            "foreign issuer": (t.foreign, "is not the configured one"),
            "wrong audience": (t.wrong_audience, "not for this server"),
            "forged signature": (forged(t.alice), "signature does not verify"),
            "alg none": (unsigned(t.alice), "'none', which uibus does not accept"),
            "hs256": (hs256(t.alice), "'HS256', which uibus does not accept")}


@pytest.fixture
async def app(idp: OidcProvider, tmp_path: Path) -> AsyncIterator[App]:
    file = tmp_path / "tokens"
    file.write_text(f"{MACHINE} (machines) *\n")
    config = Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / "u.db"), grace_seconds=1.0,
                    tokens_file=str(file), oidc_issuer=idp.issuer, oidc_audience=AUD, oidc_leeway_seconds=0)
    async with running(config) as started:
        yield started


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def via_mcp(app: App, session: str, headers: dict[str, str], garbage: bool = False) -> Outcome:
    """tools/list on /mcp; a refusal's 401 must carry the resource metadata challenge."""
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"http://127.0.0.1:{app.http_port}/mcp", headers={
            "content-type": "application/json", "accept": "application/json, text/event-stream",
            "x-uibus-session": session, **headers}, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    reply = r.json()
    if "result" in reply:
        return Outcome("OK", "", "/mcp/tools/list")
    assert r.status_code == 401, (r.status_code, reply)
    challenge = r.headers["www-authenticate"]
    metadata = f"http://127.0.0.1:{app.http_port}/.well-known/oauth-protected-resource/mcp"
    assert challenge.startswith("Bearer ") and f'resource_metadata="{metadata}"' in challenge, challenge
    assert ('error="invalid_token"' in challenge) == bool(headers), challenge
    return Outcome(reply["error"]["data"]["status"], reply["error"]["message"], "/mcp/tools/list")


async def via_acp(app: App, session: str, headers: dict[str, str], garbage: bool = False) -> Outcome:
    """The /acp WebSocket: its upgrade takes the token; an accepted editor's `initialize` is answered."""
    try:
        async with ws_connect(f"ws://127.0.0.1:{app.http_port}/acp", additional_headers=headers) as ws:
            await ws.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                      "params": {"protocolVersion": 1, "clientCapabilities": {}}}))
            reply = json.loads(await ws.recv())
    except InvalidStatus as exc:
        assert exc.response.status_code == 401, exc.response.status_code
        assert "resource_metadata=" in exc.response.headers["www-authenticate"]
        error = json.loads(exc.response.body)
        return Outcome(error["code"], error["error"], "/acp")
    assert reply["result"]["protocolVersion"] == 1, reply
    return Outcome("OK", "", "/acp")


async def via_http_api(app: App, session: str, headers: dict[str, str], garbage: bool = False) -> Outcome:
    outcome = await via_http(app, session, headers, garbage)
    if outcome.code == "UNAUTHENTICATED":  # the HTTP API's 401 names the resource metadata too
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"http://127.0.0.1:{app.http_port}/api/v1/hello_world/streaming_chat",
                                json={"user_message": {"text": "hi"}}, headers=headers)
        assert r.status_code == 401 and "resource_metadata=" in r.headers["www-authenticate"], r.headers
    return outcome


DOORS = {"grpc": via_grpc, "grpc-web": via_grpc_web, "http": via_http_api, "codebolt": via_websocket,
         "mcp": via_mcp, "acp": via_acp}


@pytest.mark.parametrize("door", DOORS)
async def test_a_provider_token_is_accepted_and_every_bad_one_refused_saying_why(
        door: str, app: App, tokens: Tokens) -> None:
    attempt = DOORS[door]
    assert (await attempt(app, "team-1", bearer(tokens.alice), False)).code == "OK"
    assert (await attempt(app, "team-1", bearer(MACHINE), False)).code == "OK"  # the tokens file's, beside it
    for kind, (token, why) in bad_tokens(tokens).items():
        outcome = await attempt(app, "team-1", bearer(token), False)
        assert outcome.code == "UNAUTHENTICATED" and why in outcome.message, (door, kind, outcome)
        signature = token.split(".")[2]
        assert token not in outcome.message and (not signature or signature[:20] not in outcome.message)
    # No token at all: still "needs a token", the resource metadata named on the HTTP doors.
    assert (await attempt(app, "team-1", {}, False)).code == "UNAUTHENTICATED"


async def test_claims_map_to_the_person_tenant_and_role(app: App, tokens: Tokens, idp: OidcProvider) -> None:
    assert app.oidc is not None
    alice = app.oidc.verify(tokens.alice.encode())
    assert alice is not None and (alice.person, alice.tenant, alice.role) == ("alice", "team-a", "owner")
    assert not alice.all_sessions and alice.patterns == ("*",)
    assert alice.name == f"oidc {idp.issuer} sub alice" and tokens.alice not in repr(alice)
    bob = app.oidc.verify(tokens.bob.encode())
    assert bob is not None and bob.role == "approver"  # uibus-approver (his `staff` group maps to nothing here)
    # Verified once: the second call is the cache's.
    assert app.oidc.verify(tokens.alice.encode()) is alice
    assert app.oidc.verify(b"not-a-jwt") is None and app.oidc.verify(MACHINE.encode()) is None
    # The ID token is the client's (aud = its client id), not this server's.
    id_token = idp.tokens("alice")["id_token"]
    with pytest.raises(Exception, match="not for this server"):
        app.oidc.verify(id_token.encode())
    assert app.oidc.decode(id_token, "uibus-kit")["sub"] == "alice"  # what the page's sign-in does with one


async def test_role_map_tenant_default_and_person_claim(idp: OidcProvider, tmp_path: Path) -> None:
    config = Config(host="127.0.0.1", port=0, http_port=0, store=":memory:", oidc_issuer=idp.issuer,
                    oidc_audience=AUD, oidc_person_claim="email", oidc_role_map="staff=owner,uibus-owner=observer",
                    oidc_tenant="people-x")
    async with running(config) as app:
        assert app.oidc is not None
        bob = app.oidc.verify(idp.token("bob").encode())
        assert bob is not None and (bob.person, bob.role) == ("bob@example.com", "owner")  # the strongest wins
        dave = app.oidc.verify(idp.token("dave").encode())
        assert dave is not None and (dave.tenant, dave.role) == ("people-x", "participant")
        with pytest.raises(Exception, match="'email' claim"):  # a login with no email: no person
            app.oidc.verify(idp.token("nobody").encode())


async def test_the_protected_resource_metadata(app: App, idp: OidcProvider) -> None:
    async with httpx.AsyncClient(timeout=10, base_url=f"http://127.0.0.1:{app.http_port}") as http:
        for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
            r = await http.get(path)
            assert r.status_code == 200, r.text
            assert r.json() == {"resource": f"http://127.0.0.1:{app.http_port}/mcp",
                                "authorization_servers": [idp.issuer], "bearer_methods_supported": ["header"],
                                "resource_name": "uibus"}
        r = await http.get("/.well-known/oauth-protected-resource", headers={
            "host": f"localhost:{app.http_port}", "x-forwarded-proto": "https"})
        assert r.json()["resource"] == f"https://localhost:{app.http_port}/mcp"
        # A Host the browser policy does not answer is refused before any metadata names it.
        assert (await http.get("/.well-known/oauth-protected-resource", headers={"host": "evil.example"})
                ).status_code in (400, 403, 421)


async def test_without_a_provider_there_is_no_metadata(web: App) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"http://127.0.0.1:{web.http_port}/.well-known/oauth-protected-resource")
    assert r.status_code == 404 and "--oidc-issuer" in r.text


async def test_bad_provider_settings_stop_the_start(idp: OidcProvider, tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match=r"--oidc-issuer: 'http://example\.com' is not an https URL"):
        Config(oidc_issuer="http://example.com", oidc_client_id="x")
    with pytest.raises(InvalidConfig, match="--oidc-role-map: 'admins=king' is not value=role"):
        Config(oidc_issuer=idp.issuer, oidc_client_id="x", oidc_role_map="admins=king")
    with pytest.raises(InvalidConfig, match="--oidc-audience: is needed"):
        Config(oidc_issuer=idp.issuer)
    # The provider's discovery names another issuer (127.0.0.1, not localhost): a misconfiguration.
    config = Config(host="127.0.0.1", port=0, http_port=0, store=":memory:", oidc_client_id="uibus",
                    oidc_issuer=f"http://localhost:{idp.port}")
    with pytest.raises(ConfigError, match=f"names issuer 'http://127.0.0.1:{idp.port}', not"):
        async with running(config):
            pass


async def test_an_unreachable_provider_refuses_its_tokens_and_keeps_machines_working(tmp_path: Path) -> None:
    with oidc_provider(resource=AUD) as gone:
        token = gone.token("alice")
    file = tmp_path / "tokens"
    file.write_text(f"{MACHINE} *\n")
    config = Config(host="127.0.0.1", port=0, http_port=0, store=":memory:", tokens_file=str(file), oidc_audience=AUD,
                    oidc_issuer=gone.issuer)  # nothing listens there any more
    async with running(config) as app:
        outcome = await via_grpc(app, "s", bearer(token), False)
        assert outcome.code == "UNAUTHENTICATED" and "signing keys are not fetched yet" in outcome.message, outcome
        assert (await via_grpc(app, "s", bearer(MACHINE), False)).code == "OK"


async def test_a_provider_alone_closes_every_door(idp: OidcProvider, tokens: Tokens, tmp_path: Path) -> None:
    """No tokens file, no --auth-token: the provider's verifier alone turns tokens on (a Tokens with
    no file grants is still the one in force, not an empty one that leaves every call open)."""
    config = Config(host="127.0.0.1", port=0, http_port=free_port(), store=str(tmp_path / "u.db"), grace_seconds=1.0,
                    oidc_issuer=idp.issuer, oidc_audience=AUD)
    async with running(config) as app:
        assert app.own_user is None  # tokens decide, not the loopback peer's user
        for door, attempt in DOORS.items():
            assert (await attempt(app, "s", {}, False)).code == "UNAUTHENTICATED", door
            assert (await attempt(app, "s", bearer(tokens.alice), False)).code == "OK", door


async def test_a_providers_person_reaches_only_their_tenants_sessions(app: App, tokens: Tokens,
                                                                     idp: OidcProvider) -> None:
    """A provider's grant allows every session *name* (its tenant has no patterns); roles decide
    which sessions: a session the operator's machine made (no tenant's) and another tenant's are
    out of reach and out of the listing, a free name is the person's to create and own, and their
    tenant's people hold their tenant-wide role there."""
    dave = idp.token("dave")  # no tenant claim: the default tenant's participant

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        async def call(path: str, request: object, reply: type, token: str, session: str) -> tuple[object, object]:
            method = channel.unary_unary(path, request_serializer=type(request).SerializeToString,  # type: ignore[attr-defined]
                                         response_deserializer=reply.FromString)  # type: ignore[attr-defined]
            try:
                return grpc.StatusCode.OK, await method(request, metadata=(
                    ("authorization", f"Bearer {token}"), ("x-uibus-session", session)))
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()

        async def role(token: str, session: str) -> str:
            code, who = await call("/uibus.v1.TeamService/WhoAmI", tpb.WhoAmIRequest(), tpb.WhoAmIReply, token, session)
            assert code == grpc.StatusCode.OK, who
            return str(who.role)  # type: ignore[attr-defined]

        async def listed(token: str) -> set[str]:
            code, got = await call("/uibus.v1.SessionService/ListSessions", spb.ListSessionsRequest(),
                                   spb.SessionList, token, "default")
            assert code == grpc.StatusCode.OK, got
            return {s.session for s in got.sessions}  # type: ignore[attr-defined]

        create = "/uibus.v1.SessionService/CreateSession"
        assert (await call(create, spb.CreateSessionRequest(), spb.SessionEntry, MACHINE, "ops-1"))[0] == \
            grpc.StatusCode.OK
        code, why = await call("/uibus.v1.SessionService/GetWorkspaceDiff", spb.AgentRequest(agent="x"),
                               spb.WorkspaceDiff, tokens.alice, "ops-1")
        assert code == grpc.StatusCode.PERMISSION_DENIED and "holds no role" in str(why), why
        assert await role(tokens.alice, "ops-1") == ""
        assert (await call(create, spb.CreateSessionRequest(), spb.SessionEntry, tokens.alice, "a-1"))[0] == \
            grpc.StatusCode.OK
        assert await role(tokens.alice, "a-1") == "owner"
        assert await role(tokens.bob, "a-1") == "approver"  # alice's tenant: bob's tenant-wide role
        assert await role(dave, "a-1") == ""  # another tenant's person: nothing
        assert "ops-1" not in await listed(tokens.alice) and "a-1" in await listed(tokens.alice)
        assert "a-1" not in await listed(dave) and "ops-1" not in await listed(dave)
