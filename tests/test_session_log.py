"""The session log (uibus.domain.session_log): seq and epoch on every ClineMessage, coalescing,
retention with its floor, and resuming streams from a cursor (`x-uibus-since`) — on real servers
over real gRPC, across a restart (the SQLite file) and from one replica to another (Redis)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import Reader, running, start_app, wait_for
from tests.redisproc import RedisProcess, redis_cluster, redis_cluster_clean, redis_server
from uibus.clients.connection import Connection
from uibus.domain.session_log import MESSAGE, SessionLog, new_key
from uibus.infra.config import Config
from uibus.infra.sqlite_store import SqliteStore
from uibus.infra.store import LogEntry, LogRetention
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2, webview_pb2, webview_pb2_grpc

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server"]  # the fixtures, imported to be used here
pytestmark = pytest.mark.timeout(120)
EMPTY = common_pb2.EmptyRequest()


def _say(ts: int, text: str, partial: bool = False) -> ui_pb2.ClineMessage:
    return ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text, partial=partial)


def _since(seq: int) -> tuple[tuple[str, str], ...]:
    return (("x-uibus-since", str(seq)),)


async def _drain(reader: Reader, n: int) -> list[ui_pb2.ClineMessage]:
    return [await reader.next() for _ in range(n)]


async def _quiet(reader: Reader) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await reader.next(timeout=0.3)


# ---- the store's log --------------------------------------------------------------------------


def _entry(seq: int, key: str, size: int = 10, at: float = 0.0) -> LogEntry:
    return LogEntry(seq, MESSAGE, key, 1, at, b"x" * size)


async def test_sqlite_log_coalesces_and_keeps_within_count_bytes_and_age(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "log.db"))
    try:
        keep = LogRetention(max_entries=5, max_bytes=0, max_age_s=0)
        await store.log_append("s", [_entry(1, "a"), _entry(2, "b"), _entry(3, "a")], keep)
        read = await store.log_read("s")
        assert [(e.seq, e.key) for e in read.entries] == [(2, "b"), (3, "a")] and read.floor == 0
        await store.log_append("s", [_entry(s, f"k{s}") for s in range(4, 10)], keep)
        read = await store.log_read("s")
        assert [e.seq for e in read.entries] == [5, 6, 7, 8, 9] and read.floor == 4  # count: the oldest went
        assert [e.seq for e in (await store.log_read("s", 7)).entries] == [8, 9]
        await store.log_append("s", [_entry(10, "big", 100)], LogRetention(max_entries=0, max_bytes=120, max_age_s=0))
        read = await store.log_read("s")
        assert [e.seq for e in read.entries] == [8, 9, 10] and read.floor == 7  # bytes: 10 + 10 + 100
        await store.log_append("s", [_entry(11, "huge", 1000)], LogRetention(max_entries=0, max_bytes=10, max_age_s=0))
        assert [e.seq for e in (await store.log_read("s")).entries] == [11]  # the newest always stays
        old = LogRetention(max_entries=0, max_bytes=0, max_age_s=0.05)
        await asyncio.sleep(0.1)
        await store.log_append("s", [_entry(12, "new")], old)
        read = await store.log_read("s")
        assert [e.seq for e in read.entries] == [12] and read.floor == 11  # age
        assert await store.log_head("s") == (12, 1)
        assert await store.drop_session("s")
        assert (await store.log_read("s")).entries == [] and await store.log_head("s") == (0, 0)
    finally:
        await store.close()


def _news(log: SessionLog) -> list[bool]:
    """`new` of the session's stamped entries not yet committed (the first goes to a write at once)."""
    return [e.new for batch in (log._writing.get("s", {}), log._pending.get("s", {})) for e, _ in batch.values()]


