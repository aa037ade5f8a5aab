"""The UI feed: what a session's webviews see, and what they ask of the host.

Hosts publish (messages, theme, clicks, add-to-input text, focus and visibility signals), webviews
subscribe to streams of those, and webviews' requests of the host (open a URL, scroll to a
settings section, "initialized") travel the other way. State worth replaying (the theme, the
announcement, the latest state of the recent ClineMessages) lives in the session store; everything
else is live on the bus.

`UI_STREAMS` is the one table of Cline's `subscribeTo*` streams: UiService serves one RPC per
entry and WebviewService multiplexes them all, both from this table (a test compares it with
`ui.proto`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from uibus.domain.clock import TsClock
from uibus.domain.recent import RecentMessages
from uibus.domain.session_log import MESSAGE, SessionLog, new_key
from uibus.infra import kinds
from uibus.infra.bus import LIVE, Bus, Live
from uibus.infra.errors import FailedPrecondition, InvalidArgument
from uibus.infra.json_input import load_json
from uibus.infra.kinds import Kind
from uibus.infra.replay import Catchup
from uibus.infra.store import Store
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

log = logging.getLogger("uibus.feed")

THEME_KEY = "ui/theme"
ANNOUNCEMENT_KEY = "ui/announcement"  # {"latest": id, "last_shown": id}
TERMINAL_MODE_KEY = "ui/terminal_execution_mode"  # "vscodeTerminal" | "backgroundExec"
# trackIntent's actions as upstream Cline's webview sends them; anything else is counted as "other",
# so a caller cannot grow /metrics with labels of its choosing.
INTENT_ACTIONS = ("new_task_clicked", "prompt_submitted")
MAX_INTENT_FIELD_CHARS = 256
HOST_REQUESTS = "host_request"  # the kind of the host's requests in the session log
MAX_URL_CHARS = 2048
MAX_THEME_CHARS = 256 * 1024
AGENT_PROVIDER = "uibus"  # a hosted agent's reply: model_info.provider_id (model_id: the agent's name)
_EMPTY = common_pb2.Empty()
_PROVIDER_TYPES = frozenset(ui_pb2.WebviewProviderType.values())
# The valid numbers of each enum field, computed once: `EnumTypeWrapper.values()` builds a new list
# per call, which was most of what a publish cost in uibus's own code (bench/README.md).
_ENUMS = tuple((name, enum, frozenset(enum.values())) for name, enum in (
    ("type", ui_pb2.ClineMessageType), ("ask", ui_pb2.ClineAsk), ("say", ui_pb2.ClineSay)))
_BUTTONS: dict[int, Kind] = {
    host_pb2.BUTTON_MCP: kinds.MCP_BUTTON,
    host_pb2.BUTTON_HISTORY: kinds.HISTORY_BUTTON,
    host_pb2.BUTTON_CHAT: kinds.CHAT_BUTTON,
    host_pb2.BUTTON_ACCOUNT: kinds.ACCOUNT_BUTTON,
    host_pb2.BUTTON_SETTINGS: kinds.SETTINGS_BUTTON,
    host_pb2.BUTTON_MARKETPLACE: kinds.MARKETPLACE_BUTTON,
    host_pb2.BUTTON_WORKTREES: kinds.WORKTREES_BUTTON,
}


@dataclass(frozen=True, slots=True)
class UiStream:
    """One of Cline's `subscribeTo*` streams."""

    rpc: str  # the cline.UiService method
    kind: Kind
    # What picks a subscriber's target: nothing, the WebviewProviderTypeRequest's provider type
    # (clicks typed SIDEBAR/TAB), or the StringRequest's client id (focus one webview).
    target: Literal["", "provider", "client_id"] = ""
    current: bool = False  # the stream starts with the current state (kept in the store)

    def target_of(self, request: Any) -> str:
        """The subscriber's target for this stream's request; InvalidArgument when it has none."""
        if self.target == "provider":
            if request.provider_type not in _PROVIDER_TYPES:
                raise InvalidArgument(f"provider_type {request.provider_type} is not a WebviewProviderType "
                                      "(SIDEBAR=0, TAB=1)")
            return ui_pb2.WebviewProviderType.Name(request.provider_type)
        if self.target == "client_id":
            if not request.value:
                raise InvalidArgument("Client ID is required")
            return str(request.value)
        return ""


