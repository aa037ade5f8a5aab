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

import asyncio
import base64
import binascii
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from uibus import kinds
from uibus.bus import LIVE, Bus, Live
from uibus.domain.clock import TsClock
from uibus.errors import FailedPrecondition, InvalidArgument, StoreFull, StoreUnavailable
from uibus.json_input import load_json
from uibus.kinds import Kind
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2
from uibus.store import Store

log = logging.getLogger("uibus.feed")

THEME_KEY = "ui/theme"
ANNOUNCEMENT_KEY = "ui/announcement"  # {"latest": id, "last_shown": id}
# The latest state of each of the session's recent messages (RecentMessages), what a webview opened
# later starts with: {"<ts>": base64 of the serialized ClineMessage, ...}, oldest first; finished
# messages in the first key, messages still growing (partial) in the second.
RECENT_KEY = "ui/recent"
RECENT_PARTIAL_KEY = "ui/recent-partial"
MAX_RECENT = 200  # messages kept per session (and per key): the newest by ts
MAX_RECENT_BYTES = 256 * 1024  # per key, only the newest within this many bytes (the newest always)
RECENT_WRITE_S = 0.25  # a session is written at most once per this (at once when it was not just written)
MAX_URL_CHARS = 2048
MAX_THEME_CHARS = 256 * 1024
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
    return host_pb2.HostRequest(id=uuid.uuid4().hex, ts=int(time.time() * 1000), **what)


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


def _encode(message: ui_pb2.ClineMessage) -> str:
    """A message as stored: base64 of its protobuf bytes (every field kept exactly, unlike a
    hand-picked JSON shape, and about ten times cheaper than proto3 JSON both ways)."""
    return base64.b64encode(message.SerializeToString()).decode("ascii")


