"""What the served CodeBolt actions do, on the shared session store and bus.

* chatEvent: messages go to the session's chat history (the domain's `ChatHistory`, so
  neuro-san chat and CodeBolt share one conversation) and to subscribeToPartialMessage as
  finished ClineMessages; confirmations, notices and process status are extension-UI dialogs and
  requests (the domain's `Dialogs`), so any extension-UI client answers them; waitforReply waits
  for the next user entry of the session's chat history (CodeBoltService.SendUserMessage or a
  StreamingChat turn), announced on the bus by `ChatHistory.append`.
* stateEvent / memoryEvent: one store key per entry (`codebolt/agent/<key>`,
  `codebolt/project/<key>`, `codebolt/memory/<key>`), so a write never reads-modifies-writes and
  two agents writing different keys cannot lose each other's update.

Each action returns a `Reply`; the connection (uibus.edge.codebolt.gateway) sends it. A failure the
agent should hear about is a domain error, which the handler pipeline turns into a success:false
reply carrying its status code, exactly as it would on any other transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from uibus.domain.core import Core
from uibus.domain.history import MAX_HISTORY
from uibus.edge.codebolt import protocol
from uibus.edge.codebolt.protocol import Request
from uibus.infra.bus import Subscription
from uibus.infra.errors import InvalidArgument, ResourceExhausted, UibusError, Unavailable
from uibus.infra.json_input import dump_json
from uibus.infra.tasks import cancel_all
from uibus.pb.cline import ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as xpb

SOURCE = "codebolt"
MAX_TEXT = 64 * 1024
MAX_KEY = 256
MAX_KEYS = 1000  # entries per state/memory namespace and session
# Bytes per namespace and session (keys and values as JSON): what getApplicationState sends back,
# both state namespaces three times over (codeboltjs reads `data`, the fields and `state`), stays
# under the 1 MiB frame limit; and one session cannot make the server hold or copy much.
MAX_STATE_BYTES = 128 * 1024
DEFAULT_BUTTONS = ("Yes", "No")
HISTORY_DEFAULT = 1000
STATUS_KEY = "codebolt"
_STATUS_TEXT = {"processStarted": "running", "processStoped": "stopped", "processFinished": "finished"}
AGENT_PREFIX = "codebolt/agent/"
PROJECT_PREFIX = "codebolt/project/"
MEMORY_PREFIX = "codebolt/memory/"


@dataclass(slots=True)
class Reply:
    success: bool
    data: Any = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # codeboltjs-facing top-level fields
    reply_type: str = ""  # overrides the request's reply type (feedbackResponse)


def fail(error: str) -> Reply:
    return Reply(False, error=error)


class BadRequest(InvalidArgument):
    """A field of the action's payload is missing or of the wrong kind."""


@dataclass(slots=True)
class Context:
    core: Core
    session: str


def _text(fields: dict[str, Any], *names: str, required: bool = True) -> str:
    for name in names:
        value = fields.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRequest(f"`{name}` must be a string, got {type(value).__name__}")
        if len(value) > MAX_TEXT:
            raise BadRequest(f"`{name}` is {len(value)} characters long; the limit is {MAX_TEXT}")
        if value or not required:
            return value
    if required:
        raise BadRequest(f"`{names[0]}` is required (a non-empty string)")
    return ""


def _key(fields: dict[str, Any]) -> str:
    key = fields.get("key")
    if not isinstance(key, str) or not key:
        raise BadRequest("`key` is required (a non-empty string)")
    if len(key) > MAX_KEY:
        raise BadRequest(f"`key` is {len(key)} characters long; the limit is {MAX_KEY}")
    return key


async def post_agent_message(ctx: Context, text: str) -> dict[str, Any]:
    core = ctx.core
    ts = core.clock.next()
    await core.history.append(ctx.session, "assistant", text, agent=SOURCE, source=SOURCE, ts=ts)
    return {"ts": ts, "subscribers": core.feed.say(ctx.session, text, ui_pb2.TEXT, ts=ts)}


# ---- chatEvent: immediate ----

async def send_message(ctx: Context, req: Request) -> Reply:
    return Reply(True, await post_agent_message(ctx, _text(req.fields, "message", "text", "content")))


async def get_chat_history(ctx: Context, req: Request) -> Reply:
    limit = req.fields.get("limit", HISTORY_DEFAULT)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_HISTORY:
        raise BadRequest(f"`limit` must be an integer within 1..{MAX_HISTORY}")
    entries = await ctx.core.history.read(ctx.session, last=limit)
    return Reply(True, entries, extra={"messages": [_library_message(e) for e in entries]})