UI_STREAMS: tuple[UiStream, ...] = (
    UiStream("subscribeToAddToInput", kinds.ADD_TO_INPUT),
    UiStream("subscribeToMcpButtonClicked", kinds.MCP_BUTTON, "provider"),
    UiStream("subscribeToHistoryButtonClicked", kinds.HISTORY_BUTTON, "provider"),
    UiStream("subscribeToChatButtonClicked", kinds.CHAT_BUTTON),
    UiStream("subscribeToAccountButtonClicked", kinds.ACCOUNT_BUTTON),
    UiStream("subscribeToSettingsButtonClicked", kinds.SETTINGS_BUTTON, "provider"),
    UiStream("subscribeToPartialMessage", kinds.PARTIAL_MESSAGE),
    UiStream("subscribeToTheme", kinds.THEME, current=True),
    UiStream("subscribeToRelinquishControl", kinds.RELINQUISH_CONTROL),
    UiStream("subscribeToFocusChatInput", kinds.FOCUS_CHAT_INPUT, "client_id"),
    UiStream("subscribeToDidBecomeVisible", kinds.DID_BECOME_VISIBLE),
    UiStream("subscribeToWorktreesButtonClicked", kinds.WORKTREES_BUTTON),
    UiStream("subscribeToMarketplaceButtonClicked", kinds.MARKETPLACE_BUTTON),
    UiStream("subscribeToShowWebview", kinds.SHOW_WEBVIEW),
)
_BY_PROVIDER = frozenset(s.kind for s in UI_STREAMS if s.target == "provider")


def check_url(url: str) -> str | None:
    """Why `url` may not be opened, or None. Only absolute http(s) URLs reach the host."""
    if not url:
        return "url is required"
    if len(url) > MAX_URL_CHARS:
        return f"url is {len(url)} characters long; the limit is {MAX_URL_CHARS}"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "url contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        return f"url is malformed: {exc}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"only http and https URLs can be opened, not {parts.scheme or 'a relative URL'}:"
    if not host:
        return "url has no host"
    return None


def check_cline_message(msg: ui_pb2.ClineMessage) -> str | None:
    """Why a ClineMessage cannot be shown, or None."""
    if msg.ts <= 0:
        return "ts is required: a webview identifies a message by its ts (Unix milliseconds)"
    for name, enum, valid in _ENUMS:
        value = getattr(msg, name)
        if value not in valid:
            return f"{name}={value} is not a valid {enum.DESCRIPTOR.name}"
    return None


def _host_request(**what: Any) -> host_pb2.HostRequest:
    return host_pb2.HostRequest(id=new_key(), ts=int(time.time() * 1000), **what)


@dataclass(frozen=True, slots=True)
class Announcement:
    latest: str = ""
    last_shown: str = ""


@dataclass(frozen=True, slots=True)
class Replayed:
    """An event a stream starts with because it is kept state (a recent message, the current theme),
    not because it happened now: `UiFeed.events(..., replay=True)` wraps those in this, so
    WebviewService can mark them (`WebviewEvent.replayed`) and a page can tell history from news."""

    item: Any


class _ReplayEnd:
    """What `UiFeed.events(..., mark_end=True)` yields once the stream has sent what it starts with."""

    def __repr__(self) -> str:
        return "REPLAY_END"


REPLAY_END = _ReplayEnd()


class _Gap:
    """What `UiFeed.events(..., since=...)` yields when the cursor is older than the session's log
    keeps: the client missed events that are gone, so what follows is a snapshot, not the rest."""

    def __repr__(self) -> str:
        return "GAP"


GAP = _Gap()


def _by_seq(message: ui_pb2.ClineMessage) -> int:
    return message.seq


