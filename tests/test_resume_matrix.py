"""Resuming every session stream that takes a cursor, in every situation (docs/streams/resume.md):
one table of stream kinds times one table of scenarios, on real servers over loopback.

Kinds: Cline's `subscribeToPartialMessage`, `WebviewService/Subscribe` (its partial messages,
and with `extension_ui` its extension-UI part), `ExtensionUiService/Subscribe`, the host's
`SubscribeHostRequests` (all with the `x-uibus-since` metadata), and ACP's `session/resume` with
`_meta {"uibus/since": N}` (the ACP SDK's client app over the WebSocket `/acp`).

Scenarios, each one cell per kind: the client sees an event and takes its cursor, goes away,
events are published meanwhile, and it resumes from the cursor —
* `same`: on the same server: exactly the missed events, once, in order, then a live one;
* `restart`: the missed events published before a restart of the server (embedded SQLite store,
  the same file), resumed after it;
* `replicas`: seen and published on replica A, resumed on replica B (one redis-server);
* `gap`: on a server whose log keeps 4 events (`--log-max-events 4`), more are published
  meanwhile: the cursor is too old and the stream says so as its kind does ("The gap"), then live.

The servers are shared by every cell (module scope): one restartable embedded server, one pair of
replicas, one server with the small log; each cell uses a session of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

import pytest
import pytest_asyncio

from tests.acpkit import need, prompt, seqs_of
from tests.conftest import Reader, free_port, start_app, wait_for
from tests.redisproc import RedisProcess
from tests.support import ext, needs
from tests.test_acp_serve import CWD, EditorProc, editor
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2, webview_pb2, webview_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]
SMALL_LOG = 4  # --log-max-events of the `gap` scenario's server
WAIT_S = 5.0  # the longest any one event is waited for


# ---- the servers --------------------------------------------------------------------------------


class Server:
    """One embedded uibus (its SQLite store in a file), restartable on the same store and ports."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app: App | None = None

    async def start(self) -> App:
        self.app = await start_app(self.config)
        return self.app

    async def restart(self) -> App:
        await self.stop()
        return await self.start()

    async def stop(self) -> None:
        if self.app is not None:
            app, self.app = self.app, None
            await wait_for(lambda: app.bus.count() == 0, WAIT_S, what="every stream ended")
            await app.aclose(grace=1.0)


@dataclass
class Servers:
    solo: Server  # same, restart
    small: Server  # gap
    a: App  # replicas
    b: App


@pytest_asyncio.fixture(scope="module", loop_scope="module")
@needs("redis")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Servers]:
    tmp = tmp_path_factory.mktemp("matrix")
    base = Config(host="127.0.0.1", port=0, grace_seconds=1.0)
    redis = RedisProcess(tmp)
    solo = Server(replace(base, http_port=free_port(), store=str(tmp / "solo.db")))
    small = Server(replace(base, http_port=free_port(), store=str(tmp / "small.db"), log_max_events=SMALL_LOG))
    pair: list[App] = []
    try:
        await solo.start()
        await small.start()
        for name in "ab":
            pair.append(await start_app(replace(base, http_port=free_port(), store=str(tmp / f"{name}.db"),
                                                redis_url=redis.url)))
        await wait_for(lambda: all(x.bus.connected for x in pair), WAIT_S, what="both replicas on redis")
        yield Servers(solo, small, *pair)
    finally:
        for app in pair:
            await app.aclose(grace=1.0)
        for server in (solo, small):
            await server.stop()
        redis.kill()
    for app in pair:
        assert app.bus.count() == 0, "a subscription was left behind"


@dataclass
class Place:
    """Where a cell's client first reads, where it resumes, and what happens in between."""

    first: Callable[[], App]  # the server the client reads from first and events are published on
    between: Callable[[str], Awaitable[None]]  # after the events meanwhile (the session's id)
    resumed: Callable[[], App]  # the server the client resumes on
    live: Callable[[], App]  # the server the live event after the resume is published on
    meanwhile: int  # how many events are published while the client is away


