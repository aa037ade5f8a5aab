"""The editor's sign-in with uibus, as ACP's `logout` and `auth/status` see it.

An editor is signed in to uibus by the transport, never in-band: the bearer token `uibus acp`
was given (`--token`) or the one `/acp`'s upgrade or first request carried, checked by uibus before
any session is touched. So uibus offers no `authMethods` (nothing to `authenticate` with, no
terminal login for an editor to run) and:

* `auth/status` reports the connection's state: `authenticated` with the token's tenant as the
  account's organization where the transport knows it (`/acp`; `uibus acp` over gRPC only learns
  that the server takes its token), `not_required` where uibus runs without tokens, `unauthenticated`
  after `logout` or when the server refuses the token. It is a pure query (a cheap ListSessions
  probe for `uibus acp`) and never answers `auth_required`, as the schema requires.
* `logout` ends this connection's sign-in: the sessions it holds are detached (their running
  prompts cancelled, the sessions and their other UIs go on) and every later request but
  `initialize`, `auth/status` and `logout` is `auth_required` (-32000). The token is not revoked:
  it is the operator's (`--tokens-file`), other connections holding it go on. Signing in again
  is a new connection with a token, as ACP's "reconnect" for a method uibus does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from uibus.edge.editors.uplink import Uplink
from uibus.infra.jsonrpc import AUTH_REQUIRED, RpcError

# What a signed-out connection may still ask.
OPEN_METHODS = frozenset({"initialize", "logout", "auth/status"})
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True)
class Identity:
    """Who the transport let in: whether it presented a token, and the token's tenant where the
    transport knows it (None: uibus acp over gRPC, where only the server knows)."""

    token: bool = False
    tenant: str | None = None


class Account:
    """One connection's sign-in state."""

    def __init__(self, identity: Identity, uplink: Uplink, prefix: str) -> None:
        self.identity = identity
        self.uplink = uplink
        self.probe = f"{prefix}=uibus-auth-status="  # a prefix no session of the editor's has (its own, so allowed)
        self.signed_out = False

    def gate(self, method: str) -> None:
        """auth_required for a signed-out connection's requests (but the few it may still make)."""
        if self.signed_out and method not in OPEN_METHODS:
            raise RpcError(AUTH_REQUIRED, "this connection logged out of uibus (logout): reconnect with a token "
                                          "(uibus acp --token, or the Authorization header of /acp) to go on")

    async def status(self) -> dict[str, Any]:
        """`auth/status`: the connection's state and, signed in with a token, its account."""
        if self.signed_out:
            return {"state": "unauthenticated"}
        try:
            await self.uplink.sessions(self.probe)  # a probe: nothing listed, the token checked
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED:
                return {"state": "unauthenticated"}
            return {"state": "unknown"}
        if not self.identity.token:
            return {"state": "not_required"}
        account: dict[str, Any] = {"label": "uibus bearer token", "active": True}
        if self.identity.tenant:
            account["organization"] = self.identity.tenant
        return {"state": "authenticated", "accounts": [account]}
