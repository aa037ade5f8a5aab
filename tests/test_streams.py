"""Stream lifecycle and back-pressure: subscriptions vanish the moment a stream ends, and a slow
subscriber only ever hurts itself."""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.conftest import Reader, next_message, replace, subscriber, wait_for
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

EMPTY_REQ = common_pb2.EmptyRequest()


async def test_200_subscribers_cancel_or_disconnect_and_counts_return_to_zero(app, connect):
    cancelling = connect("many")
    calls = [cancelling.ui.subscribeToPartialMessage(EMPTY_REQ) for _ in range(100)]
    # The other 100 live in client processes that are killed: a real disconnect. (Closing a
    # grpc.aio channel does not cancel a stream nobody is awaiting — grpc/grpc#32005 — so the
    # server would rightly keep it: its connection is still open.)
    clients = [subscriber(f"127.0.0.1:{app.port}", "many", 25) for _ in range(4)]
    try:
        for client in clients:
            assert await asyncio.to_thread(client.stdout.readline) == b"live\n"
        await wait_for(lambda: app.bus.count(session="many") == 200, timeout=10, what="200 subscriptions")
        assert app.bus.count("partial_message") == 100 and app.bus.count("add_to_input") == 100
        for call in calls:
            call.cancel()  # client cancel
        for client in clients:
            client.kill()  # disconnect
    finally:
        for client in clients:
            client.kill()
            client.wait()
    took = await wait_for(lambda: app.bus.count() == 0, timeout=1.0, what="all subscriptions gone")
    assert app.bus.count("partial_message") == 0 and app.bus.count("add_to_input") == 0
    assert app.bus.subscriptions("many", "partial_message") == []
    assert took < 1.0


async def test_deadline_ends_subscription(app, connect):
    conn = connect()
    call = conn.ui.subscribeToDidBecomeVisible(EMPTY_REQ, timeout=0.3)
    await wait_for(lambda: app.bus.count("did_become_visible") == 1)
    try:
        await call.read()
        raise AssertionError("stream should have hit its deadline")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: app.bus.count() == 0, timeout=1.0, what="deadline cleanup")


async def test_subscription_limit_per_session(tmp_path):
    app = App(replace(_config(tmp_path), max_streams_per_session=3))
    await app.start()
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="tiny") as conn:
            open_ = [Reader(conn.ui.subscribeToAddToInput(EMPTY_REQ)) for _ in range(3)]
            await wait_for(lambda: app.bus.count(session="tiny") == 3)
            with_err = conn.ui.subscribeToAddToInput(EMPTY_REQ)
            try:
                await with_err.read()
                raise AssertionError("4th subscription should be refused")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "limit 3" in (exc.details() or "")
            other = Reader(conn.ui.subscribeToAddToInput(EMPTY_REQ, metadata=(("x-uibus-session", "b"),)))
            await wait_for(lambda: app.bus.count(session="b") == 1)  # other sessions unaffected
            for r in [*open_, other]:
                r.cancel()
            await wait_for(lambda: app.bus.count() == 0)
    finally:
        await app.aclose(grace=0.5)


def _config(tmp_path):
    from uibus.infra.config import Config

    return Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "s.db"))