def _decode(data: Any) -> ui_pb2.ClineMessage | None:
    """The stored message, or None for an entry that is not one (never fails a reader)."""
    if not isinstance(data, str):
        return None
    try:
        return ui_pb2.ClineMessage.FromString(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None


class RecentMessages:
    """The latest state of each session's recent ClineMessages, kept in the store so a webview
    opened later (or reloaded) starts with the conversation so far.

    Write-behind, because publishing a partial message must stay cheap and never await (a reply
    grows many times a second, and `UiFeed.say` runs in cancel paths): `note` only records the
    message in memory. A session's noted states are written in one go at once when the session was
    not written in the last `write_s`, else at the end of that interval; so a session costs at most
    one write per `write_s` however fast it publishes, and a message that stops changing is stored
    within `write_s`. One write per session is in flight at a time, so an older state never
    overwrites a newer one; `read` merges the store with what is still in memory, so on this
    process a message can be replayed the moment it is published. With several replicas each
    message is written by the replica it was published on (`Store.update` is atomic across them).

    Two keys, so that a streaming reply does not rewrite the whole conversation every `write_s`:
    finished messages (`partial` false) in RECENT_KEY, written only when a message finishes, and
    messages still growing in RECENT_PARTIAL_KEY (usually one or two, so a cheap write); a message
    moves from the second to the first when it finishes. Each key holds the newest `max_messages`
    by ts, and of those only the newest whose encoded sizes sum to at most `max_bytes` (the newest
    one is always kept, as the store's lists keep their newest entry); `read` gives the newest
    `max_messages` of both. Memory holds at most 2 x `max_messages` unwritten states per session,
    only until its next write. The writes are ordinary store writes (they stamp the session's
    activity, and retention deletes the keys with the session). A failed write is dropped, counted
    in `write_failures`: the store already logs and reports its failures, and live delivery never
    depended on it.
    """

    def __init__(self, store: Store, *, max_messages: int = MAX_RECENT, max_bytes: int = MAX_RECENT_BYTES,
                 write_s: float = RECENT_WRITE_S) -> None:
        self.store = store
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.write_s = write_s
        self.write_failures = 0
        self._pending: dict[str, dict[int, ui_pb2.ClineMessage]] = {}  # noted, not yet being written
        self._writing: dict[str, dict[int, ui_pb2.ClineMessage]] = {}  # the batch whose write is in flight
        self._cooling: dict[str, asyncio.TimerHandle] = {}  # written less than write_s ago: the next write
        self._tasks: set[asyncio.Task[None]] = set()

    def note(self, session: str, message: ui_pb2.ClineMessage) -> None:
        """Records `message` as its ts's latest state and makes sure it gets written. The message is
        kept as it is (not copied): callers hand over a message they no longer change."""
        pending = self._pending.get(session)
        if pending is None:
            pending = self._pending[session] = {}
        pending[message.ts] = message
        if len(pending) > 2 * self.max_messages:
            for ts in sorted(pending)[:-self.max_messages]:
                del pending[ts]
        if session not in self._cooling and session not in self._writing:
            self._start(session)

    def _start(self, session: str) -> None:
        """Starts writing what the session has pending, in a task (the caller must not wait)."""
        self._cooling.pop(session, None)
        batch = self._pending.pop(session, None)
        if not batch:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): nothing can write, as a failed write
            self.write_failures += 1
            return
        task = loop.create_task(self._write(session, batch))
        self._writing[session] = batch
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, session: str, batch: dict[int, ui_pb2.ClineMessage]) -> None:
        try:
            newest = sorted(batch)[-self.max_messages:]
            done = {str(ts): _encode(batch[ts]) for ts in newest if not batch[ts].partial}
            growing = {str(ts): _encode(batch[ts]) for ts in newest if batch[ts].partial}
            if done:
                await self.store.update(session, RECENT_KEY, lambda current: self._merge(current, done))
            await self.store.update(session, RECENT_PARTIAL_KEY,
                                    lambda current: self._merge(current, growing, done) or None)
        except (StoreUnavailable, StoreFull):
            self.write_failures += 1
        except Exception as exc:  # a bug of ours must not stop the session's writes
            self.write_failures += 1
            log.error("recent messages not stored", exc_info=exc, extra={"fields": {"session": session}})
        finally:
            self._writing.pop(session, None)
        self._cooling[session] = asyncio.get_running_loop().call_later(self.write_s, self._start, session)

    def _merge(self, current: Any, add: dict[str, str], remove: dict[str, str] | None = None) -> dict[str, str]:
        """The stored value with `add` merged in and `remove`'s keys taken out, within the bounds,
        oldest first (pure: Store.update may run it again after a conflict)."""
        entries = {k: v for k, v in current.items() if k.isdigit()} if isinstance(current, dict) else {}
        for key in remove or ():
            entries.pop(key, None)
        entries.update(add)
        kept: list[str] = []
        total = 0
        for key in sorted(entries, key=int, reverse=True)[:self.max_messages]:
            size = len(key) + len(entries[key]) + 6  # as JSON: two pairs of quotes, a colon, a comma
            if kept and total + size > self.max_bytes:
                break
            kept.append(key)
            total += size
        return {key: entries[key] for key in reversed(kept)}

    async def read(self, session: str) -> dict[int, ui_pb2.ClineMessage]:
        """The latest state of the session's recent messages by ts (the newest `max_messages`): what
        is stored (a finished state over a growing one), overridden by what this process noted and
        has not written yet."""
        growing = await self.store.get(session, RECENT_PARTIAL_KEY)
        done = await self.store.get(session, RECENT_KEY)
        messages: dict[int, ui_pb2.ClineMessage] = {}
        for stored in (growing, done):
            if isinstance(stored, dict):
                for key, data in stored.items():
                    message = _decode(data)
                    if message is not None and key.isdigit():
                        messages[int(key)] = message
        for batch in (self._writing.get(session), self._pending.get(session)):  # read after the awaits
            if batch:
                messages.update(batch)
        if len(messages) > self.max_messages:
            messages = {ts: messages[ts] for ts in sorted(messages)[-self.max_messages:]}
        return messages

    async def flush(self) -> None:
        """Writes everything noted now and waits for every write (tests; a shutdown that wants it)."""
        while True:
            for session in list(self._pending):
                if session not in self._writing:
                    timer = self._cooling.pop(session, None)
                    if timer is not None:
                        timer.cancel()
                    self._start(session)
            if not self._tasks:
                return
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class UiFeed:
    def __init__(self, bus: Bus, store: Store, clock: TsClock, *, recent: RecentMessages | None = None) -> None:
        """`recent` keeps the sessions' recent messages (by default with the module's bounds)."""
        self.bus = bus
        self.store = store
        self.clock = clock
        self.recent = recent if recent is not None else RecentMessages(store)

    # ---- webviews: streams ----

    async def events(self, session: str, stream: UiStream, target: str = "", *,
                     replay: bool = False) -> AsyncIterator[Any]:
        """The stream's events until it ends: `LIVE` once subscribed (the pipeline sends the
        response headers then), the current state where the stream has one, then live events.

        With `replay` (WebviewService; never cline.UiService, whose subscribeToPartialMessage stays
        live only, as in Cline) the partial-message stream starts with the session's recent
        messages, oldest ts first, and what a stream starts with comes wrapped in `Replayed`.

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
            if replay and stream.kind is kinds.PARTIAL_MESSAGE:
                # Read after subscribing, so nothing published meanwhile is missed. What the mailbox
                # got since then is taken into the replay (it is the same as, or newer than, what was
                # read for its ts), so it is neither sent twice nor sent older after newer.
                recent = await self.recent.read(session)
                while len(sub):
                    item = await anext(sub)
                    recent[item.ts] = item
                for ts in sorted(recent):
                    yield Replayed(recent[ts])
            async for item in sub:
                yield item
        finally:
            bus.unsubscribe(sub)

    async def host_requests(self, session: str) -> AsyncIterator[host_pb2.HostRequest | Live]:
        """What the session's webviews ask of the host (open a URL, scroll, initialized); `LIVE` first."""
        bus = self.bus
        sub = bus.subscribe(session, kinds.HOST_REQUEST)
        try:
            await bus.ready(session)
            yield LIVE
            async for item in sub:
                yield item
        finally:
            bus.unsubscribe(sub)

    # ---- hosts: publishing (each returns how many subscribers the event reached) ----

    def add_to_input(self, session: str, text: str) -> int:
        return self.bus.publish(session, kinds.ADD_TO_INPUT, common_pb2.String(value=text))

    def click(self, session: str, button: int, provider_type: int | None = None) -> int:
        """A button click; a typed click reaches the webviews that subscribed with that type."""
        kind = _BUTTONS.get(button)
        if kind is None:
            raise InvalidArgument(f"button={button} is not one of MCP, HISTORY, CHAT, ACCOUNT, SETTINGS")
        target = None
        if provider_type is not None:
            if provider_type not in _PROVIDER_TYPES:
                raise InvalidArgument(f"provider_type={provider_type} is not SIDEBAR (0) or TAB (1)")
            if kind in _BY_PROVIDER:
                target = ui_pb2.WebviewProviderType.Name(provider_type)
        return self.bus.publish(session, kind, _EMPTY, target=target)

    def publish_message(self, session: str, message: ui_pb2.ClineMessage) -> int:
        """A (partial) ClineMessage as the host sent it; the bus coalesces its states by ts."""
        problem = check_cline_message(message)
        if problem:
            raise InvalidArgument(problem)
        self.recent.note(session, message)
        return self.bus.publish(session, kinds.PARTIAL_MESSAGE, message, key=message.ts)

    def say(self, session: str, text: str, say: int = ui_pb2.TEXT, *, ts: int = 0, partial: bool = False) -> int:
        """A SAY message of uibus's own (chat replies, CodeBolt messages); `ts` from `clock`."""
        ts = ts or self.clock.next()
        msg = ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=say, text=text, partial=partial)  # type: ignore[arg-type]
        self.recent.note(session, msg)
        return self.bus.publish(session, kinds.PARTIAL_MESSAGE, msg, key=ts)

    def remember_question(self, session: str, text: str) -> int:
        """Keeps a user's chat question among the session's recent messages (a SAY USER_FEEDBACK)
        without publishing it: a page opened later replays the conversation with its questions,
        while live UIs see exactly what they saw before (Cline's webview renders its own input)."""
        ts = self.clock.next()
        self.recent.note(session, ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.USER_FEEDBACK, text=text))
        return ts

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

    # ---- webviews: requests of the host ----

    def scroll_to_settings(self, session: str, section: str) -> int:
        return self.bus.publish(session, kinds.HOST_REQUEST, _host_request(
            scroll_to_settings=host_pb2.ScrollToSettings(section=section)))

    async def initialize_webview(self, session: str) -> None:
        """Tells the host, and replays the current theme so every stream of the session is fresh."""
        self.bus.publish(session, kinds.HOST_REQUEST, _host_request(webview_initialized=host_pb2.WebviewInitialized()))
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
        if not self.bus.publish(session, kinds.HOST_REQUEST, _host_request(open_url=host_pb2.OpenUrl(url=url))):
            raise FailedPrecondition(f"no host is subscribed to host requests of session {session!r}; "
                                     "nothing can open the URL")

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
