"""The page's sign-in through a real OpenID Connect provider (npm oidc-provider, tests/oidckit.py):
real headless Chromium through the provider's own login page, and the HTTP-level edges of the
cookie (CSRF on every state-changing call, forged and expired cookies, the login state cookie,
sign-out on the server side). docs/security/sign-in.md, "The page".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.conftest import free_port, running, shots
from tests.oidckit import PAGE_CLIENT, OidcProvider, adrive, oidc_provider
from tests.support import needs
from tests.webclient import frame
from uibus.app import App
from uibus.edge.transports.signin import _set_cookie
from uibus.infra.config import Config
from uibus.infra.web_sessions import WebSessions
from uibus.pb.uibus.v1 import sessions_pb2

OPERATOR = "operator-token-for-tests"
pytestmark = pytest.mark.node


@pytest.fixture
@needs("node")
def idp_port() -> Iterator[tuple[OidcProvider, int]]:
    port = free_port()
    with oidc_provider(redirect_uris=[f"http://127.0.0.1:{port}/auth/callback"]) as provider:
        yield provider, port


def signin_config(tmp_path: Path, provider: OidcProvider, port: int, **kw: Any) -> Config:
    return replace(Config(host="127.0.0.1", port=0, http_port=port, store=str(tmp_path / "uibus.db"),
                          grace_seconds=2.0, auth_token=OPERATOR),
                   oidc_issuer=provider.issuer, oidc_client_id=PAGE_CLIENT[0], oidc_client_secret=PAGE_CLIENT[1],
                   oidc_audience=provider.resource, **kw)


@pytest.fixture
async def site(tmp_path: Path, idp_port: tuple[OidcProvider, int]) -> AsyncIterator[tuple[App, OidcProvider]]:
    provider, port = idp_port
    async with running(signin_config(tmp_path, provider, port)) as app:
        yield app, provider


def base(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}"


async def sign_in(client: httpx.AsyncClient, app: App, person: str, back: str = "/") -> httpx.Response:
    """The flow as a browser runs it, over HTTP: /auth/login, the provider's pages, /auth/callback."""
    start = await client.get(f"{base(app)}/auth/login", params={"return": back})
    assert start.status_code == 302, start.text
    callback = await adrive(client, start.headers["location"], person, f"{base(app)}/auth/callback")
    return await client.get(callback)


def cookie(client: httpx.AsyncClient, name: str) -> str:
    return next(c.value for c in client.cookies.jar if c.name == name)


async def test_browser_signs_in_through_the_provider_calls_and_signs_out(
        site: tuple[App, OidcProvider], browser: Any, tmp_path: Path) -> None:
    app, _provider = site
    page = await browser.new_page(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"{base(app)}/?session=team-chat")
    await page.click("#signin")  # the server's sign-in page (401 without a token or cookie)
    await page.fill("input[name=login]", "bob")  # the provider's own login page (devInteractions)
    await page.fill("input[name=password]", "any password")
    await page.click(".login-submit")
    if await page.locator(".login-submit").count():  # its consent page
        await page.click(".login-submit")
    await page.wait_for_selector("#signed-in", timeout=10_000)
    assert urlsplit(page.url).path == "/" and "session=team-chat" in page.url  # back where it started
    who = page.locator("#signed-in")
    assert await who.get_attribute("data-person") == "bob"
    assert await who.get_attribute("data-role") == "approver" and await who.get_attribute("data-tenant") == "team-a"
    assert "Bob" in (await who.text_content() or "")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)  # its stream: a call as bob
    # A call that changes something, through gRPC-Web with the cookie (+ the page's CSRF header).
    await page.wait_for_function("() => document.querySelectorAll('#agent option[value]:not([value=\"\"])')"
                                 ".length > 0", timeout=5000)
    await page.fill("#input", "Hello from a signed-in page")
    await page.press("#input", "Enter")
    await page.locator(".msg.agent .text").first.wait_for(timeout=10_000)
    assert "error" not in (await page.locator(".msg.agent").first.get_attribute("class") or "")
    await page.screenshot(path=str(shots(tmp_path) / "signed-in.png"))
    session_cookie = next(c for c in await page.context.cookies() if c["name"] == "uibus_session")
    assert session_cookie["httpOnly"] and session_cookie["sameSite"] == "Lax"

    await page.click("#sign-out")  # the provider's end-session page asks; say yes
    await page.wait_for_load_state()
    if await page.locator("button[autofocus], button[type=submit]").count():
        await page.locator("button[autofocus], button[type=submit]").first.click()
        await page.wait_for_load_state()
    assert not [c for c in await page.context.cookies() if c["name"] == "uibus_session"]
    await page.goto(f"{base(app)}/?session=team-chat")
    assert await page.locator("#signin").count() == 1 and await page.locator("#signed-in").count() == 0
    # The old cookie, replayed by anyone who kept it, is refused: the sign-out revoked it.
    async with httpx.AsyncClient(cookies={"uibus_session": session_cookie["value"]}) as client:
        refused = await client.get(f"{base(app)}/auth/me")
        assert refused.status_code == 401 and "signed out" in refused.json()["error"]
        # The audit log has both, with bob (not uibus) as their actor and the page as their door.
        log = await client.get(f"{base(app)}/api/audit", params={"person": "bob"},
                               headers={"authorization": f"Bearer {OPERATOR}"})
    assert log.status_code == 200, log.text
    acts = {(e["act"], e["who"], e["door"]) for e in log.json()["entries"]}
    assert {("signin", "bob", "page"), ("signout", "bob", "page")} <= acts, acts
    assert not errors, errors
    await page.close()


