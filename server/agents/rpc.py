"""`backend = "rpc"`: a coding agent that speaks pi's RPC mode (`pi --mode rpc`), hosted per session.

The protocol (`docs/rpc.md` in pi's npm package `@mariozechner/pi-coding-agent`) is JSON lines over the agent's
stdio: commands in (`prompt`, `abort`, `get_state`, `extension_ui_response`), responses (`type:
"response"`, with the command's `id`) and events out (`agent_start` … `agent_end`, `message_update`
deltas, `tool_execution_*`, `extension_ui_request`). Records are split on `\\n` only: U+2028 and
U+2029 are ordinary characters inside JSON strings.

One process per (uibus session, agent) — an `RpcSession`, owned by the engine's agent sessions — in
its own process group, started on the session's first turn and reused, so the agent keeps its own
conversation. With option `resume` (default true) the `sessionFile` that `get_state` names is the
conversation's handle (uibus.domain.agent_handles): a later process of the same uibus session (after
an idle close, a restart, on another replica) reopens it with `switch_session`. A turn is one `prompt`:

* it ends at `agent_end`, or at the prompt's `response` for an extension command — a `/name` the
  agent's `get_commands` lists as one (anything else, `/usr/bin/true` too, is a model prompt) —
  which pi runs at once and answers when it has finished (a model prompt is answered *first* and its
  run follows, so the response cannot end it). Even then the response ends it only when a `get_state`
  asked after it says no run started (pi starts a prompt's run before it reads the next command), so
  a run's output is never cut off into no turn or the next one;
* text deltas are the reply's pieces; thinking and tool executions are MAXIMAL messages and Cline
  messages on the session's webviews (REASONING, COMMAND_SAY + COMMAND_OUTPUT_SAY for `bash`, TOOL_SAY
  with ClineSayTool JSON for the others);
* `success: false`, an assistant message that ended in `error`, or a final auto-retry failure end
  it with the agent's error; cancelling it sends `abort` (the next turn waits, bounded, for the
  aborted run to end).

Every `extension_ui_request` goes through the session's `Dialogs` (via `SessionUi`), so every UI of
the session shows it, on any replica; the first answer goes back as `extension_ui_response` with
the agent's id. pi resolves a dialog's `timeout` itself and tells nobody, so the dialog is opened
with the same timeout and the UIs see it close then. A dialog whose process died or whose turn was
cancelled is closed for every UI (and answered `cancelled` to a live agent).

This module is only that mapping. The process — options, spawning in its own group, JSON-line
framing, the bounds on lines and stderr, SIGTERM then SIGKILL — is uibus.agents.stdio's; commands
matched to their responses, the turn loop (queue, deadline, waiting for a cancelled run), the
dialog tasks and the failure of every wait when the process dies are uibus.agents.turns', shared
with any other stdio protocol. Faults: the process dies mid-turn → the turn ends at once with the
exit status; an unknown event → one rate-limited log line; starting, stopping, a cancelled run's
end and a turn are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from uibus.agents import AgentError, Piece, SessionUi, Turn
from uibus.agents.attachments import pi_images
from uibus.agents.safe_files import file_beneath
from uibus.agents.stdio import StdioBackend
from uibus.agents.stdio import text as _str
from uibus.agents.steer import PiSteering
from uibus.agents.turns import Event, StdioSession, TurnRun
from uibus.agents.views import AGENT as _AGENT
from uibus.agents.views import TOOL_RESULT as _TOOL_RESULT
from uibus.agents.views import ClineView, pi_tool
from uibus.agents.views import struct as _struct
from uibus.infra import dialog_limits as limits
from uibus.infra.errors import InvalidArgument, ResourceExhausted, Unavailable
from uibus.pb.cline import ui_pb2
from uibus.pb.neuro_san.api.grpc import chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

log = logging.getLogger("uibus.agents.rpc")

_NOTIFY = {"info": ext_pb.NOTIFY_TYPE_INFO, "warning": ext_pb.NOTIFY_TYPE_WARNING, "error": ext_pb.NOTIFY_TYPE_ERROR}
_PLACEMENT = {"aboveEditor": ext_pb.WIDGET_PLACEMENT_ABOVE_EDITOR, "belowEditor": ext_pb.WIDGET_PLACEMENT_BELOW_EDITOR}
_DIALOGS = frozenset({"select", "confirm", "input", "editor"})
_FIRE = frozenset({"notify", "setStatus", "setWidget", "setTitle", "set_editor_text"})
# Every event pi's RPC mode documents; anything else is logged (rate-limited) and ignored.
_EVENTS = frozenset({"agent_start", "agent_end", "turn_start", "turn_end", "message_start", "message_update",
                     "message_end", "tool_execution_start", "tool_execution_update", "tool_execution_end",
                     "queue_update", "compaction_start", "compaction_end", "auto_retry_start", "auto_retry_end",
                     "extension_error", "response"})


def _content_text(result: Any) -> str:
    """The text of a tool result (`{"content": [{"type": "text", "text": …}, …]}`)."""
    if not isinstance(result, dict) or not isinstance(result.get("content"), list):
        return ""
    return "".join(_str(c.get("text")) for c in result["content"] if isinstance(c, dict) and c.get("type") == "text")


class RpcAgent(StdioBackend):
    """The configured agent: its options checked at start-up, its processes counted."""

    def session(self, ui: SessionUi) -> RpcSession:
        return RpcSession(self, ui)

    def prompt_capabilities(self) -> dict[str, bool] | None:
        """pi's `prompt` takes images, no other files (uibus.agents.attachments.pi_images)."""
        return {"image": True, "audio": False, "embeddedContext": False}


