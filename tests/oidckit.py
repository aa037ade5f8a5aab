"""A real OpenID Connect provider for tests: npm `oidc-provider` (tests/oidc/provider.mjs) on a free
loopback port, and what a test needs of it without a browser: tokens for a named person, got by
driving the provider's own login and consent pages over HTTP (authorization code + PKCE, as a
person's browser would), and the same driving for a client's own authorization URL (the MCP client's
redirect handler, tests/test_mcp_oauth.py).

    with oidc_provider(resource="http://127.0.0.1:8080/mcp") as idp:   # or the `oidc` fixture
        token = idp.token("alice")            # a JWT access token, aud = the resource, alice's claims
        idp.token("alice", ttl=1)             # one that expires after a second
        idp.token("alice", resource="https://elsewhere.example/")  # another audience

The accounts (ACCOUNTS, or `accounts=`) give each person's `email`, `groups` and `tenant` claims;
any other login is a person with no claims besides `sub`. Every instance has its own issuer URL and
signing key: a second one is a foreign issuer.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import pytest

from tests.conftest import free_port, require, require_binary
from tests.support import needs

HERE = Path(__file__).parent / "oidc"
# The page's client (part B's sign-in uses it) and the kit's own (for `token`).
PAGE_CLIENT = ("uibus-page", "uibus-page-secret")
KIT_CLIENT = ("uibus-kit", "uibus-kit-secret")
KIT_REDIRECT = "http://127.0.0.1:9/callback"  # never served: the driving stops at it
ACCOUNTS: dict[str, dict[str, Any]] = {
    "alice": {"email": "alice@example.com", "name": "Alice", "groups": ["uibus-owner"], "tenant": "team-a"},
    "bob": {"email": "bob@example.com", "name": "Bob", "groups": ["uibus-approver", "staff"], "tenant": "team-a"},
    "carol": {"email": "carol@example.com", "name": "Carol", "groups": ["uibus-observer"], "tenant": "team-a"},
    "dave": {"email": "dave@example.com", "name": "Dave", "groups": ["uibus-participant"]},
    "erin": {"email": "erin@example.com", "name": "Erin", "groups": [], "tenant": "team-b"},
}
_FORM = re.compile(r'<form[^>]*action="([^"]+)"[^>]*method="post"[^>]*>(.*?)</form>', re.S | re.I)
_INPUT = re.compile(r"<input([^>]*)>", re.I)
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def pkce() -> tuple[str, str]:
    """A PKCE verifier and its S256 challenge (RFC 7636)."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    return verifier, challenge


def _next_request(response: httpx.Response, person: str) -> tuple[str, str, dict[str, str] | None]:
    """Where the driving goes from a provider's answer: a redirect's target, or the login/consent
    form's submission (its hidden fields, the login filled with `person`, any password)."""
    if response.is_redirect:
        return "GET", urljoin(str(response.url), response.headers["location"]), None
    found = _FORM.search(response.text)
    if response.status_code != 200 or found is None:
        raise AssertionError(f"the provider answered {response.status_code} at {response.url}: {response.text[:400]}")
    fields: dict[str, str] = {}
    for tag in _INPUT.findall(found.group(2)):
        attrs = dict(_ATTR.findall(tag))
        name = attrs.get("name")
        if name == "login":
            fields[name] = person
        elif name == "password":
            fields[name] = "any password"
        elif name:
            fields[name] = html.unescape(attrs.get("value", ""))
    return "POST", urljoin(str(response.url), html.unescape(found.group(1))), fields


def drive(client: httpx.Client, url: str, person: str, stop_at: str) -> str:
    """Follows an authorization URL through the provider's login and consent pages as `person`
    until it redirects to a URL starting with `stop_at` (the client's redirect URI), which it returns
    (with `code` and `state`, or `error`) without requesting it."""
    method, data = "GET", None
    for _ in range(12):
        if url.startswith(stop_at):
            return url
        response = client.request(method, url, data=data)
        method, url, data = _next_request(response, person)
    raise AssertionError(f"no redirect to {stop_at} after 12 steps (last: {url})")


