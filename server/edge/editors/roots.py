"""An editor's `additionalDirectories` (session/new, load, resume), checked where it attaches.

The hosted agent decides nothing here and neither does the editor: uibus passes only directories
its configuration already shows the agent (the rule, and its second, authoritative check with links
resolved, are uibus.agents.acp_access's). This side checks what it can before a session is touched —
the paths' shape, the agent's support, the roots uibus reports in Connectivity's metadata — so a
refusal is the request's own -32602 naming the directory and the rule, not a later turn's error.
"""

from __future__ import annotations

from typing import Any

from uibus.agents.acp_access import check_directories, directories_of
from uibus.edge.editors.uplink import Uplink
from uibus.infra.errors import InvalidArgument
from uibus.infra.jsonrpc import INVALID_PARAMS, RpcError


def offered(facts: dict[str, Any] | None) -> bool:
    """Whether to advertise `sessionCapabilities.additionalDirectories`: the hosted agent may take them
    (an ACP agent that advertised them, or one not started yet whose answer is not known)."""
    return isinstance(facts, dict) and facts.get("supported") is not False


async def directories(params: dict[str, Any], uplink: Uplink) -> list[str]:
    """The request's additionalDirectories, checked (-32602 naming the directory and why); [] when none."""
    try:
        dirs = directories_of(params.get("additionalDirectories"))
    except InvalidArgument as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None
    if not dirs:
        return []
    agent = uplink.agent or "(the server's default agent)"
    facts = await uplink.directory_facts()
    if facts is None or facts.get("supported") is False:
        why = ("its initialize advertises no sessionCapabilities.additionalDirectories" if facts is not None
               else "only a hosted ACP agent that advertises sessionCapabilities.additionalDirectories does")
        raise RpcError(INVALID_PARAMS, f"additionalDirectories: agent {agent} takes none ({why}): open the session "
                                       "without them")
    roots = [r for r in facts.get("roots") or [] if isinstance(r, str)]
    try:
        check_directories(agent, dirs, roots)
    except InvalidArgument as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None
    return dirs