def place(scenario: str, s: Servers) -> Place:
    async def nothing(session: str) -> None:
        pass

    async def restart(session: str) -> None:
        await s.solo.restart()

    def solo() -> App:
        assert s.solo.app is not None
        return s.solo.app

    def small() -> App:
        assert s.small.app is not None
        return s.small.app

    return {
        "same": Place(solo, nothing, solo, solo, 2),
        "restart": Place(solo, restart, solo, solo, 2),
        "replicas": Place(lambda: s.a, nothing, lambda: s.b, lambda: s.a, 2),
        "gap": Place(small, nothing, small, small, SMALL_LOG + 3),
    }[scenario]


SCENARIOS = ["same", "restart", "replicas", "gap"]


# ---- the gRPC stream kinds ----------------------------------------------------------------------


def _since(session: str, since: int | None) -> tuple[tuple[str, str], ...]:
    return (("x-uibus-session", session),) + ((("x-uibus-since", str(since)),) if since is not None else ())


def _say(n: int) -> ui_pb2.ClineMessage:
    return ui_pb2.ClineMessage(ts=n, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=f"m{n}")


async def _publish_message(conn: Connection, n: int) -> None:
    await conn.host.PublishPartialMessage(_say(n))


async def _publish_status(conn: Connection, n: int) -> None:
    await ext(conn).SetStatus(extension_ui_pb2.SetStatusRequest(key=f"k{n}", text=f"v{n}"))


async def _publish_host_request(conn: Connection, n: int) -> None:
    await conn.ui.scrollToSettings(common_pb2.StringRequest(value=f"s{n}"))


def _status_n(event: extension_ui_pb2.ExtensionUiEvent) -> int | None:
    if event.HasField("request") and event.request.HasField("set_status"):
        return int(event.request.set_status.key[1:])
    return None


def _webview(conn: Connection, session: str, since: int | None, extension_ui: bool) -> Any:
    request = webview_pb2.WebviewSubscribeRequest(client_id="matrix", mark_replay_end=True, extension_ui=extension_ui)
    return webview_pb2_grpc.WebviewServiceStub(conn.channel).Subscribe(request, metadata=_since(session, since))


async def _until_replay_complete(reader: Reader) -> list[Any]:
    events: list[Any] = []
    while not (events and events[-1].replay_complete):
        events.append(await reader.next(WAIT_S))
    return events


@dataclass(frozen=True)
class Kind:
    """One stream kind: how to open it (with a cursor or none), publish the event numbered n on
    it, and read an event's number (None: not one of ours, as the theme) and position."""

    name: str
    open: Callable[[Connection, str, int | None], Any]
    publish: Callable[[Connection, int], Awaitable[None]]
    number: Callable[[Any], int | None]
    seq: Callable[[Any], int]
    # Reads the answer to a too-old cursor (after the cell's first event, `first`, and the events
    # 2..last published meanwhile) and asserts it is the kind's explicit gap.
    gap: Callable[[Reader, Any, int], Awaitable[None]]
    # Its publish returns once the event is committed to the session's log (a final ClineMessage, an
    # extension-UI event); else the event is written behind, committed within LOG_WRITE_S (a request
    # of the host: docs/streams/resume.md), and a replica reads it after that.
    durable: bool = True


async def _cline_gap(reader: Reader, first: Any, last: int) -> None:
    """A full snapshot at a new epoch: the kept messages, stamped again under a new epoch."""
    kept = [await reader.next(WAIT_S) for _ in range(SMALL_LOG)]
    assert [m.ts for m in kept] == list(range(last - SMALL_LOG + 1, last + 1))
    assert {m.epoch for m in kept} == {kept[0].seq} and kept[0].epoch > first.epoch


async def _webview_gap(reader: Reader, first: Any, last: int) -> None:
    """One `gap` event (source: the stream), then the kept messages, replayed."""
    events = await _until_replay_complete(reader)
    gaps = [i for i, e in enumerate(events) if e.gap]
    assert len(gaps) == 1 and events[gaps[0]].source == "subscribeToPartialMessage", events
    shown = [(i, e) for i, e in enumerate(events) if e.HasField("partial_message")]
    assert all(i > gaps[0] and e.replayed for i, e in shown)
    assert [e.partial_message.ts for _, e in shown] == list(range(last - SMALL_LOG + 1, last + 1))


