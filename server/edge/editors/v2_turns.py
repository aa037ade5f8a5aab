"""ACP v2 draft's session methods for an editor that negotiated protocol version 2, on top of the
one `Editor` (uibus.edge.editors.agent): the same domain calls, the same attachments, the same
turns — v2 only changes when things are said and how.

* `session/prompt` is answered as soon as the prompt is inserted (`{messageId}`, after the
  `user_message` echo and a `state_update` `running`); the turn runs on, owned by the session's
  attachment, and its end is a `state_update` `idle` with the stop reason v1's answer would have
  carried (`error` with the JSON-RPC error where v1's answer would have been one), and the cursor
  (`_meta` `uibus/seq`) v1's answer carried;
* turns other UIs run (a page, a phone, another editor, whatever the protocol) are foreground work
  of the session too: `running` / `idle` from the session's listing (WatchSessions' `running`),
  the idle sent once the feed has settled, without a stop reason (uibus's listing does not say it);
* `session/resume` sends the current state after any replay and before its answer; `replayFrom`
  takes `start`, uibus's own `{"type": "_uibus/seq", "seq": N}` and v1's `_meta` `uibus/since`;
* `session/close` cancels a running turn and lets its `idle` `cancelled` go out before answering;
* `session/set_config_option` of the `mode` option is v1's `session/set_mode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from uibus.edge.editors import updates, v2
from uibus.edge.editors.attached import SETTLE_S, Attached
from uibus.edge.editors.cursor import SEQ_KEY
from uibus.edge.editors.uplink import Uplink
from uibus.infra.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, RESOURCE_NOT_FOUND, RpcError
from uibus.infra.tasks import cancel_and_wait

Method = Callable[[dict[str, Any]], Awaitable[Any]]


class Editor(Protocol):
    """What v2 uses of the one editor connection (uibus.edge.editors.agent.Editor): its sessions
    and the very methods v1 answers with, so both versions make the same calls."""

    uplink: Uplink
    sessions: dict[str, Attached]

    async def offer(self, capabilities: Any) -> dict[str, Any]: ...
    async def new(self, params: dict[str, Any]) -> dict[str, Any]: ...
    async def resume(self, params: dict[str, Any]) -> dict[str, Any]: ...
    async def close(self, params: dict[str, Any]) -> dict[str, Any]: ...
    async def list(self, params: dict[str, Any]) -> dict[str, Any]: ...
    async def set_mode(self, params: dict[str, Any]) -> dict[str, Any]: ...
    def start_turn(self, params: dict[str, Any]) -> tuple[Attached, asyncio.Task[Any]]: ...
    async def finish_turn(self, attached: Attached, turn: asyncio.Task[Any]) -> dict[str, Any]: ...
    def error_of(self, exc: Exception) -> RpcError | None: ...


@dataclass
class Foreground:
    """One attachment's foreground state as this editor was told it."""

    state: str = "idle"
    ready: bool = False  # the new/resume answer is on its way: the listing may speak from now on
    runner: asyncio.Task[None] | None = None  # this editor's own turn, until its idle is sent
    listed_busy: bool = False  # what the listing said last
    stale: bool = False  # the listing's "running" may still be the own turn's: wait for its "idle"

    def own(self) -> bool:
        return self.runner is not None and not self.runner.done()