async def test_a_message_ts_above_the_log_is_new_and_one_it_holds_replaces_across_a_restart(tmp_path: Path) -> None:
    """A ClineMessage whose ts is above every one the session's log holds (the store says its highest
    at `prepare`, across a restart too) is stamped `new` (SQLite skips the look-up of a row to
    replace); one the log holds is not, and its final state replaces the stored row. `flush` commits
    inline on SQLite (no write task left running) and the count retention keeps by stays exact."""
    path = str(tmp_path / "log.db")
    keep = LogRetention(max_entries=3, max_bytes=0, max_age_s=0)
    store = SqliteStore(path)
    try:
        log = SessionLog(store, retention=keep)
        await log.prepare("s")
        assert not log._pending.get("s") and log._heads["s"].top_known
        for ts in (10, 20):
            log.stamp("s", _say(ts, "first"))
        assert _news(log) == [True, True]
        await log.flush("s")
        assert not log._writing and not log._pending.get("s") and log.appended == 2
        await log.aclose()
    finally:
        await store.close()
    store = SqliteStore(path)
    try:
        log = SessionLog(store, retention=keep)
        await log.prepare("s")
        log.stamp("s", _say(10, "final"))  # held by the log: replaces its row
        log.stamp("s", _say(15, "between"))  # below the highest held, unknown: looked up
        log.stamp("s", _say(30, "new"))
        assert _news(log) == [False, False, True]
        await log.flush("s")
        read = await store.log_read("s")
        assert [(e.key, ui_pb2.ClineMessage.FromString(e.data).text) for e in read.entries] == [
            ("10", "final"), ("15", "between"), ("30", "new")] and read.floor > 0  # 20 went: four kept three
        await log.aclose()
    finally:
        await store.close()


async def test_sqlite_log_keeps_count_and_bytes_of_new_key_entries(tmp_path: Path) -> None:
    """Entries whose key was just made (`new`: host requests) skip SQLite's look-up of an older row
    of their key; the count and bytes retention keeps by stay exact beside replaced entries."""
    store = SqliteStore(str(tmp_path / "log.db"))
    try:
        keep = LogRetention(max_entries=4, max_bytes=0, max_age_s=0)
        fresh = [LogEntry(s, "host_request", new_key(), 1, 0.0, b"x" * 10, new=True) for s in (1, 2, 3)]
        await store.log_append("s", [*fresh, _entry(4, "a")], keep)
        await store.log_append("s", [_entry(5, "a")], keep)  # replaces seq 4: still four entries
        read = await store.log_read("s")
        assert [e.seq for e in read.entries] == [1, 2, 3, 5] and read.floor == 0
        await store.log_append("s", [LogEntry(6, "host_request", new_key(), 1, 0.0, b"y" * 10, new=True)], keep)
        read = await store.log_read("s")
        assert [e.seq for e in read.entries] == [2, 3, 5, 6] and read.floor == 1  # counted: the oldest went
        assert [e.key for e in read.entries[:2]] == [fresh[1].key, fresh[2].key]
        assert len({e.key for e in fresh}) == 3 and all(len(e.key) == 32 for e in fresh)
        await store.log_append("s", [_entry(7, "big", 100)], LogRetention(max_entries=0, max_bytes=125, max_age_s=0))
        assert [e.seq for e in (await store.log_read("s")).entries] == [5, 6, 7]  # bytes: 10 + 10 + 100
    finally:
        await store.close()


async def _redis_log_semantics(store: Any) -> None:
    keep = LogRetention(max_entries=3, max_bytes=0, max_age_s=0)
    for session in ("s", "t", ""):  # sessions in different slots on a cluster ("" has a tag of its own)
        await store.log_append(session, [_entry(1, "a"), _entry(2, "b"), _entry(3, "a")], keep)
        assert [(e.seq, e.key) for e in (await store.log_read(session)).entries] == [(2, "b"), (3, "a")]
        await store.log_append(session, [_entry(4, "c"), _entry(5, "d")], keep)
        read = await store.log_read(session, 2)
        assert [e.seq for e in read.entries] == [3, 4, 5] and read.floor == 2
        assert [e.seq for e in (await store.log_read(session, last=2)).entries] == [4, 5]
        assert await store.log_head(session) == (5, 1)
        big = 1796 * 10**12 + 123  # a real seq (wall-clock microseconds): beyond what Lua prints plainly
        await store.log_append(session, [_entry(big, "e"), _entry(big + 1, "a")], keep)
        assert [e.seq for e in (await store.log_read(session, 5)).entries] == [big, big + 1]
        assert session in [s for s, _ in await store.sessions()]  # a log write stamps the session
        assert await store.drop_session(session)
        assert (await store.log_read(session)).entries == [] and await store.log_head(session) == (0, 0)


