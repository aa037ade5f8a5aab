"""Who is acting now: the caller of the call being served, as the pipeline admitted it.

The audit log (who approved, who stopped, who deleted) records acts the domain performs, but the
domain knows nothing of tokens, doors or clients; the pipeline sets the current `Actor` in a
context variable when it admits a call, and whatever the call's handler does (in this task, or in
tasks it starts, which copy the context) reads it with `current()`. Nothing is passed through
every signature, and a call that carries no actor (uibus's own work: a turn's end, a timeout) reads
`SYSTEM`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Actor:
    """One caller, as the audit log names it. Never a token value: `who` is a person (a provider's
    subject or e-mail, a tokens-file `person=`) or where the token came from ("--tokens-file line 3")."""

    who: str
    tenant: str = ""
    door: str = ""  # grpc, grpc-web, http, acp, mcp, codebolt, page, cli, inprocess
    client: str = ""  # the caller's own name for itself (user-agent, clientInfo), bounded
    person: bool = False  # `who` is a person (signed in, or a token naming one), not a machine


SYSTEM = Actor("uibus", door="internal")
# The actor, or how to make it: the pipeline names every call's actor but only a few calls record
# anything (an approval, a stop), so it sets a maker and `current()` makes the Actor when asked.
Maker = Actor | Callable[[], Actor]
_CURRENT: ContextVar[Maker] = ContextVar("uibus_actor", default=SYSTEM)


def current() -> Actor:
    found = _CURRENT.get()
    return found if found.__class__ is Actor else found()  # type: ignore[operator, return-value]


def snapshot() -> Maker:
    """The current actor as it was set (not made): what `acting` restores after a nested call."""
    return _CURRENT.get()


def acting(actor: Maker) -> object:
    """Makes `actor` (or what `actor()` makes, when asked) the current one for this context; the
    token `restore` takes."""
    return _CURRENT.set(actor)


def restore(token: object) -> None:
    _CURRENT.reset(token)  # type: ignore[arg-type]