async def _webview_extension_ui_gap(reader: Reader, first: Any, last: int) -> None:
    """`extension_ui.gap`, then the extension-UI snapshot (every status kept), replayed."""
    events = [e for e in await _until_replay_complete(reader) if e.HasField("extension_ui")]
    assert [e.extension_ui.gap for e in events].count(True) == 1 and events[0].extension_ui.gap, events
    snapshot = events[1:]
    assert all(e.extension_ui.request.replayed for e in snapshot)
    assert sorted(_status_n(e.extension_ui) or 0 for e in snapshot) == list(range(1, last + 1))


async def _extension_ui_gap(reader: Reader, first: Any, last: int) -> None:
    """One event with `gap`, then the snapshot (every status kept), replayed."""
    gap = await reader.next(WAIT_S)
    assert gap.gap and not gap.HasField("request"), gap
    snapshot = [await reader.next(WAIT_S) for _ in range(last)]
    assert all(e.request.replayed for e in snapshot)
    assert sorted(_status_n(e) or 0 for e in snapshot) == list(range(1, last + 1))


async def _host_gap(reader: Reader, first: Any, last: int) -> None:
    """One HostRequest with `gap` and no request in it."""
    gap = await reader.next(WAIT_S)
    assert gap.gap and gap.WhichOneof("request") is None, gap


KINDS = [
    Kind("cline", lambda conn, session, since: conn.ui.subscribeToPartialMessage(
             common_pb2.EmptyRequest(), metadata=_since(session, since)),
         _publish_message, lambda m: m.ts, lambda m: m.seq, _cline_gap),
    Kind("webview", lambda conn, session, since: _webview(conn, session, since, False), _publish_message,
         lambda e: e.partial_message.ts if e.HasField("partial_message") else None,
         lambda e: e.partial_message.seq, _webview_gap),
    Kind("webview_extension_ui", lambda conn, session, since: _webview(conn, session, since, True), _publish_status,
         lambda e: _status_n(e.extension_ui) if e.HasField("extension_ui") else None,
         lambda e: e.extension_ui.seq, _webview_extension_ui_gap),
    Kind("extension_ui", lambda conn, session, since: ext(conn).Subscribe(
             extension_ui_pb2.SubscribeRequest(), metadata=_since(session, since)),
         _publish_status, _status_n, lambda e: e.seq, _extension_ui_gap),
    Kind("host_requests", lambda conn, session, since: conn.host.SubscribeHostRequests(
             common_pb2.Empty(), metadata=_since(session, since)),
         _publish_host_request, lambda r: int(r.scroll_to_settings.section[1:] or 0) or None, lambda r: r.seq,
         _host_gap, durable=False),
]


async def _ours(reader: Reader, kind: Kind) -> Any:
    """The next event of ours (skipping the theme, the replay marker and such)."""
    while True:
        event = await reader.next(WAIT_S)
        if kind.number(event) is not None:
            return event


async def _subscribed(kind: Kind, reader: Reader, app: App, session: str) -> None:
    """The stream is live on `app` (so what is published next is news, not its snapshot)."""
    if kind.name.startswith("webview"):
        await _until_replay_complete(reader)  # every stream of the webview's has started
    await wait_for(lambda: app.bus.count(session=session) > 0, WAIT_S, what=f"{kind.name} subscribed")


async def _ended(apps: list[App], session: str) -> None:
    """Every stream of the cell's session has ended on every server it used."""
    await wait_for(lambda: all(app.bus.count(session=session) == 0 for app in apps), 10,
                   what=f"{session}'s streams ended")


async def _quiet(reader: Reader, kind: Kind) -> None:
    """Nothing of ours arrives within 0.3 s: nothing twice, nothing extra."""
    try:
        async with asyncio.timeout(0.3):
            event = await _ours(reader, kind)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected {event}")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
