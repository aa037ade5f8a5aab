"""The vocabulary shared by publishers and subscribers: event kinds, their overflow policies and
the store keys of UI state. Services import names from here instead of spelling strings."""

from __future__ import annotations

from uibus.bus import Policy

ADD_TO_INPUT = "add_to_input"
MCP_BUTTON = "mcp_button"
HISTORY_BUTTON = "history_button"
CHAT_BUTTON = "chat_button"
ACCOUNT_BUTTON = "account_button"
SETTINGS_BUTTON = "settings_button"
PARTIAL_MESSAGE = "partial_message"
THEME = "theme"
RELINQUISH_CONTROL = "relinquish_control"
FOCUS_CHAT_INPUT = "focus_chat_input"
DID_BECOME_VISIBLE = "did_become_visible"
HOST_REQUEST = "host_request"
EXTENSION_UI = "extension_ui"  # extension-UI requests and dialog-closed events

POLICIES: dict[str, Policy] = {
    PARTIAL_MESSAGE: Policy.COALESCE,  # keyed by ClineMessage.ts: newest state of a message wins
    THEME: Policy.LATEST,
    # keyed by dialog id (a closed event replaces its request) or status/widget key (newest wins)
    EXTENSION_UI: Policy.COALESCE,
}

# Store keys (per session).
THEME_KEY = "ui/theme"
ANNOUNCEMENT_KEY = "ui/announcement"  # {"latest": id, "last_shown": id}
EXT_UI_PREFIX = "extui/"  # extension-UI state: extui/title, extui/status/<key>, extui/widget/<key>