def _library_message(entry: dict[str, Any]) -> dict[str, Any]:
    """A history entry as codeboltjs's getChatHistoryResponse `messages` item."""
    role = entry.get("role", "")
    return {"id": str(entry.get("ts", "")), "content": entry.get("text", ""),
            "sender": "user" if role == "user" else (entry.get("agent") or entry.get("source") or role),
            "timestamp": protocol.timestamp(entry.get("ts", 0)), "type": "message",
            **({"role": role} if role in ("user", "assistant", "system") else {})}


async def notification(ctx: Context, req: Request) -> Reply:
    text = _text(req.fields, "message", "text")
    reply = await ctx.core.dialogs.notify(ctx.session, xpb.NotifyRequest(message=text,
                                                                         notify_type=xpb.NOTIFY_TYPE_INFO))
    return Reply(True, {"id": reply.id, "subscribers": reply.subscribers})


async def process_status(ctx: Context, req: Request) -> Reply:
    """Status for every extension UI; a `message` with it (codeboltjs's onActionMessage answer
    sends processStoped with the agent's reply) is the agent's message in the chat."""
    message = req.fields.get("message")
    if isinstance(message, str) and message.strip():
        await post_agent_message(ctx, _text(req.fields, "message"))
    text = _STATUS_TEXT[req.action]
    reply = await ctx.core.dialogs.set_status(ctx.session, xpb.SetStatusRequest(key=STATUS_KEY, text=text))
    return Reply(True, {"status": text, "subscribers": reply.subscribers})


# ---- chatEvent: waiting (run as tasks; `sub` is the user-message subscription, taken up front) ----

async def next_user_message(sub: Subscription) -> dict[str, Any]:
    """The first user entry appended to the session's chat history since `sub` began: sent with
    CodeBoltService.SendUserMessage, or a neuro-san StreamingChat turn of the same session."""
    async for entry in sub:
        if entry.get("role") == "user":
            return entry  # type: ignore[no-any-return]
    raise Unavailable("uibus is shutting down")  # the bus closed the subscription


async def wait_for_reply(ctx: Context, req: Request, sub: Subscription | None) -> Reply:
    assert sub is not None
    prompt = _text(req.fields, "message", "text", required=False)
    if prompt:
        await post_agent_message(ctx, prompt)
    user = await next_user_message(sub)
    return Reply(True, {"text": user["text"], "ts": user["ts"], "source": user["source"]},
                 extra=protocol.user_message(user["text"], user["ts"]))


