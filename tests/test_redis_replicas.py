"""Two uibus replicas sharing one real redis-server: events published on one reach webviews on
the other, state written on one is read on the other, sessions stay apart, a Redis outage only
pauses replication, and every subscription is gone when its stream ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from tests.conftest import free_port, next_message, start_app, wait_for
from tests.redisproc import RedisProcess
from tests.redistarget import RedisTarget, redis_cluster, redis_cluster_clean, redis_server, redis_target
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.infra.redis import ReplicatedBus
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server", "redis_target"]


class Replica:
    def __init__(self, app: App, opened: list[Connection]) -> None:
        self.app = app
        self._opened = opened

    @property
    def bus(self) -> ReplicatedBus:
        assert isinstance(self.app.bus, ReplicatedBus)
        return self.app.bus

    def connect(self, session: str = "default") -> Connection:
        conn = Connection(f"127.0.0.1:{self.app.port}", session=session)
        self._opened.append(conn)
        return conn

    async def subscribed(self, kind: str, session: str = "default", n: int = 1) -> None:
        await wait_for(lambda: self.bus.count(kind, session) == n, what=f"{n} {kind} subscription(s)")
        if n:
            await self.bus.ready(session)  # what the stream awaits before its headers


R = TypeVar("R", bound=Replica)


@asynccontextmanager
async def two_replicas(redis_url: str, tmp_path: Path, replica: type[R], *,
                       http: bool = False, cluster: bool = False) -> AsyncIterator[tuple[R, R]]:
    """Two replicas (of the `replica` wrapper class) on one Redis, both connected to it; with
    `http`, each also has an HTTP port (for /metrics). Closes their connections and apps."""
    apps: list[App] = []
    opened: list[Connection] = []
    try:
        for name in ("a", "b"):
            apps.append(await start_app(Config(host="127.0.0.1", port=0, http_port=free_port() if http else 0,
                                               store=str(tmp_path / f"{name}.db"), redis_url=redis_url,
                                               redis_cluster=cluster, grace_seconds=1.0)))
        a, b = replica(apps[0], opened), replica(apps[1], opened)
        await wait_for(lambda: a.bus.connected and b.bus.connected, what="both replicas on redis")
        yield a, b
    finally:
        for conn in opened:
            await conn.close()
        for app in apps:
            await app.aclose(grace=0.5)


@pytest.fixture
async def replicas(redis_target: RedisTarget, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two replicas on one redis-server, then on the Redis Cluster."""
    async with two_replicas(redis_target.url, tmp_path, Replica, cluster=redis_target.cluster) as pair:
        yield pair


