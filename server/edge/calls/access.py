"""What a call needs of its caller's token (policy 3 of uibus.edge.pipeline), and the one bearer
check HTTP doors that run no call share with it.

Kept apart from the pipeline's wrapping: the route table (uibus.edge.transports.routes), the roles
table (which least role a method needs of a person) and the pipeline all read one declaration of
which methods are open, sessionless, process-wide or bound to their session.
"""

from __future__ import annotations

from typing import Any

from uibus.infra.auth import Grant, Tokens, bearer
from uibus.infra.errors import PermissionDenied, Unauthenticated

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes carry no token
# Calls that touch no session: any valid token may make them (by path prefix / suffix).
SESSIONLESS_PREFIXES = ("/grpc.reflection.",)
SESSIONLESS_SUFFIXES = ("ConciergeService/List", "AgentService/Function", "AgentService/Connectivity",
                        # listings of the sessions the token may use: filtered by `visible_sessions`
                        "SessionService/ListSessions", "SessionService/WatchSessions",
                        # the caller's own role (none is an answer), an invite (it names its session)
                        "TeamService/WhoAmI", "TeamService/AcceptInvite")
# Calls that see every session at once: only an all-sessions token may make them.
PROCESS_WIDE = ("/uibus.v1.HostService/GetBusStats",
                "/uibus.v1.AuditService/Verify")  # the whole audit chain, every session's entries in it

# What a method's token must allow (see `access_of`); OWN_USER: no tokens, loopback: the caller's
# socket must be uibus's own user's (uibus.infra.peers).
OPEN, ANY_TOKEN, ALL_SESSIONS, ITS_SESSION, OWN_USER = "open", "any token", "all sessions", "its session", "own user"
METRICS_READER = "metrics reader"  # an HTTP door's only other need: --metrics-token or an all-sessions token



def authorization_of(metadata: Any) -> Any:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


def check_bearer(tokens: Tokens, access: str, authorization: str | bytes | None) -> Grant | None:
    """Policy 3 at an HTTP door, as the HTTP port's route table declares it (uibus.edge.transports.routes),
    beside `Pipeline.authorize` for calls: one token reading for both. The token's grant (None: tokens
    off, or the metrics token, which has none); Unauthenticated / PermissionDenied say what is needed."""
    if not tokens.enabled:
        return None
    token = bearer(authorization)
    grant = tokens.grant(token)
    if access == METRICS_READER and not tokens.may_read_metrics(token):
        if grant is not None:  # a tenant's token: /metrics shows every tenant's traffic
            raise PermissionDenied("needs --metrics-token or a token that may use all sessions")
        raise Unauthenticated("needs `Authorization: Bearer <token>` (--metrics-token or an all-sessions token)")
    if grant is None and access != METRICS_READER:
        raise Unauthenticated("needs `Authorization: Bearer <token>`")
    return grant


def every_session(session: str) -> bool:
    return True


def access_of(method: str) -> str:
    """What a call of `method` needs. Every method not listed as open, sessionless or process-wide
    is checked against its session, so a new service is tenant-safe without being listed."""
    if method.startswith(OPEN_METHODS):
        return OPEN
    if method in PROCESS_WIDE:
        return ALL_SESSIONS
    if method.startswith(SESSIONLESS_PREFIXES) or method.endswith(SESSIONLESS_SUFFIXES):
        return ANY_TOKEN
    return ITS_SESSION
