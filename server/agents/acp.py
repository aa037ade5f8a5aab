"""`backend = "acp"`: an Agent Client Protocol agent (Claude Code's ACP adapter, Gemini CLI's ACP
mode, codex-acp, any agent built on `@agentclientprotocol/sdk`), hosted per session; uibus is the
ACP *client*.

ACP is JSON-RPC 2.0 over the agent's stdio, one message per line. This module is only ACP's
mapping: uibus.agents.stdio runs the process (options, its group, framing, bounds, SIGTERM then
SIGKILL), uibus.agents.jsonrpc matches requests and responses, uibus.agents.turns runs the turns
(queue, deadline, waiting for a cancelled prompt) and owns the permission dialogs. Per (uibus
session, agent) one process and one ACP session:

* start: `initialize` (protocol version 1; client capabilities: no `fs`, no `terminal` — an agent
  uses its own tools, and uibus never reads or writes files or runs commands for a request), then
  `authenticate` if the agent lists methods and the config names one of them (`auth_method`), else
  `auth/status` where the agent answers it (unauthenticated: the turn's error, naming the operator's
  option `login`; a terminal sign-in method is never run, uibus.agents.acp_access), then
  `session/new` with the configured `cwd` and — when the agent can speak MCP over HTTP — uibus's own
  `/mcp` (with `x-uibus-session` and the token), so the agent gets `ask_user`, `notify_user` and
  the other agents as tools; with option `resume` (default true) the `sessionId` and `cwd` are
  the conversation's handle (uibus.domain.agent_handles), and a later process of the same uibus
  session reopens it with `session/load` (or `session/resume`) instead of `session/new`, its
  replay dropped;
* an editor's `additionalDirectories` ride on its turns (metadata, uibus.agents.acp_access): checked
  against the agent's configuration and given to it by `session/resume` (or `session/load`) of the
  open session with the full list, when it advertises `sessionCapabilities.additionalDirectories`;
* uibus never sends `logout`: the agent's credentials are the operator's, shared by every session
  (an editor's `logout` ends the editor's own sign-in with uibus, uibus.edge.editors.account);
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

Why not the protocol's Python SDK (`agent-client-protocol`): its stdio connection reassembles a
line of any length (a 200 MiB line passed with a 1 MiB reader limit), spawns the agent outside a
process group with a trimmed environment and leaves its stderr pipe unread, logs a traceback per
hostile line with no rate limit, and costs about 26 µs per `session/update` end to end (a task per
message, pydantic validation) against about 3 µs here; see the issue's closing note for the figures.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

from uibus.agents import AgentError, Piece, SessionUi, Stop, Turn, option
from uibus.agents import acp_access as access
from uibus.agents.attachments import acp_prompt, image_markdown
from uibus.agents.diffs import unified
from uibus.agents.jsonrpc import JsonRpcSession
from uibus.agents.stdio import StdioBackend
from uibus.agents.stdio import text as _str
from uibus.agents.steer import AcpSteering
from uibus.agents.turns import TurnRun
from uibus.agents.views import AGENT, TOOL_RESULT, ClineView, acp_tool, message
from uibus.infra import dialog_limits as limits
from uibus.infra.errors import InvalidArgument, ResourceExhausted, Unavailable
from uibus.infra.peer import Method
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

log = logging.getLogger("uibus.agents.acp")

PROTOCOL_VERSION = 1
_UPDATES = frozenset({"agent_message_chunk", "agent_thought_chunk", "tool_call", "tool_call_update", "plan",
                      "user_message_chunk", "available_commands_update", "current_mode_update",
                      "config_option_update", "session_info_update", "usage_update"})
_CANCELLED: dict[str, Any] = {"outcome": {"outcome": "cancelled"}}  # a permission request's, unanswered
_ANSWERED: dict[str, Any] = {"uibus": "the prompt was answered"}  # a turn's queue marker, compared by identity


def _content(blocks: Any) -> str:
    """The text of an ACP ContentBlock, or of a list of ToolCallContent."""
    if isinstance(blocks, dict):
        if blocks.get("type") == "text":
            return _str(blocks.get("text"))
        if blocks.get("type") == "content":
            return _content(blocks.get("content"))
        if blocks.get("type") == "image":  # shown inline (markdown) when small; named otherwise
            return image_markdown(_str(blocks.get("mimeType")), _str(blocks.get("data")))
        if blocks.get("type") == "diff":  # a real line diff (old text null: a new file)
            old = blocks.get("oldText")
            return unified(_str(blocks.get("path")), _str(old) if old is not None else None,
                           _str(blocks.get("newText"))) + "\n"
        return ""
    if isinstance(blocks, list):
        return "".join(_content(b) for b in blocks)
    return ""


class AcpAgent(StdioBackend):
    """The configured ACP agent: options checked at start-up, processes counted."""

    extra_options = frozenset({"auth_method", "offer_mcp", "login"})

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.auth_method: str = option(self.spec, "auth_method", str, "")
        self.offer_mcp: bool = option(self.spec, "offer_mcp", bool, True)
        # How an operator signs the agent in on the host (shown when it needs a sign-in; never run).
        self.login: list[str] = option(self.spec, "login", list, [])
        if not all(isinstance(a, str) and a for a in self.login):
            raise ValueError(f"agent {self.spec.name!r}: option login must be a list of non-empty strings "
                             "(the command an operator runs to sign the agent in; uibus never runs it)")
        # Whether its initialize advertised sessionCapabilities.additionalDirectories (None: not started yet).
        self.seen_additional_directories: bool | None = None

        # What the agent's last `initialize` said it takes with a prompt: one program answers every
        # session alike, so any of its processes tells (unknown until the first one started).
        self.seen_prompt_capabilities: dict[str, bool] | None = None

    def session(self, ui: SessionUi) -> AcpSession:
        return AcpSession(self, ui)

    def prompt_capabilities(self) -> dict[str, bool] | None:
        return self.seen_prompt_capabilities

    def roots(self) -> list[str]:
        """The directories an editor's additionalDirectories may name (or lie in): see uibus.agents.acp_access."""
        box = self.options.isolation.sandbox
        shown = [self.options.cwd] if self.options.cwd and self.workspace_repo is None else []
        extra = option(self.spec, "read_only", list, []) if box is not None else []
        return [*shown, *(os.path.normpath(os.path.expanduser(p)) for p in extra)]

    def directories(self) -> dict[str, Any] | None:
        return {"roots": self.roots(), "supported": self.seen_additional_directories}