async def test_redis_streams_log(redis_server: RedisProcess) -> None:
    from uibus.infra.redis import RedisStore

    store = RedisStore(redis_server.url, "logtest")
    try:
        await _redis_log_semantics(store)
    finally:
        await store.close()


async def test_redis_streams_log_on_a_cluster(redis_cluster_clean: Any) -> None:
    """Each session's stream and index share the session's hash slot: no CROSSSLOT anywhere."""
    from uibus.infra.redis import RedisStore

    store = RedisStore(redis_cluster_clean.url, "logtest", cluster=True)
    try:
        await _redis_log_semantics(store)
    finally:
        await store.close()


# ---- stamping ---------------------------------------------------------------------------------


async def test_seq_grows_across_a_restart_and_the_epoch_stays(config: Config) -> None:
    async with running(config) as app, Connection(f"127.0.0.1:{app.port}", session="r") as conn:
        reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY))
        await wait_for(lambda: app.bus.count("partial_message", "r") == 1, what="subscribed")
        await conn.host.PublishPartialMessage(_say(1, "one"))
        before = await reader.next()
        reader.cancel()
    async with running(config) as app, Connection(f"127.0.0.1:{app.port}", session="r") as conn:
        reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY))
        await wait_for(lambda: app.bus.count("partial_message", "r") == 1, what="subscribed")
        await conn.host.PublishPartialMessage(_say(2, "two"))
        after = await reader.next()
        reader.cancel()
    assert after.seq > before.seq > 0
    assert after.epoch == before.epoch == before.seq  # the same conversation, read back from the log


async def test_a_task_message_starts_a_new_epoch(app: Any, connect: Any) -> None:
    conn = connect(session="tasks")
    reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY))
    await wait_for(lambda: app.bus.count("partial_message", "tasks") == 1, what="subscribed")
    await conn.host.PublishPartialMessage(_say(1, "hello"))
    await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=2, type=ui_pb2.SAY, say=ui_pb2.TASK, text="new task"))
    await conn.host.PublishPartialMessage(_say(3, "in the task"))
    first, task, third = await _drain(reader, 3)
    assert first.seq < task.seq < third.seq
    assert first.epoch < task.epoch == task.seq == third.epoch
    reader.cancel()


# ---- resuming ---------------------------------------------------------------------------------


async def test_cline_stream_resumes_exactly_after_its_cursor(app: Any, connect: Any) -> None:
    """Disconnect, events published meanwhile (one of them a newer state of a message already
    seen), resume from the cursor: exactly the missed states, once, in log order, then live."""
    conn = connect(session="resume")
    reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY))
    await wait_for(lambda: app.bus.count("partial_message", "resume") == 1, what="subscribed")
    for ts in (1, 2, 3):
        await conn.host.PublishPartialMessage(_say(ts, f"m{ts}", partial=ts == 3))
    seen = await _drain(reader, 3)
    reader.cancel()
    await wait_for(lambda: app.bus.count("partial_message", "resume") == 0, what="unsubscribed")
    cursor = seen[-1].seq
    await conn.host.PublishPartialMessage(_say(3, "m3 grown", partial=True))
    await conn.host.PublishPartialMessage(_say(3, "m3 done"))
    await conn.host.PublishPartialMessage(_say(4, "m4"))
    resumed = Reader(conn.ui.subscribeToPartialMessage(EMPTY, metadata=_since(cursor)))
    got = await _drain(resumed, 2)
    assert [(m.ts, m.text) for m in got] == [(3, "m3 done"), (4, "m4")]  # coalesced: m3's latest state
    assert cursor < got[0].seq < got[1].seq
    await _quiet(resumed)
    await conn.host.PublishPartialMessage(_say(5, "live"))
    live = await resumed.next()
    assert (live.ts, live.text) == (5, "live") and live.seq > got[1].seq
    await _quiet(resumed)  # nothing twice
    resumed.cancel()
    # A cursor at the head: nothing to replay, live at once.
    at_head = Reader(conn.ui.subscribeToPartialMessage(EMPTY, metadata=_since(live.seq)))
    await wait_for(lambda: app.bus.count("partial_message", "resume") == 1, what="subscribed again")
    await _quiet(at_head)
    at_head.cancel()


