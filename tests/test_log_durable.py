"""Acknowledged is durable: a chat reply its caller received is in the session's log, so a
SIGKILL of `uibus serve` right after the turn loses nothing any caller saw (20 tries, each a
real process killed with no goodbye, the next one reading the same SQLite file; and with two
replicas on Redis, the killed one's replies read on the other). The same for every other call
whose reply acknowledges an event kept: an agent's notice, a UI's answer to a dialog."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tests.chatkit import answer
from tests.conftest import Reader, ServerProcess
from tests.redisproc import RedisProcess, redis_server
from tests.support import ext
from uibus.clients.connection import Connection
from uibus.domain.session_log import LOG_WRITE_S
from uibus.pb.uibus.v1 import extension_ui_pb2, webview_pb2, webview_pb2_grpc

__all__ = ["redis_server"]  # the fixture, imported to be used here
pytestmark = pytest.mark.timeout(300)
TRIES = 20


async def _replayed(target: str, session: str) -> list[str]:
    """The texts a webview opened now starts with (the recent messages, a view of the log)."""
    async with Connection(target, session=session) as conn:
        stub = webview_pb2_grpc.WebviewServiceStub(conn.channel)
        call = stub.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id="check", mark_replay_end=True))
        texts = []
        while True:
            event = await asyncio.wait_for(call.read(), 10)
            if event.replay_complete:
                break
            if event.HasField("partial_message"):
                texts.append(event.partial_message.text)
        call.cancel()
        return texts


async def test_sigkill_right_after_a_turn_loses_no_acknowledged_reply(spawn: Callable[..., ServerProcess]) -> None:
    acknowledged: list[str] = []
    server = spawn()
    for i in range(TRIES):
        await server.wait_ready()
        async with Connection(server.target, session="kill") as conn:
            reply = await answer(conn, "hello_world", f"turn {i}")
        server.proc.kill()  # SIGKILL the moment the caller has its reply: no flush, no goodbye
        server.proc.wait(10)
        acknowledged.append(reply.text)
        server = spawn()
    await server.wait_ready()
    shown = await _replayed(server.target, "kill")
    missing = [text for text in acknowledged if text not in shown]
    assert not missing, f"{len(missing)} of {TRIES} acknowledged replies lost: {missing[:3]}"
    for i in range(TRIES):
        assert f"turn {i}" in shown  # the questions too


async def test_sigkill_of_a_replica_right_after_a_turn_loses_nothing_on_redis(
        spawn: Callable[..., ServerProcess], redis_server: RedisProcess) -> None:
    """Two replicas on one Redis: turns on replica A, A SIGKILLed right after each; replica B (never
    killed) shows every acknowledged reply from the shared log."""
    acknowledged: list[str] = []
    b = spawn("--redis-url", redis_server.url)
    await b.wait_ready()
    a = spawn("--redis-url", redis_server.url)
    for i in range(TRIES):
        await a.wait_ready()
        async with Connection(a.target, session="kill-r") as conn:
            reply = await answer(conn, "hello_world", f"turn {i}")
        a.proc.kill()
        a.proc.wait(10)
        acknowledged.append(reply.text)
        a = spawn("--redis-url", redis_server.url)
    shown = await _replayed(b.target, "kill-r")
    missing = [text for text in acknowledged if text not in shown]
    assert not missing, f"{len(missing)} of {TRIES} acknowledged replies lost: {missing[:3]}"


def _since_start(session: str) -> tuple[tuple[str, str], ...]:
    return (("x-uibus-session", session), ("x-uibus-since", "0"))


async def _acknowledge_events(target: str, session: str, i: int) -> str:
    """Makes two acknowledged events on the server at `target` and returns the answered dialog's
    id once the last one is acknowledged: an agent's notice and a UI's answer to an agent's dialog
    (the agent's call is left waiting for its result)."""
    async with Connection(target, session=session) as conn:
        await ext(conn).Notify(extension_ui_pb2.NotifyRequest(message=f"n{i}"))
        ui = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest()))
        asking = asyncio.ensure_future(ext(conn).Select(extension_ui_pb2.SelectRequest(title=f"d{i}",
                                                                                       options=["a", "b"])))
        while True:
            event = await ui.next(10)
            if event.HasField("request") and event.request.HasField("select"):
                break
        await ext(conn).Respond(extension_ui_pb2.RespondRequest(id=event.request.id, value="b"))
        asking.cancel()
        ui.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await asking
        return event.request.id


async def _next(reader: Reader, lost: str) -> Any:
    try:
        return await reader.next(5)
    except TimeoutError:
        raise AssertionError(lost) from None


