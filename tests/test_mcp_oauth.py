"""MCP authorization as the specification says (2025-06-18 / 2025-11-25 "Authorization"), with the
real Python `mcp` client's OAuth flow against a real provider (npm oidc-provider, tests/oidckit.py):

without a token /mcp answers 401 whose `WWW-Authenticate` names the protected resource metadata
(RFC 9728); the client reads it, finds the provider, registers itself (dynamic client registration),
signs alice in (authorization code + PKCE, the resource indicator = uibus's /mcp: the token's
audience), and then lists and calls tools with the provider's access token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

from tests.conftest import free_port, running
from tests.oidckit import adrive, oidc_provider
from tests.test_mcp import chat_args
from uibus.infra.config import Config

pytestmark = pytest.mark.node
REDIRECT = "http://127.0.0.1:9/mcp-client-callback"  # the client's; never served (the driving stops at it)


class Memory:
    """The client's token storage (mcp.client.auth.TokenStorage), in memory."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


async def test_the_mcp_client_signs_in_through_the_provider_and_calls_tools(tmp_path: Path) -> None:
    port = free_port()
    resource = f"http://127.0.0.1:{port}/mcp"
    with oidc_provider(resource=resource) as idp:
        config = Config(host="127.0.0.1", port=0, http_port=port, store=str(tmp_path / "u.db"), grace_seconds=1.0,
                        oidc_issuer=idp.issuer, oidc_audience=resource)
        async with running(config) as app:
            assert app.http_port == port
            # Without a token: 401, and where to learn how to get one.
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(resource, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                    headers={"accept": "application/json, text/event-stream"})
                assert r.status_code == 401, r.text
                metadata_url = f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp"
                assert r.headers["www-authenticate"] == f'Bearer realm="uibus", resource_metadata="{metadata_url}"'
                metadata = (await http.get(metadata_url)).json()
                assert metadata["resource"] == resource and metadata["authorization_servers"] == [idp.issuer]

            redirected: dict[str, Any] = {}

            async def redirect_handler(url: str) -> None:
                """The person's browser: the provider's login and consent pages, as alice."""
                assert url.startswith(f"{idp.issuer}/auth?") and "code_challenge=" in url, url
                query = parse_qs(urlsplit(url).query)
                assert query["resource"] == [resource], query  # RFC 8707: the token is for uibus's /mcp
                async with httpx.AsyncClient(timeout=10) as browser:
                    redirected["url"] = await adrive(browser, url, "alice", REDIRECT)

            async def callback_handler() -> AuthorizationCodeResult:
                query = parse_qs(urlsplit(redirected["url"]).query)
                assert "code" in query, redirected
                return AuthorizationCodeResult(code=query["code"][0], state=query.get("state", [None])[0],
                                               iss=query.get("iss", [None])[0])

            storage = Memory()
            auth = OAuthClientProvider(
                server_url=resource, storage=storage, redirect_handler=redirect_handler,
                callback_handler=callback_handler,
                client_metadata=OAuthClientMetadata(client_name="uibus test MCP client", redirect_uris=[REDIRECT],
                                                    grant_types=["authorization_code", "refresh_token"],
                                                    response_types=["code"]))
            async with httpx2.AsyncClient(auth=auth, headers={"x-uibus-session": "oauth-1"},
                                          timeout=httpx2.Timeout(30)) as http2, \
                    Client(streamable_http_client(resource, http_client=http2)) as client:
                tools = {t.name for t in (await client.list_tools()).tools}
                assert "hello_world" in tools, tools
                result = await client.call_tool("hello_world", chat_args("hi from alice"))
                assert not result.is_error and "hi from alice" in str(result.content), result
            # It registered itself and holds the provider's token for uibus's /mcp.
            assert storage.client is not None and storage.client.client_id
            assert storage.tokens is not None
            assert app.oidc is not None
            grant = app.oidc.verify(storage.tokens.access_token.encode())
            assert grant is not None and (grant.person, grant.tenant, grant.role) == ("alice", "team-a", "owner")