async def test_resume_races_nothing_published_during_the_replay(app: Any, connect: Any) -> None:
    """A publisher keeps going while clients resume: each resumed stream gets every ts exactly in
    its latest state, no seq twice, no seq out of order."""
    conn = connect(session="race")
    await conn.host.PublishPartialMessage(_say(1, "start"))
    cursor = (await app.core.feed.log.read("race")).head
    stop = asyncio.Event()

    async def publish() -> None:
        ts = 100
        while not stop.is_set():
            ts += 1
            await conn.host.PublishPartialMessage(_say(ts, f"m{ts}"))

    task = asyncio.ensure_future(publish())
    try:
        for _ in range(5):
            call = conn.ui.subscribeToPartialMessage(EMPTY, metadata=_since(cursor))
            seqs: list[int] = []
            async for message in call:
                seqs.append(message.seq)
                if len(seqs) == 30:
                    break
            call.cancel()
            assert seqs == sorted(set(seqs)) and seqs[0] > cursor, seqs
            # contiguous in the log: every message after the cursor, none skipped
            logged = [e.seq for e in (await app.core.feed.log.read("race", cursor)).entries]
            assert logged[:30] == seqs
    finally:
        stop.set()
        await task


async def test_a_bad_cursor_is_invalid_argument(app: Any, connect: Any) -> None:
    conn = connect(session="bad")
    for value in ("-1", "abc", "1" * 25):
        call = conn.ui.subscribeToPartialMessage(EMPTY, metadata=(("x-uibus-since", value),))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-uibus-since" in err.value.details()


async def test_a_too_old_cursor_gets_the_gap(app: Any, connect: Any) -> None:
    """Retention dropped entries after the cursor: the webview gets `gap` then the snapshot; a
    Cline stream gets the snapshot at a new epoch."""
    app.core.feed.log.retention = LogRetention(max_entries=3, max_bytes=0, max_age_s=0)
    conn = connect(session="old")
    await conn.host.PublishPartialMessage(_say(1, "first"))
    await app.core.feed.log.flush("old")
    cursor = (await app.core.feed.log.read("old")).head
    for ts in range(2, 8):
        await conn.host.PublishPartialMessage(_say(ts, f"m{ts}"))
        await app.core.feed.log.flush("old")
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="c", mark_replay_end=True),
                          metadata=(("x-uibus-session", "old"), *_since(cursor)))
    events: list[webview_pb2.WebviewEvent] = []
    while not (events and events[-1].replay_complete):
        events.append(await asyncio.wait_for(call.read(), 5))
    call.cancel()
    gaps = [e for e in events if e.gap]
    assert len(gaps) == 1 and gaps[0].source == "subscribeToPartialMessage"
    snapshot = [e.partial_message.ts for e in events if e.HasField("partial_message")]
    assert events.index(gaps[0]) < next(i for i, e in enumerate(events) if e.HasField("partial_message"))
    assert snapshot == [5, 6, 7]  # what the log still keeps

    old_epoch = (await app.core.feed.log.read("old")).entries[-1].epoch
    reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY, metadata=_since(cursor)))
    again = await _drain(reader, 3)
    assert [m.ts for m in again] == [5, 6, 7]
    assert {m.epoch for m in again} == {again[0].seq} and again[0].epoch > old_epoch  # a new epoch
    reader.cancel()