class RpcSession(StdioSession):
    """One agent process of one uibus session, spoken to in pi's RPC mode."""

    logger = log
    handshake_says = "answer get_state"
    agent_kind = "an agent in RPC mode"

    def __init__(self, backend: RpcAgent, ui: SessionUi) -> None:
        super().__init__(backend, ui)
        self._ids = itertools.count(1)
        self._answered: set[str] = set()
        self._fires: asyncio.Queue[Event] = asyncio.Queue()
        self._command_turn = False  # this turn's prompt is an extension command (see prepare)
        self._runs_started = 0  # agent_start events seen: did a command's prompt start a run after all?
        self.steering = PiSteering(self.command, self._keep_conversation)  # models, commands, sessions

    # ---- the process ----

    async def handshake(self) -> None:
        self.tasks.spawn(self._fire_forever(), name="rpc agent ui")
        state = await self.command("get_state")  # a program that is not an RPC agent fails here, clearly
        if self.options.resume:
            if self.ui.handle and await self._resume(self.ui.handle):
                state = await self.command("get_state")  # the session file now open
            await self._keep_conversation(state)
        data = state.get("data")
        # models and commands, for the UIs: in the background, so a start never waits on them
        self.tasks.spawn(self.steering.refresh(data if isinstance(data, dict) else {}), name="rpc agent state")

    async def _keep_conversation(self, state: dict[str, Any] | None = None) -> None:
        """With option resume, keeps the session file pi has open (its `get_state`), so the next
        process reopens it; without, nothing."""
        if not self.options.resume:
            return
        if state is None:
            state = await self.command("get_state")
        data = state.get("data") if isinstance(state.get("data"), dict) else {}
        path = data.get("sessionFile")
        await self.ui.keep_handle({"sessionFile": path if isinstance(path, str) and path else None})

    async def _resume(self, handle: dict[str, Any]) -> bool:
        """Reopens the session file of an earlier process (`switch_session`); False (the UIs told
        why) when there is none (pi ran with `--no-session`) or pi refuses it."""
        path = handle.get("sessionFile")
        if not isinstance(path, str) or not path:
            await self.ui.started_fresh("the agent kept no session file (is it run with --no-session?)")
            return False
        # pi "switches" to a file that is not there as to a new, empty session, and says success:
        # looked at first (the agent runs on this host, with its files), so that is never silent
        launch = self.backend.launch(self.ui, self.process.cwd)
        if not await asyncio.to_thread(file_beneath, launch.host_path(path), launch.tenant_home()):
            await self.ui.started_fresh(f"its session file {path} is gone (is ~/.pi/agent/sessions on a volume "
                                        "every replica mounts?)")
            return False
        reply = await self.command("switch_session", sessionPath=path)
        data = reply.get("data") if isinstance(reply.get("data"), dict) else {}
        if not reply.get("success") or data.get("cancelled"):
            why = _str(reply.get("error")) or ("an extension cancelled the switch" if data.get("cancelled")
                                               else "the agent refused it")
            await self.ui.started_fresh(f"switch_session failed: {why}")
            return False
        self.ui.resumed()
        return True

    async def command(self, kind: str, **fields: Any) -> Event:
        """Sends a command and waits for its response (failed when the process goes)."""
        ident = f"uibus-{next(self._ids)}"
        self.process.send({"type": kind, "id": ident, **fields})
        future = self.requests.open(ident)
        try:
            await self.process.drain()
            return await future
        finally:
            future.cancel()  # a wait given up (or a failed drain) leaves nothing behind; no-op once answered

    def on_message(self, message: Event) -> None:
        kind = message.get("type")
        if kind == "response":
            if self.requests.resolve(message.get("id"), message):
                return
        elif kind == "extension_ui_request":
            self._ui_request(message)
            return
        elif kind == "agent_start":
            self._runs_started += 1
            self.run_started()
        elif kind == "agent_end":
            self.run_ended()
        elif kind not in _EVENTS:
            self.log.warn("unknown", "unknown agent event; ignored", event=_str(kind)[:80])
            return
        self.deliver(message)

    # ---- extension UI ----

    def _ui_request(self, message: Event) -> None:
        method, ident = message.get("method"), message.get("id")
        if not isinstance(ident, str) or not ident:
            self.log.warn("ui", "extension_ui_request without an id; ignored")
            return
        if method in _DIALOGS:
            self.asks.open(ident, self._dialog(ident, method, message), name="agent dialog")
        elif method in _FIRE:
            self._fires.put_nowait(message)
        else:
            self.log.warn("ui", "unknown extension_ui_request method; ignored", method=_str(method)[:80])

    @staticmethod
    def dialog_request(method: str, m: Event) -> Any:
        """The dialog for an agent's request, fitted into the dialogs' limits (uibus.infra.dialog_limits)."""
        kw: dict[str, Any] = {}
        timeout = limits.fit_timeout_ms(m.get("timeout"))
        if timeout is not None:
            kw["timeout_ms"] = timeout
        title = limits.fit_title(m.get("title"), method)
        if method == "select":
            return ext_pb.SelectRequest(title=title, options=limits.fit_options(m.get("options")), **kw)
        if method == "confirm":
            return ext_pb.ConfirmRequest(title=title, message=limits.fit_text(m.get("message")), **kw)
        if method == "input":
            if isinstance(m.get("placeholder"), str):
                kw["placeholder"] = limits.fit_text(m["placeholder"])
            return ext_pb.InputRequest(title=title, **kw)
        if isinstance(m.get("prefill"), str):
            kw["prefill"] = limits.fit_text(m["prefill"], limits.MAX_LONG_TEXT)
        return ext_pb.EditorRequest(title=title, **kw)

    def _answer(self, ident: str, **answer: Any) -> None:
        if ident in self._answered or not self.alive:
            return
        self._answered.add(ident)
        with contextlib.suppress(AgentError):
            self.process.send({"type": "extension_ui_response", "id": ident, **answer})

    async def _dialog(self, ident: str, method: str, message: Event) -> None:
        """One dialog at every UI of the session; its first answer back to the agent."""
        try:
            result = await self.ui.ask(self.dialog_request(method, message))
        except asyncio.CancelledError:  # its turn was cancelled or the process went
            self._answer(ident, cancelled=True)
            raise
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:  # cannot be shown: the agent must go on
            self.log.warn("ui", "agent dialog refused", error=str(exc))
            self._answer(ident, cancelled=True)
            return
        outcome = result.outcome
        if outcome == ext_pb.DIALOG_OUTCOME_ANSWERED:
            if method == "confirm":
                self._answer(ident, confirmed=result.confirmed)
            else:
                self._answer(ident, value=result.value)
        elif outcome != ext_pb.DIALOG_OUTCOME_TIMED_OUT:  # a timeout the agent resolved itself
            self._answer(ident, cancelled=True)

    @staticmethod
    def fire_request(m: Event) -> Any:
        """The fire-and-forget request for an agent's, fitted into the limits as dialogs are."""
        method = m["method"]
        if method == "notify":
            return ext_pb.NotifyRequest(message=limits.fit_text(m.get("message")),
                                        notify_type=_NOTIFY.get(m.get("notifyType"), ext_pb.NOTIFY_TYPE_UNSPECIFIED))
        if method == "setStatus":
            request = ext_pb.SetStatusRequest(key=limits.fit_key(m.get("statusKey")))
            if isinstance(m.get("statusText"), str):
                request.text = limits.fit_text(m["statusText"])
            return request
        if method == "setWidget":
            return ext_pb.SetWidgetRequest(
                key=limits.fit_key(m.get("widgetKey")), lines=limits.fit_lines(m.get("widgetLines")),
                placement=_PLACEMENT.get(m.get("widgetPlacement"), ext_pb.WIDGET_PLACEMENT_UNSPECIFIED))
        if method == "setTitle":
            return ext_pb.SetTitleRequest(title=limits.fit_text(m.get("title"), limits.MAX_TITLE))
        return ext_pb.SetEditorTextRequest(text=limits.fit_text(m.get("text"), limits.MAX_LONG_TEXT))

    async def _fire_forever(self) -> None:
        """The fire-and-forget requests, in the agent's order (a status set then cleared stays cleared)."""
        while True:
            message = await self._fires.get()
            try:
                await self.ui.fire(self.fire_request(message))
            except Exception as exc:  # refused (bad field, a full store): logged, the agent goes on
                self.log.warn("ui", "agent UI request refused", method=_str(message.get("method")), error=str(exc))

    # ---- a turn ----

    async def _extension_command(self, line: str) -> bool:
        """Whether `/line` names an extension command (which pi runs before it answers the prompt,
        so the turn ends at the response), not a prompt template, a skill or a path such as
        `/usr/bin/true` (a model run, ending at agent_end). Asked of the agent each time
        (`get_commands`: extensions may add commands). Only a command the agent listed is one: an
        agent that cannot say, or lists none, gets a model prompt (whose turn waits for agent_end;
        taking it for a command ended the turn before its run and gave the run to no turn)."""
        name = line.split(None, 1)[0] if line.strip() else ""
        if not name:
            return False
        try:
            async with asyncio.timeout(self.options.start_timeout):
                reply = await self.command("get_commands")
        except (AgentError, TimeoutError):
            return False
        data = reply.get("data")
        commands = data.get("commands") if isinstance(data, dict) else None
        if not reply.get("success") or not isinstance(commands, list):
            return False
        return any(isinstance(c, dict) and c.get("name") == name and c.get("source") == "extension"
                   for c in commands)

    async def _run_followed(self, started: int) -> bool:
        """After a command's response: whether the prompt started a run after all (an agent that
        listed a command it then did not run, or one whose command starts a run). pi starts a
        prompt's run before it reads our next command, so `get_state` is the barrier: its answer
        comes after that run's `agent_start`, with `isStreaming` set."""
        try:
            async with asyncio.timeout(self.options.start_timeout):
                state = await self.command("get_state")
        except TimeoutError:
            return True  # cannot tell: wait for agent_end (bounded by the turn's deadline)
        data = state.get("data") if isinstance(state.get("data"), dict) else {}
        return self._runs_started != started or data.get("isStreaming") is True

    async def prepare(self, turn: Turn) -> None:
        self._command_turn = turn.text.startswith("/") and await self._extension_command(turn.text[1:])

    async def run_turn(self, turn: Turn, run: TurnRun) -> AsyncIterator[Piece]:
        view = _TurnView(self.ui)
        ident = f"uibus-{next(self._ids)}"
        is_command, responded = self._command_turn, False
        try:
            try:
                images = pi_images(turn, self.backend.spec.name)
            except AgentError:
                run.ended = True  # refused before anything was sent: no run to abort
                raise
            started = self._runs_started
            self.process.send({"type": "prompt", "message": turn.text, "id": ident, **images})
            while True:
                message = await run.next()
                kind = message.get("type")
                if kind == "response":
                    if message.get("id") != ident:
                        continue
                    if not message.get("success", False):
                        run.ended = True  # refused: no run to abort
                        raise AgentError(_str(message.get("error")) or "the agent refused the prompt")
                    responded = True
                    if is_command and not self.running and not await self._run_followed(started):
                        break  # pi ran the command before it answered, and no run followed
                    is_command = False  # a run is on: this turn is its, to agent_end
                    continue
                if kind == "agent_end":
                    run.ended = True
                    break
                for piece in view.event(kind, message):
                    yield piece
            if view.error:
                raise AgentError(view.error)
        finally:
            view.finish()
            if is_command and responded:  # nothing of it runs any more: nothing to abort
                run.ended = True

    def cancel_run(self) -> None:
        with contextlib.suppress(AgentError):
            self.process.send({"type": "abort"})
        self.run_started()  # until its agent_end: the next turn waits for it