async def test_sigkill_right_after_an_acknowledged_event_loses_none(spawn: Callable[..., ServerProcess]) -> None:
    """Each try: a notice and a dialog's answer acknowledged, then SIGKILL at once. A UI resuming
    from the start of the log on the next process gets every one."""
    tries = TRIES // 2
    answered: list[str] = []
    server = spawn()
    for i in range(tries):
        await server.wait_ready()
        answered.append(await _acknowledge_events(server.target, "acked", i))
        server.proc.kill()  # SIGKILL the moment the last acknowledgement arrived
        server.proc.wait(10)
        server = spawn()
    await server.wait_ready()
    async with Connection(server.target, session="acked") as conn:
        ui = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest(), metadata=_since_start("acked")))
        notices: list[str] = []
        closed: list[tuple[str, int]] = []
        while len(notices) < tries or len(closed) < tries:
            event = await _next(ui, f"extension-UI events lost: replayed notices {notices}, closes {closed}")
            if event.HasField("request") and event.request.HasField("notify"):
                notices.append(event.request.notify.message)
            elif event.HasField("closed"):
                closed.append((event.closed.id, event.closed.reason))
            assert not (event.HasField("request") and event.request.HasField("select")), \
                "a dialog answered before the crash was replayed as waiting"
        assert notices == [f"n{i}" for i in range(tries)]
        # answered, as acknowledged: not closed later as lost with its process (SHUTDOWN)
        assert closed == [(dialog_id, extension_ui_pb2.DIALOG_OUTCOME_ANSWERED) for dialog_id in answered]
        ui.call.cancel()


async def test_a_dialog_waiting_when_its_server_was_killed_is_closed_for_resuming_uis(
        spawn: Callable[..., ServerProcess]) -> None:
    """A dialog still waiting at a SIGKILL is in the log as waiting and no process holds it. A UI that
    saw it and resumes from its cursor on the next process is told it closed (SHUTDOWN), and one
    resuming from the start is never shown it as waiting; a dialog open on the new process stays
    open for them, and the dead one's answer is refused NOT_FOUND."""
    server = spawn()
    await server.wait_ready()
    async with Connection(server.target, session="orphan") as conn:
        ui = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest()))
        asking = asyncio.ensure_future(ext(conn).Select(extension_ui_pb2.SelectRequest(title="old", options=["a"])))
        seen = await _next(ui, "the dialog never reached the UI")
        assert seen.request.HasField("select")
        # A dialog's request is written behind (uibus.domain.session_log: only what a reply acknowledges
        # is awaited), so the UI may see it a few ms before its commit. The crash this test is about
        # comes after that write, not during it.
        await asyncio.sleep(4 * LOG_WRITE_S)
        server.proc.kill()  # with the dialog waiting
        server.proc.wait(10)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await asking
    server = spawn()
    await server.wait_ready()
    async with Connection(server.target, session="orphan") as conn:
        asking = asyncio.ensure_future(ext(conn).Select(extension_ui_pb2.SelectRequest(title="new", options=["b"])))
        live = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest()))
        new = await _next(live, "the new dialog never reached a UI")
        assert new.request.select.title == "new"

        resumed = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest(), metadata=(
            ("x-uibus-session", "orphan"), ("x-uibus-since", str(seen.seq)))))
        events = [await _next(resumed, "nothing replayed"), await _next(resumed, "one event replayed")]
        by_kind = {e.WhichOneof("event"): e for e in events}
        assert by_kind["closed"].closed.id == seen.request.id
        assert by_kind["closed"].closed.reason == extension_ui_pb2.DIALOG_OUTCOME_SHUTDOWN
        assert by_kind["request"].request.id == new.request.id  # the new one: still waiting

        fresh = Reader(ext(conn).Subscribe(extension_ui_pb2.SubscribeRequest(), metadata=_since_start("orphan")))
        replayed = [await _next(fresh, "nothing replayed from the start") for _ in range(2)]
        waiting = [e.request.id for e in replayed if e.HasField("request")]
        assert waiting == [new.request.id], replayed
        assert live.queue.qsize() <= 1  # the live UI got the close of the dead one, at most
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ext(conn).Respond(extension_ui_pb2.RespondRequest(id=seen.request.id, value="a"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        await ext(conn).Respond(extension_ui_pb2.RespondRequest(id=new.request.id, value="b"))
        assert (await asyncio.wait_for(asking, 10)).value == "b"
        for reader in (live, resumed, fresh):
            reader.call.cancel()
