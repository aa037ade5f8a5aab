"""Sessions: every call belongs to the session named by the `x-uibus-session` metadata key.

Names are validated once here so no service has to guess what a bad name does to a store key or
a metric label.
"""

from __future__ import annotations

import re

import grpc

SESSION_KEY = "x-uibus-session"
DEFAULT_SESSION = "default"
_VALID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


class BadSession(ValueError):
    pass


def check_session(name: str) -> str:
    if not _VALID.fullmatch(name):
        raise BadSession(f"session name {name[:40]!r} is invalid: use 1-128 characters from "
                         "A-Z a-z 0-9 . _ : @ / + = -")
    return name


def session_from_metadata(metadata: object) -> str:
    """The session of a call's metadata (a sequence of (key, value) pairs)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == SESSION_KEY:
            return check_session(value if isinstance(value, str) else value.decode())
    return DEFAULT_SESSION


async def session_of(context: grpc.aio.ServicerContext) -> str:
    """The calling session, or aborts the call with INVALID_ARGUMENT."""
    try:
        return session_from_metadata(context.invocation_metadata())
    except BadSession as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise  # unreachable: abort raises
