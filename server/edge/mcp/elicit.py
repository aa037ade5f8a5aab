"""A uibus dialog as an MCP elicitation, and back: the one translation between the extension-UI
dialogs (select, confirm, input, editor) and MCP's form elicitations, used wherever a modern client
is asked instead of a UI — `ask_user` answered through `input_required`, and a hosted agent's
permission question inside a task (uibus.edge.mcp.tasks).

Also the `requestState` of `ask_user`: the specification's opaque token that a client echoes
when it retries a request with its answers. uibus keeps nothing between the two requests (the
retry may reach another replica), so the token only binds the retry to the request it answers:
a digest of the session, the tool and its arguments. It needs no secret: whoever retries is the
person answering, and can only answer their own question.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from uibus.edge.mcp.protocol import InvalidParams
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext

Dialog = ext.SelectRequest | ext.ConfirmRequest | ext.InputRequest | ext.EditorRequest
ACTIONS = ("accept", "decline", "cancel")


def form(dialog: Dialog) -> dict[str, Any]:
    """The `elicitation/create` input request that asks what `dialog` asks."""
    if isinstance(dialog, ext.SelectRequest):
        prop: dict[str, Any] = {"type": "string", "title": dialog.title, "enum": list(dialog.options)}
        key, message = "value", dialog.title
    elif isinstance(dialog, ext.ConfirmRequest):
        prop = {"type": "boolean", "title": dialog.title, "default": False}
        key, message = "confirmed", f"{dialog.title}\n\n{dialog.message}" if dialog.message else dialog.title
    else:
        prop = {"type": "string", "title": dialog.title}
        if isinstance(dialog, ext.InputRequest) and dialog.HasField("placeholder"):
            prop["description"] = dialog.placeholder
        if isinstance(dialog, ext.EditorRequest) and dialog.HasField("prefill"):
            prop["default"] = dialog.prefill
        key, message = "value", dialog.title
    return {"method": "elicitation/create",
            "params": {"mode": "form", "message": message,
                       "requestedSchema": {"type": "object", "properties": {key: prop}, "required": [key]}}}


def dialog_of(request: ext.ExtensionUiRequest) -> Dialog | None:
    """The dialog an extension-UI request opens (None: a request that asks nothing)."""
    which = request.WhichOneof("method")
    return getattr(request, which) if which in ("select", "confirm", "input", "editor") else None


def answer(dialog: Dialog, response: Any, where: str) -> ext.RespondRequest:
    """The dialog's answer from the client's `ElicitResult` (`where` names it in errors): accept
    gives the value (or the confirmation), decline is a "no" to a confirmation and a dismissal of
    anything else, cancel is a dismissal."""
    if not isinstance(response, dict) or response.get("action") not in ACTIONS:
        raise InvalidParams(f"{where} must be an ElicitResult: an object with action accept, decline or cancel")
    action = response["action"]
    confirm = isinstance(dialog, ext.ConfirmRequest)
    if action == "cancel" or (action == "decline" and not confirm):
        return ext.RespondRequest(cancelled=True)
    if action == "decline":
        return ext.RespondRequest(confirmed=False)
    content = response.get("content")
    if not isinstance(content, dict):
        raise InvalidParams(f"{where}: an accepted answer needs content, the form's fields")
    if confirm:
        confirmed = content.get("confirmed")
        if not isinstance(confirmed, bool):
            raise InvalidParams(f"{where}: content.confirmed must be true or false")
        return ext.RespondRequest(confirmed=confirmed)
    value = content.get("value")
    if not isinstance(value, str):
        raise InvalidParams(f"{where}: content.value must be a string")
    if isinstance(dialog, ext.SelectRequest) and value not in dialog.options:
        raise InvalidParams(f"{where}: {value[:80]!r} is not one of the options ({', '.join(dialog.options)})")
    return ext.RespondRequest(value=value)


def result_of(respond: ext.RespondRequest) -> ext.DialogResult:
    """The DialogResult a UI's answer would have given (what ask_user reports either way)."""
    which = respond.WhichOneof("answer")
    if which == "cancelled":
        return ext.DialogResult(outcome=ext.DIALOG_OUTCOME_CANCELLED)
    if which == "confirmed":
        return ext.DialogResult(outcome=ext.DIALOG_OUTCOME_ANSWERED, confirmed=respond.confirmed)
    return ext.DialogResult(outcome=ext.DIALOG_OUTCOME_ANSWERED, value=respond.value)


def request_state(session: str, tool: str, args: dict[str, Any]) -> str:
    """The token that binds a retry to this request (see the module's docstring)."""
    canonical = json.dumps([session, tool, args], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(canonical.encode()).digest()[:18]
    return "v1." + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def check_state(state: Any, session: str, tool: str, args: dict[str, Any]) -> None:
    if not isinstance(state, str) or state != request_state(session, tool, args):
        raise InvalidParams(f"{tool}: requestState does not belong to this request (retry the same tool with the "
                            "same arguments, in the same session, with the requestState it answered)")
