"""The chat's session side: server-kept ChatContext, isolation between sessions and agents,
persistence across a restart, chat history, the live feed to Cline webviews, and cancellation."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from tests.chatkit import AI, FRAMEWORK, MAXIMAL, Agent, answer, chat, local, request, running, write_agents
from tests.conftest import wait_for
from uibus.clients.connection import Connection
from uibus.domain.history import CONTEXT_PREFIX
from uibus.edge.calls import CallContext
from uibus.infra import kinds
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.neuro_san.api.grpc import chat_pb2


async def test_server_continues_the_conversation_when_the_client_sends_no_context(connect):
    conn = connect("cont")
    first = await answer(conn, "hello_world", "my name is Ada")
    assert "This is the start of our conversation." in first.text
    second = await answer(conn, "hello_world", "what is my name?")
    assert 'Earlier you said: "my name is Ada" (this is turn 2).' in second.text
    third = await answer(conn, "hello_world", "bye")
    assert 'Earlier you said: "what is my name?" (this is turn 3).' in third.text
    texts = [m.text for m in third.chat_context.chat_histories[0].messages]
    assert texts[0::2] == ["my name is Ada", "what is my name?", "bye"]


async def test_a_context_sent_by_the_client_wins(app, connect):
    conn = connect("wins")
    await answer(conn, "hello_world", "stored one")
    await answer(conn, "hello_world", "stored two")
    own = chat_pb2.ChatContext()
    history = own.chat_histories.add()
    history.origin.add(tool="hello_world", instantiation_index=1)
    history.messages.add(type=chat_pb2.ChatMessage.HUMAN, text="zebra")
    history.messages.add(type=chat_pb2.ChatMessage.AI, text="ok")
    reply = await answer(conn, "hello_world", "and now?", context=own)
    assert 'Earlier you said: "zebra" (this is turn 2).' in reply.text
    # An empty context starts over, and the stored conversation becomes the client's.
    fresh = await answer(conn, "hello_world", "new start", context=chat_pb2.ChatContext())
    assert "This is the start of our conversation." in fresh.text
    stored = await app.core.history.load_context("wins", "hello_world")
    assert [m.text for m in stored.chat_histories[0].messages][0::2] == ["new start"]
    after = await answer(conn, "hello_world", "next")
    assert 'Earlier you said: "new start" (this is turn 2).' in after.text


async def test_sessions_and_agents_never_see_each_others_context(config, tmp_path: Path):
    path = write_agents(tmp_path, [local("one"), local("two")])
    async with running(config, path) as app:
        target = f"127.0.0.1:{app.port}"
        async with Connection(target, session="a") as a, Connection(target, session="b") as b:
            await answer(a, "one", "alpha")
            await answer(b, "one", "beta")
            await answer(a, "two", "gamma")
            assert 'Earlier you said: "alpha"' in (await answer(a, "one", "again")).text
            assert 'Earlier you said: "beta"' in (await answer(b, "one", "again")).text
            assert 'Earlier you said: "gamma"' in (await answer(a, "two", "again")).text
            assert "start of our conversation" in (await answer(b, "two", "first")).text
            assert sorted((await app.store.scan("a", CONTEXT_PREFIX)).keys()) == [
                "chat/context/one", "chat/context/two"]


async def test_context_survives_a_restart_with_the_sqlite_store(spawn):
    server = spawn()
    await server.wait_ready()
    async with Connection(server.target, session="durable") as conn:
        await answer(conn, "hello_world", "remember the lighthouse")
    server.stop()  # SIGKILL: no graceful flush, the committed rows must still be there
    again = spawn()
    await again.wait_ready()
    async with Connection(again.target, session="durable") as conn:
        reply = await answer(conn, "hello_world", "what did I say?")
    assert 'Earlier you said: "remember the lighthouse" (this is turn 2).' in reply.text


async def test_chat_history_is_appended_per_session_and_readable(app, connect):
    conn = connect("hist")
    watcher = app.bus.subscribe("hist", kinds.CHAT_MESSAGE)
    first = await answer(conn, "hello_world", "one")
    second = await answer(conn, "hello_world", "two")
    entries = await app.core.history.read("hist")
    assert [(e["role"], e["text"]) for e in entries] == [
        ("user", "one"), ("assistant", first.text), ("user", "two"), ("assistant", second.text)]
    assert {(e["agent"], e["source"]) for e in entries} == {("hello_world", "neuro-san")}
    assert entries == sorted(entries, key=lambda e: e["ts"])
    # Other sides append to the same list and read it back.
    await app.core.history.append("hist", "user", "from the UI", source="webview")
    assert (await app.core.history.read("hist", last=1))[0]["text"] == "from the UI"
    assert await app.core.history.read("other") == []
    # Each entry was announced on the bus as it was stored.
    announced = [await asyncio.wait_for(watcher.__anext__(), 1) for _ in range(5)]
    assert announced == [*entries, (await app.core.history.read("hist", last=1))[0]]
    app.bus.unsubscribe(watcher)
    assert app.bus.count(kinds.CHAT_MESSAGE) == 0
    with pytest.raises(ValueError, match="role 'robot' is not one of user, assistant, system"):
        await app.core.history.append("hist", "robot", "beep")


async def test_a_cline_subscriber_sees_the_chat_grow_and_finish(app, connect):
    viewer, other = connect("live"), connect("elsewhere")
    stream = viewer.ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
    other_stream = other.ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE) == 2, what="both subscriptions")
    chatter = connect("live")
    # 70 ms between pieces is above the engine's 50 ms publish interval, so every piece shows.
    responses = await chat(chatter, "hello_world", "show me", filter_type=MAXIMAL,
                           sly={"chunks": 5, "delay_ms": 70})
    final_text = responses[-1].response.text
    # The question first, as Cline's host says a user's message: every UI of the session shows it.
    asked = await asyncio.wait_for(stream.read(), 2)
    assert (asked.type, asked.say, asked.text, asked.partial) == (ui_pb2.SAY, ui_pb2.USER_FEEDBACK, "show me", False)
    seen: list[ui_pb2.ClineMessage] = []
    while not seen or seen[-1].partial:
        seen.append(await asyncio.wait_for(stream.read(), 2))
    assert len(seen) == 6  # five growing states, then the finished message
    assert {m.ts for m in seen} == {seen[0].ts} and seen[0].ts > asked.ts > 0
    assert all(m.type == ui_pb2.SAY and m.say == ui_pb2.TEXT for m in seen)
    assert [m.partial for m in seen] == [True] * 5 + [False]
    texts = [m.text for m in seen]
    assert all(len(a) < len(b) and b.startswith(a) for a, b in itertools.pairwise(texts[:-1]))
    assert texts[-2] == texts[-1] == final_text
    # The next reply is a new webview message (a new ts); the other session saw nothing.
    await answer(chatter, "hello_world", "again")
    later = await asyncio.wait_for(stream.read(), 2)
    assert later.ts > seen[0].ts
    assert app.bus.count(kinds.PARTIAL_MESSAGE, "elsewhere") == 1
    assert app.bus.counters[kinds.PARTIAL_MESSAGE.name].published >= 8
    try:
        leaked = await asyncio.wait_for(other_stream.read(), 0.2)
    except TimeoutError:
        leaked = None
    assert leaked is None, leaked
    stream.cancel()
    other_stream.cancel()
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE) == 0, what="subscriptions removed")


async def test_cancelling_a_chat_stops_the_local_agent_at_once(app, connect):
    conn = connect("cancel")
    backend = app.core.chat.backend("hello_world")
    viewer = conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
    await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "cancel") == 1, what="viewer subscribed")
    call = Agent(conn, "hello_world").StreamingChat(
        request("long one", filter_type=MAXIMAL, sly={"chunks": 50, "delay_ms": 200}))
    types = [(await call.read()).response.type for _ in range(2)]
    assert types[-1] == AI and backend.active == 1
    cancelled_at = time.monotonic()
    call.cancel()
    took = await wait_for(lambda: backend.active == 0, timeout=2, what="backend stopped")
    assert backend.cancelled == 1
    print(f"cancel -> local agent stopped: {(time.monotonic() - cancelled_at) * 1000:.1f} ms (poll 5 ms)")
    assert time.monotonic() - cancelled_at < 0.1, f"backend still running {took * 1000:.0f} ms after the cancel"
    # The webview's message was closed rather than left "typing", and no answer was stored.
    asked = await asyncio.wait_for(viewer.read(), 2)
    assert (asked.say, asked.text) == (ui_pb2.USER_FEEDBACK, "long one")
    states = []
    while not states or states[-1].partial:
        states.append(await asyncio.wait_for(viewer.read(), 2))
    assert states[-1].partial is False and "Hello from".startswith(states[-1].text)
    assert [e["role"] for e in await app.core.history.read("cancel")] == ["user"]
    assert (await app.core.history.load_context("cancel", "hello_world")).chat_histories == []
    viewer.cancel()
    await wait_for(lambda: app.bus.count() == 0, what="all subscriptions gone")
    # The server goes on serving the session.
    final = (await chat(conn, "hello_world", "short", sly={"chunks": 2}))[-1].response
    assert final.type == FRAMEWORK and backend.active == 0


async def test_a_chat_parked_between_pieces_is_closed_when_the_call_ends(app):
    """A cancel that lands while gRPC is sending finds the chat parked at a `yield`; the call's
    done-callback must still stop the backend at once (here driven through the registry, as the
    HTTP side does, with a context that records its done-callbacks)."""
    backend = app.core.chat.backend("hello_world")
    handler = app.registry.lookup("/hello_world.AgentService/StreamingChat")
    context = CallContext((("x-uibus-session", "parked"),), "test", "inprocess")
    responses = handler.unary_stream(request("park me", filter_type=MAXIMAL, sly={"chunks": 20, "delay_ms": 50}),
                                     context)
    assert (await responses.__anext__()).response.type != FRAMEWORK  # progress
    assert (await responses.__anext__()).response.type == AI  # now parked at a yield
    assert backend.active == 1
    ended_at = time.monotonic()
    context.finish(cancelled=True)  # the RPC ended (cancel, deadline, disconnect): done callbacks run
    await wait_for(lambda: backend.active == 0, timeout=1, what="backend closed")
    assert time.monotonic() - ended_at < 0.1 and backend.cancelled == 1
    await responses.aclose()