async def confirmation(ctx: Context, req: Request, sub: Subscription | None) -> Reply:
    """A select dialog with the buttons as options; with `withFeedback`, a user message that
    arrives first answers instead (feedbackResponse) and the dialog closes for every UI."""
    text = _text(req.fields, "message", "text", "question")
    buttons = req.fields.get("buttons") or list(DEFAULT_BUTTONS)
    if not isinstance(buttons, list) or not all(isinstance(b, str) and b for b in buttons):
        raise BadRequest("`buttons` must be a list of non-empty strings")
    request = xpb.SelectRequest(title=text, options=buttons)
    timeout = req.fields.get("timeoutMs")
    if timeout is not None:
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
            raise BadRequest("`timeoutMs` must be a positive integer (milliseconds)")
        request.timeout_ms = timeout
    dialog = asyncio.ensure_future(ctx.core.dialogs.ask(ctx.session, request))
    feedback = asyncio.ensure_future(next_user_message(sub)) if sub is not None else None
    try:
        await asyncio.wait([t for t in (dialog, feedback) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all((dialog, feedback))  # the one that lost; a cancel of ours still propagates
    if feedback is not None and not feedback.cancelled() and feedback.exception() is None:
        user = feedback.result()
        return Reply(True, {"feedback": user["text"], "ts": user["ts"]}, reply_type="feedbackResponse",
                     extra={"feedback": user["text"], "message": user["text"]})
    if dialog.cancelled():  # the user-message subscription ended first: the bus closed for shutdown
        raise Unavailable("uibus is shutting down")
    try:
        result = dialog.result()
    except UibusError as exc:  # the dialog could not be shown: say why, with its status
        raise type(exc)(f"confirmation dialog failed: {exc}") from None
    if result.outcome == xpb.DIALOG_OUTCOME_ANSWERED:
        return Reply(True, {"button": result.value, "dialogId": result.id},
                     extra={"answer": result.value, "message": result.value})
    how = "dismissed by the user" if result.outcome == xpb.DIALOG_OUTCOME_CANCELLED else \
        f"not answered within {request.timeout_ms} ms"
    return Reply(False, {"dialogId": result.id}, error=f"confirmation dialog {result.id} was {how}",
                 extra={"answer": ""})


# ---- stateEvent / memoryEvent ----

def _entry(fields: dict[str, Any]) -> dict[str, Any]:
    """codeboltjs nests {key, value} in `payload`; the AsyncAPI form puts them in `message`."""
    payload = fields.get("payload")
    return payload if isinstance(payload, dict) else fields


async def _put(ctx: Context, prefix: str, fields: dict[str, Any]) -> str:
    key = _key(fields)
    if "value" not in fields:
        raise BadRequest("`value` is required (any JSON value; null deletes the key)")
    value = fields["value"]
    store = ctx.core.store
    if value is not None:
        kept = await store.scan(ctx.session, prefix)
        if prefix + key not in kept and len(kept) >= MAX_KEYS:
            raise BadRequest(f"this session already keeps {MAX_KEYS} keys under {prefix!r}; delete one first")
        size = _size(key, value) + sum(_size(k[len(prefix):], v) for k, v in kept.items()
                                         if k != prefix + key)
        if size > MAX_STATE_BYTES:
            raise ResourceExhausted(f"{prefix!r} of this session would hold {size} bytes of JSON, over the limit "
                                    f"of {MAX_STATE_BYTES}: store less, or delete keys (value null)")
    await store.put(ctx.session, prefix + key, value)
    return key


def _size(key: str, value: Any) -> int:
    """What an entry costs in a reply: its key and its value as JSON, in UTF-8 bytes."""
    return len(key.encode()) + len(dump_json(value).encode())


async def _all(ctx: Context, prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in (await ctx.core.store.scan(ctx.session, prefix)).items()}


async def add_agent_state(ctx: Context, req: Request) -> Reply:
    key = await _put(ctx, AGENT_PREFIX, _entry(req.fields))
    return Reply(True, {"key": key}, extra={"payload": {"success": True}})


async def get_agent_state(ctx: Context, req: Request) -> Reply:
    state = await _all(ctx, AGENT_PREFIX)
    return Reply(True, state, extra={"payload": state})


async def update_project_state(ctx: Context, req: Request) -> Reply:
    key = await _put(ctx, PROJECT_PREFIX, _entry(req.fields))
    return Reply(True, {"key": key}, extra={"payload": {"success": True}, "state": await _all(ctx, PROJECT_PREFIX)})


async def get_project_state(ctx: Context, req: Request) -> Reply:
    state = await _all(ctx, PROJECT_PREFIX)
    return Reply(True, state, extra={"projectState": state})


async def get_application_state(ctx: Context, req: Request) -> Reply:
    state = {"session": ctx.session, "agentState": await _all(ctx, AGENT_PREFIX),
             "projectState": await _all(ctx, PROJECT_PREFIX)}
    return Reply(True, state, extra={**state, "state": state})


async def memory_set(ctx: Context, req: Request) -> Reply:
    fields = _entry(req.fields)
    key = await _put(ctx, MEMORY_PREFIX, fields)
    return Reply(True, {"key": key}, extra={"key": key, "value": fields["value"]})


async def memory_get(ctx: Context, req: Request) -> Reply:
    key = _key(_entry(req.fields))
    value = await ctx.core.store.get(ctx.session, MEMORY_PREFIX + key)
    return Reply(True, {"key": key, "value": value, "found": value is not None}, extra={"key": key, "value": value})


Immediate = Callable[[Context, Request], Awaitable[Reply]]
Waiting = Callable[[Context, Request, Subscription | None], Awaitable[Reply]]

IMMEDIATE: dict[str, Immediate] = {
    "chatEvent.sendMessage": send_message,
    "chatEvent.getChatHistory": get_chat_history,
    "chatEvent.notificationEvent": notification,
    "chatEvent.processStarted": process_status,
    "chatEvent.processStoped": process_status,
    "chatEvent.processFinished": process_status,
    "stateEvent.addToAgentState": add_agent_state,
    "stateEvent.getAgentState": get_agent_state,
    "stateEvent.updateProjectState": update_project_state,
    "stateEvent.getProjectState": get_project_state,
    "stateEvent.getApplicationState": get_application_state,
    "memoryEvent.memorySet": memory_set,
    "memoryEvent.memoryGet": memory_get,
}
# Waiting actions, and whether a user message answers them (then a subscription is taken first).
WAITING: dict[str, tuple[Waiting, Callable[[Request], bool]]] = {
    "chatEvent.waitforReply": (wait_for_reply, lambda req: True),
    "chatEvent.confirmationRequest": (confirmation, lambda req: req.fields.get("withFeedback") is True),
}