async def test_grpc_stream_resumes_from_its_cursor(servers: Servers, kind: Kind, scenario: str) -> None:
    where = place(scenario, servers)
    session = f"{kind.name}-{scenario}"
    async with AsyncExitStack() as stack:
        def connect(app: App) -> Connection:
            conn = Connection(f"127.0.0.1:{app.port}", session=session)
            stack.push_async_callback(conn.close)
            return conn

        conn = connect(where.first())
        reader = Reader(kind.open(conn, session, None))
        await _subscribed(kind, reader, where.first(), session)
        await kind.publish(conn, 1)
        first = await _ours(reader, kind)
        assert kind.number(first) == 1 and kind.seq(first) > 0
        cursor = kind.seq(first)
        reader.cancel()  # the client goes away
        for n in range(2, 2 + where.meanwhile):
            await kind.publish(conn, n)
        last = 1 + where.meanwhile
        await conn.close()
        await where.between(session)
        if scenario in ("replicas", "gap") and not kind.durable:
            await where.first().core.feed.log.flush(session)  # as LOG_WRITE_S later: committed (and trimmed)

        back = Reader(kind.open(connect(where.resumed()), session, cursor))
        if scenario == "gap":
            await kind.gap(back, first, last)
            resumed_to = 0
        else:
            missed = [await _ours(back, kind) for _ in range(where.meanwhile)]
            assert [kind.number(e) for e in missed] == list(range(2, last + 1))  # exactly the missed ones, in order
            seqs = [kind.seq(e) for e in missed]
            assert seqs == sorted(set(seqs)) and seqs[0] > cursor, seqs
            resumed_to = seqs[-1]
        await _quiet(back, kind)  # once
        await wait_for(lambda: where.resumed().bus.count(session=session) > 0, WAIT_S, what="resumed stream live")
        live_conn = connect(where.live())
        await kind.publish(live_conn, last + 1)
        live = await _ours(back, kind)
        assert kind.number(live) == last + 1 and kind.seq(live) > resumed_to  # then live
        await _quiet(back, kind)
        back.cancel()
    await _ended([where.resumed(), where.live()], session)


# ---- ACP session/resume ---------------------------------------------------------------------------


def _ws(app: App) -> str:
    return f"ws://127.0.0.1:{app.http_port}/acp"


async def _editor(app: App, editors: list[EditorProc]) -> EditorProc:
    ed = await editor("ws", _ws(app))
    editors.append(ed)
    await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    return ed


@pytest.mark.node
@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_acp_session_resume_from_its_cursor(servers: Servers, scenario: str) -> None:
    need("@agentclientprotocol/sdk")
    where = place(scenario, servers)
    editors: list[EditorProc] = []
    try:
        one = await _editor(where.first(), editors)
        session = (await one.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
        answered = await one.answer_of(one.start("session/prompt", prompt(session, "turn 1")))
        assert answered["ev"] == "response", answered
        cursor = answered["meta"]["uibus/seq"]
        await one.close()  # the editor goes away; the session goes on without it

        other = await _editor(where.first(), editors)  # another editor of the session publishes meanwhile
        assert await other.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
        mark = len(other.events)
        last = 1 + (where.meanwhile if scenario != "gap" else SMALL_LOG)
        for n in range(2, last + 1):
            await other.call("session/prompt", prompt(session, f"turn {n}"))
        missed = other.text(session, start=mark)
        assert f'You said: "turn {last}"' in missed
        if scenario == "restart":
            await other.close()
        await where.between(session)

        later = await _editor(where.resumed(), editors)  # the editor again, with its cursor
        resume = {"sessionId": session, "cwd": CWD, "mcpServers": [], "_meta": {"uibus/since": cursor}}
        answer = await later.answer_of(later.start("session/resume", resume))
        assert answer["ev"] == "response", answer
        seqs = seqs_of(later, session)
        if scenario == "gap":
            assert answer["meta"]["uibus/gap"] is True, answer  # the gap said, and the history whole
            assert f'You said: "turn {last}"' in later.text(session)
        else:
            assert "uibus/gap" not in answer.get("meta", {}), answer
            assert later.text(session) == missed  # exactly what followed the cursor, once, in order
            assert seqs and None not in seqs and seqs == sorted(seqs) and min(seqs) > cursor  # type: ignore
            assert answer["meta"]["uibus/seq"] == max(seqs)  # type: ignore[type-var]
        mark = len(later.events)
        if scenario == "restart":  # the editor that published went with the server
            other = await _editor(where.live(), editors)
            assert await other.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
        await other.call("session/prompt", prompt(session, "live"))  # then live, on the resumed subscription
        await later.until(lambda _: 'You said: "live"' in later.text(session, start=mark), WAIT_S, "the live turn")
        live = seqs_of(later, session, mark)
        assert None not in live and min(live) > max(s for s in seqs if s is not None)  # type: ignore
    finally:
        for ed in editors:
            if ed.proc.returncode is None:
                await ed.close()
    await _ended([where.first(), where.resumed(), where.live()], session)