async def adrive(client: httpx.AsyncClient, url: str, person: str, stop_at: str) -> str:
    """`drive` with an async client."""
    method, data = "GET", None
    for _ in range(12):
        if url.startswith(stop_at):
            return url
        response = await client.request(method, url, data=data)
        method, url, data = _next_request(response, person)
    raise AssertionError(f"no redirect to {stop_at} after 12 steps (last: {url})")


class OidcProvider:
    """One running provider (see the module docstring). `stop()` ends it (the fixtures do)."""

    def __init__(self, *, resource: str = "", redirect_uris: Sequence[str] = (),
                 accounts: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        node = require_binary("node")
        require("npm oidc-provider (.ci/setup: npm ci --prefix tests/oidc)",
                (HERE / "node_modules" / "oidc-provider").is_dir(), "node")
        self.port = free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.resource = resource or f"{self.issuer}/default-resource"  # a token's `aud` when none is asked
        self.accounts = dict(ACCOUNTS if accounts is None else accounts)
        args = [node, str(HERE / "provider.mjs"), "--port", str(self.port), "--resource", self.resource,
                "--accounts", json.dumps(self.accounts)]
        for uri in redirect_uris:
            args += ["--redirect-uri", uri]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE)
        self.log: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.decode(errors="replace"))
                if line.startswith(b"ready "):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 20
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                self.stop()
                raise AssertionError(f"oidc-provider did not start on port {self.port}: {err[-800:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    @property
    def jwks_uri(self) -> str:
        return f"{self.issuer}/jwks"

    def authorize_url(self, client_id: str, redirect_uri: str, challenge: str, *, scope: str = "openid uibus",
                      resource: str | None = None, state: str = "state") -> str:
        params = {"client_id": client_id, "response_type": "code", "redirect_uri": redirect_uri, "scope": scope,
                  "state": state, "code_challenge": challenge, "code_challenge_method": "S256",
                  "resource": resource or self.resource, "prompt": "consent"}
        return f"{self.issuer}/auth?{urlencode(params)}"

    def tokens(self, person: str, *, resource: str | None = None, ttl: int = 0, scope: str = "openid uibus",
               client: tuple[str, str] = KIT_CLIENT, redirect_uri: str = KIT_REDIRECT) -> dict[str, Any]:
        """The provider's whole token response for `person` (access_token, id_token, expires_in…),
        by the authorization code flow with PKCE through its login page. `ttl` > 0: the access token
        lives that many seconds."""
        resource = resource or self.resource
        if ttl:
            resource += ("&" if "?" in resource else "?") + f"ttl={ttl}"
        verifier, challenge = pkce()
        with httpx.Client(timeout=10) as http:
            back = drive(http, self.authorize_url(client[0], redirect_uri, challenge, scope=scope, resource=resource),
                         person, redirect_uri)
            query = parse_qs(urlsplit(back).query)
            if "code" not in query:
                raise AssertionError(f"the provider refused to sign {person} in: {back}")
            r = http.post(f"{self.issuer}/token", auth=client, data={
                "grant_type": "authorization_code", "code": query["code"][0], "redirect_uri": redirect_uri,
                "code_verifier": verifier, "resource": resource})
        assert r.status_code == 200, (r.status_code, r.text[:400])
        return r.json()  # type: ignore[no-any-return]

    def token(self, person: str, **kw: Any) -> str:
        """A JWT access token for `person` (keywords as `tokens`)."""
        return str(self.tokens(person, **kw)["access_token"])


@contextmanager
def oidc_provider(**kw: Any) -> Iterator[OidcProvider]:
    """A provider for the block (keywords as OidcProvider's), stopped after it."""
    provider = OidcProvider(**kw)
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture
@needs("node")
def oidc() -> Iterator[OidcProvider]:
    """A provider with the ACCOUNTS, whose tokens' default audience is its own `/default-resource`
    (give uibus `oidc_audience=oidc.resource`); modules that need another resource build their own
    with `oidc_provider(resource=…)`."""
    with oidc_provider() as provider:
        yield provider
