"""The user as MCP tools: `ask_user` asks the person at the session's UIs (webview, browser page or
terminal) and returns the answer, its dismissal or its timeout; `notify_user` and `set_status` show
something there without waiting. One implementation for both eras: a modern client (2026-07-28)
that can fill in forms is asked itself through `input_required` (uibus.edge.mcp.elicit), so the
question needs no open request and the answer may come back to any replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from uibus.domain.dialogs import Dialogs
from uibus.edge.mcp import elicit, protocol
from uibus.edge.mcp.protocol import Envelope, InvalidParams
from uibus.infra.bus import LIVE
from uibus.infra.dialog_limits import MAX_TIMEOUT_MS
from uibus.infra.quotas import Quotas
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext

_OUTCOMES = {ext.DIALOG_OUTCOME_ANSWERED: "answered", ext.DIALOG_OUTCOME_CANCELLED: "cancelled",
             ext.DIALOG_OUTCOME_TIMED_OUT: "timed_out", ext.DIALOG_OUTCOME_CALLER_CANCELLED: "caller_cancelled"}
_LEVELS = {"info": ext.NOTIFY_TYPE_INFO, "warning": ext.NOTIFY_TYPE_WARNING, "error": ext.NOTIFY_TYPE_ERROR}
ASKED = "ask_user"  # the key of ask_user's one input request

_STRING = {"type": "string"}
USER_TOOLS: dict[str, dict[str, Any]] = {
    "ask_user": {
        "name": "ask_user",
        "title": "Ask the user",
        "description": (
            "Ask the person at this session's UI (webview, browser page or terminal) and wait for the answer. "
            "kind: select (pick one of options), confirm (yes/no), input (one line), editor (multi-line text). "
            "The result says whether the user answered, dismissed the dialog or let it time out."),
        "inputSchema": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "description": "The question, shown as the dialog's title"},
                "kind": {"type": "string", "enum": ["select", "confirm", "input", "editor"],
                         "description": "Default: select when options are given, else input"},
                "options": {"type": "array", "items": _STRING, "description": "select: the choices"},
                "message": {"type": "string", "description": "confirm: the text under the title"},
                "placeholder": {"type": "string", "description": "input: the hint in the empty field"},
                "prefill": {"type": "string", "description": "editor: the text to start from"},
                "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_MS // 1000,
                                    "description": "Give up after this long (default: wait for the answer; "
                                                   "at most a day)"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    },
    "notify_user": {
        "name": "notify_user",
        "title": "Notify the user",
        "description": "Show a notification at this session's UIs, without waiting.",
        "inputSchema": {
            "type": "object",
            "properties": {"message": _STRING, "level": {"type": "string", "enum": list(_LEVELS)}},
            "required": ["message"],
            "additionalProperties": False,
        },
    },
    "set_status": {
        "name": "set_status",
        "title": "Set a status entry",
        "description": ("Set (or, without text, clear) one entry of the status line at this session's UIs, "
                        "e.g. key 'build', text 'running tests'."),
        "inputSchema": {
            "type": "object",
            "properties": {"key": _STRING, "text": _STRING},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


def _string(args: Mapping[str, Any], key: str, tool: str, required: bool = False) -> str | None:
    value = args.get(key)
    if value is None:
        if required:
            raise InvalidParams(f"{tool} needs arguments.{key} (a string)")
        return None
    if not isinstance(value, str):
        raise InvalidParams(f"{tool}: arguments.{key} must be a string, not {type(value).__name__}")
    return value


def _only(args: Mapping[str, Any], tool: str) -> None:
    allowed = USER_TOOLS[tool]["inputSchema"]["properties"]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise InvalidParams(f"{tool} takes no argument {', '.join(unknown)} (it takes: {', '.join(allowed)})")




async def run_user_tool(dialogs: Dialogs, quotas: Quotas, tool: str, session: str, args: dict[str, Any],
                        tenant: str, envelope: Envelope | None = None,
                        params: Mapping[str, Any] | None = None) -> AsyncIterator[Any]:
    """The tools/call of one user tool: `LIVE` once it waits, then its result (a dict). `envelope`:
    a modern request's (its client may be asked itself); `params`: the request's, for the answers
    a retried request carries."""
    _only(args, tool)
    if tool == "notify_user":
        message = _string(args, "message", tool, required=True) or ""
        level = _string(args, "level", tool) or "info"
        if level not in _LEVELS:
            raise InvalidParams(f"notify_user: level must be one of {', '.join(_LEVELS)}, not {level!r}")
        fired = await dialogs.notify(session, ext.NotifyRequest(message=message, notify_type=_LEVELS[level]))
        yield _fired(fired, session, "notification")
        return
    if tool == "set_status":
        key = _string(args, "key", tool, required=True) or ""
        text = _string(args, "text", tool)
        request = ext.SetStatusRequest(key=key)
        if text:
            request.text = text
        fired = await dialogs.set_status(session, request)
        yield _fired(fired, session, "status")
        return
    dialog = _dialog(args)
    if envelope is not None and envelope.elicits_forms():
        yield await _elicited(dialogs, dialog, session, args, params or {})
        return
    with quotas.hold("dialogs", tenant):
        yield LIVE  # admitted and valid: the wait for the person begins
        result = await dialogs.ask(session, dialog)
    yield _answer(dialog, result)


async def _elicited(dialogs: Dialogs, dialog: elicit.Dialog, session: str, args: dict[str, Any],
                    params: Mapping[str, Any]) -> dict[str, Any]:
    """ask_user in the stateless era: the first request gets the question back as an input request;
    its retry, carrying the answer and the requestState, gets the answer as a UI's would read. The
    answer is the MCP client's person's, so it is in the audit log as a UI's answer would be (and,
    as there, refused while the log cannot write)."""
    responses, state = params.get("inputResponses"), params.get("requestState")
    if responses is None and state is None:
        return {"resultType": "input_required", "inputRequests": {ASKED: elicit.form(dialog)},
                "requestState": elicit.request_state(session, ASKED, args)}
    elicit.check_state(state, session, ASKED, args)
    if not isinstance(responses, dict) or ASKED not in responses:
        raise InvalidParams(f"ask_user: the retry must carry inputResponses.{ASKED}, the answer to the question")
    respond = elicit.answer(dialog, responses[ASKED], f"inputResponses.{ASKED}")
    dialogs.audit.ready()
    respond.id = ASKED
    kind = {ext.SelectRequest: "select", ext.ConfirmRequest: "confirm", ext.InputRequest: "input"}.get(
        type(dialog), "editor")
    await dialogs.record_answer(session, respond, ext.ExtensionUiRequest(id=ASKED, **{kind: dialog}))
    return _answer(dialog, elicit.result_of(respond))


def _fired(reply: ext.FireReply, session: str, what: str) -> dict[str, Any]:
    n = reply.subscribers
    text = (f"The {what} reached {n} UI{'s' if n != 1 else ''} of session {session}." if n
            else f"No UI of session {session} is open; the {what} was kept for the next one that opens."
            if what == "status" else f"No UI of session {session} is open; nobody saw the {what}.")
    return protocol.text_result(text, {"id": reply.id, "subscribers": n})


def _dialog(args: dict[str, Any]) -> ext.SelectRequest | ext.ConfirmRequest | ext.InputRequest | ext.EditorRequest:
    tool = "ask_user"
    title = _string(args, "title", tool, required=True) or ""
    options = args.get("options")
    if options is not None and (not isinstance(options, list) or not all(isinstance(o, str) for o in options)):
        raise InvalidParams("ask_user: arguments.options must be a list of strings")
    kind = _string(args, "kind", tool) or ("select" if options else "input")
    timeout = args.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout <= MAX_TIMEOUT_MS / 1000):
        raise InvalidParams(f"ask_user: arguments.timeout_seconds must be a positive number of seconds, at most "
                            f"{MAX_TIMEOUT_MS // 1000} (a day)")
    extra = {"timeout_ms": max(1, round(timeout * 1000))} if timeout is not None else {}
    misplaced = {"options": "select", "message": "confirm", "placeholder": "input", "prefill": "editor"}
    for key, owner in misplaced.items():
        if args.get(key) is not None and kind != owner:
            raise InvalidParams(f"ask_user: arguments.{key} is for kind {owner}, not {kind}")
    if kind == "select":
        return ext.SelectRequest(title=title, options=options or [], **extra)
    if kind == "confirm":
        return ext.ConfirmRequest(title=title, message=_string(args, "message", tool) or "", **extra)
    if kind == "input":
        placeholder = _string(args, "placeholder", tool)
        return ext.InputRequest(title=title, **({"placeholder": placeholder} if placeholder is not None else {}),
                                **extra)
    if kind == "editor":
        prefill = _string(args, "prefill", tool)
        return ext.EditorRequest(title=title, **({"prefill": prefill} if prefill is not None else {}), **extra)
    raise InvalidParams(f"ask_user: kind must be select, confirm, input or editor, not {kind!r}")


def _answer(dialog: Any, result: ext.DialogResult) -> dict[str, Any]:
    outcome = _OUTCOMES.get(result.outcome, "unknown")
    structured: dict[str, Any] = {"outcome": outcome, "dialog_id": result.id}
    confirm = isinstance(dialog, ext.ConfirmRequest)
    if confirm:
        structured["confirmed"] = result.confirmed
    if result.HasField("value"):
        structured["value"] = result.value
    if outcome == "answered":
        text = ("The user confirmed." if result.confirmed else "The user declined.") if confirm else result.value
    elif outcome == "cancelled":
        text = "The user dismissed the dialog without answering."
    elif outcome == "timed_out":
        text = "The user did not answer in time."
    else:
        text = f"The dialog ended without an answer ({outcome})."
    return protocol.text_result(text, structured)
