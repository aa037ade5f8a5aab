"""Who the call being served is, for the audit log: the pipeline names the caller once it is admitted.

The pipeline calls `admitted(grant, context)` after its token check; whatever the handler then
does (the domain recording an approval, a steering call, a delete) reads it as
`uibus.infra.actor.current()`. `who` is the grant's person, else its name (where the token came from,
"--tokens-file line 3", never the token); "local user" without tokens (uibus's own user, checked by
its socket). `door` is the way the call came in — grpc, grpc-web, http, mcp, codebolt, or for the
in-process calls a door makes on its caller's behalf (/acp) that door's name, so an editor's
approval over ACP reads "acp", not "inprocess". `client` is the caller's own name for itself: its
user-agent (a native gRPC call's metadata, an HTTP door's header), bounded; where a protocol's
client names itself (ACP's `initialize`, MCP's `clientInfo`), that name and version first
(`client_named`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from uibus.edge.calls.context import CallContext
from uibus.infra.actor import Actor, acting
from uibus.infra.audit import MAX_CLIENT
from uibus.infra.auth import Grant

LOCAL_USER = "local user"
_DOORS = {"websocket": "codebolt"}  # the metrics label of a transport -> its door's name


def door_of(context: Any) -> str:
    if isinstance(context, CallContext):
        door = getattr(context, "door", "") or context.transport
        return _DOORS.get(door, door)
    return "grpc"


def client_of(context: Any) -> str:
    client = getattr(context, "client", "") if isinstance(context, CallContext) else ""
    if not client:
        for key, value in context.invocation_metadata() or ():
            if key == "user-agent" and isinstance(value, str):
                client = value
                break
    return "".join(c for c in str(client) if c.isprintable())[:MAX_CLIENT]


def client_named(info: Any, fallback: str = "") -> str:
    """The name a protocol's client gives itself (ACP's and MCP's `clientInfo`: name, version),
    as the audit log's `client`: `name/version`, then the user-agent it came with, bounded and
    printable; `fallback` alone when it gave none (or not an object)."""
    if not isinstance(info, dict) or not isinstance(info.get("name"), str) or not info["name"].strip():
        return fallback
    version = info.get("version")
    named = info["name"].strip()[:60] + (f"/{version.strip()[:30]}" if isinstance(version, str) and version.strip()
                                          else "")
    text = f"{named} ({fallback})" if fallback else named
    return "".join(c for c in text if c.isprintable())[:MAX_CLIENT]


def actor_of(grant: Grant | None, context: Any) -> Actor:
    if grant is None:
        return Actor(LOCAL_USER, door=door_of(context), client=client_of(context))
    return Actor(grant.person or grant.name, tenant=grant.tenant, door=door_of(context), client=client_of(context),
                 person=bool(grant.person))


def admitted(grant: Grant | None, context: Any) -> None:
    """Makes the admitted caller the current actor of this call (the pipeline restores the one before
    when the call ends: an in-process call runs in its caller's task)."""
    acting(partial(actor_of, grant, context))  # made only if something records (uibus.infra.actor)
