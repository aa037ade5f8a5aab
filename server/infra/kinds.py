"""Every kind of bus event, as one record each: name, payload type, overflow policy, presence.

Publishers and subscribers import the records from here and nowhere else, so a kind's name (its
topic and its name on the Redis wire), what travels in it, and what a full mailbox does with it
are stated once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2, host_pb2


class Policy(enum.Enum):
    """What a full mailbox does with one more event."""

    DROP_OLDEST = "drop_oldest"  # clicks and notices: the newest events matter most
    COALESCE = "coalesce"  # partial messages: a newer state of the same key replaces the queued one
    LATEST = "latest"  # state such as the theme: only the newest value is worth delivering


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    payload: type[Any]  # a protobuf message class, or dict for JSON entries
    policy: Policy = Policy.DROP_OLDEST
    # Replicas announce their subscriber counts of this kind, so a publisher on any replica knows
    # whether anyone listens anywhere (openUrl must say "no host" rather than lose the URL).
    presence: bool = False
    # The wire protocol version (uibus.infra.redis.codec.PROTOCOL) that first carried this kind between
    # replicas. A replica sends it only while every live replica speaks that version or a later one,
    # and otherwise delivers it locally only (counted in uibus_replication_kept_local_total): a peer
    # never receives a kind it does not know. Every kind of uibus 0.1.0 is 1.
    since: int = 1


_EMPTY = common_pb2.Empty
ADD_TO_INPUT = Kind("add_to_input", common_pb2.String)
MCP_BUTTON = Kind("mcp_button", _EMPTY)
HISTORY_BUTTON = Kind("history_button", _EMPTY)
CHAT_BUTTON = Kind("chat_button", _EMPTY)
ACCOUNT_BUTTON = Kind("account_button", _EMPTY)
SETTINGS_BUTTON = Kind("settings_button", _EMPTY)
# Today's Cline webview's streams: new in wire protocol 2, so a 0.1.0 replica is never sent them.
MARKETPLACE_BUTTON = Kind("marketplace_button", _EMPTY, since=2)
WORKTREES_BUTTON = Kind("worktrees_button", _EMPTY, since=2)
SHOW_WEBVIEW = Kind("show_webview", ui_pb2.ShowWebviewEvent, since=2)
# Keyed by ClineMessage.ts: at a full mailbox the newest state of a message replaces its older one.
PARTIAL_MESSAGE = Kind("partial_message", ui_pb2.ClineMessage, Policy.COALESCE)
THEME = Kind("theme", common_pb2.String, Policy.LATEST)
RELINQUISH_CONTROL = Kind("relinquish_control", _EMPTY)
FOCUS_CHAT_INPUT = Kind("focus_chat_input", _EMPTY)
DID_BECOME_VISIBLE = Kind("did_become_visible", _EMPTY)
HOST_REQUEST = Kind("host_request", host_pb2.HostRequest, presence=True)
# Extension-UI requests and dialog-closed events, keyed by dialog id (a closed event replaces its
# request) or by status/widget key (the newest wins).
EXTENSION_UI = Kind("extension_ui", extension_ui_pb2.ExtensionUiEvent, Policy.COALESCE)
# An extension-UI answer given on one replica for a dialog held by another, and the verdict back.
# Presence: a replica listens for answers to a session while it holds (or recently held) dialogs
# there, so a forwarder knows at once when no replica can give a verdict, and a UI stream knows
# whether the replica that wrote a waiting dialog to the store is still alive.
EXT_UI_ANSWER = Kind("ext_ui_answer", extension_ui_pb2.ForwardedAnswer, presence=True)
EXT_UI_ANSWER_RESULT = Kind("ext_ui_answer_result", extension_ui_pb2.ForwardedAnswerResult)
# Every entry appended to a session's chat history (a JSON dict), so a side waiting for "the next
# user message" (CodeBolt's waitforReply) subscribes instead of polling.
CHAT_MESSAGE = Kind("chat_message", dict)
# A chat turn of a hosted agent carried to the replica that owns the agent (uibus.replicas.turn_forwarding),
# targeted at the owner's id, and its cancel (JSON dicts). Presence: a forwarder knows whether the
# owner listens at all. The replies go back targeted at the turn's id: each ChatResponse as it is,
# and JSON dicts for accepted, heartbeat, moved and the end (status and message).
AGENT_TURN = Kind("agent_turn", dict, presence=True)
AGENT_TURN_REPLY = Kind("agent_turn_reply", dict)
# The events of a `/mcp` call's event stream (JSON dicts: number, framed event, end), targeted at the
# stream's name, so a client resuming that stream on another replica gets the rest of the call live
# (uibus.edge.transports.mcp_resume); and its "a reader is reading" notices back to the call's replica
# (target: the name + "/reader"), so the call is not cancelled as abandoned. New in wire protocol 2.
MCP_EVENT = Kind("mcp_event", dict, since=2)

ALL: tuple[Kind, ...] = (ADD_TO_INPUT, MCP_BUTTON, HISTORY_BUTTON, CHAT_BUTTON, ACCOUNT_BUTTON, SETTINGS_BUTTON,
                         MARKETPLACE_BUTTON, WORKTREES_BUTTON, SHOW_WEBVIEW,
                         PARTIAL_MESSAGE, THEME, RELINQUISH_CONTROL, FOCUS_CHAT_INPUT, DID_BECOME_VISIBLE,
                         HOST_REQUEST, EXTENSION_UI, EXT_UI_ANSWER, EXT_UI_ANSWER_RESULT, CHAT_MESSAGE,
                         AGENT_TURN, AGENT_TURN_REPLY, MCP_EVENT)
