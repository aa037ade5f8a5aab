"""Steering a hosted agent across replicas (agent ownership meets steering): three replicas on one real
redis-server, the ACP fixture agent hosted by one of them (its lease owner, A). A turn sent to B runs
at A; a StopTurn sent to C reaches A over the bus: B's caller gets CANCELLED with the "stopped from
a UI" message and the agent gets `session/cancel`. SetMode, SetModel and NewConversation sent to C
act at A and answer with A's result or A's error; the listings served by B and C show A's agent
state (running, modes), and no longer once A stopped. A turn sent to B runs in B's caller's trace.
A turn cut off by A's shutdown (SIGTERM, after the grace) ends UNAVAILABLE saying the conversation
is kept, and the session's webviews (on B) get an ERROR saying so."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request
from tests.conftest import require, wait_for
from tests.hostkit import need_fixture, stop_a_hung_pi_turn
from tests.pikit import PI, Reply, pi_agent, scripted_model
from tests.redisproc import RedisProcess, redis_server
from tests.replicakit import (
    final,
    fixture_process,
    fixture_workers,
    owner_of,
    replicas,
    started,
    streaming_chat,
    worker_channels,
)
from tests.test_acp_agent import fixture_agent, fixture_log
from tests.test_tracing import TRACE_ID, TRACEPARENT, http_receiver, otlp_http
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

__all__ = ["otlp_http", "redis_server"]  # the fixtures

pytestmark = [pytest.mark.redis, pytest.mark.node, pytest.mark.timeout(120)]


def api(conn: Connection) -> Any:
    return sessions_pb2_grpc.SessionServiceStub(conn.channel)


async def listed_until(conn: Connection, session: str, ok: Callable[[pb.SessionEntry], bool]) -> pb.SessionEntry:
    """The session's entry in `conn`'s listing once `ok` holds (the owner's state write crossed the store)."""
    seen = None
    for _ in range(250):
        listed = await api(conn).ListSessions(pb.ListSessionsRequest(prefix=session))
        seen = next((s for s in listed.sessions if s.session == session), None)
        if seen is not None and ok(seen):
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"the listing never showed what was expected; last: {seen}")


