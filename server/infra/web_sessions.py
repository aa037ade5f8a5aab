"""The page's sign-in session: a short JWT uibus signs itself, kept in an HttpOnly cookie.

Why a token of our own and not the provider's: the provider's ID and access tokens are meant for
uibus's server side (the code exchange, part A's bearer check), never for a cookie a browser
replays on every request; what the page needs is who (person, tenant, role), until when, and the
CSRF value its calls must echo (uibus.edge.transports.signin). So after the provider's sign-in
uibus issues this token (joserfc, HS256) and the provider's tokens are dropped.

* **The key** every replica must share: `--session-secret-file` (at least 32 bytes), else a random
  key created once in the store (record `key` of STORE_NAMESPACE, set-if-absent, so the replicas
  that start together agree on the first writer's) and re-read every REFRESH_S, so a key the
  store's retention lost and a replica re-created is taken up by the others.
* **Sign-out** must end the token everywhere before its `exp`: its id (`jti`) goes into the record
  `revoked` of the store ({jti: exp}, expired ids pruned at each write, so it stays as small as
  the sessions signed out within one max age). Each replica re-reads it every REFRESH_S, so a
  signed-out cookie is refused by every replica within that (on the replica that signed it out,
  at once). `verify` stays synchronous (a `Tokens.verifiers` entry): it reads the cached set.
* **The login state** (PKCE verifier, `state`, `nonce`, where to return) travels in a second
  short-lived cookie signed with the same key (`typ` "login"), so any replica can finish a flow
  another replica started; its `state` must equal the callback's, so a state cookie cannot be
  replayed for another flow.

The store records live under a name no session can have (STORE_NAMESPACE starts with `!`, which
`check_session` refuses; the sessions listing leaves such names out).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from joserfc import jws, jwt
from joserfc.errors import BadSignatureError, ExpiredTokenError, JoseError
from joserfc.jwk import OctKey

from uibus.infra.auth import ALL, Grant
from uibus.infra.errors import ConfigError, UibusError, Unauthenticated
from uibus.infra.roles import is_role
from uibus.infra.store import Store

log = logging.getLogger("uibus.infra.web_sessions")

STORE_NAMESPACE = "!uibus/web-signin"  # not a session name (check_session refuses `!`)
ISSUER = "uibus:page"  # the `iss` of every token this module signs: how `verify` knows its kind
SESSION, LOGIN = "session", "login"  # the `typ` claim: a sign-in session, or a login flow's state
REFRESH_S = 2.0  # how often the revoked ids and the key are re-read from the store
TOUCH_S = 600.0  # how often the key record is written again, so store retention never finds it idle
LOGIN_TTL_S = 600  # a login flow (the provider's page, its form) must finish within this
MIN_SECRET_BYTES = 32
_ALG = ["HS256"]


@dataclass(frozen=True, slots=True)
class PageSession:
    """One signed-in page: who, until when, and the CSRF value its calls must carry."""

    person: str
    tenant: str
    role: str  # tenant-wide role from the provider's claims ("" = only session memberships)
    exp: int  # epoch seconds
    csrf: str
    jti: str
    name: str = ""  # what to show (the provider's `name` or `email`); never used to decide anything

    def shown(self) -> dict[str, Any]:
        """What `GET /auth/me` answers (the CSRF value included: the page must echo it)."""
        return {"person": self.person, "tenant": self.tenant, "role": self.role, "exp": self.exp,
                "name": self.name, "csrf": self.csrf}


def read_secret_file(path: str) -> bytes:
    """The key of `--session-secret-file`; ConfigError when it cannot be read or is too short."""
    try:
        data = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError("--session-secret-file", f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError("--session-secret-file", f"{path} holds {len(data)} bytes: a session key needs at least "
                          f"{MIN_SECRET_BYTES} (e.g. `head -c 48 /dev/urandom | base64 > {path}`)")
    return data


def _kind_of(token: bytes | str) -> dict[str, Any] | None:
    """The unverified claims of a compact JWS that names us as issuer; None for any other token
    (a tokens-file token, a provider's JWT): `verify` must answer "not my kind" for those."""
    raw = token if isinstance(token, bytes) else token.encode("ascii", "replace")
    if raw.count(b".") != 2 or len(raw) > 8192:
        return None
    try:
        parsed = json.loads(jws.extract_compact(raw).payload)
    except (JoseError, ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) and parsed.get("iss") == ISSUER else None


class WebSessions:
    """Issues and checks the page's session tokens and login states (see the module docstring).
    An async context manager: entering loads the key and the revoked ids and starts their refresh."""

    def __init__(self, store: Store, *, max_age_s: float = 8 * 3600.0, secret_file: str = "",
                 refresh_s: float = REFRESH_S) -> None:
        self.store = store
        self.max_age_s = max_age_s
        self.secret_file = secret_file
        self.refresh_s = refresh_s
        self._key: OctKey | None = None
        self._revoked: dict[str, int] = {}
        self._refresher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WebSessions:
        if self.secret_file:
            self._key = OctKey.import_key(read_secret_file(self.secret_file))
        await self._refresh()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="uibus-web-sessions")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    # ---- the shared key and revoked ids ---------------------------------------------------------

    async def _refresh(self, touch: bool = False) -> None:
        if not self.secret_file:
            fresh = base64.b64encode(secrets.token_bytes(48)).decode()
            record = await self.store.update(STORE_NAMESPACE, "key", lambda cur: cur or fresh) if touch or \
                self._key is None else await self.store.get(STORE_NAMESPACE, "key")
            if not record:  # gone (retention): make one again; every replica takes the first writer's
                record = await self.store.update(STORE_NAMESPACE, "key", lambda cur: cur or fresh)
            key = OctKey.import_key(base64.b64decode(record))
            if self._key is None or key.as_dict() != self._key.as_dict():
                self._key = key
        revoked = await self.store.get(STORE_NAMESPACE, "revoked") or {}
        now = int(time.time())
        self._revoked = {jti: exp for jti, exp in {**self._revoked, **revoked}.items() if exp > now}

    async def _refresh_forever(self) -> None:
        touched = time.monotonic()
        while True:
            await asyncio.sleep(self.refresh_s)
            touch = time.monotonic() - touched >= TOUCH_S
            try:
                await self._refresh(touch)
            except UibusError as exc:  # the store fails: keep the cached key and ids, try again
                log.warning("page sessions not refreshed", extra={"fields": {"error": str(exc)}})
                continue
            if touch:
                touched = time.monotonic()

    @property
    def key(self) -> OctKey:
        if self._key is None:
            raise RuntimeError("WebSessions is used before it was entered (`async with`)")
        return self._key

    # ---- sessions --------------------------------------------------------------------------------

    def issue(self, person: str, tenant: str, role: str, *, not_after: float,
              name: str = "") -> tuple[str, PageSession]:
        """A new session token for `person`, expiring at min(`not_after`, now + max age)."""
        exp = int(min(not_after, time.time() + self.max_age_s))
        session = PageSession(person, tenant, role if is_role(role) else "", exp, secrets.token_urlsafe(24),
                              secrets.token_urlsafe(16), name[:200])
        claims = {"iss": ISSUER, "typ": SESSION, "sub": person, "tenant": tenant, "role": session.role,
                  "exp": exp, "iat": int(time.time()), "jti": session.jti, "csrf": session.csrf, "name": session.name}
        return jwt.encode({"alg": "HS256"}, claims, self.key), session

    def read(self, token: bytes | str) -> PageSession:
        """The session of a token; Unauthenticated saying why not (not a session of this server,
        expired, signed out)."""
        claims = self._checked(token, SESSION, "sign-in session")
        session = PageSession(str(claims.get("sub", "")), str(claims.get("tenant", "")), str(claims.get("role", "")),
                              int(claims["exp"]), str(claims.get("csrf", "")), str(claims.get("jti", "")),
                              str(claims.get("name", "")))
        if not session.person or not session.csrf or not session.jti:
            raise Unauthenticated("the sign-in session token lacks its person, CSRF value or id: sign in again")
        if session.jti in self._revoked:
            raise Unauthenticated("this sign-in session was signed out: sign in again")
        return session

    def verify(self, token: bytes) -> Grant | None:
        """A `Tokens.verifiers` entry: the grant of a page session token, None for another kind."""
        if _kind_of(token) is None:
            return None
        session = self.read(token)
        return grant_of(session)

    async def revoke(self, session: PageSession) -> None:
        """Makes `session` unusable on every replica (at once here, within REFRESH_S elsewhere)."""
        self._revoked[session.jti] = session.exp

        def add(current: Any) -> dict[str, int]:
            now = int(time.time())
            kept = {j: e for j, e in (current or {}).items() if isinstance(e, int) and e > now}
            kept[session.jti] = session.exp
            return kept

        await self.store.update(STORE_NAMESPACE, "revoked", add)

    # ---- login states ----------------------------------------------------------------------------

    def login_state(self, **values: str) -> str:
        """A signed, short-lived token of a login flow's `values` (state, nonce, PKCE verifier, return)."""
        claims = {"iss": ISSUER, "typ": LOGIN, "exp": int(time.time()) + LOGIN_TTL_S, **values}
        return jwt.encode({"alg": "HS256"}, claims, self.key)

    def open_login_state(self, token: str, state: str) -> dict[str, Any]:
        """The values of a login state token whose `state` is `state`; Unauthenticated otherwise
        (forged, expired, or the state of another flow)."""
        claims = self._checked(token, LOGIN, "sign-in attempt")
        if not state or not hmac.compare_digest(str(claims.get("state", "")), state):
            raise Unauthenticated("the sign-in answer does not belong to this browser's sign-in attempt (state "
                                  "mismatch): start again at /auth/login")
        return claims

    def _checked(self, token: bytes | str, typ: str, what: str) -> dict[str, Any]:
        try:
            claims = jwt.decode(token, self.key, algorithms=_ALG).claims
            jwt.JWTClaimsRegistry(iss={"essential": True, "value": ISSUER}, exp={"essential": True}).validate(claims)
        except ExpiredTokenError:
            raise Unauthenticated(f"the {what} has expired: sign in again") from None
        except BadSignatureError:
            raise Unauthenticated(f"the {what} was not signed by this server (forged, or its key changed): "
                                  "sign in again") from None
        except (JoseError, ValueError, UnicodeDecodeError):
            raise Unauthenticated(f"the {what} is not a token of this server: sign in again") from None
        if claims.get("typ") != typ:
            raise Unauthenticated(f"the {what} is a token of another kind: sign in again")
        return claims


def grant_of(session: PageSession) -> Grant:
    """The grant a signed-in page acts with: the person, their tenant and tenant-wide role, on the
    sessions their memberships allow (patterns `*`, not all-sessions: a person's grant never is)."""
    base = Grant.of(f"page sign-in of {session.person}", (ALL,), session.tenant or "anonymous", named=True)
    return replace(base, person=session.person, role=session.role)
