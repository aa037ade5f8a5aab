"""A person's identity provider's tokens as bearer tokens: the verifier uibus registers on
`Tokens.verifiers` when `--oidc-issuer` is set (docs/security/sign-in.md).

A presented token that looks like a JWT (three dot-separated base64url parts) is this verifier's;
anything else is not (None: the tokens file's and the page's kinds). Of a JWT, in this order:

1. its `iss` must be the configured issuer ("issuer X is not the configured one (Y)");
2. its `alg` must be an asymmetric one of ALGORITHMS (no `none`, no HS*: a public key is no secret);
   its `typ`, when given, a JWT's or an access token's (RFC 9068), not another kind of token;
3. its signature must verify with the issuer's published keys (uibus.infra.oidc_keys, fetched at
   start and kept fresh in the background: a check never waits on the network; a key id the keys do
   not hold asks for a fetch, rate-limited, and is refused for now);
4. `exp` (required), `nbf` and `iat` within `--oidc-leeway-seconds` of now; `aud` one of
   `--oidc-audience` (default: the client id).

Each refusal is `Unauthenticated` saying which and why ("token expired at 2026-05-01T10:00:00Z"),
which every door carries to the caller (UNAUTHENTICATED, 401). An accepted token's grant is the
claim mapping's (uibus.infra.oidc_config.grant_of) and is kept, by the token's digest, until the
token expires (a bounded LRU), so a stream's every call does not verify it again.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from joserfc import jws, jwt
from joserfc.errors import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidClaimError,
    JoseError,
    MissingClaimError,
)

from uibus.infra.auth import Grant, Tokens
from uibus.infra.errors import Unauthenticated
from uibus.infra.oidc_config import OidcSettings, grant_of, settings_of
from uibus.infra.oidc_keys import ProviderKeys

ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
TYPES = ("jwt", "at+jwt", "application/jwt", "application/at+jwt")
CACHE_SIZE = 10_000  # verified tokens remembered (a digest and a grant each)
MAX_TOKEN = 16 * 1024  # a JWT longer than this is not verified
_JWT = re.compile(rb"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")


def looks_like_jwt(token: bytes) -> bool:
    return _JWT.fullmatch(token) is not None


def when(seconds: Any) -> str:
    """A NumericDate as a UTC time an operator reads."""
    try:
        return datetime.fromtimestamp(float(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        return repr(seconds)[:40]


class Oidc:
    """The configured provider: its keys (`async with`: fetched at start, refreshed until exit), the
    verifier `verify` for `Tokens.verifiers`, and for the page's sign-in `metadata`, `decode`, `grant_of`."""

    def __init__(self, settings: OidcSettings, keys: ProviderKeys | None = None) -> None:
        self.settings = settings
        self.keys = keys or ProviderKeys(settings.issuer)
        self._cache: OrderedDict[bytes, tuple[Grant, float]] = OrderedDict()

    async def __aenter__(self) -> Oidc:
        await self.keys.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.keys.__aexit__(*exc)

    @property
    def issuer(self) -> str:
        """The issuer as its tokens name it (the discovery document's spelling once fetched)."""
        return str(self.keys.metadata.get("issuer") or self.settings.issuer)

    @property
    def metadata(self) -> dict[str, Any]:
        """The provider's discovery document ({} until it has been fetched)."""
        return self.keys.metadata

    def grant_of(self, claims: dict[str, Any]) -> Grant:
        return grant_of(self.settings, claims)

    def verify(self, token: bytes) -> Grant | None:
        """The verifier (module docstring): None for a token that is not a JWT, its grant when it is
        accepted; Unauthenticated saying why when refused."""
        if not looks_like_jwt(token):
            return None
        digest = hashlib.sha256(token).digest()
        now = time.time()
        cached = self._cache.get(digest)
        if cached is not None:
            if now <= cached[1]:
                self._cache.move_to_end(digest)
                return cached[0]
            del self._cache[digest]
        claims = self.decode(token)
        grant = self.grant_of(claims)
        self._cache[digest] = (grant, float(claims["exp"]) + self.settings.leeway_s)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grant

    def decode(self, token: str | bytes, audience: str | Iterable[str] | None = None) -> dict[str, Any]:
        """The claims of a token the provider signed for `audience` (default: the configured
        audiences; the page passes its client id for an ID token), checked as the module docstring
        says; Unauthenticated naming what failed."""
        raw = token.encode() if isinstance(token, str) else token
        if len(raw) > MAX_TOKEN:
            raise Unauthenticated(f"the token is over {MAX_TOKEN} bytes")
        try:
            compact = jws.extract_compact(raw)
            header = compact.headers()
            unverified = json.loads(compact.payload)
        except (JoseError, ValueError, TypeError, UnicodeDecodeError):
            raise Unauthenticated("the token is not a JWT uibus can read (a header, claims and a signature)") from None
        if not isinstance(unverified, dict):
            raise Unauthenticated("the token's claims are not a JSON object")
        issuer = self.issuer
        iss = unverified.get("iss")
        if iss != issuer:
            raise Unauthenticated(f"the token's issuer {str(iss)[:100]!r} is not the configured one ({issuer!r})")
        alg, typ, kid = header.get("alg"), header.get("typ"), header.get("kid")
        if alg not in ALGORITHMS:
            raise Unauthenticated(f"the token is signed with {str(alg)[:20]!r}, which uibus does not accept "
                                  f"(one of {', '.join(ALGORITHMS)})")
        if typ is not None and str(typ).lower() not in TYPES:
            raise Unauthenticated(f"the token's type {str(typ)[:40]!r} is not an access token's (at+jwt) or a JWT's")
        keys = self.keys.keys
        if keys is None:
            raise Unauthenticated(f"{issuer}'s signing keys are not fetched yet ({self.keys.error}): retry later")
        if kid is not None and str(kid) not in self.keys.kids:
            asked = self.keys.wanted(str(kid))
            raise Unauthenticated(f"the token is signed with key {str(kid)[:80]!r}, which is not among {issuer}'s "
                                  f"keys{' (fetching them again: retry in a moment)' if asked else ''}")
        try:
            claims = jwt.decode(raw, keys, algorithms=list(ALGORITHMS)).claims
        except BadSignatureError:
            raise Unauthenticated(f"the token's signature does not verify with {issuer}'s keys") from None
        except JoseError as exc:
            raise Unauthenticated(f"the token cannot be verified: {exc.description or exc.error}") from None
        self._check_claims(claims, audience)
        return claims

    def _check_claims(self, claims: dict[str, Any], audience: str | Iterable[str] | None) -> None:
        audiences = [audience] if isinstance(audience, str) else list(audience or self.settings.audiences)
        leeway = int(self.settings.leeway_s)
        registry = jwt.JWTClaimsRegistry(leeway=leeway, exp={"essential": True},
                                         aud={"essential": True, "values": audiences})
        try:
            registry.validate(claims)
        except ExpiredTokenError:
            raise Unauthenticated(f"the token expired at {when(claims.get('exp'))} (now {when(time.time())})") from None
        except MissingClaimError as exc:
            raise Unauthenticated(f"the token has no {exc.claim!r} claim") from None
        except InvalidClaimError as exc:
            if exc.claim == "aud":
                raise Unauthenticated(f"the token is for {claims.get('aud')!r}, not for this server "
                                      f"({', '.join(audiences)}: --oidc-audience)") from None
            if exc.claim in ("nbf", "iat") and "NumericDate" not in str(exc.description):
                raise Unauthenticated(f"the token is not valid yet (nbf {when(claims.get('nbf'))}, iat "
                                      f"{when(claims.get('iat'))}; now {when(time.time())})") from None
            raise Unauthenticated(f"the token's {exc.claim!r} claim is not valid: {exc.description}") from None


@asynccontextmanager
async def installed(config: Any, tokens: Tokens) -> AsyncIterator[Oidc | None]:
    """The App's part (`config` a uibus.infra.config.Config): with `--oidc-issuer`, the provider's keys
    fetched before anything serves and its verifier on `tokens` (so `tokens.enabled`); None without."""
    settings = settings_of(config)
    if settings is None:
        yield None
        return
    async with Oidc(settings) as oidc:
        tokens.verifiers.append(oidc.verify)
        try:
            yield oidc
        finally:
            tokens.verifiers.remove(oidc.verify)
