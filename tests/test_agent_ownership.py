"""One live hosted agent per (session, agent) across replicas and workers (docs/hosting/durable.md).

Two replicas (and `--workers 2`) on one real redis-server host the real agents (the ACP fixture,
pi 0.73 and claude-code-acp 0.16 on the scripted model servers). Turns of one session land on both;
one replica holds the agent's lease and runs its one process, the other carries its turns there
over the bus (uibus.replicas.turn_forwarding): processes are counted, and the agent (or the
scripted model) shows one conversation. Then the caller's cancel and deadline at a forwarded turn,
the owner SIGKILLed mid-turn (UNAVAILABLE with the message, the next turn taken over within the
lease), and fencing (an owner cut off from Redis past its lease runs no turn of a session another
replica took over). Counts (agent sessions, subscriptions, leases) return to zero.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request, write_agents
from tests.conftest import require, start_app, wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from tests.hostkit import need_fixture
from tests.pikit import PI, Reply, agent_pids, pi_agent, scripted_model, turn_of
from tests.redisproc import (
    RedisClusterProcess,
    RedisProcess,
    _command,
    redis_cluster,
    redis_cluster_clean,
    redis_server,
)
from tests.replicakit import (
    LEASE_S,
    final,
    fixture_process,
    fixture_workers,
    owner_of,
    replicas,
    started,
    streaming_chat,
    worker_channels,
)
from tests.scripted_models import Say, claude_model
from tests.support import scrape_by_name
from tests.test_acp_agent import CLAUDE_ACP, claude_agent, fixture_agent, fixture_log
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config
from uibus.infra.store import Lease, Store
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server"]  # the fixtures

pytestmark = [pytest.mark.redis, pytest.mark.node, pytest.mark.timeout(180)]

# ---- the store's lease: the embedded stores and Redis, one contract ------------------------------


async def lease_contract(store: Store) -> None:
    a = await store.take_lease("s", "pi", "A", 0.5)
    assert a == Lease("A", a.token)
    assert await store.take_lease("s", "pi", "B", 0.5) == Lease("A", a.token)  # held: B is told who owns it
    assert await store.take_lease("s", "pi", "A", 0.5) == Lease("A", a.token)  # the owner renews, same token
    assert await store.renew_lease("s", "pi", "A", a.token, 0.5)
    assert not await store.renew_lease("s", "pi", "B", a.token, 0.5)
    await asyncio.sleep(0.6)  # expired: B takes it over with a higher token, and A is fenced
    b = await store.take_lease("s", "pi", "B", 0.5)
    assert (b.owner, b.taken_from) == ("B", "A") and b.token > a.token
    assert not await store.renew_lease("s", "pi", "A", a.token, 0.5)
    await store.drop_lease("s", "pi", "A", a.token)  # not A's any more: nothing happens
    assert (await store.take_lease("s", "pi", "A", 0.5)).owner == "B"
    await store.drop_lease("s", "pi", "B", b.token)  # given up: A takes it at once (a free lease, not one over)
    c = await store.take_lease("s", "pi", "A", 0.5)
    assert c == Lease("A", c.token) and c.token > b.token
    assert (await store.take_lease("s", "other", "B", 0.5)).owner == "B"  # one lease per (session, agent)


async def test_the_lease_contract_on_sqlite_and_redis(tmp_path: Path, redis_server: RedisProcess) -> None:
    from uibus.infra.redis.store import RedisStore
    from uibus.infra.sqlite_store import SqliteStore
    for store in (SqliteStore(str(tmp_path / "s.db")), RedisStore(redis_server.url)):
        async with store:
            await lease_contract(store)


async def test_the_lease_contract_on_a_redis_cluster(redis_cluster_clean: RedisClusterProcess) -> None:
    """One script on one key in the session's slot: the same on a cluster (no CROSSSLOT)."""
    from uibus.infra.redis.store import RedisStore
    async with RedisStore(redis_cluster_clean.url, cluster=True) as store:
        await lease_contract(store)


# ---- one process, one conversation --------------------------------------------------------------


async def test_turns_through_both_replicas_reach_one_acp_agent(tmp_path: Path, redis_server: RedisProcess) -> None:
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="s") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="s") as on_b:
            assert await final(on_a, "acp", "one") == "Turn 1: one"
            assert await final(on_b, "acp", "two") == "Turn 2: two"  # the same agent session, on A
            assert await final(on_b, "acp", "three") == "Turn 3: three"
            assert await final(on_a, "acp", "four") == "Turn 4: four"
            assert started(apps, "acp") == 1
            assert len([e for e in fixture_log(tmp_path) if "initialize" in e]) == 1
            assert owner_of(apps, "s", "acp") is a
            assert a.core.agent_sessions.count() == 1 and b.core.agent_sessions.count() == 0
            on_b_metrics, on_a_metrics = await scrape_by_name(b), await scrape_by_name(a)
            assert on_b_metrics["uibus_agent_turns_forwarded_total"] == 2
            assert on_a_metrics["uibus_agent_turns_served_total"] == 2
            assert on_a_metrics["uibus_agent_leases_taken_over_total"] == 0
            assert on_a_metrics["uibus_agent_leases_fenced_total"] == 0


