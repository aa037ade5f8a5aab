"""The page's sign-in, assembled (docs/security/sign-in.md, "The page"): the session tokens
(uibus.infra.web_sessions) and the `/auth/` routes (uibus.edge.transports.signin), when a provider
is configured. Kept out of `uibus.app` so the app's start stays one line per part.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from uibus.edge.transports.signin import Provider, SignIn
from uibus.infra.auth import Tokens
from uibus.infra.config import Config
from uibus.infra.store import Store

T = TypeVar("T")
Enter = Callable[[str, AbstractAsyncContextManager[T]], Awaitable[T]]


async def enter_identity(enter: Enter[Any], config: Config, tokens: Tokens) -> Any:
    """The identity provider (--oidc-issuer: its keys fetched, its verifier on `tokens`), entered with
    `enter`; None without one. Imported here only then: its JOSE and HTTP stack is ~20 MB of a
    uibus that has no provider (uibus.infra.oidc)."""
    if not config.oidc_issuer:
        return None
    from uibus.infra.oidc import installed

    return await enter("identity provider", installed(config, tokens))


async def enter_signin(enter: Enter[Any], config: Config, store: Store, tokens: Tokens,
                       provider: Provider | None, audit: Any = None) -> SignIn | None:
    """The page's sign-in, entered with `enter` (the app's resources: closed in reverse), or None
    when no provider is configured. Its verifier goes first on `tokens.verifiers`: the provider's
    verifier takes every JWT and would refuse the page's (another issuer)."""
    if provider is None:
        return None
    from uibus.infra.web_sessions import WebSessions  # its JOSE stack: only when sign-in is on

    web: WebSessions = await enter("page sign-in sessions", WebSessions(
        store, max_age_s=config.session_max_age_seconds, secret_file=config.session_secret_file))
    tokens.verifiers.insert(0, web.verify)
    settings = getattr(provider, "settings", None)
    client_id = getattr(settings, "client_id", "") or config.oidc_client_id
    secret = getattr(settings, "client_secret", "") or config.oidc_client_secret
    signin: SignIn = await enter("page sign-in", SignIn(web, provider, client_id, secret, audit=audit,
                                                        on_signout=tokens.tell_revoked))
    return signin
