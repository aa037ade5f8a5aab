"""Steering a hosted agent from any UI of its session: stop its turn, set its mode or model, start
a new conversation, and read what it offers (modes, models, commands).

A hosted agent session (uibus.agents.AgentSession) offers what its protocol has through its
`steering` (a `Steerable`: uibus.agents.steer's AcpSteering and PiSteering, owned by AcpSession and
RpcSession); what it does
not implement is refused with FAILED_PRECONDITION naming what the agent lacks, so a UI can hide
the control and a script learns why. Stopping needs nothing of the agent: it cancels the task
running the turn (AgentSessions.stop), which runs the agent's own cancel (pi `abort`, ACP
`session/cancel`) exactly as when the turn's caller goes away.

Every call here acts on the agents open in this process. With replicas an agent lives at one
replica only (its lease owner): the edge (uibus.replicas.placement) decides where a steering call
runs and, for an agent open elsewhere, carries it to the owner, which runs it with `here`.
"""

from __future__ import annotations

import base64
from typing import Any, Protocol, runtime_checkable

from uibus.domain.agent_sessions import AgentSessions
from uibus.infra.audit import NoAudit, Recorder
from uibus.infra.errors import FailedPrecondition, InvalidArgument, NotFound
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.pb.uibus.v1 import sessions_pb2 as pb


@runtime_checkable
class Steerable(Protocol):
    """What a hosted agent session may offer beyond turns, as its `steering` (each call optional in
    practice: the steering checks for it by name, and that `state()["can"]` offers it)."""

    def state(self) -> dict[str, Any]:
        """{"modes": [{"id","name","description"}], "current_mode", "models": [...], "current_model",
        "commands": [{"name","description","input_hint"}], "title", "conversation",
        "conversations": [...], "can": ["set_mode", "set_model", "new_conversation"]}"""
        ...


def _steering(agent: Any) -> Steerable | None:
    return getattr(agent, "steering", None)


def state_of(name: str, agent: Any, running: bool) -> pb.AgentState:
    """The AgentState of a live agent session: what every one has, and what it says it offers."""
    state = pb.AgentState(agent=name, live=True, running=running, can=["stop"])
    steering = _steering(agent)
    if steering is None:
        return state
    info: dict[str, Any] = steering.state() or {}
    for mode in info.get("modes") or ():
        state.modes.append(pb.AgentMode(id=str(mode.get("id", "")), name=str(mode.get("name") or mode.get("id", "")),
                                        description=str(mode.get("description") or "")))
    for model in info.get("models") or ():
        state.models.append(pb.AgentModel(id=str(model.get("id", "")),
                                          name=str(model.get("name") or model.get("id", "")),
                                          description=str(model.get("description") or "")))
    for command in info.get("commands") or ():
        state.commands.append(pb.AgentCommand(name=str(command.get("name", "")).lstrip("/"),
                                              description=str(command.get("description") or ""),
                                              input_hint=str(command.get("input_hint") or "")))
    state.current_mode = str(info.get("current_mode") or "")
    state.current_model = str(info.get("current_model") or "")
    state.title = str(info.get("title") or "")
    state.conversation = str(info.get("conversation") or "")
    state.conversations.extend(str(c) for c in info.get("conversations") or ())
    state.can.extend(str(c) for c in info.get("can") or ())
    return state


def state_from(result: dict[str, Any]) -> pb.AgentState:
    """The state a steering call's result (`here`'s) carries."""
    return pb.AgentState.FromString(base64.b64decode(str(result.get("state", ""))))