async def test_never_reading_subscriber_is_bounded_and_does_not_slow_others(tmp_path):
    """A stuck webview fills its transport window, then its own mailbox, and then loses its oldest
    events (counted); the publisher never waits and a reading subscriber gets every event in order."""
    app = App(replace(_config(tmp_path), queue_size=8))
    await app.start()
    try:
        target = f"127.0.0.1:{app.port}"
        async with Connection(target) as host, Connection(target) as fast_conn, Connection(target) as slow_conn:
            stuck = slow_conn.ui.subscribeToPartialMessage(EMPTY_REQ)  # never read
            fast = Reader(fast_conn.ui.subscribeToPartialMessage(EMPTY_REQ))
            await wait_for(lambda: app.bus.count("partial_message") == 2)
            text = "x" * 16_000
            n = 400  # 6.4 MB: far beyond the stuck stream's HTTP/2 window
            publish_times = []
            received: list[int] = []

            async def consume() -> None:
                while len(received) < n:
                    received.append((await fast.next(timeout=10)).ts)

            consumer = asyncio.ensure_future(consume())
            for i in range(1, n + 1):
                t0 = time.perf_counter()
                reply = await host.host.PublishPartialMessage(
                    ui_pb2.ClineMessage(ts=i, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text))
                publish_times.append(time.perf_counter() - t0)
                assert reply.subscribers == 2
            await asyncio.wait_for(consumer, 20)
            assert received == list(range(1, n + 1))  # nothing lost for the reader, in order
            slow_sub = next(s for s in app.bus.subscriptions("default", "partial_message") if len(s) > 0)
            assert len(slow_sub) <= 8  # the stuck mailbox stays within its bound
            stats = await host.host.GetBusStats(common_pb2.Empty())
            kind = next(k for k in stats.kinds if k.kind == "partial_message")
            assert kind.dropped > 0  # and what it lost is counted
            assert max(publish_times) < 1.0  # a publish never waits on a subscriber
            stuck.cancel()
            fast.cancel()
            await wait_for(lambda: app.bus.count() == 0)
    finally:
        await app.aclose(grace=0.5)


async def test_partial_message_overflow_coalesces_by_ts(tmp_path):
    """At the bound a newer state of a queued message replaces it instead of evicting another."""
    app = App(replace(_config(tmp_path), queue_size=4))
    await app.start()
    try:
        bus = app.bus
        sub = bus.subscribe("s", kinds.PARTIAL_MESSAGE)
        for ts in (1, 2, 3, 4):
            bus.publish("s", kinds.PARTIAL_MESSAGE, ("state", ts, 0), key=ts)
        for version in range(1, 50):  # a long-growing message 2 while the reader is stuck
            bus.publish("s", kinds.PARTIAL_MESSAGE, ("state", 2, version), key=2)
        got = [sub._items.popleft()[1] for _ in range(len(sub))]
        assert got == [("state", 1, 0), ("state", 2, 49), ("state", 3, 0), ("state", 4, 0)]
        assert bus.counters["partial_message"].coalesced == 49
        assert bus.counters["partial_message"].dropped == 0
        bus.unsubscribe(sub)
        assert bus.count() == 0
    finally:
        await app.aclose(grace=0.5)


async def test_theme_overflow_keeps_latest(connect, app):
    sub = app.bus.subscribe("t", kinds.THEME, maxsize=2)
    for i in range(10):
        app.bus.publish("t", kinds.THEME, i)
    assert [sub._items.popleft()[1] for _ in range(len(sub))] == [8, 9]
    app.bus.unsubscribe(sub)


async def test_click_overflow_drops_oldest(app):
    sub = app.bus.subscribe("c", kinds.CHAT_BUTTON, maxsize=3)
    for i in range(10):
        app.bus.publish("c", kinds.CHAT_BUTTON, i)
    assert [sub._items.popleft()[1] for _ in range(len(sub))] == [7, 8, 9]
    assert app.bus.counters["chat_button"].dropped == 7
    app.bus.unsubscribe(sub)
    app.bus.unsubscribe(sub)  # twice is harmless
    assert app.bus.count() == 0


async def test_stream_survives_neighbour_errors(app, connect):
    """A bad call next to a live stream leaves the stream and the server working."""
    conn = connect()
    stream = Reader(conn.ui.subscribeToAddToInput(EMPTY_REQ))
    await wait_for(lambda: app.bus.count("add_to_input") == 1)
    for _ in range(5):
        try:
            await conn.ui.openUrl(common_pb2.StringRequest(value="javascript:alert(1)"))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    await conn.host.PublishAddToInput(host_pb2.TextEvent(text="still here"))
    assert (await next_message(stream)).value == "still here"