async def test_log_max_events_makes_an_old_cursor_get_the_gap(config: Config) -> None:
    """`--log-max-events` bounds what the server's session log keeps: with 3, a cursor taken after
    the first of 7 messages is older than the log and gets `gap`, then what is kept; a cursor
    within what is kept resumes without one."""
    async with running(replace(config, log_max_events=3)) as app, \
            Connection(f"127.0.0.1:{app.port}", session="small") as conn:
        assert app.core.feed.log.retention == LogRetention(max_entries=3)
        await conn.host.PublishPartialMessage(_say(1, "first"))
        await app.core.feed.log.flush("small")
        old = (await app.core.feed.log.read("small")).head
        for ts in range(2, 8):
            await conn.host.PublishPartialMessage(_say(ts, f"m{ts}"))
            await app.core.feed.log.flush("small")
        kept = (await app.core.feed.log.read("small")).entries
        assert [e.key for e in kept] == ["5", "6", "7"]
        stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)

        async def resume(cursor: int) -> list[webview_pb2.WebviewEvent]:
            call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="c", mark_replay_end=True),
                                  metadata=(("x-uibus-session", "small"), *_since(cursor)))
            events: list[webview_pb2.WebviewEvent] = []
            while not (events and events[-1].replay_complete):
                events.append(await asyncio.wait_for(call.read(), 5))
            call.cancel()
            return events

        events = await resume(old)
        assert [e.source for e in events if e.gap] == ["subscribeToPartialMessage"]
        assert [e.partial_message.ts for e in events if e.HasField("partial_message")] == [5, 6, 7]
        events = await resume(kept[0].seq)  # within what is kept: no gap, just what came after
        assert not any(e.gap for e in events)
        assert [e.partial_message.ts for e in events if e.HasField("partial_message")] == [6, 7]


async def test_webview_resume_replays_only_after_the_cursor(app: Any, connect: Any) -> None:
    conn = connect(session="wvr")
    for ts in (1, 2):
        await conn.host.PublishPartialMessage(_say(ts, f"m{ts}"))
    cursor = (await app.core.feed.log.read("wvr")).head
    await conn.host.PublishPartialMessage(_say(3, "m3"))
    stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="c", mark_replay_end=True),
                          metadata=(("x-uibus-session", "wvr"), *_since(cursor)))
    events: list[webview_pb2.WebviewEvent] = []
    while not (events and events[-1].replay_complete):
        events.append(await asyncio.wait_for(call.read(), 5))
    assert [(e.partial_message.ts, e.replayed) for e in events if e.HasField("partial_message")] == [(3, True)]
    assert not any(e.gap for e in events)
    call.cancel()


async def test_resume_after_a_restart_of_the_server(config: Config) -> None:
    async with running(config) as app, Connection(f"127.0.0.1:{app.port}", session="rs") as conn:
        await conn.host.PublishPartialMessage(_say(1, "before"))
        cursor = (await app.core.feed.log.read("rs")).head
        await conn.host.PublishPartialMessage(_say(2, "missed, then restart"))
    async with running(config) as app, Connection(f"127.0.0.1:{app.port}", session="rs") as conn:
        reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY, metadata=_since(cursor)))
        (missed,) = await _drain(reader, 1)
        assert (missed.ts, missed.text) == (2, "missed, then restart") and missed.seq > cursor
        await _quiet(reader)
        reader.cancel()


async def test_resume_on_another_replica(redis_server: RedisProcess, tmp_path: Path) -> None:
    """Events published on replica A while the client was away; it resumes on replica B."""
    base = Config(host="127.0.0.1", port=0, http_port=0, redis_url=redis_server.url, grace_seconds=1.0)
    apps = [await start_app(replace(base, store=str(tmp_path / f"{n}.db"))) for n in "ab"]
    conns: list[Connection] = []
    try:
        a, b = apps
        await wait_for(lambda: all(getattr(x.bus, "connected", False) for x in apps), what="both on redis")
        ca = Connection(f"127.0.0.1:{a.port}", session="moving")
        cb = Connection(f"127.0.0.1:{b.port}", session="moving")
        conns += [ca, cb]
        await ca.host.PublishPartialMessage(_say(1, "seen on a"))
        cursor = (await a.core.feed.log.read("moving")).head
        await ca.host.PublishPartialMessage(_say(2, "missed"))
        reader = Reader(cb.ui.subscribeToPartialMessage(EMPTY, metadata=_since(cursor)))
        (missed,) = await _drain(reader, 1)
        assert (missed.ts, missed.text) == (2, "missed")
        await wait_for(lambda: b.bus.count("partial_message", "moving") == 1, what="B subscribed")
        await ca.host.PublishPartialMessage(_say(3, "live from a"))
        live = await reader.next()
        assert (live.ts, live.text) == (3, "live from a")
        await _quiet(reader)
        reader.cancel()
    finally:
        for conn in conns:
            await conn.close()
        for x in apps:
            await x.aclose(grace=1.0)


