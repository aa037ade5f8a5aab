"""The extension-UI limits, in one place for everyone who makes or relays a dialog: how long a
title, a message, an option list may be, how far off a timeout.

The limits are generous for real dialogs and small enough that one request cannot make every
UI of a session render megabytes of options or lines. Two ways to meet them, one per kind of caller:

* `check_*`: a client's request beyond a limit is refused — each check returns why it cannot be
  shown (a message for INVALID_ARGUMENT) or None (the domain's `Dialogs`, the MCP server);
* `fit_*`: a hosted agent's request is fitted — cut (and marked) rather than refused, since a
  refused dialog would block the agent's tool until it gives up (pi's extension UI, ACP's
  permission requests).

It sits on the lowest floor (it knows only the protos) so the domain and the agents share it
without either importing the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from uibus.infra.roles import ROLES, is_role
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


# A dialog's addressee (teams: uibus.domain.members): "" (by kind), a role, or `person:<id>`.
PERSON = "person:"
_PERSON_ID = re.compile(r"[^\s\x00-\x1f]{1,256}")


def addressee_problem(addressee: str) -> str | None:
    """Why `addressee` is none: "" (the default), a role, or `person:<id>`."""
    if not addressee or is_role(addressee):
        return None
    if addressee.startswith(PERSON) and _PERSON_ID.fullmatch(addressee[len(PERSON):]):
        return None
    return f"addressee {addressee[:40]!r} is neither a role ({', '.join(ROLES)}) nor person:<id>"


def _addressee(r: pb.SelectRequest | pb.ConfirmRequest | pb.InputRequest | pb.EditorRequest) -> str | None:
    return addressee_problem(r.addressee)


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p), None)


def check_select(r: pb.SelectRequest) -> str | None:
    problem = _first((_title(r.title), _timeout(r), _addressee(r)))
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
    return _first((_title(r.title), _too_long("message", r.message, MAX_TEXT), _timeout(r),
                   _addressee(r)))


def check_input(r: pb.InputRequest) -> str | None:
    return _first((_title(r.title), _too_long("placeholder", r.placeholder, MAX_TEXT), _timeout(r),
                   _addressee(r)))


def check_editor(r: pb.EditorRequest) -> str | None:
    return _first((_title(r.title), _too_long("prefill", r.prefill, MAX_LONG_TEXT), _timeout(r),
                   _addressee(r)))


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


# ---- fitting what an agent asks into the limits ----


def safe_text(value: Any) -> str:
    """A string a peer sent, made safe for protobuf (a lone surrogate cannot be encoded)."""
    out = value if isinstance(value, str) else "" if value is None else str(value)
    try:
        out.encode()
    except UnicodeEncodeError:
        out = out.encode("utf-8", "replace").decode()
    return out


def fit_text(value: Any, limit: int = MAX_TEXT) -> str:
    """`value` as text within `limit` characters: cut, the cut marked with an ellipsis."""
    out = safe_text(value)
    return out if len(out) <= limit else out[:limit - 1] + "…"


def fit_title(value: Any, fallback: str, limit: int = MAX_TITLE) -> str:
    """A dialog title within the limit; a blank one becomes `fallback` (a dialog needs a title:
    naming what asks is better than refusing it)."""
    title = fit_text(value, limit)
    return title if title.strip() else fit_text(fallback, limit)


def fit_options(values: Any, option_limit: int = MAX_OPTION) -> list[str]:
    """A select's options: each cut to `option_limit`, at most MAX_OPTIONS of them (not a list: none)."""
    if not isinstance(values, list):
        return []
    return [fit_text(v, option_limit) for v in values[:MAX_OPTIONS]]


def fit_lines(values: Any) -> list[str]:
    """A widget's lines: each cut to MAX_LINE, at most MAX_LINES of them (not a list: none)."""
    if not isinstance(values, list):
        return []
    return [fit_text(v, MAX_LINE) for v in values[:MAX_LINES]]


def fit_key(value: Any) -> str:
    """A status or widget key within MAX_KEY."""
    return fit_text(value, MAX_KEY)


def fit_timeout_ms(value: Any) -> int | None:
    """A dialog timeout in ms, or None when it is not a positive number within a day (beyond that
    the dialog is shown without one and the agent keeps its own)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_TIMEOUT_MS:
        return int(value)
    return None