class _TurnView(ClineView):
    """What one turn shows: MAXIMAL messages for the caller, Cline messages for the webviews."""

    def __init__(self, ui: SessionUi) -> None:
        super().__init__(ui)
        self.error = ""
        self.text_before = False  # text came in an earlier assistant message of this run
        self.text_here = False
        self._tools: dict[str, tuple[str, dict[str, Any]]] = {}  # toolCallId -> (name, args)

    def event(self, kind: Any, m: dict[str, Any]) -> list[Piece]:
        if kind == "message_update":
            return self._delta(m.get("assistantMessageEvent"))
        if kind == "message_start":
            if isinstance(m.get("message"), dict) and m["message"].get("role") == "assistant":
                self.text_before = self.text_before or self.text_here
                self.text_here = False
            return []
        if kind == "message_end":
            message = m.get("message")
            if isinstance(message, dict) and message.get("role") == "assistant" \
                    and message.get("stopReason") == "error":
                self.error = _str(message.get("errorMessage")) or "the model request failed"
            return []
        if kind == "tool_execution_start":
            return self._tool_start(m)
        if kind == "tool_execution_update":
            self._tool_output(m, _content_text(m.get("partialResult")), partial=True)
            return []
        if kind == "tool_execution_end":
            return self._tool_end(m)
        if kind == "auto_retry_end" and m.get("success") is False:
            self.error = _str(m.get("finalError")) or "the model request failed after retries"
        elif kind == "extension_error":
            return [chat_pb2.ChatMessage(type=_AGENT, text=f"extension error: {_str(m.get('error'))}",
                                         structure=_struct({"kind": "extension_error", **m}))]
        return []

    def _delta(self, event: Any) -> list[Piece]:
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "text_delta":
            delta = _str(event.get("delta"))
            pieces: list[Piece] = []
            if not self.text_here and self.text_before and delta:
                pieces.append("\n\n")  # the next assistant message of the run
            self.text_here = self.text_here or bool(delta)
            if delta:
                pieces.append(delta)
            return pieces
        if kind == "thinking_delta":
            delta = _str(event.get("delta"))
            self.show("thinking", ui_pb2.REASONING, self.shown("thinking") + delta, partial=True)
            return [chat_pb2.ChatMessage(type=_AGENT, text=delta, structure=_struct({"kind": "thinking"}))]
        if kind == "thinking_end":
            content = event.get("content")
            self.show("thinking", ui_pb2.REASONING, _str(content) if isinstance(content, str) else
                      self.shown("thinking"), partial=False)
        return []

    def _tool_start(self, m: dict[str, Any]) -> list[Piece]:
        ident, name = _str(m.get("toolCallId")), _str(m.get("toolName"))
        args = m.get("args") if isinstance(m.get("args"), dict) else {}
        self._tools[ident] = (name, args)
        if name == "bash":
            self.show(f"command {ident}", ui_pb2.COMMAND_SAY, _str(args.get("command")), partial=False)
        else:
            self.show(f"tool {ident}", ui_pb2.TOOL_SAY, pi_tool(name, args, None), partial=True)
        return [chat_pb2.ChatMessage(type=_AGENT, text=f"{name} {json.dumps(args, default=str)[:2000]}",
                                     structure=_struct({"kind": "tool_start", "tool": name, "tool_call_id": ident,
                                                        "args": args}))]

    def _tool_output(self, m: dict[str, Any], output: str, *, partial: bool) -> None:
        ident = _str(m.get("toolCallId"))
        name, args = self._tools.get(ident, (_str(m.get("toolName")), {}))
        if name == "bash":
            self.show(f"output {ident}", ui_pb2.COMMAND_OUTPUT_SAY, output, partial=partial)
        else:
            self.show(f"tool {ident}", ui_pb2.TOOL_SAY, pi_tool(name, args, output), partial=partial)

    def _tool_end(self, m: dict[str, Any]) -> list[Piece]:
        ident = _str(m.get("toolCallId"))
        output = _content_text(m.get("result"))
        self._tool_output(m, output, partial=False)
        name, _ = self._tools.pop(ident, (_str(m.get("toolName")), {}))
        is_error = m.get("isError") is True
        return [chat_pb2.ChatMessage(type=_TOOL_RESULT, text=output, structure=_struct(
            {"kind": "tool_end", "tool": name, "tool_call_id": ident, "is_error": is_error}))]