def _by_ts(message: ui_pb2.ClineMessage) -> int:
    return message.ts


def _messages(entries: list[Any]) -> dict[int, ui_pb2.ClineMessage]:
    found: dict[int, ui_pb2.ClineMessage] = {}
    for entry in entries:
        try:
            message = ui_pb2.ClineMessage.FromString(entry.data)
        except DecodeError:
            continue
        found[message.ts] = message
    return found


class UiFeed:
    def __init__(self, bus: Bus, store: Store, clock: TsClock, *, log: SessionLog | None = None) -> None:
        """`log` is the sessions' ordered log (by default with the default retention); the recent
        messages a webview starts with are a view of it."""
        self.bus = bus
        self.store = store
        self.clock = clock
        self.log = log if log is not None else SessionLog(store)
        self.recent = RecentMessages(self.log)
        # trackIntent calls by action (INTENT_ACTIONS and "other"): read by /metrics at scrape time.
        self.intents: dict[str, int] = dict.fromkeys((*INTENT_ACTIONS, "other"), 0)

    # ---- webviews: streams ----

    async def events(self, session: str, stream: UiStream, target: str = "", *,
                     replay: bool = False, mark_end: bool = False, since: int | None = None) -> AsyncIterator[Any]:
        """The stream's events until it ends: `LIVE` once subscribed (the pipeline sends the
        response headers then), the current state where the stream has one, then live events.

        With `replay` (WebviewService; never cline.UiService, whose subscribeToPartialMessage stays
        live only, as in Cline) the partial-message stream starts with the session's recent
        messages, oldest ts first, and what a stream starts with comes wrapped in `Replayed`.
        With `mark_end`, `REPLAY_END` follows what the stream starts with (every stream yields it,
        once, also those that start with nothing), so WebviewService can tell its client the
        replay is complete instead of the client guessing from a quiet spell.

        With `since` (a resume cursor: the seq of the last event the client had), the
        partial-message stream first sends the latest state of every message whose state changed
        after it, from the session's log, oldest seq first, each once, then live; a cursor older
        than the log keeps gets `GAP` (webviews) or a fresh snapshot at a new epoch (Cline).

        The subscription is removed in the `finally` beside it, which runs on cancel, disconnect,
        deadline and shutdown alike.
        """
        bus = self.bus
        sub = bus.subscribe(session, stream.kind, target)
        try:
            await bus.ready(session)  # heard on every replica before the headers say so
            yield LIVE
            if stream.current:
                # Read after subscribing, so a change in between is not missed; the value just read
                # may then also arrive as an event (published a moment before, or relayed late by
                # another replica): current state is delivered at least once, newest last.
                theme = await self.theme(session)
                if theme is not None:
                    value = common_pb2.String(value=theme)
                    yield Replayed(value) if replay else value
            # Replay then live (uibus.infra.replay), a message's states keyed by its ts: a live state of
            # a message this stream has replayed that is not newer (by seq) was queued before the
            # replay was read and is sent no more. By ts, not a seq threshold: another replica's
            # publisher may stamp a newer message with a lower seq.
            catchup: Catchup[ui_pb2.ClineMessage] = Catchup(sub, key=_by_ts, version=_by_seq)
            if stream.kind is kinds.PARTIAL_MESSAGE and (replay or since is not None):
                # Read after subscribing, so nothing published meanwhile is missed. What the mailbox
                # got since then is taken into the replay (the higher seq of a ts wins), so it is
                # neither sent twice nor sent older after newer.
                gap = False
                if since is None:
                    found = await self.recent.read(session)
                else:
                    log_read = await self.log.read(session, since, kind=MESSAGE)
                    gap = log_read.gap
                    found = {} if gap else _messages(log_read.entries)
                await catchup.merge(found, live_wins_ties=True)
                if gap:
                    # The cursor is older than what the log keeps: say so, never a silent hole. A
                    # webview (replay) gets GAP then the recent messages; a Cline stream gets the
                    # snapshot at a new epoch (Cline's webview drops what it had of older epochs).
                    if replay:
                        yield GAP
                        for ts, message in (await self.recent.read(session)).items():
                            known = found.get(ts)
                            if known is None or message.seq > known.seq:
                                found[ts] = message
                    else:
                        found = self._resnapshot(session, await self.recent.read(session))
                # A snapshot in ts order (the conversation as shown), a resume in log (seq) order.
                for message in sorted(found.values(), key=_by_ts if since is None or gap else _by_seq):
                    catchup.sent(message)
                    yield Replayed(message) if replay else message
            if mark_end:
                yield REPLAY_END
            async for item in catchup.live():  # without what the replay sent (queued before the read)
                yield item
        finally:
            bus.unsubscribe(sub)

    async def host_requests(self, session: str, since: int | None = None) -> AsyncIterator[host_pb2.HostRequest | Live]:
        """What the session's webviews ask of the host (open a URL, scroll, initialized); `LIVE`
        first. With `since`, the requests logged after that seq come first (each once, in order),
        or one `gap` request when the cursor is older than the log keeps."""
        bus = self.bus
        sub = bus.subscribe(session, kinds.HOST_REQUEST)
        try:
            await bus.ready(session)
            yield LIVE
            catchup: Catchup[host_pb2.HostRequest] = Catchup(sub)  # replay then live (uibus.infra.replay), by seq
            if since is not None:
                missed, gap = await self.log.resume(session, since, HOST_REQUESTS, host_pb2.HostRequest, catchup)
                if gap:
                    yield host_pb2.HostRequest(gap=True, seq=self.log.head(session))
                for item in missed:
                    yield item
            async for item in catchup.live():  # the requests replayed, queued meanwhile too, come no more
                yield item
        finally:
            bus.unsubscribe(sub)

    def _to_host(self, session: str, request: host_pb2.HostRequest, *, needs_host: str = "") -> int:
        """Logs a request of the host (its seq), written behind (docs/streams/resume.md says why),
        and publishes it; how many hosts got it. `needs_host`: what cannot happen with no host
        listening; then the request is taken back (never replayed) and the caller told."""
        self.log.stamp_event(session, HOST_REQUESTS, request.id, request, new=True)  # a new_key()
        reached = self.bus.publish(session, kinds.HOST_REQUEST, request)
        if not reached and needs_host:
            self.log.retract(session, HOST_REQUESTS, request.id)
            raise FailedPrecondition(f"no host is subscribed to host requests of session {session!r}; "
                                     f"nothing can {needs_host}")
        return reached

    def _resnapshot(self, session: str, recent: dict[int, ui_pb2.ClineMessage]) -> dict[int, ui_pb2.ClineMessage]:
        """The recent messages again, stamped at a new epoch and published to every UI of the
        session (so all of them converge on the same conversation under the new fence, and a later
        reader finds them in the log); returns them as stamped."""
        again: dict[int, ui_pb2.ClineMessage] = {}
        self.log.new_epoch(session)
        for ts in sorted(recent):
            message = ui_pb2.ClineMessage()
            message.CopyFrom(recent[ts])
            self.log.stamp(session, message)
            self.bus.publish(session, kinds.PARTIAL_MESSAGE, message, key=ts)
            again[ts] = message
        return again

    # ---- hosts: publishing (each returns how many subscribers the event reached) ----

    def add_to_input(self, session: str, text: str) -> int:
        return self.bus.publish(session, kinds.ADD_TO_INPUT, common_pb2.String(value=text))

    def click(self, session: str, button: int, provider_type: int | None = None) -> int:
        """A button click; a typed click reaches the webviews that subscribed with that type."""
        kind = _BUTTONS.get(button)
        if kind is None:
            raise InvalidArgument(f"button={button} is not one of MCP, HISTORY, CHAT, ACCOUNT, SETTINGS, "
                                  "MARKETPLACE, WORKTREES")
        target = None
        if provider_type is not None:
            if provider_type not in _PROVIDER_TYPES:
                raise InvalidArgument(f"provider_type={provider_type} is not SIDEBAR (0) or TAB (1)")
            if kind in _BY_PROVIDER:
                target = ui_pb2.WebviewProviderType.Name(provider_type)
        return self.bus.publish(session, kind, _EMPTY, target=target)

    async def prepare(self, session: str) -> None:
        """Learns the session's current conversation (epoch) from its log, once per process:
        awaited by the callers that can before they publish (a host's publish, a chat turn)."""
        await self.log.prepare(session)

    async def durable(self, session: str) -> None:
        """Waits until every message state of the session published so far is committed to its
        log: a chat turn's final reply is in the log before its caller's stream ends."""
        await self.log.flush(session)

    def publish_message(self, session: str, message: ui_pb2.ClineMessage) -> int:
        """A (partial) ClineMessage as the host sent it; the bus coalesces its states by ts."""
        problem = check_cline_message(message)
        if problem:
            raise InvalidArgument(problem)
        self.log.stamp(session, message)  # its seq and epoch, and into the log, before fan-out
        return self.bus.publish(session, kinds.PARTIAL_MESSAGE, message, key=message.ts)

    def say(self, session: str, text: str, say: int = ui_pb2.TEXT, *, ts: int = 0, partial: bool = False,
            agent: str = "") -> int:
        """A SAY message of uibus's own (chat replies, CodeBolt messages); `ts` from `clock`. A hosted
        agent's reply names the agent (`model_info`: provider `uibus`, model the agent), so a page
        that replays it later heads it as the live reply was headed."""
        ts = ts or self.clock.next()
        msg = ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=say, text=text, partial=partial)  # type: ignore[arg-type]
        if agent:
            msg.model_info.provider_id, msg.model_info.model_id = AGENT_PROVIDER, agent
        self.log.stamp(session, msg)
        return self.bus.publish(session, kinds.PARTIAL_MESSAGE, msg, key=ts)

    def question(self, session: str, text: str) -> int:
        """Shows a user's chat question to the session's UIs (a SAY USER_FEEDBACK, as Cline's host
        says a user's follow-up) and keeps it among the recent messages: an editor attached over ACP
        or a second page sees the question of a turn another UI started live, and a page opened later
        replays the conversation with its questions. The UI that asked matches it to what it shows
        already (the page by its text, an editor by owning the turn), so nothing shows it twice."""
        return self.say(session, text, ui_pb2.USER_FEEDBACK)

    async def set_theme(self, session: str, theme: str) -> int:
        """Cline sends the theme as a JSON document; anything else would break its webview."""
        if len(theme) > MAX_THEME_CHARS:
            raise InvalidArgument(f"theme is {len(theme)} characters; the limit is {MAX_THEME_CHARS}")
        load_json(theme, "theme (a JSON document)")
        await self.store.put(session, THEME_KEY, theme)
        return self.bus.publish(session, kinds.THEME, common_pb2.String(value=theme))

    async def theme(self, session: str) -> str | None:
        theme = await self.store.get(session, THEME_KEY)
        return theme if isinstance(theme, str) else None

    def relinquish_control(self, session: str) -> int:
        return self.bus.publish(session, kinds.RELINQUISH_CONTROL, _EMPTY)

    def focus_chat_input(self, session: str, client_id: str = "") -> int:
        """Focuses one webview's chat input, or every webview's with an empty id."""
        return self.bus.publish(session, kinds.FOCUS_CHAT_INPUT, _EMPTY, target=client_id or None)

    def did_become_visible(self, session: str) -> int:
        return self.bus.publish(session, kinds.DID_BECOME_VISIBLE, _EMPTY)

    def show_webview(self, session: str, preserve_editor_focus: bool = False) -> int:
        """The host asks the session's webviews to show themselves (Cline's sendShowWebviewEvent)."""
        return self.bus.publish(session, kinds.SHOW_WEBVIEW,
                                ui_pb2.ShowWebviewEvent(preserve_editor_focus=preserve_editor_focus))

    # ---- webviews: requests of the host ----

    def scroll_to_settings(self, session: str, section: str) -> int:
        request = _host_request()
        request.scroll_to_settings.section = section  # in place: no ScrollToSettings built and copied in
        return self._to_host(session, request)

    async def initialize_webview(self, session: str) -> None:
        """Tells the host, and replays the current theme so every stream of the session is fresh."""
        self._to_host(session, _host_request(webview_initialized=host_pb2.WebviewInitialized()))
        theme = await self.theme(session)
        if theme is not None:
            self.bus.publish(session, kinds.THEME, common_pb2.String(value=theme))

    async def open_url(self, session: str, url: str) -> None:
        """A server cannot open a browser on the user's machine: the host does, if one listens
        (on any replica: `ready` makes the other replicas' counts for the session known)."""
        problem = check_url(url)
        if problem:
            raise InvalidArgument(problem)
        await self.bus.ready(session)
        self._to_host(session, _host_request(open_url=host_pb2.OpenUrl(url=url)), needs_host="open the URL")

    async def open_walkthrough(self, session: str) -> None:
        """Cline opens its walkthrough in the editor: that is the host's to do, as with `open_url`,
        so the request goes to the host (on any replica), and with no host listening the caller
        hears so rather than the request vanishing."""
        await self.bus.ready(session)
        self._to_host(session, _host_request(open_walkthrough=host_pb2.OpenWalkthrough()),
                      needs_host="open the walkthrough")

    async def open_folder(self, session: str, path: str, new_window: bool) -> None:
        """Cline's switchWorktree opens a folder in the editor: the host's to do (the caller names
        a worktree uibus listed), so it is a host request; with no host listening the caller hears so."""
        await self.bus.ready(session)
        self._to_host(session, _host_request(open_folder=host_pb2.OpenFolder(path=path, new_window=new_window)),
                      needs_host="open the worktree")

    async def set_terminal_execution_mode(self, session: str, background: bool) -> str:
        """Keeps the webview's choice in the session (the host reads it in GetSessionState) and tells
        a listening host at once; returns the mode's name as Cline says it."""
        mode = "backgroundExec" if background else "vscodeTerminal"
        await self.store.put(session, TERMINAL_MODE_KEY, mode)
        self._to_host(session, _host_request(terminal_execution_mode=host_pb2.TerminalExecutionMode(mode=mode)))
        return mode

    async def terminal_execution_mode(self, session: str) -> str:
        mode = await self.store.get(session, TERMINAL_MODE_KEY)
        return mode if isinstance(mode, str) else ""

    def track_intent(self, event: ui_pb2.IntentEvent) -> str:
        """Counts a webview's intent by action (a known action, else "other"); returns the label.
        Nothing of it is stored: it is telemetry (counted on /metrics, an attribute of the call's span)."""
        for name in ("action", "source"):
            value = getattr(event, name)
            if len(value) > MAX_INTENT_FIELD_CHARS:
                raise InvalidArgument(f"{name} is {len(value)} characters; the limit is {MAX_INTENT_FIELD_CHARS}")
        if event.text_length < 0:
            raise InvalidArgument(f"text_length={event.text_length} is negative")
        action = event.action if event.action in INTENT_ACTIONS else "other"
        self.intents[action] = self.intents.get(action, 0) + 1
        return action

    # ---- announcements ----

    async def announcement(self, session: str) -> Announcement:
        state = await self.store.get(session, ANNOUNCEMENT_KEY) or {}
        return Announcement(state.get("latest", ""), state.get("last_shown", ""))

    async def set_announcement(self, session: str, latest: str) -> Announcement:
        shown = (await self.announcement(session)).last_shown
        await self.store.put(session, ANNOUNCEMENT_KEY, {"latest": latest, "last_shown": shown})
        return Announcement(latest, shown)

    async def announcement_shown(self, session: str) -> None:
        """Marks the session's latest announcement as shown."""
        latest = (await self.announcement(session)).latest
        await self.store.put(session, ANNOUNCEMENT_KEY, {"latest": latest, "last_shown": latest})
