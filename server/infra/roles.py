"""The roles a person holds on a session, weakest first, and their one order.

Who holds which role is recorded elsewhere (a session's members, a provider's claims, a tokens-file
line); what a method needs is the roles table's (docs/security/roles.md). Here only the words and
how they compare, so every layer that speaks of roles (the pipeline's check, the domain's members,
the page) agrees on one order: each role may do everything the roles before it may.

* `observer`: reads the session (history, feeds, diffs);
* `participant`: also chats (sends prompts, publishes as a UI);
* `approver`: also answers the agent's questions and permission dialogs;
* `owner`: also steers (stop, mode, model), deletes, invites, exports and merges.
"""

from __future__ import annotations

OBSERVER, PARTICIPANT, APPROVER, OWNER = "observer", "participant", "approver", "owner"
ROLES: tuple[str, ...] = (OBSERVER, PARTICIPANT, APPROVER, OWNER)
_RANK = {role: rank for rank, role in enumerate(ROLES)}


def is_role(word: str) -> bool:
    return word in _RANK


def at_least(held: str | None, least: str) -> bool:
    """Whether `held` (None or "": no role) may do what needs `least`."""
    return held is not None and held in _RANK and _RANK[held] >= _RANK[least]


def stronger(a: str | None, b: str | None) -> str | None:
    """The stronger of two roles held at once (a tenant-wide one and a session's own)."""
    if not a or a not in _RANK:
        return b if b in _RANK else None
    if not b or b not in _RANK:
        return a
    return a if _RANK[a] >= _RANK[b] else b