class AcpSession(JsonRpcSession):
    """One ACP agent process and its one ACP session, for one uibus session."""

    logger = log
    run_noun = "prompt"
    handshake_says = "finish initialize/session/new"
    agent_kind = "an ACP agent"

    def __init__(self, backend: AcpAgent, ui: SessionUi) -> None:
        super().__init__(backend, ui)
        self.acp = backend
        self.session_id = ""
        self.capabilities: dict[str, Any] = {}
        self.cwd = ""
        self.mcp_servers: list[dict[str, Any]] = []
        self.directories: list[str] = []  # the additionalDirectories the agent holds for this conversation
        self._terminal: list[dict[str, Any]] = []  # the terminal sign-in methods it offers (never run)
        self.steering = AcpSteering(self)  # modes, models, commands, conversations (the sessions API's)
        self._prompt: asyncio.Future[Any] | None = None  # the running turn's session/prompt

    # ---- messages ----

    def methods(self) -> Mapping[str, Method]:
        return {"session/request_permission": self._ask_permission}

    def cancelled_result(self, method: str, params: dict[str, Any]) -> Any:
        """A permission request whose turn was cancelled (or whose process went) is answered
        `cancelled`, as the protocol requires."""
        return _CANCELLED if method == "session/request_permission" else None

    def on_notification(self, method: Any, params: dict[str, Any]) -> None:
        if method == "session/update":
            if params.get("sessionId") == self.session_id:
                self.steering.seen_update(params.get("update"))  # modes, commands, title: kept between turns too
                self.deliver(params)
            return
        super().on_notification(method, params)

    # ---- lifecycle ----

    async def handshake(self) -> None:
        init = await self.call("initialize", {
            "protocolVersion": PROTOCOL_VERSION,
            "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
            "clientInfo": {"name": "uibus", "version": "1"}})
        if not isinstance(init, dict) or init.get("protocolVersion") != PROTOCOL_VERSION:
            version = init.get("protocolVersion") if isinstance(init, dict) else None
            raise AgentError(f"the agent speaks ACP protocol version {version!r}; uibus speaks {PROTOCOL_VERSION}")
        self.capabilities = init.get("agentCapabilities") or {}
        accepts = self.capabilities.get("promptCapabilities")
        accepts = accepts if isinstance(accepts, dict) else {}
        self.acp.seen_prompt_capabilities = {k: accepts.get(k) is True for k in ("image", "audio", "embeddedContext")}
        sessions = self.capabilities.get("sessionCapabilities") or {}
        self.acp.seen_additional_directories = isinstance(sessions.get("additionalDirectories"), dict)
        await self._sign_in(init)
        servers = []
        mcp = self.ui.mcp_endpoint(self.acp.spec.name) if self.acp.offer_mcp else None
        if mcp is not None and (self.capabilities.get("mcpCapabilities") or {}).get("http"):
            url, headers = mcp
            servers.append({"type": "http", "name": "uibus", "url": url,
                            "headers": [{"name": k, "value": v} for k, v in headers.items()]})
        cwd = self.process.cwd or os.getcwd()  # its workspace, else option cwd
        self.cwd, self.mcp_servers = cwd, servers
        if not (self.options.resume and self.ui.handle and await self._resume(self.ui.handle, servers)):
            try:
                created = await self.call("session/new", {"cwd": cwd, "mcpServers": servers})
            except AgentError as exc:
                if str(exc).endswith(f"(JSON-RPC {access.AUTH_REQUIRED})"):  # auth_required
                    raise access.signin_problem(self.acp.spec.name, self._terminal, self.acp.login,
                                                f"session/new: {exc}") from None
                raise
            if not isinstance(created, dict) or not isinstance(created.get("sessionId"), str):
                raise AgentError("session/new did not return a sessionId")
            self.session_id = created["sessionId"]
            self.steering.seen_session(created)
            await self.keep_conversation()

    async def _sign_in(self, init: dict[str, Any]) -> None:
        """`authenticate` with option auth_method (an agent-run method it offers); else, where the agent
        answers `auth/status`, a clear error before any session when it says it is not signed in.
        Terminal methods are never run (uibus.agents.acp_access): the operator signs the agent in."""
        methods, self._terminal = access.auth_methods(init)
        wanted = self.acp.auth_method
        if wanted:
            if wanted not in methods:
                raise AgentError(f"option auth_method {wanted!r} is not one the agent offers ({methods}; terminal "
                                 f"methods {[m['id'] for m in self._terminal]} are never run by uibus)")
            await self.call("authenticate", {"methodId": wanted})
            return
        if isinstance((self.capabilities.get("auth") or {}).get("status"), dict):
            status = await self.call("auth/status", {})
            state = status.get("state") if isinstance(status, dict) else None
            if state == "unauthenticated":
                raise access.signin_problem(self.acp.spec.name, self._terminal, self.acp.login,
                                            "its auth/status says unauthenticated")

    async def _set_roots(self, wanted: list[str]) -> None:
        """The editor's additionalDirectories for this conversation, checked against the rule with links
        resolved, then given to the agent the way ACP changes them on an open session: `session/resume`
        (or `session/load`, its replay dropped) of the same session with the full new list."""
        name = self.acp.spec.name
        if wanted and not self.acp.seen_additional_directories:
            raise AgentError(f"agent {name!r} takes no additionalDirectories (its initialize advertises no "
                             "sessionCapabilities.additionalDirectories): open the session without them")
        try:
            access.check_directories(name, wanted, self.acp.roots(), self.acp.hidden, resolve=True)
        except InvalidArgument as exc:
            raise AgentError(str(exc)) from None
        params = {"sessionId": self.session_id, "cwd": self.cwd, "mcpServers": self.mcp_servers,
                  "additionalDirectories": wanted}
        if isinstance((self.capabilities.get("sessionCapabilities") or {}).get("resume"), dict):
            await self.call("session/resume", params)
        elif self.capabilities.get("loadSession") is True:
            sid, self.session_id = self.session_id, ""  # its replay names no session of ours: dropped
            try:
                await self.call("session/load", params)
            finally:
                self.session_id = sid
        else:
            raise AgentError(f"agent {name!r} cannot change the directories of an open conversation (it offers "
                             "neither session/resume nor session/load)")
        self.directories = wanted

    async def keep_conversation(self) -> None:
        """With option resume, keeps the ACP session now open, so the next process resumes it."""
        if self.options.resume:
            await self.ui.keep_handle({"sessionId": self.session_id, "cwd": self.cwd})

    async def _resume(self, handle: dict[str, Any], servers: list[dict[str, Any]]) -> bool:
        """Picks up the conversation of an earlier process: `session/load` where the agent offers it
        (it fails at once for a conversation the agent no longer has), else `session/resume`. What
        the agent replays while loading names a session id that is not ours yet, so it reaches no
        turn and no webview: the session's UIs already hold the transcript. False (the UIs told
        why) when it cannot: a new conversation starts."""
        sid, cwd = handle.get("sessionId"), handle.get("cwd")
        if not isinstance(sid, str) or not sid or not isinstance(cwd, str):
            await self.ui.started_fresh("its stored conversation handle is not usable")
            return False
        if cwd != (self.process.cwd or os.getcwd()):  # the agent must work where the config says
            await self.ui.started_fresh(f"its working directory changed from {cwd} (option cwd)")
            return False
        if self.capabilities.get("loadSession") is True:
            method = "session/load"
        elif isinstance((self.capabilities.get("sessionCapabilities") or {}).get("resume"), dict):
            method = "session/resume"
        else:
            await self.ui.started_fresh("the agent offers neither session/load nor session/resume")
            return False
        try:
            loaded = await self.call(method, {"sessionId": sid, "cwd": cwd, "mcpServers": servers})
        except AgentError as exc:
            if not self.alive:
                raise
            await self.ui.started_fresh(f"{method} failed: {exc}")
            return False
        self.session_id = sid
        if isinstance(loaded, dict):  # its modes and models, as session/new would have said them
            self.steering.seen_session(loaded)
        self.ui.resumed()
        return True

    # ---- permissions ----

    @staticmethod
    def permission_dialog(params: dict[str, Any]) -> tuple[ext_pb.SelectRequest, dict[str, str]]:
        """The select a permission request is shown as, and option label -> optionId."""
        call = params.get("toolCall") if isinstance(params.get("toolCall"), dict) else {}
        title = limits.fit_title(call.get("title"), "The agent asks for permission")
        labels: dict[str, str] = {}
        for o in params.get("options") or []:
            if isinstance(o, dict) and isinstance(o.get("optionId"), str):
                label = limits.fit_text(o.get("name") or o["optionId"], limits.MAX_OPTION - 40)
                if label in labels:
                    label = f"{label} ({o['optionId']})"
                labels[label] = o["optionId"]
        return ext_pb.SelectRequest(title=title, options=list(labels)[:limits.MAX_OPTIONS]), labels

    async def _ask_permission(self, params: dict[str, Any]) -> dict[str, Any]:
        """One dialog at every UI of the session; the answer is the agent's outcome (a cancel of
        it is answered `cancelled` by the peer: `cancelled_result`)."""
        request, labels = self.permission_dialog(params)
        try:
            result = await self.ui.ask(request)
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:
            self.log.warn("ui", "permission dialog refused", error=str(exc))
            return _CANCELLED
        if result.outcome == ext_pb.DIALOG_OUTCOME_ANSWERED and result.value in labels:
            return {"outcome": {"outcome": "selected", "optionId": labels[result.value]}}
        return _CANCELLED

    # ---- a turn ----

    async def run_turn(self, turn: Turn, run: TurnRun) -> AsyncIterator[Piece]:
        view = _AcpView(self.ui)
        try:
            blocks = acp_prompt(turn, self.capabilities, self.acp.spec.name)  # text, images, files
            wanted = access.requested(turn.metadata)  # the editor's additionalDirectories, if it named them
            if wanted is not None and wanted != self.directories:
                await self._set_roots(wanted)
        except AgentError:
            run.ended = True  # refused before anything was sent: no prompt to cancel
            raise
        prompt = self._prompt = self.request("session/prompt", {"sessionId": self.session_id, "prompt": blocks})
        prompt.add_done_callback(lambda f: run.put(_ANSWERED) or
                                 (f.cancelled() or f.exception()))  # retrieved: a cancelled turn never reads it
        try:
            while True:
                item = await run.next()
                if item is _ANSWERED:
                    run.ended = True
                    break
                for piece in view.update(item.get("update"), self.log):
                    yield piece
            result = prompt.result()  # a JSON-RPC error raises here (AgentError)
            reason = result.get("stopReason") if isinstance(result, dict) else None
            if isinstance(reason, str) and reason:
                yield Stop(reason[:40])  # structured, also for a refusal (whose answer is the error below)
            if reason == "refusal":
                raise AgentError("the agent refused to continue (stopReason refusal)")
            if reason not in ("end_turn", "max_tokens", "max_turn_requests", "cancelled"):
                self.log.warn("stop", "unknown stopReason", stop_reason=_str(reason)[:80])
        finally:
            view.finish()

    def cancel_run(self) -> None:
        """The protocol's cancel (every permission request was answered `cancelled` by then); the
        next turn waits for the cancelled prompt's response."""
        self.notify("session/cancel", {"sessionId": self.session_id})
        self.run = self._prompt


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
            self.show(f"tool {ident}", ui_pb2.TOOL_SAY, acp_tool(call), partial=not done)
        if done:
            pieces.append(message(TOOL_RESULT, call["output"], kind="tool_end", tool=call["kind"], tool_call_id=ident,
                                  status=call["status"], is_error=call["status"] == "failed"))
        return pieces