async def test_a_fresh_log_reads_what_another_wrote(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "x.db"))
    try:
        log = SessionLog(store)
        message = log.stamp("s", _say(1, "hi"))
        await log.flush("s")
        replay = await SessionLog(store).read("s")
        assert [e.seq for e in replay.entries] == [message.seq]
        await log.aclose()
    finally:
        await store.close()


async def test_a_new_chat_conversation_starts_a_new_epoch(app: Any, connect: Any) -> None:
    """The chat's messages are stamped too: a turn continuing the conversation keeps its epoch, a
    turn starting over (an empty ChatContext from the client) starts a new one."""
    from tests.chatkit import answer
    from uibus.pb.neuro_san.api.grpc import chat_pb2

    conn = connect(session="convo")
    reader = Reader(conn.ui.subscribeToPartialMessage(EMPTY))
    await wait_for(lambda: app.bus.count("partial_message", "convo") == 1, what="subscribed")

    async def turn(text: str, **kw: Any) -> list[ui_pb2.ClineMessage]:
        await answer(conn, "hello_world", text, **kw)
        shown = []
        while not shown or shown[-1].partial or shown[-1].say != ui_pb2.TEXT:
            shown.append(await reader.next())
        return shown

    first = await turn("one")
    second = await turn("two")
    fresh = await turn("over", context=chat_pb2.ChatContext())
    seqs = [m.seq for m in first + second + fresh]
    assert seqs == sorted(set(seqs))
    assert {m.epoch for m in first + second} == {first[0].seq}  # the question opened the conversation
    assert {m.epoch for m in fresh} == {fresh[0].seq} and fresh[0].seq > second[-1].seq
    reader.cancel()


