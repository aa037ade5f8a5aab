"""One issuer's published keys: its discovery document (`/.well-known/openid-configuration`) and its
JWKS, fetched when the app starts and refreshed in the background, so that checking a token never
waits on the network (the verifier is called in the middle of a call, on the event loop).

* At start (`__aenter__`): discovery, then the JWKS, within FETCH_S. A document whose `issuer` is not
  the configured one, or without `jwks_uri`, stops the start (a misconfiguration, ConfigError naming
  --oidc-issuer). A provider that cannot be reached does not: the tokens-file tokens keep working,
  provider tokens are refused saying why ("keys not fetched yet: …"), and fetching is retried.
* Every REFRESH_S, and when a token names a key id the set does not hold (a key rotation: `wanted`),
  at most once per REFETCH_S so that tokens with made-up key ids cannot make uibus hammer the provider.
  A refresh that fails keeps the keys in force.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from uibus.infra.errors import ConfigError
from uibus.infra.tasks import cancel_and_wait

log = logging.getLogger("uibus.infra.oidc")
FETCH_S = 10.0  # one fetch of the document or the keys
REFRESH_S = 300.0  # keys refreshed this often (a provider publishes a new key before signing with it)
REFETCH_S = 30.0  # a key id not in the set fetches the keys again, at most this often
RETRY_S = 5.0  # after a failed fetch (the provider unreachable at start), tried again this soon
MAX_DOCUMENT = 1 << 20  # a discovery document or JWKS larger than this is not one


def discovery_url(issuer: str) -> str:
    return issuer.rstrip("/") + "/.well-known/openid-configuration"


class ProviderKeys:
    """The issuer's discovery document (`metadata`) and signing keys (`keys`), kept fresh."""

    def __init__(self, issuer: str, *, refresh_s: float = REFRESH_S, refetch_s: float = REFETCH_S) -> None:
        self.issuer = issuer
        self.metadata: dict[str, Any] = {}
        self.keys: KeySet | None = None
        self.kids: frozenset[str] = frozenset()
        self.error = "not fetched yet"  # why there are no keys (when `keys` is None)
        self.refresh_s, self.refetch_s = refresh_s, refetch_s
        self._last_fetch = 0.0
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ProviderKeys:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_S))
        try:
            await self.fetch()
        except ConfigError:
            await self._session.close()
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.error = f"{discovery_url(self.issuer)}: {_why(exc)}"
            log.error("the identity provider's keys could not be fetched; its tokens are refused until they are",
                      extra={"fields": {"issuer": self.issuer, "error": self.error}})
        self._task = asyncio.create_task(self._refresh(), name="uibus-oidc-keys")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        if self._session is not None:
            await self._session.close()

    async def _get(self, url: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(url, headers={"accept": "application/json"}, allow_redirects=False) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status} from {url}")
            body = await r.content.read(MAX_DOCUMENT + 1)
            if len(body) > MAX_DOCUMENT:
                raise ValueError(f"{url} answered more than {MAX_DOCUMENT} bytes")
            document = json.loads(body)
            if not isinstance(document, dict):
                raise ValueError(f"{url} did not answer a JSON object")
            return document

    async def fetch(self) -> None:
        """Discovery (once it has succeeded, only the keys again), then the JWKS."""
        self._last_fetch = time.monotonic()
        if not self.metadata:
            metadata = await self._get(discovery_url(self.issuer))
            if str(metadata.get("issuer", "")).rstrip("/") != self.issuer.rstrip("/"):
                raise ConfigError("--oidc-issuer", f"{discovery_url(self.issuer)} names issuer "
                                                   f"{str(metadata.get('issuer'))[:100]!r}, not {self.issuer!r}")
            if not isinstance(metadata.get("jwks_uri"), str):
                raise ConfigError("--oidc-issuer", f"{discovery_url(self.issuer)} names no jwks_uri")
            self.metadata = metadata
        jwks = await self._get(self.metadata["jwks_uri"])
        try:
            keys = KeySet.import_key_set(jwks)  # type: ignore[arg-type]
        except (JoseError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{self.metadata['jwks_uri']} is not a JWK set: {exc}") from None
        self.keys = keys
        self.kids = frozenset(str(k.kid) for k in keys.keys if k.kid)
        self.error = ""

    def wanted(self, kid: str) -> bool:
        """A token names key `kid` that the set does not hold: fetch again soon (rate-limited).
        True when a fetch was asked for (the token's caller may retry in a moment)."""
        if time.monotonic() - self._last_fetch < self.refetch_s:
            return False
        self._wake.set()
        return True

    async def _refresh(self) -> None:
        while True:
            delay = self.refresh_s if self.keys is not None else RETRY_S
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.fetch()
            except (aiohttp.ClientError, TimeoutError, ValueError, ConfigError) as exc:
                why = exc.what if isinstance(exc, ConfigError) else _why(exc)
                if self.keys is None:
                    self.error = why
                log.warning("the identity provider's keys were not refreshed; the ones in force stay",
                            extra={"fields": {"issuer": self.issuer, "error": why}})


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