async def test_expired_sign_in_sends_the_page_to_sign_in_again(
        tmp_path: Path, idp_port: tuple[OidcProvider, int], browser: Any) -> None:
    provider, port = idp_port
    async with running(signin_config(tmp_path, provider, port, session_max_age_seconds=4.0)) as app:
        page = await browser.new_page()
        await page.goto(f"{base(app)}/")
        await page.click("#signin")
        await page.fill("input[name=login]", "carol")
        await page.fill("input[name=password]", "x")
        await page.click(".login-submit")
        if await page.locator(".login-submit").count():
            await page.click(".login-submit")
        await page.wait_for_selector("#signed-in[data-role=observer]", timeout=10_000)
        await page.wait_for_selector("#signin-ended", timeout=8000)
        assert "expired" in (await page.locator("#signin-ended-why").text_content() or "")
        assert (await page.get_attribute("#sign-in-again", "href") or "").startswith("/auth/login")
        await page.close()


async def test_cookie_calls_need_the_csrf_value(site: tuple[App, OidcProvider]) -> None:
    app, _ = site
    async with httpx.AsyncClient(timeout=10) as client:
        landed = await sign_in(client, app, "alice", back="/?session=x")
        assert landed.status_code == 303 and landed.headers["location"] == "/?session=x"
        csrf = cookie(client, "uibus_csrf")
        me = (await client.get(f"{base(app)}/auth/me")).json()
        assert (me["person"], me["tenant"], me["role"], me["csrf"]) == ("alice", "team-a", "owner", csrf)
        assert me["exp"] > time.time()
        create = f"{base(app)}/api/v1/sessions/CreateSession"
        head = {"x-uibus-session": "csrf-1", "content-type": "application/json"}
        for extra in ({}, {"x-uibus-csrf": "not-the-value"}):
            refused = await client.post(create, headers={**head, **extra}, content="{}")
            assert refused.status_code == 403 and "x-uibus-csrf" in refused.text, refused.text
        # Over gRPC-Web, the page's own door, the same.
        grpc_web = await client.post(f"{base(app)}/uibus.v1.SessionService/CreateSession",
                                     headers={"content-type": "application/grpc-web+proto",
                                              "x-uibus-session": "csrf-1"},
                                     content=frame(sessions_pb2.CreateSessionRequest().SerializeToString()))
        assert grpc_web.status_code == 403
        operator = {"authorization": f"Bearer {OPERATOR}"}  # a bearer wins over the cookie
        listed = (await client.get(f"{base(app)}/api/v1/sessions", headers=operator)).json()
        assert "csrf-1" not in [s["session"] for s in listed.get("sessions", [])]  # nothing changed
        made = await client.post(create, headers={**head, "x-uibus-csrf": csrf}, content="{}")
        assert made.status_code == 200, made.text
        listed = (await client.get(f"{base(app)}/api/v1/sessions", headers=operator)).json()
        assert "csrf-1" in [s["session"] for s in listed.get("sessions", [])]
        # A WebSocket upgrade cannot carry the header: an Origin and ?csrf= instead.
        refused = await client.get(f"{base(app)}/acp", headers={
            "connection": "upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
            "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==", "origin": base(app)})
        assert refused.status_code == 403 and "csrf" in refused.text
        ws_headers = {"cookie": f"uibus_session={cookie(client, 'uibus_session')}", "origin": base(app)}
        async with connect(f"ws://127.0.0.1:{app.http_port}/acp?csrf={csrf}", additional_headers=ws_headers,
                           open_timeout=10) as upgraded:  # admitted as alice
            assert upgraded.response is not None and upgraded.response.status_code == 101

        # Sign-out is CSRF-checked too, then revokes the cookie's session on the server.
        value = cookie(client, "uibus_session")
        assert (await client.post(f"{base(app)}/auth/logout")).status_code == 403
        out = await client.post(f"{base(app)}/auth/logout", data={"csrf": csrf})
        assert out.status_code == 303 and out.headers["location"].startswith(_.issuer)  # the provider's end
        assert "uibus_session=;" in out.headers.get("set-cookie", "") or not client.cookies.get("uibus_session")
    async with httpx.AsyncClient(cookies={"uibus_session": value}) as replay:
        again = await replay.post(create, headers={**head, "x-uibus-csrf": csrf}, content="{}")
        assert again.status_code == 401 and "signed out" in again.text