async def test_steering_sent_to_a_third_replica_acts_at_the_owner(tmp_path: Path, redis_server: RedisProcess) -> None:
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=3) as apps:
        a, b, c = apps
        async with Connection(f"127.0.0.1:{a.port}", session="x") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="x") as on_b, \
                Connection(f"127.0.0.1:{c.port}", session="x") as on_c:
            assert await final(on_a, "acp", "one") == "Turn 1: one"
            assert owner_of(apps, "x", "acp") is a
            # nothing runs: the owner says so
            assert (await api(on_c).StopTurn(pb.AgentRequest(agent="acp"))).stopped is False

            call = Agent(on_b, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            seen = await listed_until(on_c, "x", lambda e: list(e.running) == ["acp"])  # A's agent, listed on C
            assert [(s.agent, s.live) for s in seen.agents] == [("acp", True)]
            assert [m.id for m in seen.agents[0].modes] == ["default", "plan"]
            assert (await api(on_c).StopTurn(pb.AgentRequest(agent="acp"))).stopped is True
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert "stopped from a UI" in (err.value.details() or "")
            await wait_for(lambda: sum("cancelled" in e for e in fixture_log(tmp_path)) == 1, timeout=10,
                           what="session/cancel at the agent, on A")

            state = await api(on_c).SetMode(pb.SetModeRequest(agent="acp", mode_id="plan"))
            assert state.current_mode == "plan" and state.agent == "acp"
            assert any(e.get("session/set_mode", {}).get("modeId") == "plan" for e in fixture_log(tmp_path))
            seen = await listed_until(on_b, "x", lambda e: bool(e.agents) and e.agents[0].current_mode == "plan")
            assert list(seen.running) == [] and [a.agent for a in seen.agents] == ["acp"]
            # the owner's errors come back with their status and message
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_c).SetMode(pb.SetModeRequest(agent="acp", mode_id="yolo"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "default, plan" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_b).SetModel(pb.SetModelRequest(agent="acp", model_id="x"))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details() == "acp offers no model choice"

            old = state.conversation
            state = await api(on_b).NewConversation(pb.AgentRequest(agent="acp"))
            assert state.conversation != old and list(state.conversations) == [old]
            assert await final(on_c, "acp", "hello") == "Turn 1: hello"  # the fresh conversation, at A
            assert started(apps, "acp") == 1
            assert all(x.bus.count(kinds.AGENT_TURN_REPLY) == 0 for x in (b, c))
            await a.aclose(grace=0.5)  # the owner stops: its agent leaves the other replicas' listings
            await listed_until(on_c, "x", lambda e: not e.agents)


async def test_a_forwarded_turn_stays_in_its_callers_trace(tmp_path: Path, redis_server: RedisProcess,
                                                          otlp_http: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The turn sent to B runs at A: A's turn span is a child of B's call span, in the caller's trace."""
    need_fixture()
    async with http_receiver() as (endpoint, got):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
            a, b = apps
            async with Connection(f"127.0.0.1:{a.port}", session="t") as on_a, \
                    Connection(f"127.0.0.1:{b.port}", session="t") as on_b:
                assert await final(on_a, "acp", "one") == "Turn 1: one"  # A owns the agent
                stream = Agent(on_b, "acp").StreamingChat(request("two", filter_type=MAXIMAL),
                                                          metadata=(("traceparent", TRACEPARENT),))
                assert [r async for r in stream][-1].response.text == "Turn 2: two"
    calls = [s for s in got.named("acp.AgentService/StreamingChat") if s.trace_id == TRACE_ID]
    assert len(calls) == 1 and calls[0].resource["service.instance.id"] != ""
    (call,) = calls
    turns = [s for s in got.children(call) if s.name == "chat turn acp"]
    assert len(turns) == 1, [s.name for s in got.spans if s.trace_id == TRACE_ID]
    (turn,) = turns
    assert turn.trace_id == TRACE_ID and turn.attributes["uibus.chat.outcome"] == "completed"
    assert turn.attributes["uibus.session"] == "t"


async def test_a_turn_cut_off_by_shutdown_says_the_conversation_is_kept(tmp_path: Path, redis_server: RedisProcess,
                                                                       spawn: Any) -> None:
    """SIGTERM at the replica running the turns: after its grace (1 s) they are cut by uibus, not by
    gRPC's "Cancelling all calls": their callers (one at the owner, one at B whose turn was carried
    to the owner) get UNAVAILABLE with the message, a webview of the session on B an ERROR with the
    same text; the process exits 0."""
    need_fixture()
    owner = await fixture_process(tmp_path, redis_server, spawn)
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
        (b,) = apps
        async with Connection(owner.target, session="z") as on_owner, \
                Connection(f"127.0.0.1:{b.port}", session="z") as on_b, \
                Connection(f"127.0.0.1:{b.port}", session="z2") as on_b2:
            webview = ui_pb2_grpc.UiServiceStub(on_b.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
            await wait_for(lambda: b.bus.count(kinds.PARTIAL_MESSAGE, "z") == 1, what="the webview on B")
            call = Agent(on_owner, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            # and a turn of another session, sent to B and carried to the owner
            async with Connection(owner.target, session="z2") as other:
                assert await final(other, "acp", "one") == "Turn 1: one"
            forwarded = Agent(on_b2, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(forwarded.read(), 20)).response.text == "Working "
            owner.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            message = ("the turn of acp was interrupted: the uibus server hosting it is shutting down; the "
                       "conversation is kept, send the turn again")
            for cut in (call, forwarded):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in cut:
                        pass
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
                assert error.value.details() == message
            assert 0.9 < time.monotonic() - signalled < 5  # the grace was given
            async with asyncio.timeout(5):
                while not ((m := await webview.read()).say == ui_pb2.ERROR and m.text == error.value.details()):
                    pass
            webview.cancel()
            assert await asyncio.to_thread(owner.proc.wait, 30) == 0
        assert any("cancelled" in e for e in fixture_log(tmp_path))  # the agent got session/cancel


async def test_steering_an_owner_that_does_not_answer_is_unavailable(tmp_path: Path, redis_server: RedisProcess,
                                                                    spawn: Any) -> None:
    """The owner frozen (SIGSTOP) while its lease still runs: a StopTurn at B ends UNAVAILABLE within
    the accept bound, saying the owner did not answer."""
    need_fixture()
    owner = await fixture_process(tmp_path, redis_server, spawn, "--agent-lease-seconds", "10")
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
        (b,) = apps
        async with Connection(owner.target, session="f") as on_owner, \
                Connection(f"127.0.0.1:{b.port}", session="f") as on_b:
            assert await final(on_owner, "acp", "one") == "Turn 1: one"
            assert (await api(on_b).StopTurn(pb.AgentRequest(agent="acp"))).stopped is False  # it answers
            owner.proc.send_signal(signal.SIGSTOP)
            try:
                asked = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await api(on_b).StopTurn(pb.AgentRequest(agent="acp"))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == ("the uibus replica hosting agent 'acp' for this session did not "
                                               "answer the stop request; try again shortly")
                assert time.monotonic() - asked < 10
            finally:
                owner.proc.send_signal(signal.SIGCONT)
            assert b.bus.count(kinds.AGENT_TURN_REPLY) == 0


async def test_a_forwarded_pi_turn_stopped_and_pi_steered_from_the_forwarder(tmp_path: Path,
                                                                            redis_server: RedisProcess) -> None:
    """pi hosted by A; B carries a turn to it and a UI on B stops it (pi `abort`: the model request
    is dropped), sets pi's model and starts a new session there; B's listing shows pi's models."""
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model, replicas(tmp_path, redis_server, [pi_agent(tmp_path, model)]) as apps:
        model.script(Reply(text="Hi."), Reply(text="Thinking very hard ", hang=True), Reply(text="Recovered."))
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="p") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="p") as on_b:
            assert await final(on_a, "pi", "hello") == "Hi."
            assert owner_of(apps, "p", "pi") is a
            seen = await listed_until(on_b, "p", lambda e: bool(e.agents) and bool(e.agents[0].models))
            assert [m.id for m in seen.agents[0].models] == ["scripted"] and "set_model" in seen.agents[0].can
            err = await stop_a_hung_pi_turn(on_b, on_b, model)  # pi saw `abort`: it dropped its model request
            assert "stopped from a UI" in (err.details() or "")
            state = await api(on_b).SetModel(pb.SetModelRequest(agent="pi", model_id="scripted"))
            assert state.current_model == "scripted"
            state = await api(on_b).NewConversation(pb.AgentRequest(agent="pi"))
            assert state.live and len(state.conversations) == 1
            assert await final(on_b, "pi", "are you there?") == "Recovered."
            assert started(apps, "pi") == 1


async def test_steering_a_name_that_is_no_hosted_agent_claims_nothing(tmp_path: Path,
                                                                     redis_server: RedisProcess) -> None:
    """Bad input is answered where it arrived: no lease is taken for a name no agent has."""
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        a, _ = apps
        async with Connection(f"127.0.0.1:{a.port}", session="n") as on_a:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_a).SetMode(pb.SetModeRequest(agent="nobody", mode_id="plan"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "nobody is not running in session 'n'" in (err.value.details() or "")
            assert (await api(on_a).StopTurn(pb.AgentRequest(agent="nobody"))).stopped is False
            assert a.placement.ownership is not None and not a.placement.ownership.held
            # a hosted agent that runs nowhere: the same answer, from whichever replica claims it
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api(on_a).SetMode(pb.SetModeRequest(agent="acp", mode_id="plan"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_steering_through_either_of_two_workers_reaches_the_one_agent(tmp_path: Path,
                                                                           redis_server: RedisProcess,
                                                                           spawn: Any) -> None:
    """`--workers 2` on Redis: each worker, whichever hosts the agent, sets its mode and lists it."""
    need_fixture()
    server = await fixture_workers(tmp_path, redis_server, spawn)
    async with worker_channels(server.target) as by_worker:
        meta = (("x-uibus-session", "w"),)
        chat = streaming_chat(next(iter(by_worker.values())))
        assert [r async for r in chat(request("one"), metadata=meta)][-1].response.text == "Turn 1: one"
        for mode, channel in zip(("plan", "default"), by_worker.values(), strict=True):
            stub = sessions_pb2_grpc.SessionServiceStub(channel)
            state = await stub.SetMode(pb.SetModeRequest(agent="acp", mode_id=mode), metadata=meta)
            assert state.current_mode == mode
            for other in by_worker.values():  # every worker lists the mode just set
                listing = sessions_pb2_grpc.SessionServiceStub(other)
                for _ in range(250):
                    listed = await listing.ListSessions(pb.ListSessionsRequest(prefix="w"))
                    if listed.sessions and listed.sessions[0].agents \
                            and listed.sessions[0].agents[0].current_mode == mode:
                        break
                    await asyncio.sleep(0.02)
                assert listed.sessions[0].agents[0].current_mode == mode
        assert len([e for e in fixture_log(tmp_path) if "initialize" in e]) == 1  # one agent process
        assert [e["session/set_mode"]["modeId"] for e in fixture_log(tmp_path) if "session/set_mode" in e] \
            == ["plan", "default"]
