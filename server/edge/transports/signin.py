"""Sign-in for the page: OpenID Connect's authorization code flow with PKCE, and the cookie it leaves.

Routes (all under `/auth/`, one entry of the route table, behind its browser policy):

* `GET /auth/login[?return=/path]`: a new `state`, `nonce` and PKCE verifier (S256), kept in a
  short-lived signed HttpOnly cookie (uibus.infra.web_sessions: any replica can finish the flow),
  then a redirect to the provider's authorization endpoint;
* `GET /auth/callback`: the state cookie must carry the `state` the provider sent back; the code is
  exchanged at the token endpoint with the client secret; the ID token is verified (part A's
  `Oidc.decode`: signature by the provider's keys, issuer, audience = our client id, expiry) and its
  `nonce` must be ours; its claims map to person, tenant and role exactly as a provider's bearer
  token's do (`Oidc.grant_of`); the session cookie is set and the browser sent back to the page;
* `POST /auth/logout`: CSRF-checked (the `x-uibus-csrf` header or a `csrf` form field); the session's
  id is revoked on every replica, the cookies cleared, and the browser sent to the provider's
  `end_session_endpoint` when it has one (else to the page);
* `GET /auth/me`: who the cookie signs in (person, tenant, role, expiry, and the CSRF value the page
  echoes); 401 when not signed in.

The cookie is `__Host-uibus_session` under TLS (Secure, Path=/, no Domain: a sibling host cannot plant
one), `uibus_session` without TLS (where `__Host-` cannot be set); HttpOnly, SameSite=Lax. A readable
companion `…uibus_csrf` carries the CSRF value for the page's script. `admit` is the route gate's one
translation of cookie into authorization (see its docstring): nothing else reads the cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, quote_plus, urlencode

from uibus.edge.transports.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    respond_json,
)
from uibus.infra.actor import Actor, acting, restore
from uibus.infra.auth import Grant
from uibus.infra.errors import Unauthenticated

if TYPE_CHECKING:  # the session tokens' JOSE stack loads only when sign-in is configured
    import aiohttp

    from uibus.infra.web_sessions import PageSession, WebSessions

log = logging.getLogger("uibus.web.signin")

PREFIX = "/auth/"
CSRF_HEADER = b"x-uibus-csrf"
CSRF_QUERY = "csrf"  # WebSocket upgrades cannot carry a header: `?csrf=` (with the Origin check)
SCOPE = "openid email profile"
EXCHANGE_TIMEOUT_S = 10.0
_SESSION, _CSRF, _LOGIN = "uibus_session", "uibus_csrf", "uibus_signin"
EXPIRED = "uibus.signin.expired"  # the scope key of why a page's cookie no longer signs in (its login page says it)


class Provider(Protocol):
    """What sign-in needs of part A's `uibus.infra.oidc.Oidc`."""

    metadata: dict[str, Any]

    def decode(self, token: str, audience: str | None = None) -> dict[str, Any]: ...

    def grant_of(self, claims: dict[str, Any]) -> Grant: ...


def secure(scope: Scope) -> bool:
    """Whether the browser reached us over TLS (then the `__Host-` names and `Secure`)."""
    return scope.get("scheme") in ("https", "wss")


def cookie_name(scope: Scope, base: str) -> str:
    return f"__Host-{base}" if secure(scope) else base


def cookies_of(scope: Scope) -> dict[str, str]:
    """The request's cookies (RFC 6265 `name=value; …`; the first of a repeated name wins)."""
    found: dict[str, str] = {}
    for key, value in scope["headers"]:
        if key != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            name, eq, val = part.strip().partition("=")
            if eq and name and name not in found:
                found[name] = val.strip().strip('"')
    return found