async def test_the_host_request_stream_resumes_after_its_cursor(app: Any, connect: Any) -> None:
    """The host's request stream: requests made while the host was away come first, exactly once,
    in order, then live; an openUrl nobody heard (refused to its caller) is never replayed."""
    from uibus.pb.uibus.v1 import host_pb2  # noqa: F401  (the message the stream carries)

    conn = connect(session="hostr")
    host = Reader(conn.host.SubscribeHostRequests(common_pb2.Empty()))
    await wait_for(lambda: app.bus.count("host_request", "hostr") == 1, what="host subscribed")
    await conn.ui.scrollToSettings(common_pb2.StringRequest(value="a"))
    first = await host.next()
    host.cancel()
    await wait_for(lambda: app.bus.count("host_request", "hostr") == 0, what="host gone")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await conn.ui.openUrl(common_pb2.StringRequest(value="https://example.com/"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for section in ("b", "c"):
        await conn.ui.scrollToSettings(common_pb2.StringRequest(value=section))
    back = Reader(conn.host.SubscribeHostRequests(common_pb2.Empty(), metadata=_since(first.seq)))
    missed = [await back.next() for _ in range(2)]
    assert [m.scroll_to_settings.section for m in missed] == ["b", "c"]
    assert first.seq < missed[0].seq < missed[1].seq
    await _quiet(back)
    await conn.ui.scrollToSettings(common_pb2.StringRequest(value="d"))
    live = await back.next()
    assert live.scroll_to_settings.section == "d" and live.seq > missed[1].seq
    await _quiet(back)
    back.cancel()


async def test_the_extension_ui_stream_resumes_after_its_cursor(app: Any, connect: Any) -> None:
    """A dialog UI that reconnects: the notices and the dialog's close it missed, each once, in
    order, then live; a too-old cursor gets `gap` and then the snapshot (kept state)."""
    from tests.support import ext
    from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

    conn = connect(session="dlgr")
    ui = Reader(ext(conn).Subscribe(pb.SubscribeRequest()))
    await wait_for(lambda: app.bus.count("extension_ui", "dlgr") == 1, what="UI subscribed")
    await ext(conn).Notify(pb.NotifyRequest(message="one"))
    one = await ui.next()
    assert one.request.notify.message == "one" and one.seq > 0
    ask = asyncio.ensure_future(ext(conn).Confirm(pb.ConfirmRequest(title="Deploy?", timeout_ms=300)))
    asked = await ui.next()
    ui.cancel()
    await wait_for(lambda: app.bus.count("extension_ui", "dlgr") == 0, what="UI gone")
    await ext(conn).Notify(pb.NotifyRequest(message="two"))
    await ext(conn).SetStatus(pb.SetStatusRequest(key="k", text="v1"))
    await ext(conn).SetStatus(pb.SetStatusRequest(key="k", text="v2"))  # coalesced with v1 in the log
    await ask  # timed out meanwhile: its closed event replaces its request in the log
    back = Reader(ext(conn).Subscribe(pb.SubscribeRequest(), metadata=_since(asked.seq)))
    got = [await back.next() for _ in range(3)]
    kinds_seen = [(g.WhichOneof("event"), g.request.WhichOneof("method") if g.HasField("request") else "")
                  for g in got]
    assert kinds_seen == [("request", "notify"), ("request", "set_status"), ("closed", "")], kinds_seen
    assert got[0].request.notify.message == "two" and got[1].request.set_status.text == "v2"
    assert got[2].closed.id == asked.request.id
    assert [g.seq for g in got] == sorted({g.seq for g in got}) and got[0].seq > asked.seq
    await _quiet(back)
    await ext(conn).Notify(pb.NotifyRequest(message="three"))
    assert (await back.next()).request.notify.message == "three"
    back.cancel()

    app.core.feed.log.retention = LogRetention(max_entries=2, max_bytes=0, max_age_s=0)
    for text in ("x", "y", "z"):
        await ext(conn).Notify(pb.NotifyRequest(message=text))
    await app.core.feed.log.flush("dlgr")
    old = Reader(ext(conn).Subscribe(pb.SubscribeRequest(), metadata=_since(one.seq)))
    gap = await old.next()
    assert gap.gap and not gap.HasField("request")
    status = await old.next()  # the snapshot: kept state (the status), replayed
    assert status.request.set_status.text == "v2" and status.request.replayed
    old.cancel()


async def test_callers_waiting_at_once_share_one_commit_and_a_lone_caller_waits_for_no_loop_turn(
        tmp_path: Path) -> None:
    """Group commit on the embedded store: 100 callers of 100 sessions, each stamping an event and
    waiting for its commit in the same turn of the loop, cost two transactions (the first caller's,
    made at once, and one for the 99 others at the next turn), not 100; every event is then in the
    file, as a second connection to it reads. A lone caller commits before its await returns with
    no turn of the loop between (nothing else runs meanwhile)."""
    path = str(tmp_path / "group.db")
    store = SqliteStore(path)
    try:
        log = SessionLog(store)
        for i in range(100):
            await log.prepare(f"g{i}")

        async def acknowledge(i: int) -> None:
            log.stamp_event(f"g{i}", "host_request", new_key(), host_pb2.HostRequest(id=f"e{i}"), new=True)
            await log.flush(f"g{i}")

        before = log.commits
        await asyncio.gather(*(acknowledge(i) for i in range(100)))
        assert log.commits - before == 2 and log.appended == 100
        other = SqliteStore(path)  # what a process reading the file after a crash would find
        try:
            for i in range(100):
                entries = (await other.log_read(f"g{i}")).entries
                assert [host_pb2.HostRequest.FromString(e.data).id for e in entries] == [f"e{i}"]
        finally:
            await other.close()

        ran: list[str] = []
        asyncio.get_running_loop().call_soon(ran.append, "other callback")
        await asyncio.sleep(0)  # a new turn: the flag of the burst above is over
        ran.clear()
        asyncio.get_running_loop().call_soon(ran.append, "other callback")
        before = log.commits
        await acknowledge(7)
        assert log.commits - before == 1 and ran == []  # committed inline: the loop did not turn
        await log.aclose()
    finally:
        await store.close()