class Steering:
    """The steering calls of the sessions API, on the hosted agents of this process."""

    def __init__(self, agents: AgentSessions, sharing: Sharing | None = None, audit: Recorder | None = None) -> None:
        """`sharing`: told when a call changed an agent's state (other processes list it); `audit`:
        where each steering act is recorded, by whom (a call carried here from another replica is
        recorded there, where it was made: `here` records nothing)."""
        self.agents = agents
        self.sharing: Sharing = sharing if sharing is not None else LocalSharing()
        self.audit: Recorder = audit if audit is not None else NoAudit()

    async def record(self, action: str, session: str, agent: str, args: dict[str, str], *,
                     forwarded: bool = False) -> None:
        """The audit entry of one steering act (`steer.stop`, `steer.set_mode`, …)."""
        await self.audit.record(f"steer.{action}", session=session, agent=agent, **args,
                                **({"forwarded": True} if forwarded else {}))

    def state_or_none(self, session: str, name: str) -> pb.AgentState | None:
        """The state of (`session`, `name`) open here, None when it is not (shared with other replicas)."""
        agent = self.agents.live_agent(session, name)
        return None if agent is None else state_of(name, agent, self.agents.running(session, name))

    async def here(self, session: str, name: str, action: str, args: dict[str, str]) -> dict[str, Any]:
        """Runs a steering call named by its action (one carried here from another replica), its
        result as the wire carries it (`state_from` reads the state back)."""
        if action == "stop":
            return {"stopped": self._stop_here(session, name)}
        if action == "set_mode":
            state = await self._set_mode_here(session, name, args.get("mode_id", ""))
        elif action == "set_model":
            state = await self._set_model_here(session, name, args.get("model_id", ""))
        elif action == "new_conversation":
            state = await self._new_conversation_here(session, name)
        else:
            raise InvalidArgument(f"unknown steering action {action!r}")
        return {"state": base64.b64encode(state.SerializeToString()).decode()}

    def _live(self, session: str, name: str) -> Any:
        if not name:
            raise InvalidArgument("agent is required: the hosted agent to steer")
        agent = self.agents.live_agent(session, name)
        if agent is None:
            # NOT_FOUND, not FAILED_PRECONDITION: what is addressed (a live agent of this session)
            # does not exist, as for a session that does not; 404 over HTTP
            raise NotFound(f"{name} is not running in session {session!r}: it starts with its first turn there")
        return agent

    def state(self, session: str, name: str) -> pb.AgentState:
        agent = self._live(session, name)
        return state_of(name, agent, self.agents.running(session, name))

    async def stop(self, session: str, name: str) -> bool:
        if not name:
            raise InvalidArgument("agent is required: the hosted agent whose turn to stop")
        stopped = self._stop_here(session, name)
        await self.record("stop", session, name, {"stopped": "yes" if stopped else "no turn ran"})
        return stopped

    def _stop_here(self, session: str, name: str) -> bool:
        return self.agents.stop(session, name)

    async def set_mode(self, session: str, name: str, mode_id: str) -> pb.AgentState:
        if not name:
            raise InvalidArgument("agent is required: the hosted agent to steer")
        state = await self._set_mode_here(session, name, mode_id)
        await self.record("set_mode", session, name, {"mode_id": mode_id})
        return state

    async def set_model(self, session: str, name: str, model_id: str) -> pb.AgentState:
        if not name:
            raise InvalidArgument("agent is required: the hosted agent to steer")
        state = await self._set_model_here(session, name, model_id)
        await self.record("set_model", session, name, {"model_id": model_id})
        return state

    async def new_conversation(self, session: str, name: str) -> pb.AgentState:
        if not name:
            raise InvalidArgument("agent is required: the hosted agent to steer")
        state = await self._new_conversation_here(session, name)
        await self.record("new_conversation", session, name, {})
        return state

    @staticmethod
    def _offered(agent: Any, name: str, what: str, method: str) -> Any:
        steering = _steering(agent)
        call = getattr(steering, method, None)
        info = steering.state() if steering is not None else {}
        if call is None or method not in (info.get("can") or ()):
            raise FailedPrecondition(f"{name} offers no {what}")
        return call

    async def _set_mode_here(self, session: str, name: str, mode_id: str) -> pb.AgentState:
        agent = self._live(session, name)
        call = self._offered(agent, name, "modes (it sent none)", "set_mode")
        if not mode_id:
            raise InvalidArgument("mode_id is required")
        ids = [str(m.get("id")) for m in agent.steering.state().get("modes") or ()]
        if mode_id not in ids:
            raise InvalidArgument(f"{name} offers no mode {mode_id!r} (it offers: {', '.join(ids)})")
        await call(mode_id)
        self.sharing.agent_changed(session, name)
        return self.state(session, name)

    async def _set_model_here(self, session: str, name: str, model_id: str) -> pb.AgentState:
        agent = self._live(session, name)
        call = self._offered(agent, name, "model choice", "set_model")
        if not model_id:
            raise InvalidArgument("model_id is required")
        ids = [str(m.get("id")) for m in agent.steering.state().get("models") or ()]
        if ids and model_id not in ids:
            raise InvalidArgument(f"{name} offers no model {model_id!r} (it offers: {', '.join(ids)})")
        await call(model_id)
        self.sharing.agent_changed(session, name)
        return self.state(session, name)

    async def _new_conversation_here(self, session: str, name: str) -> pb.AgentState:
        agent = self._live(session, name)
        call = self._offered(agent, name, "new conversation", "new_conversation")
        if self.agents.running(session, name):
            raise FailedPrecondition(f"{name} runs a turn in session {session!r}: stop it first")
        await call()
        self.sharing.agent_changed(session, name)
        return self.state(session, name)
