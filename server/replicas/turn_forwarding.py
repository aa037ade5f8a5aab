"""A hosted agent's turn that arrives at a replica which does not own the agent, carried to the owner.

The owner of a (session, agent) is the replica holding its lease (uibus.replicas.ownership). A turn
arriving anywhere else goes to it over the bus and is streamed back, so one agent process holds
one conversation whatever replica or worker a client's connection landed on:

* the forwarder publishes the turn (kind AGENT_TURN, targeted at the owner's id: the request as
  bytes, the agent, the forwarded metadata) and reads the replies targeted at the turn's id (kind
  AGENT_TURN_REPLY): "accepted", each ChatResponse in order, a heartbeat every lease_s / 4, and the
  end (status code and message). The owner runs the turn exactly as a local one (Chat.turn),
  dialogs and webview messages included: those already reach every replica's UIs.
* The caller's cancel and deadline: the forwarder's call is cancelled (the call driver turns a
  deadline into a cancel of the handler), and on its way out it sends the owner a cancel for the
  turn, which cancels it there (the agent gets pi's `abort` / ACP's `session/cancel`).
* AGENT_TURN is a presence kind, and the owner listens to a session's turns while it holds a lease
  there. A forwarder that finds the owner not listening, or not accepting within ACCEPT_S, or told
  "moved" (the owner lost the lease), claims again: once the old owner's lease expired it takes it
  and runs the turn here (a takeover). All of it is bounded by twice the lease plus ACCEPT_S.
* An owner that dies mid-turn stops beating: after `lease_s` and a quarter of silence the
  forwarder ends the turn UNAVAILABLE, saying the conversation is kept and the turn can be sent
  again (the next turn takes the lease over once it expired). Both ways: the forwarder says
  "alive" every lease_s / 4, and a turn whose forwarder went silent as long is cancelled at the
  owner (the forwarder's replica died: nobody would read it, and the agent must not run on).

Steering (StopTurn, SetMode, SetModel, NewConversation: uibus.domain.steering) of an agent hosted
elsewhere takes the same way: an AGENT_TURN "steer" to the owner, whose listener runs it
(`steer_here`) and answers "accepted" at once, then "end" with the result or the error's status and
message. A stop cancels the owner's run of a forwarded turn like a local one, so that turn's
forwarder hears CANCELLED with the owner's "stopped from a UI" message.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

from google.protobuf import wrappers_pb2

from uibus.infra import kinds, telemetry
from uibus.infra.bus import Bus, BusClosed, SubscriptionLimit
from uibus.infra.errors import UibusError, Unavailable
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.replicas.asking import Exchange, Listeners, beat, end_of, raise_end, replier
from uibus.replicas.ownership import LEASE_S, HostedAgents, Interrupted, Ownership, interrupted

log = logging.getLogger("uibus.agents")

ACCEPT_S = 2.0  # how long a forwarded turn waits for the owner to take it (at least; half a lease if longer)
RETRY_S = 0.2  # between claims while the owner does not answer
SEEN_MAX = 4096  # turn ids remembered against a redelivery
REPLY_QUEUE = 1 << 20  # a forwarded turn's mailbox, in events: bounded by the mailbox's bytes instead
STEER_S = 45.0  # how long an accepted steering call may take at the owner (pi answers each state read within 10 s)

RunHere = Callable[[str, str, agent_pb2.ChatRequest, Mapping[str, str]], AsyncIterator[agent_pb2.ChatResponse]]
# (session, agent, action, args) -> the result (uibus.domain.steering.Steering.here)
SteerHere = Callable[[str, str, str, dict[str, str]], Awaitable[dict[str, Any]]]


class _Moved(Exception):
    """The turn did not reach a replica that runs it: claim the owner again."""


BATCH_BYTES = 256 * 1024  # a batch of pieces is sent at the latest once it holds this many bytes
BATCH_S = 0.002  # or this long after its first piece: imperceptible in a stream, and bursts grow into one batch


class _Replies:
    """The owner's replies to one forwarded turn. Pieces are framed (4-byte length, ChatResponse
    bytes) into one bus event per pass of the event loop: an agent's pieces come in bursts, and one
    Redis message per burst instead of per piece is most of what keeps a forwarded turn's cost
    near a local one's (bench/agent_forwarding.py). Control replies flush the batch first, so
    the forwarder reads everything in order."""

    __slots__ = ("_frames", "_publish", "_scheduled", "_seq", "_size")

    def __init__(self, publish: Callable[[Any], object]) -> None:
        self._publish = publish
        self._frames: list[bytes] = []
        self._size = 0
        self._scheduled = False
        self._seq = 0  # each batch starts with its number (4 bytes): a redelivered one is known

    def piece(self, response: agent_pb2.ChatResponse) -> None:
        data = response.SerializeToString()
        self._frames.append(len(data).to_bytes(4, "big"))
        self._frames.append(data)
        self._size += len(data) + 4
        if self._size >= BATCH_BYTES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(BATCH_S, self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._frames:
            self._seq += 1
            batch = wrappers_pb2.BytesValue(value=self._seq.to_bytes(4, "big") + b"".join(self._frames))
            self._frames.clear()
            self._size = 0
            self._publish(batch)

    def control(self, value: dict[str, Any]) -> None:
        self.flush()
        self._publish(value)


def _trace_of(item: dict[str, Any]) -> Any:
    """The forwarder's trace context a forwarded turn carries (W3C headers), for its run here to
    adopt (owned tasks start outside any trace); None when tracing is off or it carries none."""
    carried = item.get("trace")
    if telemetry.tracer is None or not isinstance(carried, dict) or not carried:
        return None
    return telemetry.extract((str(k), str(v)) for k, v in carried.items())


def _unframe(batch: bytes) -> list[agent_pb2.ChatResponse]:
    """The ChatResponses of one batch (see _Replies: its number, then length-prefixed pieces)."""
    view = memoryview(batch)
    out = []
    at, end = 4, len(view)  # after the batch's number
    while at + 4 <= end:
        size = int.from_bytes(view[at:at + 4], "big")
        out.append(agent_pb2.ChatResponse.FromString(view[at + 4:at + 4 + size]))
        at += 4 + size
    return out


class TurnForwarding:
    """Routes each hosted agent turn to its owner; serves the turns forwarded to this replica."""

    def __init__(self, bus: Bus, store: Store, agents: HostedAgents, run_here: RunHere, steer_here: SteerHere,
                 say_error: Callable[[str, str], object] = lambda session, text: None, *,
                 lease_s: float = LEASE_S) -> None:
        """`run_here` runs a turn of an agent this replica owns (Chat.turn), `steer_here` a
        steering call (Steering.here); `say_error(session, text)` tells the session's webviews (a
        Cline ERROR message) that a turn was interrupted by the loss of its host. The leases are
        this replica's (its bus's replica id) in `store`."""
        self.bus = bus
        # the leases held here: this replica listens to a session's forwarded turns while it holds one
        self.ownership = ownership = Ownership(store, agents, bus.replica_id, lease_s=lease_s,
                                               on_session=self._on_session)
        self.run_here = run_here
        self.steer_here = steer_here
        self.say_error = say_error
        self.lease_s = ownership.lease_s
        # A slow "accepted" is re-sent as a new turn (the first one cancelled): long enough that a
        # busy owner is not mistaken for a gone one, which would start the turn twice.
        self.accept_s = max(ACCEPT_S, self.lease_s / 2)
        self._seen: dict[str, None] = {}  # ids of the turns started here lately (a redelivery is ignored)
        self._serving = Tasks("forwarded agent turns")
        # the turns and steering calls other replicas carry to the sessions this replica holds leases in
        self.listeners = Listeners(bus, kinds.AGENT_TURN, ownership.owner_id, self._take, self._serving,
                                   "agent turn listener")
        self._turns: dict[str, asyncio.Task[None]] = {}  # turn id -> its run here, for its cancel
        self._alive: dict[str, float] = {}  # turn id -> when its forwarder last said it still listens
        self.forwarded = 0  # turns this replica carried to their owner (accepted there)
        self.served = 0  # turns other replicas carried here
        self.interrupted = 0  # forwarded turns whose owner went silent

    # ---- the forwarder's side ----

    async def turn(self, session: str, agent: str, request: agent_pb2.ChatRequest, metadata: Mapping[str, str],
                   check: Callable[[], None]) -> AsyncIterator[agent_pb2.ChatResponse]:
        """The ChatResponses of one turn of a hosted agent, run by its owner (here or elsewhere)."""
        check()  # bad input fails where it arrived, before anything is claimed or sent
        try:
            async with aclosing(self._route(session, agent, request, metadata)) as replies:
                async for reply in replies:
                    yield reply
        except Interrupted as exc:  # the caller gets UNAVAILABLE; every webview of the session is told
            self.say_error(session, str(exc))
            raise

    async def _route(self, session: str, agent: str, request: agent_pb2.ChatRequest,
                     metadata: Mapping[str, str]) -> AsyncIterator[agent_pb2.ChatResponse]:
        ownership = self.ownership
        give_up = time.monotonic() + 2 * self.lease_s + self.accept_s
        while True:
            owner = await ownership.claim(session, agent)
            if owner == ownership.owner_id:
                async with ownership.running(session, agent), \
                        aclosing(self.run_here(session, agent, request, metadata)) as replies:
                    async for reply in replies:
                        yield reply
                return
            try:
                async with aclosing(self._forward(session, agent, owner, request, metadata)) as batches:
                    async for batch in batches:  # one hop per batch here, not per piece
                        for reply in batch:
                            yield reply
                return
            except _Moved:
                if time.monotonic() >= give_up:
                    raise Unavailable(f"the uibus replica hosting agent {agent!r} for this session does not answer "
                                      "and its lease has not expired yet; the conversation is kept, send the turn "
                                      "again shortly") from None
                await asyncio.sleep(RETRY_S)

    async def _forward(self, session: str, agent: str, owner: str, request: agent_pb2.ChatRequest,
                       metadata: Mapping[str, str]) -> AsyncIterator[list[agent_pb2.ChatResponse]]:
        """The owner's replies to one turn carried to it, batch by batch (see _Replies)."""
        bus = self.bus
        ask = Exchange(bus, session, kinds.AGENT_TURN, kinds.AGENT_TURN_REPLY, to=owner, maxsize=REPLY_QUEUE)
        try:
            await ask.open()
        except (SubscriptionLimit, BusClosed) as exc:
            raise Unavailable(f"cannot carry the turn to the replica hosting agent {agent!r}: {exc}") from exc
        sent = ended = False
        alive: asyncio.Task[None] | None = None
        turn: dict[str, Any] = {"op": "turn", "id": ask.id, "agent": agent, "metadata": dict(metadata),
                                "request": base64.b64encode(request.SerializeToString()).decode()}
        if telemetry.tracer is not None and telemetry.recording():  # the owner's turn span joins the call's trace
            turn["trace"] = telemetry.inject({})
        try:
            if bus.announced(owner, session, kinds.AGENT_TURN) is False:
                raise _Moved  # the owner does not listen (yet, or any more)
            sent = ask.send(turn) > 0
            if not sent:
                raise _Moved
            alive = self._serving.spawn(beat(self.lease_s / 4, lambda: ask.send({"op": "alive", "id": ask.id})),
                                        name="forwarded turn alive")
            wait = self.accept_s
            last = -1  # the last batch read (a batch redelivered after a Redis outage is skipped)
            while True:
                try:
                    item = await ask.reply(wait)
                except TimeoutError:
                    if wait == self.accept_s:
                        raise _Moved from None
                    self.interrupted += 1
                    raise Interrupted(interrupted(agent)) from None
                except StopAsyncIteration:  # this replica shuts down (the bus ended its streams)
                    raise Interrupted(f"the turn of {agent} was interrupted: the uibus server it reached is "
                                      "shutting down; the conversation is kept, send the turn again") from None
                if type(item) is wrappers_pb2.BytesValue:
                    seq = int.from_bytes(item.value[:4], "big")
                    if seq > last:
                        last = seq
                        yield _unframe(item.value)
                    continue
                if type(item) is not dict:
                    continue
                op = item.get("op")
                if op == "accepted":
                    self.forwarded += 1
                    wait = self.lease_s * 1.25  # the owner beats every lease_s / 4
                elif op == "end":
                    ended = True
                    if item.get("interrupted"):
                        raise Interrupted(str(item.get("message", "")))
                    raise_end(item)
                    return
                elif op == "moved":
                    ended = True
                    raise _Moved
        finally:
            if alive is not None:
                alive.cancel()  # joined with the other serving tasks
            if sent and not ended:  # cancelled, timed out or closed by the caller: stop it at the owner
                ask.send({"op": "cancel", "id": ask.id})
            ask.close()

    async def steer(self, session: str, agent: str, action: str, args: dict[str, str]) -> dict[str, Any] | None:
        """A steering call of (`session`, `agent`) run by its owner: None when that is this replica
        (the caller acts here), else the owner's result; its error raised with the owner's status;
        UNAVAILABLE when the owner does not answer within `accept_s`, or not finish within STEER_S."""
        ownership = self.ownership
        owner = await ownership.claim(session, agent)
        if owner == ownership.owner_id:
            return None
        unanswered = (f"the uibus replica hosting agent {agent!r} for this session did not answer the {action} "
                      "request; try again shortly")
        ask = Exchange(self.bus, session, kinds.AGENT_TURN, kinds.AGENT_TURN_REPLY, to=owner, maxsize=16)
        try:
            await ask.open()
        except (SubscriptionLimit, BusClosed) as exc:
            raise Unavailable(f"cannot carry the {action} request to the replica hosting agent {agent!r}: {exc}") \
                from exc
        try:
            if ask.send({"op": "steer", "id": ask.id, "agent": agent, "action": action, "args": args}) == 0:
                raise Unavailable(unanswered)
            wait = self.accept_s
            while True:
                try:
                    item = await ask.reply(wait)
                except (TimeoutError, StopAsyncIteration):
                    raise Unavailable(unanswered) from None
                op = item.get("op") if type(item) is dict else None
                if op == "accepted":
                    wait = STEER_S
                elif op == "moved":
                    raise Unavailable(f"agent {agent!r} of this session is changing replicas; try again shortly")
                elif op == "end":
                    raise_end(item)
                    result = item.get("result")
                    return result if isinstance(result, dict) else {}
        finally:
            ask.close()

    # ---- the owner's side ----

    def _on_session(self, session: str, holding: bool) -> None:
        """Listens to `session`'s forwarded turns while this replica holds a lease there."""
        if holding:
            self.listeners.listen(session)  # unable to: other replicas' turns wait for the lease instead
        else:
            self.listeners.stop(session)

    async def _take(self, session: str, item: Any) -> None:
        """One message of a forwarder: a turn or a steering call (each run in a task of its own), a
        turn's cancel, or its forwarder's "still listening"."""
        if type(item) is not dict or type(item.get("id")) is not str:
            return
        if item.get("op") == "turn":
            if item["id"] in self._seen:  # delivered again after a Redis outage: run once
                return
            self._seen[item["id"]] = None
            if len(self._seen) > SEEN_MAX:
                del self._seen[next(iter(self._seen))]
            self._turns[item["id"]] = self._serving.spawn(
                telemetry.adopted(_trace_of(item), self._run(session, item)), name="forwarded agent turn")
        elif item.get("op") == "cancel":
            task = self._turns.get(item["id"])
            if task is not None:
                task.cancel()
        elif item.get("op") == "alive" and item["id"] in self._turns:
            self._alive[item["id"]] = time.monotonic()
        elif item.get("op") == "steer":
            self._serving.spawn(self._steer(session, item), name="forwarded steering")

    async def _run(self, session: str, item: dict[str, Any]) -> None:
        turn_id, agent = item["id"], item.get("agent")
        bus = self.bus

        replies = _Replies(replier(bus, session, kinds.AGENT_TURN_REPLY, turn_id))
        reply = replies.control
        beating: asyncio.Task[None] | None = None
        try:
            if type(agent) is not str or not self.ownership.holds(session, agent):
                reply({"op": "moved"})
                return
            request = agent_pb2.ChatRequest.FromString(base64.b64decode(str(item.get("request", ""))))
            metadata = item.get("metadata")
            metadata = {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
            self.served += 1
            reply({"op": "accepted"})
            self._alive[turn_id] = time.monotonic()
            run = asyncio.current_task()
            assert run is not None

            def beat_once() -> None:
                reply({"op": "beat"})
                if time.monotonic() - self._alive.get(turn_id, 0.0) > self.lease_s * 1.25:
                    log.warning("a forwarded turn's forwarder went silent: the turn is cancelled",
                                extra={"fields": {"session": session, "agent": agent}})
                    run.cancel()  # its forwarder's replica died: nobody reads the turn any more

            beating = self._serving.spawn(beat(self.lease_s / 4, beat_once), name="forwarded agent turn heartbeat")
            async with self.ownership.running(session, agent), \
                    aclosing(self.run_here(session, agent, request, metadata)) as responses:
                piece = replies.piece
                async for response in responses:
                    piece(response)
            reply(end_of())
        except asyncio.CancelledError:  # the forwarder's cancel, or shutdown: it hears why, if it still listens
            reply(end_of(Interrupted(interrupted(str(agent))), interrupted=True))
            raise
        except Interrupted as exc:  # fenced here: the forwarder tells the webviews
            reply(end_of(exc, interrupted=True))
        except UibusError as exc:
            reply(end_of(exc))
        except Exception as exc:  # a bug of ours: the caller gets INTERNAL, the log the traceback
            log.error("forwarded agent turn failed", exc_info=exc)
            reply(end_of(exc))
        finally:
            self._turns.pop(turn_id, None)
            self._alive.pop(turn_id, None)
            if beating is not None:
                beating.cancel()  # joined with the other serving tasks

    async def _steer(self, session: str, item: dict[str, Any]) -> None:
        """Runs a steering call carried here and answers it (see `steer`)."""
        reply = replier(self.bus, session, kinds.AGENT_TURN_REPLY, item["id"])
        agent, args = item.get("agent"), item.get("args")
        if type(agent) is not str or not self.ownership.holds(session, agent):
            reply({"op": "moved"})
            return
        reply({"op": "accepted"})
        try:
            result = await self.steer_here(session, agent, str(item.get("action", "")),
                                           {str(k): str(v) for k, v in args.items()} if isinstance(args, dict) else {})
            reply(end_of(result=result))
        except asyncio.CancelledError:
            reply(end_of(Unavailable("the uibus replica hosting the agent is shutting down")))
            raise
        except UibusError as exc:
            reply(end_of(exc))
        except Exception as exc:  # a bug of ours (or the agent's reply): the caller gets INTERNAL
            log.error("forwarded steering failed", exc_info=exc)
            reply(end_of(exc))

    # ---- lifecycle ----

    async def __aenter__(self) -> TurnForwarding:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stops listening and ends the turns run here for others (each tells its forwarder)."""
        self.listeners.close()
        await self._serving.aclose(patience=5.0)
