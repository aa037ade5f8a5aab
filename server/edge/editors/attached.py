"""One uibus session as one editor connection holds it: its live feed (turns other UIs start, the
transcript `session/load` replays), its dialogs (asked at the editor while any UI may answer), and
the editor's own prompt on it.

Own turns stream from their StreamingChat call (pieces, thoughts, tool calls as they happen); the
same turn also shows on the session's feed, so while a prompt runs every feed message is noted as
the turn's own (by `ts`) and not shown twice. The prompt answers only once the feed has shown the
turn's final message (bounded wait): everything the turn published came before it, so every later
`ts` is another UI's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from uibus.edge.editors import updates
from uibus.edge.editors.cursor import SEQ_KEY
from uibus.edge.editors.uplink import Uplink, each
from uibus.infra.jsonrpc import INVALID_REQUEST, RpcError
from uibus.infra.tasks import Tasks, cancel_and_wait
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2

log = logging.getLogger("uibus.edge.editors")

REPLAY_MAX_S = 5.0  # no replay_complete marker by then (a uibus that predates it): answer anyway
SETTLE_S = 2.0  # at most this long an answer waits for the feed to show the turn's last message
CANCELLED_SETTLE_S = 0.3  # a cancelled turn has no final message to wait for: this long instead
QUIET_S = 0.3  # `settled`: the feed showed nothing of another UI's turn for this long
_OWN_TS = 1024  # the `ts` of own turns remembered (their late states are not shown again)
_END = object()

Notify = Callable[[str, dict[str, Any]], Awaitable[None]]
Ask = Callable[[str, dict[str, Any], Callable[[int], None]], Awaitable[Any]]
Withdraw = Callable[[int], Awaitable[None]]
Busy = Callable[[bool], Awaitable[None]]


class Attached:
    def __init__(self, name: str, uplink: Uplink, notify: Notify, ask: Ask, withdraw: Withdraw, *,
                 elicitation: bool) -> None:
        self.name = name
        self.uplink = uplink
        self._notify = notify
        self._ask = ask
        self._withdraw = withdraw
        self._elicitation = elicitation
        self.tasks = Tasks(f"acp session {name}")
        self.view = updates.FeedView()
        self.replayed = 0  # transcript messages this attach found
        self.gap = False  # the cursor it resumed from was older than the session's log keeps
        self.directories: list[str] = []  # the editor's additionalDirectories (uibus.edge.editors.roots)
        self.seq = 0  # the highest log position (seq) of the messages the feed showed: the editor's cursor
        self._replay_done = asyncio.Event()
        self.detached = False  # once detached, an attach still waiting gives up
        self._live = asyncio.Event()
        self._has_headers = False
        self.refused: grpc.aio.AioRpcError | None = None  # the feed's failure before it was subscribed
        # The editor's own turn: running, the ts it owns, its final text once known.
        self.prompt: asyncio.Task[Any] | None = None
        self._feeding: asyncio.Task[None] | None = None
        self._own = False
        self._own_ts: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._finals: set[str] = set()  # finished texts the feed showed during the own turn
        self._final_seen = asyncio.Event()
        self._final: str | None = None
        self._asking: dict[str, int] = {}  # dialog id -> our request id at the editor
        # What the editor was told the agent offers: its mode (None: not known yet) and commands.
        self._mode: str | None = None
        self._commands: dict[str, Any] | None = None
        # Told whether a turn runs in the session (any UI's) each time the listing changes: the v2
        # draft's state updates (uibus.edge.editors.v2_turns); None for a v1 editor.
        self.on_busy: Busy | None = None
        # Told before another UI's turn's first piece reaches the editor: the v2 draft's `running`
        # must come first, and the listing (polled) may say so only later. None for a v1 editor.
        self.on_news: Callable[[], Awaitable[None]] | None = None
        self._shown_at = 0.0  # loop time the feed last showed another UI's message

    # ---- attach / detach ----

    async def attach(self, *, replay: bool, since: int | None = None) -> None:
        """Subscribes to the session's feed and dialogs; with `replay` the transcript goes to the
        editor first (with `since`, only what changed after that seq: the feed replays from the
        session log, then goes live on the same subscription, so nothing falls between). Returns
        once subscribed (and replayed)."""
        self._feeding = self.tasks.spawn(self._feed(replay, since), name=f"acp feed {self.name}")
        self.tasks.spawn(self._dialogs(), name=f"acp dialogs {self.name}")
        self.tasks.spawn(self._offers(), name=f"acp offers {self.name}")
        await self._replay_done.wait()
        if self.detached:  # detached while attaching (another load or resume of it on this connection)
            raise RpcError(INVALID_REQUEST, f"session {self.name} was attached again on this connection meanwhile "
                                            "(another session/load or session/resume of it): this one was superseded")
        if self.refused is not None:  # uibus refused the subscription (a token, an outage): the editor hears why
            raise self.refused

    async def detach(self) -> None:
        """Ends this editor's part in the session (its prompt, its streams, its questions); the
        session and its other UIs go on."""
        self.detached = True
        self._replay_done.set()  # an attach still waiting ends: its feed may be cancelled before it starts
        for ident in list(self._asking.values()):
            await self._withdraw(ident)
        self._asking.clear()
        await cancel_and_wait(self.prompt)
        await self.tasks.aclose(patience=5.0)

    async def update(self, update: dict[str, Any], seq: int = 0) -> None:
        """One session/update; `seq`: the log position of the message it comes from, in `_meta`
        (`uibus/seq`), so the editor knows its cursor for a later session/resume."""
        params: dict[str, Any] = {"sessionId": self.name, "update": update}
        if seq:
            params["_meta"] = {SEQ_KEY: seq}
        await self._notify("session/update", params)

    # ---- the feed ----

    async def _feed(self, replay: bool, since: int | None) -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue(64)
        call = self.uplink.feed(self.name, f"acp-{secrets.token_hex(4)}", since)
        self._has_headers = hasattr(call, "initial_metadata")

        async def pump() -> None:
            try:
                headers = getattr(call, "initial_metadata", None)
                if headers is not None:  # grpc.aio: headers => subscribed (unless they came with the
                    await headers()      # status, a refusal, which the reading below raises)
                    if not call.done():
                        self._live.set()
                async for event in each(call):
                    await queue.put(event)
            except grpc.aio.AioRpcError as exc:
                if not self._replay_done.is_set():
                    self.refused = exc
                self._live.set()  # settled: a refusal is as final as a subscription
                await queue.put(exc)
            await queue.put(_END)

        pumping = self.tasks.spawn(pump(), name=f"acp feed pump {self.name}")
        try:
            await self._replay(queue, replay)
            while (item := await queue.get()) is not _END:
                await self._show(item)
        finally:
            self._replay_done.set()
            await cancel_and_wait(pumping)

    async def _replay(self, queue: asyncio.Queue[Any], replay: bool) -> None:
        """The transcript: the replayed messages, up to the feed's `replay_complete` marker (asked
        for in `Uplink.feed`), so session/load answers the moment the history is whole, however
        long, and nothing live is taken for history. A live message before the marker (another
        stream's replay still running) is shown as live."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_MAX_S
        try:
            if not replay and self._has_headers:
                # subscribed is all session/new and resume wait for (the headers say it); the
                # history that follows is taken into the view silently (`_show`)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._live.wait(), REPLAY_MAX_S)
                return
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    return
                if item is _END or isinstance(item, Exception):
                    await self._show(item)
                    return
                if item.replay_complete:
                    return
                if item.gap:  # the cursor is below the log's floor: the recent history follows, whole
                    self.gap = True
                    continue
                if item.replayed:
                    message = self._message(item)
                    if message is not None:
                        self.replayed += 1
                        self.seq = max(self.seq, message.seq)
                        shown = self.view.updates(message)  # kept in the view either way: deltas go on from here
                        if replay:
                            for u in shown:
                                await self.update(u, message.seq)
                    continue
                await self._show(item)
        finally:
            self._replay_done.set()

    @staticmethod
    def _message(event: Any) -> ui_pb2.ClineMessage | None:
        if isinstance(event, Exception) or event is _END:
            return None
        return event.partial_message if event.WhichOneof("event") == "partial_message" else None

    async def _show(self, item: Any) -> None:
        if item is _END:
            return
        if isinstance(item, grpc.aio.AioRpcError):
            if not self._replay_done.is_set():
                self.refused = item
                return
            log.warning("the session's feed ended", extra={"fields": {"session": self.name,
                                                                      "code": item.code().name}})
            return
        message = self._message(item)
        if message is None:
            return
        self.seq = max(self.seq, message.seq)
        if item.replayed:  # history a resumed session starts with: known, not news
            self.view.updates(message)
            return
        if self._own:
            self._own_ts[message.ts] = None
            while len(self._own_ts) > _OWN_TS:
                self._own_ts.popitem(last=False)
            if not message.partial and message.say in (ui_pb2.TEXT, ui_pb2.ERROR):
                self._finals.add(message.text)
                if message.text == self._final:
                    self._final_seen.set()
            self.view.updates(message)
            return
        if message.ts in self._own_ts:
            return
        self._shown_at = asyncio.get_running_loop().time()
        shown = list(self.view.updates(message))
        if shown and self.on_news is not None:
            await self.on_news()
        for u in shown:
            await self.update(u, message.seq)

    # ---- the editor's own turn ----

    def begin_turn(self, task: asyncio.Task[Any]) -> None:
        if self.prompt is not None:
            raise RpcError(INVALID_REQUEST, f"a prompt is already running on session {self.name}: wait for its answer "
                                   "or send session/cancel")
        self.prompt, self._own = task, True
        self._finals.clear()
        self._final, self._final_seen = None, asyncio.Event()

    async def end_turn(self, final: str | None) -> None:
        """Waits (bounded) until the feed has shown the turn's last message, then stops owning."""
        try:
            if not self._feed_running():
                return
            if final is None:
                await asyncio.sleep(CANCELLED_SETTLE_S)
            elif final not in self._finals:
                self._final = final
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._final_seen.wait(), SETTLE_S)
        finally:
            self._own, self.prompt = False, None

    def forget_turn(self) -> None:
        """The prompt was withdrawn or its connection is closing: no answer will be sent for it."""
        self._own, self.prompt = False, None

    async def settled(self) -> None:
        """Returns once the feed has shown nothing of another UI's turn for QUIET_S (at most
        SETTLE_S): the listing says a turn ended on a stream of its own, which may overtake the
        turn's last pieces on the feed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + SETTLE_S
        while True:
            wait = min(self._shown_at + QUIET_S, end) - loop.time()
            if wait <= 0:
                return
            await asyncio.sleep(wait)  # polled: the quiet moves on with every piece shown

    def _feed_running(self) -> bool:
        return self._feeding is not None and not self._feeding.done()

    def cancel(self) -> None:
        """session/cancel: the running prompt's call is cancelled (the hosted agent sees it)."""
        if self.prompt is not None and not self.prompt.done():
            self.prompt.cancel()

    # ---- what the agent offers: its mode and commands, changed from any UI ----

    def offered(self, state: sessions_pb2.AgentState | None) -> list[dict[str, Any]]:
        """The updates telling the editor what changed in the agent's offer since it last heard:
        `available_commands_update` when the commands differ, `current_mode_update` when the mode
        moved from one it knew (the first mode comes in the session/load or resume answer)."""
        if state is None:
            return []
        out = []
        commands = updates.commands(state)
        if commands is not None and commands != self._commands:
            self._commands = commands
            out.append(commands)
        mode = state.current_mode or (state.modes[0].id if state.modes else "")
        if mode and mode != self._mode:
            if self._mode is not None:
                out.append({"sessionUpdate": "current_mode_update", "currentModeId": mode})
            self._mode = mode
        return out

    def now_in_mode(self, mode: str) -> bool:
        """The editor set the mode itself; False when the listing told it already (not news)."""
        news, self._mode = mode != self._mode, mode
        return news

    async def _offers(self) -> None:
        """SetMode from another UI (the page, a phone, the sessions API) and the agent's own mode
        and command changes reach this editor through the session's listing (WatchSessions)."""
        try:
            async for state, busy in self.uplink.agent_states(self.name):
                for u in self.offered(state):
                    await self.update(u)
                if self.on_busy is not None:
                    await self.on_busy(busy)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("the session's listing ended", extra={"fields": {"session": self.name,
                                                                             "code": exc.code().name}})

    # ---- dialogs ----

    async def _dialogs(self) -> None:
        try:
            async for event in self.uplink.dialogs(self.name):
                which = event.WhichOneof("event")
                if which == "request" and event.request.WhichOneof("method") in ("select", "confirm", "input",
                                                                                  "editor"):
                    self.tasks.spawn(self._question(event.request), name=f"acp question {self.name}")
                elif which == "closed":
                    ident = self._asking.pop(event.closed.id, None)
                    if ident is not None:  # another UI answered first (or it timed out): withdrawn here
                        await self._withdraw(ident)
        except grpc.aio.AioRpcError as exc:
            log.warning("the session's dialogs ended", extra={"fields": {"session": self.name,
                                                                         "code": exc.code().name}})

    async def _question(self, request: ext_pb.ExtensionUiRequest) -> None:
        params = updates.permission(self.name, request)
        method = "session/request_permission"
        if params is None and self._elicitation:
            params, method = updates.elicitation(self.name, request), "elicitation/create"
        if params is None:
            return  # an input the editor cannot show: the session's other UIs answer it
        try:
            result = await self._ask(method, params, lambda ident: self._asking.__setitem__(request.id, ident))
        except RpcError:
            return  # withdrawn, or the editor failed it: the other UIs may still answer
        finally:
            self._asking.pop(request.id, None)
        try:
            await self.uplink.respond(self.name, updates.answer(request, result))
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                log.warning("an editor's answer was refused", extra={"fields": {
                    "session": self.name, "code": exc.code().name, "details": exc.details()}})