async def test_first_turns_at_once_on_both_replicas_start_one_agent(tmp_path: Path,
                                                                   redis_server: RedisProcess) -> None:
    """The lease is taken atomically: one replica wins, the other's turn waits for the winner to
    listen and is carried there."""
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="race") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="race") as on_b:
            answers = await asyncio.gather(final(on_a, "acp", "from a"), final(on_b, "acp", "from b"))
            assert sorted(answers) in (["Turn 1: from a", "Turn 2: from b"], ["Turn 1: from b", "Turn 2: from a"])
            assert started(apps, "acp") == 1


async def test_pi_turns_through_both_replicas_reach_one_process_and_one_conversation(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model, replicas(tmp_path, redis_server, [pi_agent(tmp_path, model)]) as apps:
        model.script(Reply(text="The first answer."), Reply(text="The second answer."), Reply(text="Third."))
        a, b = apps
        async with Connection(f"127.0.0.1:{b.port}", session="pi") as on_b, \
                Connection(f"127.0.0.1:{a.port}", session="pi") as on_a:
            assert await final(on_b, "pi", "first question") == "The first answer."
            assert len(agent_pids(tmp_path / "work")) == 1
            assert await final(on_a, "pi", "second question") == "The second answer."  # carried to B
            assert await final(on_b, "pi", "third question") == "Third."
            second = json.dumps(model.requests[1]["messages"])  # pi kept one conversation
            assert "first question" in second and "The first answer." in second and "second question" in second
            assert len(agent_pids(tmp_path / "work")) == 1 and started(apps, "pi") == 1
            assert owner_of(apps, "pi", "pi") is b


async def test_claude_code_turns_through_both_replicas_reach_one_process_and_one_conversation(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    require("Claude Code's ACP adapter (npm ci --prefix tests/acp)", CLAUDE_ACP.exists(), "node")
    async with claude_model() as model, \
            replicas(tmp_path, redis_server, [claude_agent(tmp_path, model)]) as apps:
        model.script(Say("Hello from Claude Code, scripted."), Say("Still the same conversation."))
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="cc") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="cc") as on_b:
            assert await final(on_a, "claude", "hi") == "Hello from Claude Code, scripted."
            assert await final(on_b, "claude", "and now?") == "Still the same conversation."
            second = json.dumps(model.requests[1]["messages"])  # Claude Code kept its own conversation
            assert "Hello from Claude Code, scripted." in second and "and now?" in second
            assert started(apps, "claude") == 1
            assert owner_of(apps, "cc", "claude") is a


# ---- the caller's cancel and deadline at a forwarded turn ------------------------------------------


async def test_a_forwarded_turns_cancel_and_deadline_reach_the_agent(tmp_path: Path,
                                                                    redis_server: RedisProcess) -> None:
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)]) as apps:
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="c") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="c") as on_b:
            assert await final(on_a, "acp", "one") == "Turn 1: one"  # A owns the agent
            call = Agent(on_b, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            call.cancel()
            await wait_for(lambda: sum("cancelled" in e for e in fixture_log(tmp_path)) == 1, timeout=10,
                           what="session/cancel at the agent, on A")
            # The deadline: the caller's call ends DEADLINE_EXCEEDED and the agent is told to stop.
            late = Agent(on_b, "acp").StreamingChat(request("slow", filter_type=MAXIMAL), timeout=1.5)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in late:
                    pass
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: sum("cancelled" in e for e in fixture_log(tmp_path)) == 2, timeout=10,
                           what="session/cancel of the late turn, on A")
            assert await final(on_b, "acp", "next") == "Turn 4: next"  # the same agent session goes on
            assert started(apps, "acp") == 1
            await wait_for(lambda: b.bus.count(kinds.AGENT_TURN_REPLY) == 0 and not a.placement.forwarding._turns,  # type: ignore[attr-defined]
                           what="the forwarded turns' subscriptions and tasks gone")


