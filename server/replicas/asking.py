"""Request and reply over the bus: one request carried to another replica, its replies carried back.

Forwarded turns, forwarded steering calls (uibus.replicas.turn_forwarding) and forwarded dialog
answers (uibus.replicas.dialog_forwarding) all take the same way, and this module is that way once,
both sides:

* the asker picks a fresh id and subscribes to the reply kind *targeted at that id* before it
  sends anything (after `bus.ready`, so every replica's presence for the session is known and no
  reply can be published before the asker listens);
* the request is published addressed to one replica (`to`: its replica id; a turn's or a steering
  call's owner) or to every listener (`to=None`: an answer whose dialog's holder is not known);
* the replier listens, per session, to the requests targeted at it (`Listeners`: one subscription
  and one loop per session, started and stopped by its owner, ended by an overflow or shutdown) and
  publishes each reply targeted at the request's id (`replier`): "accepted" once it
  took the request, a "beat" while it works, and "end" with a status code (0, or the error's code
  and message: `end_of`, read back by `raise_end`); answers have a verdict of their own instead;
* the asker reads the replies with a wait of its choosing per reply (`Exchange.reply`): a short
  one for "accepted", a beat's for the rest, and gives up on silence. Closing unsubscribes.

The messages themselves (kinds, fields) are the wire of each use and unchanged here: a replica of
the previous release must still read them during a rolling upgrade (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from uibus.infra.bus import Bus, BusClosed, Subscription, SubscriptionLimit
from uibus.infra.errors import STATUS_NUMBERS, UibusError, error_of
from uibus.infra.kinds import Kind
from uibus.infra.tasks import Tasks


class Exchange:
    """The asker's side of one request: open (listen for replies), send, read replies, close."""

    def __init__(self, bus: Bus, session: str, kind: Kind, reply_kind: Kind, *, to: str | None = None,
                 maxsize: int | None = None) -> None:
        self.bus = bus
        self.session = session
        self.kind = kind
        self.reply_kind = reply_kind
        self.to = to
        self.maxsize = maxsize
        self.id = uuid.uuid4().hex  # the replies' target
        self._sub: Subscription | None = None
        self._replies: AsyncIterator[Any] | None = None

    async def open(self) -> None:
        """Listens for the replies (SubscriptionLimit or BusClosed when this replica cannot)."""
        await self.bus.ready(self.session)  # every replica's presence for the session known
        self._sub = self.bus.subscribe(self.session, self.reply_kind, self.id, maxsize=self.maxsize)
        self._replies = aiter(self._sub)

    def send(self, item: Any) -> int:
        """Publishes `item` (the request, or a later word about it) to `to`; how many it reached."""
        return self.bus.publish(self.session, self.kind, item, target=self.to)

    async def reply(self, wait: float | None) -> Any:
        """The next reply: TimeoutError after `wait` seconds of silence (None: no limit),
        StopAsyncIteration when this replica's bus ended its streams (shutdown)."""
        assert self._replies is not None, "open the exchange first"
        if wait is None:
            return await anext(self._replies)
        async with asyncio.timeout(wait):
            return await anext(self._replies)

    def close(self) -> None:
        if self._sub is not None:
            self.bus.unsubscribe(self._sub)
            self._sub = None


class Listeners:
    """The replier's side of one kind: per session, a subscription to the requests targeted at
    `target` (this replica; a request sent to every listener reaches it too) and one loop handing
    each to `handle(session, request)`, awaited in order (a handler that must not hold the next one
    up spawns its work in the owner's `tasks`). The owner says when to listen and when to stop; a
    mailbox that overflowed ends the loop, so askers learn at once that nobody listens."""

    def __init__(self, bus: Bus, kind: Kind, target: str, handle: Callable[[str, Any], Awaitable[None]],
                 tasks: Tasks, name: str) -> None:
        self.bus = bus
        self.kind = kind
        self.target = target
        self.handle = handle
        self.tasks = tasks  # the owner's: its teardown joins the loops with the work they spawned
        self.name = name
        self._loops: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}

    def listening(self, session: str) -> bool:
        return session in self._loops

    def listen(self, session: str) -> None:
        """Listens to `session` (no-op when it already does, or after shutdown). A replica that cannot
        subscribe (its limit, its bus closing) does not listen: askers then get no reply."""
        if session in self._loops or self.tasks.closed:
            return
        try:
            sub = self.bus.subscribe(session, self.kind, self.target)
        except (SubscriptionLimit, BusClosed):
            return
        self._loops[session] = (sub, self.tasks.spawn(self._serve(session, sub), name=self.name))

    def stop(self, session: str) -> None:
        """Stops listening to `session`: its loop ends once the request it is handling is handled."""
        loop = self._loops.pop(session, None)
        if loop is not None:
            self.bus.unsubscribe(loop[0])

    def close(self) -> None:
        """Stops every loop (shutdown); the owner's `tasks.aclose` joins them."""
        for session in list(self._loops):
            self.stop(session)

    async def _serve(self, session: str, sub: Subscription) -> None:
        try:
            async for request in sub:
                await self.handle(session, request)
        except UibusError:  # the mailbox overflowed: stop listening, so askers learn it at once
            pass
        finally:
            loop = self._loops.get(session)
            if loop is not None and loop[0] is sub:
                del self._loops[session]
            self.bus.unsubscribe(sub)


def replier(bus: Bus, session: str, reply_kind: Kind, request_id: str) -> Callable[[Any], int]:
    """The replier's side: publishes one reply to the asker of `request_id`."""
    return lambda value: bus.publish(session, reply_kind, value, target=request_id)


def end_of(error: BaseException | None = None, **extra: Any) -> dict[str, Any]:
    """The "end" reply: code 0 with `extra`, else the error's status and message (INTERNAL for any
    exception that is not one of ours)."""
    if error is None:
        return {"op": "end", "code": 0, **extra}
    if isinstance(error, UibusError):
        return {"op": "end", "code": STATUS_NUMBERS[error.code], "message": str(error), **extra}
    return {"op": "end", "code": STATUS_NUMBERS["INTERNAL"], "message": f"{type(error).__name__}: {error}", **extra}


def raise_end(item: dict[str, Any]) -> None:
    """Raises the error an "end" reply carries (its status and message); returns when it is 0."""
    code = item.get("code")
    if code:
        raise error_of(int(code), str(item.get("message", "")))


async def beat(every: float, once: Callable[[], object]) -> None:
    """`once()` every `every` seconds until cancelled: a replier's heartbeat to its asker, or an
    asker's "still listening" to its replier."""
    while True:
        await asyncio.sleep(every)
        once()