def _set_cookie(scope: Scope, base: str, value: str, max_age: int, *, http_only: bool = True) -> tuple[bytes, bytes]:
    attrs = [f"{cookie_name(scope, base)}={value}", "Path=/", f"Max-Age={max(max_age, 0)}", "SameSite=Lax"]
    if http_only:
        attrs.append("HttpOnly")
    if secure(scope):
        attrs.append("Secure")
    return b"set-cookie", "; ".join(attrs).encode("latin-1")


def _origin(scope: Scope) -> str:
    """The origin the browser used (its Host header passed the browser policy's Host check)."""
    scheme = "https" if secure(scope) else "http"
    return f"{scheme}://{header(scope, b'host') or 'localhost'}"


def _local_path(value: str) -> str:
    """Where to return after signing in: a path of this server, never another site (`//x`, `/\\x`)."""
    if not value.startswith("/") or value.startswith(("//", "/\\")) or any(c in value for c in "\r\n\\"):
        return "/"
    return value[:2000]


class SignIn:
    """The `/auth/` routes and the gate's cookie check (module docstring). `on_signout` runs after a
    sign-out (the tokens' reload hooks: this replica's streams of that session end at once)."""

    def __init__(self, web: WebSessions, provider: Provider, client_id: str, client_secret: str, *,
                 audit: Any = None, on_signout: Callable[[], None] = lambda: None) -> None:
        self.web = web
        self.provider = provider
        self.client_id = client_id
        self.client_secret = client_secret
        self.audit = audit
        self.on_signout = on_signout
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SignIn:
        import aiohttp  # ~9 MB: loaded only when sign-in is configured (the route table imports this module)

        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EXCHANGE_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ---- the gate ----------------------------------------------------------------------------------

    def admit(self, scope: Scope, safe: bool) -> tuple[int, str] | None:
        """Turns the session cookie into the request's `authorization: Bearer <session token>`, so the
        route's token check and the pipeline see the person like any bearer. A bearer header, when
        present, wins (the cookie is not read). The cookie counts only with proof the page sent it:
        the `x-uibus-csrf` header equal to the session's CSRF value; a WebSocket upgrade (no headers
        from a browser's script) needs an `Origin` (the browser policy admitted it) and `?csrf=`;
        `safe` requests (GET/HEAD of a read-only route: the page itself) need neither. Returns the
        refusal (status, why) or None (admitted, or no cookie: the route decides)."""
        if header(scope, b"authorization"):
            return None
        token = cookies_of(scope).get(cookie_name(scope, _SESSION))
        if not token:
            return None
        try:
            session = self.web.read(token)
        except Unauthenticated as exc:
            if safe:  # the page: its refusal is the sign-in page, which says so
                scope[EXPIRED] = str(exc)
                return None
            return 401, f"{exc} (the page: GET /auth/login)"
        if not safe:
            if scope["type"] == "websocket":
                given = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get(CSRF_QUERY) or [""])[0]
                if not header(scope, b"origin"):
                    return 403, "a WebSocket with the sign-in cookie must come from a page (Origin) with ?csrf="
            else:
                given = header(scope, CSRF_HEADER)
            if not given or not hmac.compare_digest(given.encode("latin-1"), session.csrf.encode()):
                return 403, ("the sign-in cookie needs the page's CSRF value in x-uibus-csrf (?csrf= on a "
                             "WebSocket): " + ("missing" if not given else "it does not match this session's"))
        scope["headers"] = [*scope["headers"], (b"authorization", b"Bearer " + token.encode("latin-1"))]
        return None

    async def _record(self, act: str, scope: Scope, person: str, tenant: str, **detail: str) -> None:
        """The audit log's entry for a sign-in or sign-out, with the person as its actor (no call was
        admitted here: the route runs no pipeline call) and the page as its door."""
        if self.audit is None:
            return
        before = acting(Actor(person, tenant=tenant, door="page", person=True,
                              client="".join(c for c in header(scope, b"user-agent") if c.isprintable())[:120]))
        try:
            await self.audit.record(act, **detail)
        finally:
            restore(before)

    # ---- the routes --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The endpoint's name below the route's prefix (the route table chose this door).
        name, method = scope["path"][len(PREFIX):], scope.get("method", "")
        path = PREFIX + name
        endpoints = {"login": ("GET", self._login), "callback": ("GET", self._callback),
                     "logout": ("POST", self._logout), "me": ("GET", self._me)}
        if scope["type"] != "http" or name not in endpoints:
            await respond(send, 404, f"not found: {path[:200]} (sign-in: /auth/login, /auth/callback, "
                          "/auth/logout, /auth/me)\n")
            return
        wanted, handler = endpoints[name]
        if method not in (wanted, "HEAD" if wanted == "GET" else wanted):
            await respond(send, 405, f"no {method[:16]} route for {path}: use {wanted}\n",
                          headers=[(b"allow", wanted.encode())])
            return
        await handler(scope, receive, send)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        state, nonce, verifier = secrets.token_urlsafe(24), secrets.token_urlsafe(24), secrets.token_urlsafe(48)
        redirect_uri = _origin(scope) + "/auth/callback"
        kept = self.web.login_state(state=state, nonce=nonce, verifier=verifier, redirect_uri=redirect_uri,
                                    back=_local_path((query.get("return") or ["/"])[0]))
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        target = self.provider.metadata["authorization_endpoint"] + "?" + urlencode({
            "response_type": "code", "client_id": self.client_id, "redirect_uri": redirect_uri, "scope": SCOPE,
            "state": state, "nonce": nonce, "code_challenge": challenge, "code_challenge_method": "S256"})
        await respond(send, 302, "", headers=[(b"location", target.encode()), (b"cache-control", b"no-store"),
                                              _set_cookie(scope, _LOGIN, kept, 600)])

    async def _failed(self, scope: Scope, send: Send, status: int, why: str) -> None:
        """A sign-in that did not work: said in a small page with the way to start again."""
        log.warning("sign-in refused", extra={"fields": {"reason": why[:300]}})
        page = ("<!doctype html><meta charset=utf-8><title>uibus · sign-in failed</title>"
                f"<p id=why>Sign-in failed: {_escape(why)}</p><p><a href=/auth/login>Sign in again</a></p>")
        await respond(send, status, page, "text/html; charset=utf-8",
                      [(b"cache-control", b"no-store"), _set_cookie(scope, _LOGIN, "", 0)])

    async def _callback(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        kept = cookies_of(scope).get(cookie_name(scope, _LOGIN), "")
        if not kept:
            await self._failed(scope, send, 400, "this browser started no sign-in here (no sign-in cookie; cookies "
                               "off, or the attempt is older than 10 minutes)")
            return
        try:
            flow = self.web.open_login_state(kept, query.get("state", ""))
        except Unauthenticated as exc:
            await self._failed(scope, send, 400, str(exc))
            return
        if "error" in query:
            await self._failed(scope, send, 401, f"the provider said {query['error'][:80]}: "
                               f"{query.get('error_description', '')[:200]}")
            return
        try:
            tokens = await self._exchange(query.get("code", ""), flow)
            claims = self.provider.decode(str(tokens.get("id_token", "")), audience=self.client_id)
            if not hmac.compare_digest(str(claims.get("nonce", "")), str(flow["nonce"])):
                raise Unauthenticated("the ID token's nonce is not this sign-in's (a replayed ID token?)")
            grant = self.provider.grant_of(claims)
        except Unauthenticated as exc:
            await self._failed(scope, send, 401, str(exc))
            return
        token, session = self.web.issue(grant.person, grant.tenant, grant.role, not_after=float(claims["exp"]),
                                        name=str(claims.get("name") or claims.get("email") or ""))
        await self._record("signin", scope, session.person, session.tenant, role=session.role)
        log.info("signed in", extra={"fields": {"person": session.person, "tenant": session.tenant}})
        await respond(send, 303, "", headers=[
            (b"location", str(flow.get("back") or "/").encode()), (b"cache-control", b"no-store"),
            _set_cookie(scope, _LOGIN, "", 0), *self._session_cookies(scope, token, session)])

    def _session_cookies(self, scope: Scope, token: str, session: PageSession) -> list[tuple[bytes, bytes]]:
        left = int(session.exp - time.time())
        return [_set_cookie(scope, _SESSION, token, left),
                _set_cookie(scope, _CSRF, session.csrf, left, http_only=False)]

    async def _exchange(self, code: str, flow: dict[str, Any]) -> dict[str, Any]:
        """The provider's token response for `code` (client_secret_basic, the PKCE verifier)."""
        if not code:
            raise Unauthenticated("the provider sent no code back")
        assert self._http is not None, "SignIn is used before it was entered"
        import aiohttp  # already loaded by __aenter__

        basic = aiohttp.encode_basic_auth(_form(self.client_id), _form(self.client_secret))  # RFC 6749 2.3.1
        data = {"grant_type": "authorization_code", "code": code, "redirect_uri": flow["redirect_uri"],
                "code_verifier": flow["verifier"]}
        try:
            async with self._http.post(self.provider.metadata["token_endpoint"], data=data,
                                       headers={"accept": "application/json", "authorization": basic}) as reply:
                body = await reply.json(content_type=None)
                status = reply.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Unauthenticated(f"the provider's token endpoint could not be reached or answered no JSON: "
                                  f"{type(exc).__name__}") from None
        if status != 200 or not isinstance(body, dict) or "id_token" not in body:
            what = body.get("error", "") if isinstance(body, dict) else ""
            raise Unauthenticated(f"the provider refused the code ({status} {str(what)[:80]})")
        return body

    async def _logout(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = header(scope, CSRF_HEADER)
        try:
            body = await read_body(receive, 4096)
        except ClientGone:
            return
        except BodyTooLarge:
            await respond(send, 413, "a sign-out's form is a CSRF field, not over 4096 bytes\n")
            return
        if not given:
            given = (parse_qs(body.decode("latin-1")).get(CSRF_QUERY) or [""])[0]
        token = cookies_of(scope).get(cookie_name(scope, _SESSION), "")
        try:
            session: PageSession | None = self.web.read(token) if token else None
        except Unauthenticated:
            session = None  # expired or signed out already: nothing to revoke, the cookies still go
        if session is not None:
            if not given or not hmac.compare_digest(given.encode("latin-1"), session.csrf.encode()):
                await respond(send, 403, "sign-out needs the page's CSRF value (x-uibus-csrf or a csrf field)\n")
                return
            await self.web.revoke(session)
            self.on_signout()
            await self._record("signout", scope, session.person, session.tenant)
            log.info("signed out", extra={"fields": {"person": session.person}})
        target = "/"
        end = self.provider.metadata.get("end_session_endpoint")
        if end and session is not None:
            target = end + "?" + urlencode({"client_id": self.client_id,
                                            "post_logout_redirect_uri": _origin(scope) + "/"})
        await respond(send, 303, "", headers=[(b"location", target.encode()), (b"cache-control", b"no-store"),
                                              _set_cookie(scope, _SESSION, "", 0),
                                              _set_cookie(scope, _CSRF, "", 0, http_only=False)])

    async def _me(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = cookies_of(scope).get(cookie_name(scope, _SESSION), "")
        headers = [(b"cache-control", b"no-store")]
        if not token:
            await respond_json(send, 401, {"error": "not signed in: GET /auth/login", "code": "UNAUTHENTICATED"},
                               headers=headers)
            return
        try:
            session = self.web.read(token)
        except Unauthenticated as exc:
            await respond_json(send, 401, {"error": str(exc), "code": "UNAUTHENTICATED"}, headers=headers)
            return
        await respond_json(send, 200, session.shown(), headers=headers)


def _form(value: str) -> str:
    return quote_plus(value)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