async def test_forged_and_expired_cookies_are_refused(site: tuple[App, OidcProvider]) -> None:
    app, _ = site
    async with WebSessions(app.store, refresh_s=60) as shared:  # the key every replica shares
        expired, old = shared.issue("alice", "team-a", "owner", not_after=time.time() - 5)
    other = Path(app.config.store).with_name("other.key")
    other.write_text("x" * 48)
    async with WebSessions(app.store, secret_file=str(other), refresh_s=60) as foreign:
        forged, fsession = foreign.issue("alice", "team-a", "owner", not_after=time.time() + 600)
    create = f"{base(app)}/api/v1/sessions/CreateSession"
    for token, csrf, why in ((forged, fsession.csrf, "not signed by this server"), (expired, old.csrf, "expired"),
                             ("garbage", "x", "not a token of this server")):
        async with httpx.AsyncClient(cookies={"uibus_session": token}) as client:
            refused = await client.post(create, headers={"x-uibus-session": "forged", "x-uibus-csrf": csrf,
                                                         "content-type": "application/json"}, content="{}")
            assert refused.status_code == 401 and why in refused.text and "sign in again" in refused.text, refused.text
            me = await client.get(f"{base(app)}/auth/me")
            assert me.status_code == 401 and why in me.json()["error"]
            page = await client.get(f"{base(app)}/")  # the page: the sign-in page, saying why
            assert page.status_code == 401 and 'id="signin"' in page.text and why in page.text
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{base(app)}/auth/me")).json()["error"].startswith("not signed in")


async def test_the_login_state_cookie_is_bound_to_its_state(site: tuple[App, OidcProvider]) -> None:
    app, _ = site
    async with httpx.AsyncClient(timeout=10) as client:
        first = await client.get(f"{base(app)}/auth/login")
        first_cookie = cookie(client, "uibus_signin")
        set_cookie = first.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Lax" in set_cookie and "Path=/" in set_cookie
        query = parse_qs(urlsplit(first.headers["location"]).query)
        assert query["code_challenge_method"] == ["S256"] and query["nonce"] and query["state"]
        callback = await adrive(client, first.headers["location"], "alice", f"{base(app)}/auth/callback")
        await client.get(f"{base(app)}/auth/login")  # a second attempt: its own state in the cookie
        replayed = await client.get(callback)  # the first flow's answer with the second's cookie
        assert replayed.status_code == 400 and "state mismatch" in replayed.text
        assert not [c for c in client.cookies.jar if c.name == "uibus_session"]
    async with httpx.AsyncClient(cookies={"uibus_signin": first_cookie}) as other:
        # Its own cookie works once; no cookie at all is refused.
        done = await other.get(callback)
        assert done.status_code == 303, done.text
    async with httpx.AsyncClient() as bare:
        refused = await bare.get(callback)
        assert refused.status_code == 400 and "no sign-in cookie" in refused.text


def test_cookie_attributes_under_tls() -> None:
    """Under TLS: the `__Host-` name (no Domain, Path=/, Secure), HttpOnly, SameSite=Lax."""
    name, value = _set_cookie({"scheme": "https", "headers": []}, "uibus_session", "v", 60)
    assert name == b"set-cookie"
    assert value == b"__Host-uibus_session=v; Path=/; Max-Age=60; SameSite=Lax; HttpOnly; Secure"
    _, plain = _set_cookie({"scheme": "http", "headers": []}, "uibus_csrf", "c", 60, http_only=False)
    assert plain == b"uibus_csrf=c; Path=/; Max-Age=60; SameSite=Lax"
