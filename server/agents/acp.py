"""`backend = "acp"`: an Agent Client Protocol agent (Claude Code's ACP adapter, Gemini CLI's ACP
mode, codex-acp, any agent built on `@agentclientprotocol/sdk`), hosted per session; uibus is the
ACP *client*.

ACP is JSON-RPC 2.0 over the agent's stdio, one message per line (uibus.agents.stdio runs the
process: options, its group, framing, bounds, SIGTERM then SIGKILL). Per (uibus session, agent)
one process and one ACP session:

* start: `initialize` (protocol version 1; client capabilities: no `fs`, no `terminal` — an agent
  uses its own tools, and uibus never reads or writes files or runs commands for a request), then
  `authenticate` if the agent lists methods and the config names one of them (`auth_method`), then
  `session/new` with the configured `cwd` and — when the agent can speak MCP over HTTP — uibus's own
  `/mcp` (with `x-uibus-session` and the token), so the agent gets `ask_user`, `notify_user` and
  the other agents as tools;
* a turn is one `session/prompt`; its `stopReason` ends it (`refusal` is the turn's error, as are
  JSON-RPC errors); `session/update` notifications are its pieces and its webview messages:
  `agent_message_chunk` → reply text, `agent_thought_chunk` → REASONING, `tool_call` and
  `tool_call_update` → COMMAND_SAY + COMMAND_OUTPUT_SAY for `execute`, TOOL_SAY (ClineSayTool JSON)
  for the others, `plan` → an INFO message with the plan as a markdown task list; anything else is logged
  once (rate-limited) and ignored;
* cancelling the call sends `session/cancel`, answers every pending permission request
  `cancelled` (as the protocol requires), and the next turn waits, bounded, for the cancelled
  prompt's response;
* `session/request_permission` (agent → client) is a dialog at every UI of the session, through the
  same `Dialogs` as pi's: a select whose options are the agent's option names; the answer is the
  chosen `optionId`, a dismissal or a timeout is `cancelled`. Other agent → client requests
  (`fs/*`, `terminal/*`, anything unknown) get JSON-RPC "method not found": uibus offered none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from uibus.agents import AgentError, Piece, SessionUi, Turn, option
from uibus.agents.stdio import StdioBackend, StdioSession
from uibus.agents.stdio import text as _str
from uibus.agents.views import AGENT, TOOL_RESULT, ClineView, cut, message
from uibus.domain import dialog_checks as limits
from uibus.errors import InvalidArgument, ResourceExhausted, Unavailable
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

log = logging.getLogger("uibus.agents.acp")

PROTOCOL_VERSION = 1
_UPDATES = frozenset({"agent_message_chunk", "agent_thought_chunk", "tool_call", "tool_call_update", "plan",
                      "user_message_chunk", "available_commands_update", "current_mode_update",
                      "config_option_update", "session_info_update", "usage_update"})
_QUIET_UPDATES = frozenset({"user_message_chunk", "available_commands_update", "current_mode_update",
                            "config_option_update", "session_info_update", "usage_update"})
# ACP tool kinds as Cline's ClineSayTool names them (execute is a command of its own).
_CLINE_TOOLS = {"read": "readFile", "edit": "editedExistingFile", "delete": "editedExistingFile",
                "move": "editedExistingFile", "search": "searchFiles", "fetch": "webFetch"}
_METHOD_NOT_FOUND = -32601
_TIMED_OUT: dict[str, Any] = {"uibus": "the turn timed out"}  # a queue marker, compared by identity


def _content(blocks: Any) -> str:
    """The text of an ACP ContentBlock, or of a list of ToolCallContent."""
    if isinstance(blocks, dict):
        if blocks.get("type") == "text":
            return _str(blocks.get("text"))
        if blocks.get("type") == "content":
            return _content(blocks.get("content"))
        if blocks.get("type") == "diff":
            return f"--- {_str(blocks.get('path'))}\n-{_str(blocks.get('oldText'))}\n+{_str(blocks.get('newText'))}"
        return ""
    if isinstance(blocks, list):
        return "".join(_content(b) for b in blocks)
    return ""


class AcpAgent(StdioBackend):
    """The configured ACP agent: options checked at start-up, processes counted."""

    extra_options = frozenset({"auth_method", "offer_mcp"})

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.auth_method: str = option(self.spec, "auth_method", str, "")
        self.offer_mcp: bool = option(self.spec, "offer_mcp", bool, True)

    def session(self, ui: SessionUi) -> AcpSession:
        return AcpSession(self, ui)


class AcpSession(StdioSession):
    """One ACP agent process and its one ACP session, for one uibus session."""

    logger = log

    def __init__(self, backend: AcpAgent, ui: SessionUi) -> None:
        super().__init__(backend, ui)
        self.session_id = ""
        self.capabilities: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._turn: asyncio.Queue[dict[str, Any] | None] | None = None
        self._permissions: dict[Any, asyncio.Task[None]] = {}  # by the agent's request id
        self._prompt_open: asyncio.Future[Any] | None = None  # a cancelled prompt not answered yet

    # ---- JSON-RPC ----

    def _reply(self, ident: Any, result: Any = None, error: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": ident}
        if error is not None:
            body["error"] = error
        else:
            body["result"] = result if result is not None else {}
        with contextlib.suppress(AgentError):
            self.process.send(body)

    def _call(self, method: str, params: dict[str, Any]) -> asyncio.Future[Any]:
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[ident] = future
        future.add_done_callback(lambda _f: self._calls.pop(ident, None))
        self.process.send({"jsonrpc": "2.0", "id": ident, "method": method, "params": params})
        return future

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        """A request to the agent and its result; its JSON-RPC error as AgentError."""
        future = self._call(method, params)
        await self.process.drain()
        return await future

    def on_message(self, m: dict[str, Any]) -> None:
        method = m.get("method")
        if method is None:  # a response to one of ours
            future = self._calls.get(m.get("id"))  # type: ignore[arg-type]
            if future is not None and not future.done():
                error = m.get("error")
                if isinstance(error, dict):
                    future.set_exception(AgentError(f"{_str(error.get('message')) or 'error'} "
                                                    f"(JSON-RPC {error.get('code')})"))
                else:
                    future.set_result(m.get("result"))
            return
        if "id" in m:  # the agent asks something of the client
            if method == "session/request_permission":
                self._permission(m["id"], m.get("params") or {})
            else:
                self.log.warn("method", "agent request uibus does not offer; answered method-not-found",
                              method=_str(method)[:80])
                self._reply(m["id"], error={"code": _METHOD_NOT_FOUND, "message": f"{method} is not offered"})
            return
        if method == "session/update":
            params = m.get("params")
            if self._turn is not None and isinstance(params, dict) and params.get("sessionId") == self.session_id:
                self._turn.put_nowait(params)
            return
        self.log.warn("unknown", "unknown agent notification; ignored", method=_str(method)[:80])

    def on_exit(self, why: str) -> None:
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(AgentError(why))
        if self._turn is not None:
            self._turn.put_nowait(None)
        for task in self._permissions.values():
            task.cancel()

    # ---- lifecycle ----

    async def start(self) -> None:
        await self.process.start()
        try:
            async with asyncio.timeout(self.options.start_timeout):
                await self._handshake()
        except TimeoutError:
            raise AgentError(f"the agent did not finish initialize/session/new within "
                             f"{self.options.start_timeout:g} s (option start_timeout_seconds); is command an "
                             "ACP agent?") from None

    async def _handshake(self) -> None:
        init = await self.call("initialize", {
            "protocolVersion": PROTOCOL_VERSION,
            "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
            "clientInfo": {"name": "uibus", "version": "1"}})
        if not isinstance(init, dict) or init.get("protocolVersion") != PROTOCOL_VERSION:
            version = init.get("protocolVersion") if isinstance(init, dict) else None
            raise AgentError(f"the agent speaks ACP protocol version {version!r}; uibus speaks {PROTOCOL_VERSION}")
        self.capabilities = init.get("agentCapabilities") or {}
        methods = [m.get("id") for m in init.get("authMethods") or [] if isinstance(m, dict)]
        wanted = self.backend.auth_method
        if wanted:
            if wanted not in methods:
                raise AgentError(f"option auth_method {wanted!r} is not one the agent offers ({methods})")
            await self.call("authenticate", {"methodId": wanted})
        servers = []
        mcp = self.ui.mcp_endpoint(self.backend.spec.name) if self.backend.offer_mcp else None
        if mcp is not None and (self.capabilities.get("mcpCapabilities") or {}).get("http"):
            url, headers = mcp
            servers.append({"type": "http", "name": "uibus", "url": url,
                            "headers": [{"name": k, "value": v} for k, v in headers.items()]})
        created = await self.call("session/new", {"cwd": self.options.cwd or os.getcwd(), "mcpServers": servers})
        if not isinstance(created, dict) or not isinstance(created.get("sessionId"), str):
            raise AgentError("session/new did not return a sessionId")
        self.session_id = created["sessionId"]

    def tasks(self) -> list[asyncio.Task[Any]]:
        return list(self._permissions.values())

    # ---- permissions ----

    def _permission(self, ident: Any, params: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._ask_permission(ident, params))
        self._permissions[ident] = task
        task.add_done_callback(lambda _t: self._permissions.pop(ident, None))

    @staticmethod
    def permission_dialog(params: dict[str, Any]) -> tuple[ext_pb.SelectRequest, dict[str, str]]:
        """The select a permission request is shown as, and option label -> optionId."""
        call = params.get("toolCall") if isinstance(params.get("toolCall"), dict) else {}
        title = cut(call.get("title") or "The agent asks for permission", limits.MAX_TITLE)
        labels: dict[str, str] = {}
        for o in params.get("options") or []:
            if isinstance(o, dict) and isinstance(o.get("optionId"), str):
                label = cut(o.get("name") or o["optionId"], limits.MAX_OPTION - 40)
                if label in labels:
                    label = f"{label} ({o['optionId']})"
                labels[label] = o["optionId"]
        return ext_pb.SelectRequest(title=title, options=list(labels)[:limits.MAX_OPTIONS]), labels

    async def _ask_permission(self, ident: Any, params: dict[str, Any]) -> None:
        request, labels = self.permission_dialog(params)
        try:
            result = await self.ui.ask(request)
        except asyncio.CancelledError:  # its turn was cancelled or the process went
            self._reply(ident, {"outcome": {"outcome": "cancelled"}})
            raise
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:
            self.log.warn("ui", "permission dialog refused", error=str(exc))
            self._reply(ident, {"outcome": {"outcome": "cancelled"}})
            return
        if result.outcome == ext_pb.DIALOG_OUTCOME_ANSWERED and result.value in labels:
            self._reply(ident, {"outcome": {"outcome": "selected", "optionId": labels[result.value]}})
        else:
            self._reply(ident, {"outcome": {"outcome": "cancelled"}})

    # ---- a turn ----

    async def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        if self._prompt_open is not None and not self._prompt_open.done():  # a cancelled turn's prompt
            try:
                async with asyncio.timeout(self.options.stop_timeout):
                    await asyncio.shield(self._prompt_open)
            except TimeoutError:
                self.process.kill()
                raise AgentError(f"the agent did not end its cancelled prompt within {self.options.stop_timeout:g}"
                                 " s (option stop_timeout_seconds); it was stopped, the next turn starts a new one") \
                    from None
            except AgentError:
                pass
        self._prompt_open = None
        if not self.alive:
            raise AgentError(self.process.gone or "the agent process is not running")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        view = _AcpView(self.ui)
        self._turn = queue
        prompt = self._call("session/prompt", {"sessionId": self.session_id,
                                               "prompt": [{"type": "text", "text": turn.text}]})
        prompt.add_done_callback(lambda f: queue.put_nowait({"uibus": "answered"}) or
                                 (f.cancelled() or f.exception()))  # retrieved: a cancelled turn never reads it
        timer = asyncio.get_running_loop().call_later(self.options.turn_timeout, queue.put_nowait, _TIMED_OUT)
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is None:
                    raise AgentError(f"{self.process.gone} during the turn")
                if item is _TIMED_OUT:
                    raise AgentError(f"the turn did not end within {self.options.turn_timeout:g} s "
                                     "(option turn_timeout_seconds)")
                if item.get("uibus") == "answered":
                    ended = True
                    break
                for piece in view.update(item.get("update"), self.log):
                    yield piece
            result = prompt.result()  # a JSON-RPC error raises here (AgentError)
            reason = result.get("stopReason") if isinstance(result, dict) else None
            if reason == "refusal":
                raise AgentError("the agent refused to continue (stopReason refusal)")
            if reason not in ("end_turn", "max_tokens", "max_turn_requests", "cancelled"):
                self.log.warn("stop", "unknown stopReason", stop_reason=_str(reason)[:80])
        finally:
            timer.cancel()
            self._turn = None
            view.finish()
            if not ended:  # cancelled or failed in the middle: the protocol's cancel
                for task in list(self._permissions.values()):
                    task.cancel()  # each answered `cancelled` and closed at every UI
                if self.alive:
                    with contextlib.suppress(AgentError):
                        self.process.send({"jsonrpc": "2.0", "method": "session/cancel",
                                           "params": {"sessionId": self.session_id}})
                    self._prompt_open = prompt  # the next turn waits for its response


class _AcpView(ClineView):
    """One turn's session/update notifications as pieces and Cline messages."""

    def __init__(self, ui: SessionUi) -> None:
        super().__init__(ui)
        self._tools: dict[str, dict[str, Any]] = {}  # toolCallId -> what is known of the call

    def update(self, u: Any, rate_log: Any) -> list[Piece]:
        if not isinstance(u, dict):
            return []
        kind = u.get("sessionUpdate")
        if kind == "agent_message_chunk":
            piece = _content(u.get("content"))
            return [piece] if piece else []
        if kind == "agent_thought_chunk":
            delta = _content(u.get("content"))
            self.show("thinking", ui_pb2.REASONING, self.shown("thinking") + delta, partial=True)
            return [message(AGENT, delta, kind="thinking")]
        if kind in ("tool_call", "tool_call_update"):
            return self._tool(u, new=kind == "tool_call")
        if kind == "plan":
            entries = [e for e in u.get("entries") or [] if isinstance(e, dict)]
            checklist = "\n".join(  # markdown task list (the page renders INFO as markdown)
                f"- [{'x' if e.get('status') == 'completed' else ' '}] {_str(e.get('content'))}"
                f"{' *(in progress)*' if e.get('status') == 'in_progress' else ''}" for e in entries)
            self.show("plan", ui_pb2.INFO, f"Plan\n\n{checklist}", partial=True)
            return [message(AGENT, checklist, kind="plan", entries=entries)]
        if kind not in _UPDATES:
            rate_log.warn("update", "unknown session/update kind; ignored", update=_str(kind)[:80])
        return []

    def _tool(self, u: dict[str, Any], *, new: bool) -> list[Piece]:
        ident = _str(u.get("toolCallId"))
        call = self._tools.setdefault(ident, {"title": "", "kind": "other", "status": "pending", "output": ""})
        for key in ("title", "kind", "status", "rawInput", "locations"):
            if u.get(key) is not None:
                call[key] = u[key]
        if u.get("content") is not None:
            call["output"] = _content(u.get("content"))
        done = call["status"] in ("completed", "failed")
        pieces: list[Piece] = []
        if new:
            pieces.append(message(AGENT, f"{_str(call['kind'])}: {_str(call['title'])}", kind="tool_start",
                                  tool=call["kind"], tool_call_id=ident, title=call["title"],
                                  status=call["status"]))
        if call["kind"] == "execute":
            raw = call.get("rawInput") if isinstance(call.get("rawInput"), dict) else {}
            command = _str(raw.get("command")) or _str(call["title"])
            if new:
                self.show(f"command {ident}", ui_pb2.COMMAND_SAY, command, partial=False)
            if call["output"] or done:
                self.show(f"output {ident}", ui_pb2.COMMAND_OUTPUT_SAY, call["output"], partial=not done)
        else:
            self.show(f"tool {ident}", ui_pb2.TOOL_SAY, self.cline_tool(call), partial=not done)
        if done:
            pieces.append(message(TOOL_RESULT, call["output"], kind="tool_end", tool=call["kind"], tool_call_id=ident,
                                  status=call["status"], is_error=call["status"] == "failed"))
        return pieces

    @staticmethod
    def cline_tool(call: dict[str, Any]) -> str:
        """Cline's ClineSayTool JSON for an ACP tool call."""
        locations = call.get("locations") if isinstance(call.get("locations"), list) else []
        path = next((_str(loc.get("path")) for loc in locations if isinstance(loc, dict)), "")
        tool = _CLINE_TOOLS.get(call["kind"], _str(call["kind"]))
        body: dict[str, Any] = {"tool": tool, "path": path or _str(call["title"])}
        if call["output"]:
            body["diff" if call["kind"] == "edit" else "content"] = call["output"]
        if call["status"] == "failed":
            body["error"] = True
        return json.dumps(body)
