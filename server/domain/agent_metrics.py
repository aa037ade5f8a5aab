"""The hosted agents' figures on /metrics: agent sessions open, processes started, sessions closed
and why, conversations resumed (where turns ran among replicas: uibus.replicas.placement's).

They are read from the domain's objects when /metrics is scraped (callables, nothing counted twice);
the app hands them to the metrics registry beside its own. A module of their own because naming
and explaining each figure is a job apart from assembling the app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uibus.domain.core import Core

Family = dict[str, tuple[str, Callable[[], float]]]  # metric name -> (help, read it now)


def agent_metrics(core: Core, agents: Any) -> tuple[Family, Family]:
    """(gauges, counters) of the hosted agents. `agents`: the loaded agents (their backends count the
    processes they started)."""
    sessions = core.agent_sessions
    gauges: Family = {"uibus_agent_sessions": (
        "agent sessions open now: hosted agents (backend rpc) that live across turns, one per (session, agent), "
        "each with its process", lambda: float(sessions.count()))}
    counters: Family = {
        "uibus_agent_processes_started_total": (
            "agent processes started (backend rpc): one per agent session, again after one died",
            lambda: float(sum(getattr(b, "started", 0) for b in agents.backends.values()))),
        "uibus_agent_sessions_closed_idle_total": ("agent sessions closed for being idle (idle_seconds)",
                                                   lambda: float(sessions.closed_idle)),
        "uibus_agent_sessions_closed_evicted_total": ("agent sessions closed because their session was evicted",
                                                      lambda: float(sessions.closed_evicted)),
        "uibus_agent_sessions_closed_reclaimed_total": (
            "idle agent sessions closed (least recently used first) so a turn could start under max_processes",
            lambda: float(sessions.closed_reclaimed)),
        "uibus_agent_sessions_closed_dead_total": ("agent sessions whose agent process had exited by itself",
                                                   lambda: float(sessions.closed_dead)),
        "uibus_agent_conversations_resumed_total": (
            "hosted agents' conversations picked up again by a new process (option resume)",
            lambda: float(sessions.handles.resumed)),
        "uibus_agent_resumes_failed_total": (
            "hosted agents' conversations that could not be resumed: a new one started, the UIs told",
            lambda: float(sessions.handles.resume_failed)),
    }
    return gauges, counters
