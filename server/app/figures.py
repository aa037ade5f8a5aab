"""The figures of the parts on /metrics that the app itself names: ready, the store, the hosted
agents (uibus.domain.agent_metrics), where turns ran among replicas (the placement's), the session
log's commits. Read when /metrics is scraped (callables, nothing counted twice). A module of its own
because naming and explaining each figure is a job apart from starting and stopping the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uibus.domain.agent_metrics import agent_metrics
from uibus.domain.core import Core
from uibus.edge.wiring import Gauges
from uibus.replicas.placement import Placement


def figures(core: Core, agents: Any, placement: Placement,
            not_ready: Callable[[], str | None]) -> tuple[Gauges, Gauges]:
    """(gauges, counters): `agents`, the loaded agents; `not_ready()`, why this process is not ready
    (None: it is)."""
    store = core.store
    gauges: Gauges = {
        "uibus_ready": ("1 while this process is ready (store and replication working, not shutting down; "
                        "with --workers, every worker ready)",
                        lambda: 0.0 if not_ready() else 1.0),
        "uibus_store_up": ("1 while the session store answers, 0 while it fails (see /readyz for why)",
                           lambda: 0.0 if store.problem else 1.0),
    }
    agent_gauges, counters = agent_metrics(core, agents)
    gauges.update(agent_gauges)
    counters.update(placement.counters())
    session_log = core.feed.log
    counters.update({
        "uibus_log_entries": ("Session log entries committed (after coalescing: one per growing message)",
                              lambda: session_log.appended),
        "uibus_log_commits": ("Session log transactions; fewer than acknowledged events when callers waiting "
                              "at once share one (group commit)", lambda: session_log.commits),
        "uibus_log_write_failures": ("Session log writes that failed (kept queued and retried while the store "
                                     "fails)", lambda: session_log.write_failures),
    })
    return gauges, counters
