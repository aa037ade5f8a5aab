"""Validation of extension-UI requests and answers: each check returns why a request cannot be
shown (a message for INVALID_ARGUMENT) or None.

The limits are generous for real dialogs and small enough that one request cannot make every
UI of a session render megabytes of options or lines.
"""

from __future__ import annotations

from collections.abc import Iterable

from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

MAX_TITLE = 4096
MAX_TEXT = 64 * 1024  # confirm message, placeholder, notify message, status text
MAX_LONG_TEXT = 1024 * 1024  # editor prefill and answers, editor text
MAX_OPTIONS = 1000
MAX_OPTION = 4096
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_KEY = 256
MAX_LINES = 1000
MAX_LINE = 4096

_NOTIFY_TYPES = frozenset(pb.NotifyType.values())
_PLACEMENTS = frozenset(pb.WidgetPlacement.values())


def _too_long(name: str, text: str, limit: int) -> str | None:
    if len(text) > limit:
        return f"{name} is {len(text)} characters long; the limit is {limit}"
    return None


def _title(title: str) -> str | None:
    if not title.strip():
        return "title is required"
    return _too_long("title", title, MAX_TITLE)


def timeout_of(request: pb.SelectRequest | pb.ConfirmRequest | pb.InputRequest | pb.EditorRequest) -> int:
    return request.timeout_ms if request.HasField("timeout_ms") else 0


def _timeout(request: pb.SelectRequest | pb.ConfirmRequest | pb.InputRequest | pb.EditorRequest) -> str | None:
    ms = timeout_of(request)
    if ms < 0:
        return f"timeout_ms={ms} is negative; use a positive number of milliseconds, or leave it unset"
    if ms > MAX_TIMEOUT_MS:
        return f"timeout_ms={ms} is more than a day ({MAX_TIMEOUT_MS} ms)"
    return None


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p), None)


def check_select(r: pb.SelectRequest) -> str | None:
    problem = _first((_title(r.title), _timeout(r)))
    if problem:
        return problem
    if not r.options:
        return "options is empty; a select needs at least one option"
    if len(r.options) > MAX_OPTIONS:
        return f"there are {len(r.options)} options; the limit is {MAX_OPTIONS}"
    too_long = next((i for i, o in enumerate(r.options) if len(o) > MAX_OPTION), None)
    if too_long is not None:
        return f"option {too_long} is {len(r.options[too_long])} characters long; the limit is {MAX_OPTION}"
    return None


def check_confirm(r: pb.ConfirmRequest) -> str | None:
    return _first((_title(r.title), _too_long("message", r.message, MAX_TEXT), _timeout(r)))


def check_input(r: pb.InputRequest) -> str | None:
    return _first((_title(r.title), _too_long("placeholder", r.placeholder, MAX_TEXT), _timeout(r)))


def check_editor(r: pb.EditorRequest) -> str | None:
    return _first((_title(r.title), _too_long("prefill", r.prefill, MAX_LONG_TEXT), _timeout(r)))


def check_notify(r: pb.NotifyRequest) -> str | None:
    if not r.message:
        return "message is required"
    if r.notify_type not in _NOTIFY_TYPES:
        return f"notify_type={r.notify_type} is not INFO (1), WARNING (2) or ERROR (3)"
    return _too_long("message", r.message, MAX_TEXT)


def _key(key: str) -> str | None:
    if not key:
        return "key is required"
    return _too_long("key", key, MAX_KEY)


def check_status(r: pb.SetStatusRequest) -> str | None:
    return _first((_key(r.key), _too_long("text", r.text, MAX_TEXT)))


def check_widget(r: pb.SetWidgetRequest) -> str | None:
    if r.placement not in _PLACEMENTS:
        return f"placement={r.placement} is not ABOVE_EDITOR (1) or BELOW_EDITOR (2)"
    if len(r.lines) > MAX_LINES:
        return f"widget has {len(r.lines)} lines; the limit is {MAX_LINES}"
    too_long = next((i for i, line in enumerate(r.lines) if len(line) > MAX_LINE), None)
    if too_long is not None:
        return f"line {too_long} is {len(r.lines[too_long])} characters long; the limit is {MAX_LINE}"
    return _key(r.key)


def check_title(r: pb.SetTitleRequest) -> str | None:
    return _too_long("title", r.title, MAX_TITLE)


def check_editor_text(r: pb.SetEditorTextRequest) -> str | None:
    return _too_long("text", r.text, MAX_LONG_TEXT)