class V2Turns:
    """The v2 method table of one editor connection (see the module docstring)."""

    def __init__(self, editor: Editor) -> None:
        self.editor = editor
        self.shapes = v2.Shapes()
        self._fg: weakref.WeakKeyDictionary[Attached, Foreground] = weakref.WeakKeyDictionary()

    def methods(self) -> dict[str, Method]:
        return {"initialize": self.initialize, "session/new": self.new, "session/list": self.editor.list,
                "session/resume": self.resume, "session/close": self.close, "session/prompt": self.prompt,
                "session/set_config_option": self.set_config_option}

    def foreground(self, attached: Attached) -> Foreground:
        found = self._fg.get(attached)
        if found is None:
            found = self._fg[attached] = Foreground()
        return found

    def watch(self, attached: Attached) -> None:
        """Hooks `attached` to the session's listing: another UI's turn is this editor's news."""
        async def busy(now: bool) -> None:
            await self._listed(attached, now)

        async def news() -> None:
            await self._news(attached)
        attached.on_busy = busy
        attached.on_news = news

    # ---- methods ----

    async def initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        """A repeated initialize: v2 or later only (the draft: a repeat uses the selected version)."""
        version = params.get("protocolVersion")
        if not isinstance(version, int) or version < v2.PROTOCOL_VERSION:
            raise RpcError(INVALID_REQUEST, f"this connection speaks protocol version {v2.PROTOCOL_VERSION}: a "
                                            "repeated initialize must ask for it (or a later one)")
        return v2.initialize_result(await self.editor.offer(params.get("capabilities")))

    async def new(self, params: dict[str, Any]) -> dict[str, Any]:
        answer = await self.editor.new(params)
        self.foreground(self.editor.sessions[answer["sessionId"]]).ready = True  # a new session is idle
        return answer

    async def resume(self, params: dict[str, Any]) -> dict[str, Any]:
        answer = await self.editor.resume(v2.replay_cursor(params))
        name = params["sessionId"]
        attached = self.editor.sessions[name]
        modes = answer.pop("modes", None)
        if modes is not None:
            self.shapes.modes[name] = modes
            answer["configOptions"] = [v2.mode_option(modes)]
        fg = self.foreground(attached)
        fg.state = "running" if await self.editor.uplink.busy(name) else "idle"
        fg.ready = True
        await attached.update({"sessionUpdate": "state_update", "state": fg.state})
        return answer

    async def close(self, params: dict[str, Any]) -> dict[str, Any]:
        attached = self.editor.sessions.get(params.get("sessionId"))  # type: ignore[arg-type]
        if attached is not None:
            runner = self.foreground(attached).runner
            if runner is not None and not runner.done():
                attached.cancel()
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(runner), SETTLE_S * 2)
            self.shapes.forget(attached.name)
        return await self.editor.close(params)

    async def prompt(self, params: dict[str, Any]) -> dict[str, Any]:
        """Inserts the prompt and answers with its messageId; the turn goes on (`_run`)."""
        attached, turn = self.editor.start_turn(params)
        fg = self.foreground(attached)
        message = self.shapes.message_id()
        try:
            await attached.update({"sessionUpdate": "user_message", "messageId": message,
                                   "content": params["prompt"]})
            await self._state(attached, fg, "running")
        except BaseException:
            attached.forget_turn()
            await cancel_and_wait(turn)
            raise
        fg.runner = attached.tasks.spawn(self._run(attached, fg, turn), name=f"acp v2 turn {attached.name}")
        return {"messageId": message}

    async def set_config_option(self, params: dict[str, Any]) -> dict[str, Any]:
        """The `mode` option: the hosted agent's mode for every UI of the session (v1's set_mode)."""
        if params.get("configId") != v2.MODE_OPTION:
            raise RpcError(INVALID_PARAMS, f"uibus offers one config option, {v2.MODE_OPTION!r}")
        if params.get("type", "id") != "id":
            raise RpcError(INVALID_PARAMS, f"{v2.MODE_OPTION} takes a value id (type \"id\")")
        name = params.get("sessionId")
        await self.editor.set_mode({"sessionId": name, "modeId": params.get("value")})
        modes = self.shapes.modes.get(name) or updates.modes(await self.editor.uplink.agent_state(name))  # type: ignore[arg-type]
        if modes is None:
            raise RpcError(RESOURCE_NOT_FOUND, "the agent no longer offers modes in this session")
        self.shapes.modes[name] = modes  # type: ignore[index]
        return {"configOptions": [v2.mode_option(modes)]}

    # ---- the foreground ----

    async def _state(self, attached: Attached, fg: Foreground, state: str, seq: int = 0, **extra: Any) -> None:
        fg.state = state
        await attached.update({"sessionUpdate": "state_update", "state": state, **extra}, seq)

    async def _run(self, attached: Attached, fg: Foreground, turn: asyncio.Task[Any]) -> None:
        """The own turn to its end, said as v2 says it: `idle` with the stop reason."""
        try:
            answer = await self.editor.finish_turn(attached, turn)
        except asyncio.CancelledError:
            raise  # the attachment ends (close, detach, the connection): nothing more is said
        except Exception as exc:
            error = exc if isinstance(exc, RpcError) else self.editor.error_of(exc) or RpcError(
                INTERNAL_ERROR, f"the turn failed: {type(exc).__name__}")
            fg.stale = fg.listed_busy
            await self._state(attached, fg, "idle", stopReason="error", error=error.body())
            return
        fg.stale = fg.listed_busy
        seq = (answer.get("_meta") or {}).get(SEQ_KEY, 0)
        await self._state(attached, fg, "idle", seq, stopReason=answer["stopReason"])

    async def _news(self, attached: Attached) -> None:
        """Another UI's turn shows its first piece while this editor still says idle: `running` goes
        first (the draft's order), and its `idle` follows the listing or, should the listing never
        have seen so short a turn, the session's own answer once the feed is quiet."""
        fg = self.foreground(attached)
        if not fg.ready or fg.state != "idle" or fg.own() or attached.prompt is not None or fg.stale:
            return
        await self._state(attached, fg, "running")
        attached.tasks.spawn(self._until_idle(attached, fg), name=f"acp v2 idle {attached.name}")

    async def _until_idle(self, attached: Attached, fg: Foreground) -> None:
        while fg.state == "running" and not fg.own() and attached.prompt is None:
            await attached.settled()
            if fg.listed_busy:  # the listing saw the turn: it says when it ends (_listed)
                return
            if not await self.editor.uplink.busy(attached.name):
                if fg.state == "running" and not fg.own() and attached.prompt is None and not fg.listed_busy:
                    await self._state(attached, fg, "idle")
                return
            await asyncio.sleep(0.2)

    async def _listed(self, attached: Attached, busy: bool) -> None:
        """The listing says whether a turn runs: another UI's turn starts or ends for this editor.
        Its own turn says its own states; a "running" that may be the own turn's, seen late, waits
        for the listing's next "idle"."""
        fg = self.foreground(attached)
        fg.listed_busy = busy
        if not fg.ready or attached.prompt is not None or fg.own():
            return
        if fg.stale:
            fg.stale = busy
            return
        if busy and fg.state == "idle":
            await self._state(attached, fg, "running")
        elif not busy and fg.state == "running":
            await attached.settled()  # the turn's last pieces first
            if fg.state == "running" and attached.prompt is None and not fg.own():
                await self._state(attached, fg, "idle")