@pytest.fixture
async def single_replicas(redis_server: RedisProcess, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two replicas on one redis-server, for the tests that kill it or write to it directly."""
    async with two_replicas(redis_server.url, tmp_path, Replica) as pair:
        yield pair


async def test_uses_redis_for_store_and_bus(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    from uibus.infra.redis import RedisStore

    assert isinstance(a.app.store, RedisStore) and isinstance(b.app.store, RedisStore)
    assert a.bus.replica_id != b.bus.replica_id


async def test_theme_set_on_a_is_current_on_b_then_changes_flow(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    host = a.connect()
    await host.host.SetTheme(host_pb2.TextEvent(text='{"name":"dark"}'))
    stream = b.connect().ui.subscribeToTheme(common_pb2.EmptyRequest())
    first = await next_message(stream)
    assert first.value == '{"name":"dark"}'  # B read A's write from the shared store
    await b.subscribed(kinds.THEME)
    await host.host.SetTheme(host_pb2.TextEvent(text='{"name":"light"}'))
    # Current state is delivered at least once: A's "dark" event may still be crossing Redis when B
    # has read it from the store (uibus.domain.feed), so it can come again before "light".
    following = (await next_message(stream)).value
    if following == '{"name":"dark"}':
        following = (await next_message(stream)).value
    assert following == '{"name":"light"}'
    state = await b.connect().host.GetSessionState(common_pb2.Empty())
    assert state.theme == '{"name":"light"}'
    stream.cancel()
    await b.subscribed(kinds.THEME, n=0)


async def test_partial_messages_cross_replicas_in_order(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    stream = b.connect().ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
    await b.subscribed(kinds.PARTIAL_MESSAGE)
    host = a.connect().host
    texts = ["Hel", "Hello", "Hello, wor", "Hello, world"]
    for i, text in enumerate(texts):
        reply = await host.PublishPartialMessage(ui_pb2.ClineMessage(
            ts=1700000000123, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text, partial=i < len(texts) - 1))
        assert reply.subscribers == 0  # counted per replica: nobody on A itself
        assert reply.replicated  # but handed to replication, which carries it to B
    got = [await next_message(stream) for _ in texts]
    assert [m.text for m in got] == texts
    assert [m.partial for m in got] == [True, True, True, False]
    assert {m.ts for m in got} == {1700000000123}
    assert got[0].type == ui_pb2.SAY and got[0].say == ui_pb2.TEXT
    stream.cancel()
    await b.subscribed(kinds.PARTIAL_MESSAGE, n=0)


async def test_coalescing_key_survives_the_hop(replicas: tuple[Replica, Replica]) -> None:
    """A slow subscriber on B keeps only the newest state of each `ts`, as it would locally."""
    a, b = replicas
    sub = b.bus.subscribe("default", kinds.PARTIAL_MESSAGE, maxsize=2)
    try:
        host = a.connect().host
        for ts, text in [(1, "a"), (2, "b"), (1, "aa"), (2, "bb"), (1, "aaa"), (2, "bbb")]:
            await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, text=text))
        await wait_for(lambda: b.bus.stats.received >= 6, what="six envelopes on B")
        b.bus.unsubscribe(sub)  # closes the mailbox: iterating yields what is queued, then ends
        assert [(m.ts, m.text) async for m in sub] == [(1, "aaa"), (2, "bbb")]
        assert b.bus.counters[kinds.PARTIAL_MESSAGE.name].coalesced == 4
    finally:
        b.bus.unsubscribe(sub)
    assert b.bus.count() == 0


async def test_button_clicks_filtered_by_provider_type(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    ui = b.connect().ui
    sidebar = ui.subscribeToHistoryButtonClicked(ui_pb2.WebviewProviderTypeRequest(provider_type=ui_pb2.SIDEBAR))
    tab = ui.subscribeToHistoryButtonClicked(ui_pb2.WebviewProviderTypeRequest(provider_type=ui_pb2.TAB))
    chat = ui.subscribeToChatButtonClicked(common_pb2.EmptyRequest())
    await b.subscribed(kinds.HISTORY_BUTTON, n=2)
    await b.subscribed(kinds.CHAT_BUTTON)
    host = a.connect().host
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_HISTORY, provider_type=ui_pb2.TAB))
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_HISTORY))  # no type: everyone
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_CHAT))
    await next_message(tab)
    await next_message(tab)
    await next_message(sidebar)
    await next_message(chat)
    # SIDEBAR got exactly one click: prove no second one is queued by sending a SIDEBAR marker.
    await host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_HISTORY,
                                                       provider_type=ui_pb2.SIDEBAR))
    await next_message(sidebar)
    assert b.bus.counters[kinds.HISTORY_BUTTON.name].delivered == 4  # TAB 2 + SIDEBAR 2
    for s in (sidebar, tab, chat):
        s.cancel()
    await wait_for(lambda: b.bus.count() == 0, what="all subscriptions gone")


async def test_focus_reaches_only_its_client_id(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    ui = b.connect().ui
    c1 = ui.subscribeToFocusChatInput(common_pb2.StringRequest(value="c1"))
    c2 = ui.subscribeToFocusChatInput(common_pb2.StringRequest(value="c2"))
    await b.subscribed(kinds.FOCUS_CHAT_INPUT, n=2)
    host = a.connect().host
    await host.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="c2"))
    await next_message(c2)
    await wait_for(lambda: b.bus.stats.received >= 1, what="envelope on B")
    assert b.bus.counters[kinds.FOCUS_CHAT_INPUT.name].delivered == 1
    await host.PublishFocusChatInput(host_pb2.FocusChatInput(client_id="c1"))
    await next_message(c1)
    assert b.bus.counters[kinds.FOCUS_CHAT_INPUT.name].delivered == 2
    c1.cancel()
    c2.cancel()
    await b.subscribed(kinds.FOCUS_CHAT_INPUT, n=0)


async def test_sessions_stay_isolated_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    s1 = b.connect("s1").ui.subscribeToAddToInput(common_pb2.EmptyRequest())
    s2 = b.connect("s2").ui.subscribeToAddToInput(common_pb2.EmptyRequest())
    await b.subscribed(kinds.ADD_TO_INPUT, "s1")
    await b.subscribed(kinds.ADD_TO_INPUT, "s2")
    await a.connect("s1").host.PublishAddToInput(host_pb2.TextEvent(text="for s1"))
    await a.connect("s2").host.PublishAddToInput(host_pb2.TextEvent(text="for s2"))
    assert (await next_message(s1)).value == "for s1"
    assert (await next_message(s2)).value == "for s2"  # not "for s1": s2 never saw it
    await a.connect("s1").host.SetTheme(host_pb2.TextEvent(text='{"s":1}'))
    assert (await b.connect("s2").host.GetSessionState(common_pb2.Empty())).theme == ""
    assert (await b.connect("s1").host.GetSessionState(common_pb2.Empty())).theme == '{"s":1}'
    s1.cancel()
    s2.cancel()
    await wait_for(lambda: b.bus.count() == 0, what="all subscriptions gone")


async def test_open_url_sees_a_host_on_the_other_replica(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    webview = a.connect().ui
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await webview.openUrl(common_pb2.StringRequest(value="https://example.com/"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    requests = b.connect().host.SubscribeHostRequests(common_pb2.Empty())
    await b.subscribed(kinds.HOST_REQUEST)
    await wait_for(lambda: a.bus.remote_count("default", kinds.HOST_REQUEST) == 1, what="A learns of B's host")
    await webview.openUrl(common_pb2.StringRequest(value="https://example.com/docs"))
    got = await next_message(requests)
    assert got.WhichOneof("request") == "open_url" and got.open_url.url == "https://example.com/docs"
    requests.cancel()
    await b.subscribed(kinds.HOST_REQUEST, n=0)
    await wait_for(lambda: a.bus.remote_count("default", kinds.HOST_REQUEST) == 0, what="A learns host left")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await webview.openUrl(common_pb2.StringRequest(value="https://example.com/"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """Runs `call` and fails if it does not finish in time: nothing may hang on a dead Redis."""
    start = time.monotonic()
    result = await asyncio.wait_for(call(), seconds)
    assert time.monotonic() - start < seconds
    return result


async def test_redis_outage_keeps_local_delivery_and_replication_resumes(
        single_replicas: tuple[Replica, Replica], redis_server: RedisProcess) -> None:
    a, b = single_replicas
    on_a = a.connect().ui.subscribeToAddToInput(common_pb2.EmptyRequest())
    on_b = b.connect().ui.subscribeToAddToInput(common_pb2.EmptyRequest())
    await a.subscribed(kinds.ADD_TO_INPUT)
    await b.subscribed(kinds.ADD_TO_INPUT)
    host_a, host_b = a.connect().host, b.connect().host
    await host_a.PublishAddToInput(host_pb2.TextEvent(text="before"))
    assert (await next_message(on_a)).value == "before"
    assert (await next_message(on_b)).value == "before"

    redis_server.kill()
    await wait_for(lambda: not a.bus.connected and not b.bus.connected, timeout=5, what="outage noticed")
    for i in range(3):  # each replica still serves its own subscribers, promptly
        reply = await _within(3, lambda i=i: host_a.PublishAddToInput(host_pb2.TextEvent(text=f"a{i}")))
        assert reply.subscribers == 1
        assert (await next_message(on_a)).value == f"a{i}"
        await _within(3, lambda i=i: host_b.PublishAddToInput(host_pb2.TextEvent(text=f"b{i}")))
        assert (await next_message(on_b)).value == f"b{i}"
    with pytest.raises(grpc.aio.AioRpcError) as err:  # state needs the store: a prompt error, not a hang
        await _within(8, lambda: host_a.GetSessionState(common_pb2.Empty()))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in (err.value.details() or "")
    theme = b.connect().ui.subscribeToTheme(common_pb2.EmptyRequest())  # a stream that reads the store first
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _within(8, lambda: theme.read())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert a.bus.stats.outages == 1 and b.bus.stats.outages == 1

    redis_server.start()
    await wait_for(lambda: a.bus.connected and b.bus.connected, timeout=10, what="replication back")

    async def crosses() -> bool:
        await host_a.PublishAddToInput(host_pb2.TextEvent(text="after"))
        try:
            while (await next_message(on_b, timeout=0.5)).value != "after":
                pass
        except TimeoutError:
            return False
        return True

    deadline = time.monotonic() + 10
    while not await crosses():  # the writer notices the restart on its first failed write at the latest
        assert time.monotonic() < deadline, "cross-replica delivery did not resume"
    while (await next_message(on_a)).value != "after":
        pass
    await host_a.SetTheme(host_pb2.TextEvent(text='{"back":true}'))
    assert (await host_b.GetSessionState(common_pb2.Empty())).theme == '{"back":true}'
    on_a.cancel()
    on_b.cancel()
    await wait_for(lambda: a.bus.count() == 0 and b.bus.count() == 0, what="all subscriptions gone")


async def test_bad_envelopes_are_counted_not_fatal(single_replicas: tuple[Replica, Replica],
                                                  redis_server: RedisProcess) -> None:
    from redis.asyncio import Redis

    a, b = single_replicas
    stream = b.connect().ui.subscribeToAddToInput(common_pb2.EmptyRequest())
    await b.subscribed(kinds.ADD_TO_INPUT)
    await b.bus.ready("default")
    raw = Redis.from_url(redis_server.url)  # a stranger on the same Redis both replicas listen to
    try:
        await raw.publish(b.bus.shard_channel("default"), b"not json\nxx")
        await raw.publish(b.bus.shard_channel("default"), b'["x","default","add_to_input",null,null,"no.such.Type"]\n')
        await raw.publish(b.bus.shard_channel("default"),
                          b'["x","default","add_to_input",null,null,"cline.String"]\n\xff\xff')
    finally:
        await raw.aclose()
    await wait_for(lambda: b.bus.stats.bad == 3, what="three bad envelopes counted")
    await a.connect().host.PublishAddToInput(host_pb2.TextEvent(text="still fine"))
    assert (await next_message(stream)).value == "still fine"
    stream.cancel()
    await b.subscribed(kinds.ADD_TO_INPUT, n=0)


async def test_stop_releases_redis_connections(redis_server: RedisProcess, tmp_path: Path) -> None:
    from redis.asyncio import Redis

    cfg = Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "x.db"), redis_url=redis_server.url)
    app = App(cfg)
    await app.start()
    await app.store.put("s", "k", 1)
    probe = Redis.from_url(redis_server.url)
    try:
        def names(clients: list[dict[str, Any]]) -> set[str]:
            return {c["name"] for c in clients}

        assert {"uibus-store", "uibus-bus"} <= names(await probe.client_list())
        await app.aclose(grace=0.5)
        await wait_for_async(lambda: probe.client_list(), lambda cl: not names(cl) & {"uibus-store", "uibus-bus"})
    finally:
        await probe.aclose()


async def wait_for_async(fetch: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok(await fetch()):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_two_server_processes_configured_by_env(redis_server: RedisProcess, spawn: Any) -> None:
    """As an operator runs it: two `python -m uibus serve` processes, Redis given by UIBUS_REDIS_URL."""
    import signal

    env = {"UIBUS_REDIS_URL": redis_server.url}
    a, b = spawn(env=env), spawn(env=env)
    await asyncio.gather(a.wait_ready(), b.wait_ready())
    async with Connection(a.target, session="ops") as on_a, Connection(b.target, session="ops") as on_b:
        await on_a.host.SetTheme(host_pb2.TextEvent(text='{"from":"a"}'))
        theme = on_b.ui.subscribeToTheme(common_pb2.EmptyRequest())
        assert (await next_message(theme, timeout=5)).value == '{"from":"a"}'
        clicks = on_b.ui.subscribeToAccountButtonClicked(common_pb2.EmptyRequest())

        async def stats_b() -> int:
            return (await on_b.host.GetBusStats(common_pb2.Empty())).subscriptions

        await wait_for_async(stats_b, lambda n: n == 2)
        await on_a.host.PublishButtonClick(host_pb2.ButtonClick(button=host_pb2.BUTTON_ACCOUNT))
        await next_message(clicks, timeout=5)
        theme.cancel()
        clicks.cancel()
        await wait_for_async(stats_b, lambda n: n == 0)
    for p in (a, b):
        p.proc.send_signal(signal.SIGTERM)
    for p in (a, b):
        assert await asyncio.to_thread(p.proc.wait, 15) == 0, p.log.read_text()


async def test_extension_ui_answer_given_on_another_replica(replicas: tuple[Replica, Replica]) -> None:
    """The agent asks on A, the only UI is on B: B's answer is forwarded to A, with A's verdict."""
    from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
    from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

    a, b = replicas
    agent = ext_grpc.ExtensionUiServiceStub(a.connect("dlg").channel)
    ui = ext_grpc.ExtensionUiServiceStub(b.connect("dlg").channel)
    events = ui.Subscribe(ext.SubscribeRequest())
    await b.subscribed(kinds.EXTENSION_UI, "dlg")
    ask = asyncio.ensure_future(agent.Confirm(ext.ConfirmRequest(title="Deploy?", message="prod", timeout_ms=10_000)))
    request = (await next_message(events, timeout=5)).request
    assert request.confirm.title == "Deploy?"

    with pytest.raises(grpc.aio.AioRpcError) as err:  # A's verdict travels back: wrong kind of answer
        await ui.Respond(ext.RespondRequest(id=request.id, value="yes"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is a confirm" in (err.value.details() or "")
    assert not ask.done()  # the dialog stays open

    await ui.Respond(ext.RespondRequest(id=request.id, confirmed=True))
    result = await asyncio.wait_for(ask, 5)
    assert result.outcome == ext.DIALOG_OUTCOME_ANSWERED and result.confirmed is True
    closed = await next_message(events, timeout=5)
    assert closed.closed.id == request.id and closed.closed.reason == ext.DIALOG_OUTCOME_ANSWERED

    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # A still listens a while: "already answered", at once
        await ui.Respond(ext.RespondRequest(id=request.id, confirmed=False))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() - start < 0.5
    events.cancel()
    await wait_for(lambda: b.bus.count() == 0, what="B's stream gone")
    assert a.bus.count() == a.bus.count(kinds.EXT_UI_ANSWER, "dlg") == 1  # A's lingering answer listener