async def test_a_dialog_of_a_forwarded_turn_is_answered_on_a_third_replica(tmp_path: Path,
                                                                          redis_server: RedisProcess) -> None:
    """The turn arrives at B, runs at A (the owner), and its permission request is answered by a UI on C."""
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=3) as apps:
        a, b, c = apps
        async with Connection(f"127.0.0.1:{a.port}", session="d") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="d") as on_b, \
                Connection(f"127.0.0.1:{c.port}", session="d") as on_c:
            assert await final(on_a, "acp", "one") == "Turn 1: one"
            (ui,) = await open_uis(c, on_c, 1, "d")
            call = asyncio.ensure_future(turn_of(on_b, "acp", "tour", maximal=True))
            asked = (await read(ui, 30)).request
            assert asked.select.title == "rm -rf build"
            await ext(on_c).Respond(pb.RespondRequest(id=asked.id, value="Reject"))
            responses = await asyncio.wait_for(call, 30)
            assert "Permission: reject." in responses[-1].response.text  # the answer given on C reached the agent on A
            assert started(apps, "acp") == 1 and owner_of(apps, "d", "acp") is a
            assert b.placement.forwarding is not None and b.placement.forwarding.forwarded == 1
            del ui


async def test_a_forwarded_pi_turns_cancel_aborts_pi_at_the_owner(tmp_path: Path, redis_server: RedisProcess) -> None:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model, replicas(tmp_path, redis_server, [pi_agent(tmp_path, model)]) as apps:
        model.script(Reply(text="Hello."), Reply(text="Thinking very hard ", hang=True), Reply(text="Recovered."))
        a, b = apps
        async with Connection(f"127.0.0.1:{a.port}", session="pc") as on_a, \
                Connection(f"127.0.0.1:{b.port}", session="pc") as on_b:
            assert await final(on_a, "pi", "hi") == "Hello."  # A owns pi
            call = Agent(on_b, "pi").StreamingChat(request("take forever", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 30)).response.text == "Thinking "
            await wait_for(lambda: model.open_requests == 1, timeout=10, what="the model request")
            call.cancel()  # at B: carried to A, where pi gets `abort` and drops its model request
            await wait_for(lambda: model.open_requests == 0, timeout=10, what="the model request to be dropped")
            assert model.cancelled == 1
            assert await final(on_b, "pi", "are you there?") == "Recovered."
            assert started(apps, "pi") == 1 and len(agent_pids(tmp_path / "work")) == 1


# ---- the owner SIGKILLed; fencing ---------------------------------------------------------------------


