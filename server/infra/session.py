"""Sessions: every call belongs to the session named by the `x-uibus-session` metadata key.

Names are validated once here so no service has to guess what a bad name does to a store key or
a metric label. A bad name is an `InvalidArgument` like any other bad input, so every transport
reports it the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import grpc

from uibus.infra.errors import InvalidArgument

SESSION_KEY = "x-uibus-session"
DEFAULT_SESSION = "default"
_VALID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


class BadSession(InvalidArgument):
    pass


def check_session(name: str) -> str:
    if not _VALID.fullmatch(name):
        raise BadSession(f"session name {name[:40]!r} is invalid: use 1-128 characters from "
                         "A-Z a-z 0-9 . _ : @ / + = -")
    return name


def session_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The session of a call's metadata (a sequence of (key, value) pairs)."""
    for key, value in metadata or ():
        if key == SESSION_KEY:
            return check_session(value if isinstance(value, str) else value.decode(errors="replace"))
    return DEFAULT_SESSION


def names_session(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether the call named its session. A caller that did not (a neuro-san client, curl, an MCP
    inspector) still runs in `default` — its UI events show on that session's webviews — but must not
    inherit the conversation some other unnamed caller had there (see Chat.turn)."""
    return any(key == SESSION_KEY for key, _value in metadata or ())


def session_of(context: grpc.aio.ServicerContext) -> str:
    """The calling session; BadSession (INVALID_ARGUMENT) when the name is invalid."""
    return session_from_metadata(context.invocation_metadata())


SINCE_KEY = "x-uibus-since"
MAX_SINCE = 2**63 - 1


def parse_since(value: str) -> int:
    """A resume cursor as a caller wrote it (metadata or `?since=`): a non-negative seq."""
    if not value.isdigit() or len(value) > 19 or int(value) > MAX_SINCE:
        raise InvalidArgument(f"{SINCE_KEY} {value[:40]!r} is not a sequence number (a non-negative integer "
                              "from an event's seq)")
    return int(value)


def since_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The cursor a stream resumes after (`x-uibus-since`), or None when it asks for none."""
    for key, value in metadata or ():
        if key == SINCE_KEY:
            return parse_since(value if isinstance(value, str) else value.decode(errors="replace"))
    return None


def since_of(context: grpc.aio.ServicerContext) -> int | None:
    """The calling stream's resume cursor; InvalidArgument when it is not a seq."""
    return since_from_metadata(context.invocation_metadata())