async def test_the_owner_killed_mid_turn_ends_it_unavailable_and_the_next_turn_takes_over(
        tmp_path: Path, redis_server: RedisProcess, spawn: Any) -> None:
    need_fixture()
    owner = await fixture_process(tmp_path, redis_server, spawn)
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
        (b,) = apps
        async with Connection(owner.target, session="k") as on_owner, \
                Connection(f"127.0.0.1:{b.port}", session="k") as on_b:
            assert await final(on_owner, "acp", "one") == "Turn 1: one"
            webview = ui_pb2_grpc.UiServiceStub(on_b.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
            await wait_for(lambda: b.bus.count(kinds.PARTIAL_MESSAGE, "k") == 1, what="the webview on B")
            call = Agent(on_b, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            owner.proc.kill()  # SIGKILL: no goodbye, its lease just stops being renewed
            killed = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the conversation is kept, send the turn again" in str(error.value.details())
            assert time.monotonic() - killed < 2 * LEASE_S + 1
            async with asyncio.timeout(5):  # the webviews are told too: a Cline ERROR message
                while not ((m := await webview.read()).say == ui_pb2.ERROR and m.text == error.value.details()):
                    pass
            webview.cancel()
            answer = ""
            for _ in range(3):  # a retry after UNAVAILABLE is allowed; within the lease bound
                try:
                    answer = await final(on_b, "acp", "again")
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert answer.endswith(": again")
            assert time.monotonic() - killed < 3 * LEASE_S + 3
            assert b.placement.ownership is not None and b.placement.ownership.taken_over == 1
            assert owner_of(apps, "k", "acp") is b and b.core.agent_sessions.count() == 1


async def test_a_forwarder_killed_mid_turn_stops_the_turn_at_the_owner(
        tmp_path: Path, redis_server: RedisProcess, spawn: Any) -> None:
    need_fixture()
    forwarder = await fixture_process(tmp_path, redis_server, spawn)
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
        (a,) = apps
        async with Connection(f"127.0.0.1:{a.port}", session="g") as on_a, \
                Connection(forwarder.target, session="g") as on_forwarder:
            assert await final(on_a, "acp", "one") == "Turn 1: one"  # A owns the agent
            call = Agent(on_forwarder, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            forwarder.proc.kill()  # it can send no cancel: its silence is what A notices
            killed = time.monotonic()
            await wait_for(lambda: any("cancelled" in e for e in fixture_log(tmp_path)), timeout=3 * LEASE_S,
                           what="session/cancel at the agent, on A")
            assert time.monotonic() - killed < LEASE_S * 1.5 + 1
            assert await final(on_a, "acp", "two") == "Turn 3: two"  # the agent session goes on at A
            assert a.placement.forwarding is not None and not a.placement.forwarding._turns


class CutProxy:
    """A TCP proxy to Redis that can be cut: every connection through it is closed and new ones refused."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self.server.wait_closed()
        self.server = None


async def test_an_owner_cut_off_from_redis_past_its_lease_stops_running_the_agent(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    need_fixture()
    proxy = CutProxy(int(redis_server.url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    path = write_agents(tmp_path, [fixture_agent(tmp_path)])
    a = await start_app(Config(host="127.0.0.1", port=0, http_port=0, redis_url=f"redis://127.0.0.1:{proxy.port}",
                               grace_seconds=1.0, agents=path, agent_lease_seconds=LEASE_S))
    try:
        async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
            (b,) = apps
            await wait_for(lambda: a.bus.connected, what="A on redis")
            async with Connection(f"127.0.0.1:{a.port}", session="f") as on_a, \
                    Connection(f"127.0.0.1:{b.port}", session="f") as on_b:
                assert await final(on_a, "acp", "one") == "Turn 1: one"
                call = Agent(on_a, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
                assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
                await proxy.cut()
                cut = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as error:  # the running turn is cut at A
                    async for _ in call:
                        pass
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "the conversation is kept" in str(error.value.details())
                assert time.monotonic() - cut < LEASE_S * 1.25 + 1.5
                assert a.placement.ownership is not None and a.placement.ownership.fenced == 1
                await wait_for(lambda: a.core.agent_sessions.count() == 0, timeout=10, what="A's agent closed")
                # A runs no turn of the session now: it cannot even learn who owns it.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await final(on_a, "acp", "on a")
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                # B takes it over once A's lease expired (its own agent: A's is gone).
                answer = ""
                for _ in range(3):
                    try:
                        answer = await final(on_b, "acp", "on b")
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert answer == "Turn 1: on b"
                assert owner_of([a, b], "f", "acp") is b and b.placement.ownership.taken_over == 1  # type: ignore[attr-defined]
                assert a.core.agent_sessions.count() == 0
    finally:
        await a.aclose(grace=0.5)
    assert a.core.agent_sessions.count() == 0


async def test_an_owner_whose_renewal_is_refused_stops_at_once(tmp_path: Path, redis_server: RedisProcess) -> None:
    """Another holder in the store (a newer token) makes the owner's next renewal fail: it is fenced
    then and there, before its own clock runs out: running turns cut, agent closed."""
    need_fixture()
    async with replicas(tmp_path, redis_server, [fixture_agent(tmp_path)], n=1) as apps:
        (a,) = apps
        async with Connection(f"127.0.0.1:{a.port}", session="r") as on_a:
            assert await final(on_a, "acp", "one") == "Turn 1: one"
            call = Agent(on_a, "acp").StreamingChat(request("slow", filter_type=MAXIMAL))
            assert (await asyncio.wait_for(call.read(), 20)).response.text == "Working "
            key = "uibus:{r}:lease:acp"
            _command(redis_server.port, "HSET", key, "owner", "intruder", "token", "999",
                     "until", str(int(time.time() * 1000) + 60_000))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the conversation is kept" in str(error.value.details())
            assert a.placement.ownership is not None and a.placement.ownership.fenced == 1
            await wait_for(lambda: a.core.agent_sessions.count() == 0, timeout=10, what="A's agent closed")
            _command(redis_server.port, "DEL", key)


# ---- --workers 2 ---------------------------------------------------------------------------------------


async def test_turns_through_two_workers_reach_one_agent(tmp_path: Path, redis_server: RedisProcess,
                                                        spawn: Any) -> None:
    need_fixture()
    server = await fixture_workers(tmp_path, redis_server, spawn)
    async with worker_channels(server.target) as by_worker:
        chats = [streaming_chat(channel) for channel in by_worker.values()]
        answers = []
        for n in range(6):
            replies = [r async for r in chats[n % 2](request(f"t{n}"), metadata=(("x-uibus-session", "w"),))]
            answers.append(replies[-1].response.text)
        assert answers == [f"Turn {n + 1}: t{n}" for n in range(6)]  # one conversation, whichever worker
        assert len([e for e in fixture_log(tmp_path) if "initialize" in e]) == 1  # one agent process
