"""State that never breaks: chat contexts within their byte budget, no lost turns, mailboxes
bounded in bytes, bounded /metrics, headers as the "subscribed" signal, and keepalive.

Real servers on loopback, real channels (native gRPC, gRPC-Web, the neuro-san HTTP API), a real
redis-server for the two-replica case, client processes that are frozen or never read.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import replace

import grpc
import httpx
import pytest

from tests.chatkit import MAXIMAL, Agent, answer, request
from tests.conftest import REPO, require, require_binary, running, subscriber, wait_for
from tests.redistarget import RedisTarget, redis_cluster, redis_cluster_clean, redis_server, redis_target
from tests.support import scrape_text
from tests.webclient import call
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.pb.cline import common_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2, extension_ui_pb2_grpc, host_pb2, webview_pb2, webview_pb2_grpc

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server", "redis_target"]

KB = 1024
MB = 1024 * 1024
BIG = 700 * KB
EMPTY = common_pb2.EmptyRequest()


def big_text(i: int) -> str:
    return f"turn {i}: " + "x" * BIG


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


# ---- 1. one big turn never breaks a chat ----------------------------------------------------------


async def test_eight_700kb_turns_then_hi_all_answer_and_the_stored_context_stays_within_budget(web_config):
    async with running(web_config) as app, Connection(f"127.0.0.1:{app.port}", session="big") as conn:
        budget = app.config.chat_context_bytes
        for i in range(8):
            reply = await answer(conn, "hello_world", big_text(i))  # the default 4 MiB receive limit
            assert reply.chat_context.ByteSize() <= budget
            stored = await app.core.history.load_context("big", "hello_world")
            assert stored.ByteSize() <= budget
        hi = await answer(conn, "hello_world", "hi")
        assert "hi" in hi.text and hi.chat_context.ByteSize() <= budget
        # The newest turn is what is kept first: the context ends with "hi" and its answer.
        messages = hi.chat_context.chat_histories[0].messages
        assert messages[-2].text == "hi"
        history = await app.core.history.read("big")  # bounded in bytes too, newest kept
        assert history[-2]["text"] == "hi" and history[-4]["text"].startswith("turn 7: ")
        metrics = await scrape_text(app.http_port)
        assert sample(metrics, "uibus_chat_context_dropped_messages_total") > 0


async def test_a_user_message_over_the_budget_is_refused_before_anything_is_stored(web_config):
    cfg = replace(web_config, chat_context_bytes=256 * KB)
    async with running(cfg) as app, Connection(f"127.0.0.1:{app.port}", session="over") as conn:
        await answer(conn, "hello_world", "small first")
        before = await app.core.history.read("over")
        context = await app.core.history.load_context("over", "hello_world")
        text = "y" * (300 * KB)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await answer(conn, "hello_world", text)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "262144 bytes" in err.value.details() and "--chat-context-bytes" in err.value.details()
        # The same refusal over the neuro-san HTTP API, with HTTP 429 and the same words.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}") as client:
            r = await client.post("/api/v1/hello_world/streaming_chat", headers={"x-uibus-session": "over"},
                                  json={"user_message": {"type": "HUMAN", "text": text}})
            assert r.status_code == 429, r.text
            assert "262144 bytes" in r.text
        assert await app.core.history.read("over") == before
        assert await app.core.history.load_context("over", "hello_world") == context
        assert "small first" in (await answer(conn, "hello_world", "still fine?")).text


async def test_a_maximal_reply_to_a_request_near_the_limit_still_fits(config):
    """MAXIMAL echoes the request in every response; a 3 MiB request must not make them unsendable."""
    cfg = replace(config, chat_context_bytes=2 * MB)
    async with running(cfg) as app, Connection(f"127.0.0.1:{app.port}", session="max") as conn:
        req = request("z" * (1536 * KB), filter_type=MAXIMAL)
        req.sly_data.update({"pad": "p" * (1536 * KB)})
        responses = [r async for r in Agent(conn, "hello_world").StreamingChat(req)]
        assert responses and responses[-1].response.chat_context.ByteSize() <= 2 * MB
        assert all(r.ByteSize() <= app.config.max_message_bytes for r in responses)
        assert responses[0].request.user_message.text == "z" * (64 * KB)  # the echo of a big request is cut


# ---- 2. parallel turns are all kept ------------------------------------------------------------------


def user_texts(ctx) -> list[str]:  # type: ignore[no-untyped-def]
    return [m.text for h in ctx.chat_histories for m in h.messages if m.type == chat_pb2.ChatMessage.HUMAN]


async def test_fifty_parallel_turns_on_sqlite_all_end_up_in_the_stored_context(config):
    async with running(config) as app, Connection(f"127.0.0.1:{app.port}", session="par") as conn:
        texts = [f"parallel {i}" for i in range(50)]
        replies = await asyncio.gather(*(answer(conn, "hello_world", t) for t in texts))
        assert all(r.text for r in replies)
        stored = await app.core.history.load_context("par", "hello_world")
        assert sorted(user_texts(stored)) == sorted(texts)


async def test_fifty_parallel_turns_on_two_replicas_sharing_redis_all_end_up_in_the_context(
        config, redis_target: RedisTarget):
    cfg = replace(config, **redis_target.config())  # one redis-server, then the Redis Cluster
    async with running(cfg) as a, running(cfg) as b, \
            Connection(f"127.0.0.1:{a.port}", session="par2") as ca, \
            Connection(f"127.0.0.1:{b.port}", session="par2") as cb:
        texts = [f"replicated {i}" for i in range(50)]
        await asyncio.gather(*(answer(ca if i % 2 else cb, "hello_world", t) for i, t in enumerate(texts)))
        for app in (a, b):
            stored = await app.core.history.load_context("par2", "hello_world")
            assert sorted(user_texts(stored)) == sorted(texts)


# ---- 3. mailboxes bounded in bytes -----------------------------------------------------------------


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_a_never_reading_subscriber_costs_at_most_its_budget_and_is_ended(spawn):
    budget = 8 * MB
    server = spawn("--mailbox-bytes", str(budget))
    await server.wait_ready()
    frozen = subscriber(server.target, "stall", 1, read=False)
    got = 0
    try:
        assert await asyncio.to_thread(frozen.stdout.readline) == b"live\n"
        async with Connection(server.target, session="stall") as conn:
            reader = conn.ui.subscribeToAddToInput(EMPTY)
            await reader.initial_metadata()

            async def read_all() -> int:
                n = 0
                async for _ in reader:
                    n += 1
                    if n == 300:
                        return n
                return n

            reading = asyncio.ensure_future(read_all())
            base = rss_kb(server.proc.pid)
            peak = base
            payload = "e" * MB
            for _ in range(300):
                await conn.host.PublishAddToInput(host_pb2.TextEvent(text=payload))
                peak = max(peak, rss_kb(server.proc.pid))
            got = await asyncio.wait_for(reading, 30)
            stats = await conn.host.GetBusStats(common_pb2.Empty())
        growth_mb = (peak - base) / 1024
        print(f"\nserver RSS {base / 1024:.0f} MB -> peak {peak / 1024:.0f} MB (+{growth_mb:.1f} MB; "
              f"budget {budget // MB} MB)")
        assert got == 300  # the reading subscriber received everything
        assert growth_mb <= budget / MB + 30
        assert stats.subscriptions == 1  # the reader's: the stalled stream's subscription was freed at once
        frozen.stdin.write(b"drain\n")
        frozen.stdin.flush()
        line = (await asyncio.wait_for(asyncio.to_thread(frozen.stdout.readline), 20)).decode().split()
        assert line[:2] == ["end", "RESOURCE_EXHAUSTED"], line
        kinds = {k.kind: k for k in stats.kinds}
        assert kinds["add_to_input"].overflowed == 1 and kinds["add_to_input"].dropped == 0
    finally:
        frozen.kill()
        frozen.wait()


async def test_the_process_wide_budget_ends_the_fullest_streams(config):
    """Each stalled stream is within its own budget, but together they are over the process's."""
    cfg = replace(config, mailbox_bytes=4 * MB, mailboxes_bytes=6 * MB)
    async with running(cfg) as app:
        bus = app.bus
        subs = [bus.subscribe("many", kinds.ADD_TO_INPUT) for _ in range(3)]
        try:
            payload = common_pb2.String(value="m" * MB)
            for _ in range(3):
                bus.publish("many", kinds.ADD_TO_INPUT, payload)
            assert bus.budget.total <= 6 * MB + 3 * 200
            ended = [s for s in subs if s.failure is not None]
            assert ended and all("--mailboxes-bytes" in str(s.failure) for s in ended)
        finally:
            for s in subs:
                bus.unsubscribe(s)
        assert bus.budget.total == 0 and bus.count() == 0


# ---- 4. /metrics stays small -----------------------------------------------------------------------


async def test_five_thousand_unknown_agent_names_keep_metrics_small(web):
    base = f"http://127.0.0.1:{web.http_port}"
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client, \
            Connection(f"127.0.0.1:{web.port}") as conn:
        sem = asyncio.Semaphore(16)

        async def http(i: int) -> None:
            async with sem:
                r = await client.get(f"/api/v1/ghost{i}/function")
                assert r.status_code == 404 or r.status_code == 501, r.status_code

        async def grpc_call(i: int) -> None:
            async with sem:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await Agent(conn, f"spook{i}").Function(agent_pb2.FunctionRequest())
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

        async def web_call(i: int) -> None:
            async with sem:
                reply = await call(client, f"{base}/phantom{i}.AgentService/Function", b"")
                assert reply.status == grpc.StatusCode.UNIMPLEMENTED.value[0]

        await asyncio.gather(*(http(i) for i in range(2500)))
        await asyncio.gather(*(grpc_call(i) for i in range(1500)))
        await asyncio.gather(*(web_call(i) for i in range(1000)))
        r = await client.get("/metrics")
    print(f"\n/metrics after 5,000 unknown agent names: {len(r.content):,} bytes")
    assert len(r.content) < 100 * KB


# ---- 6. headers mean "subscribed" ------------------------------------------------------------------


async def test_headers_received_means_subscribed_every_time_native(app, connect):
    conn = connect("live")
    for i in range(100):
        stream = conn.ui.subscribeToAddToInput(EMPTY)
        await asyncio.wait_for(stream.initial_metadata(), 2)
        reply = await conn.host.PublishAddToInput(host_pb2.TextEvent(text=f"n{i}"))
        assert reply.subscribers == 1, i
        assert (await asyncio.wait_for(stream.read(), 2)).value == f"n{i}"
        stream.cancel()
        await wait_for(lambda: app.bus.count(session="live") == 0, what="stream gone")


async def test_headers_received_means_subscribed_on_the_webview_mux_and_grpc_web(web, web_connect):
    conn = web_connect("live2")
    mux = webview_pb2_grpc.WebviewServiceStub(conn.channel)
    for i in range(20):
        stream = mux.Subscribe(webview_pb2.WebviewSubscribeRequest(client_id=f"c{i}"),
                               metadata=(("x-uibus-session", "live2"),))
        await asyncio.wait_for(stream.initial_metadata(), 2)
        assert (await conn.host.PublishAddToInput(host_pb2.TextEvent(text="x"))).subscribers == 1
        stream.cancel()
        await wait_for(lambda: web.bus.count(session="live2") == 0, what="mux streams gone")
    url = f"http://127.0.0.1:{web.http_port}/cline.UiService/subscribeToAddToInput"
    async with httpx.AsyncClient() as client:
        for _ in range(20):
            async with client.stream("POST", url, content=b"\x00\x00\x00\x00\x00", headers={
                    "content-type": "application/grpc-web+proto", "x-grpc-web": "1",
                    "x-uibus-session": "live2"}) as r:
                assert r.status_code == 200  # the response headers: subscribed
                assert (await conn.host.PublishAddToInput(host_pb2.TextEvent(text="y"))).subscribers == 1
            await wait_for(lambda: web.bus.count(session="live2") == 0, what="grpc-web stream gone")


async def test_headers_received_means_subscribed_on_host_requests_and_extension_ui(app, connect):
    conn = connect("live3")
    ext = extension_ui_pb2_grpc.ExtensionUiServiceStub(conn.channel)
    for _ in range(20):
        hosts = conn.host.SubscribeHostRequests(common_pb2.Empty())
        await asyncio.wait_for(hosts.initial_metadata(), 2)
        await conn.ui.openUrl(common_pb2.StringRequest(value="https://example.com/"))  # a host listens: OK
        assert (await asyncio.wait_for(hosts.read(), 2)).open_url.url == "https://example.com/"
        hosts.cancel()
        uis = ext.Subscribe(extension_ui_pb2.SubscribeRequest())
        await asyncio.wait_for(uis.initial_metadata(), 2)
        assert app.bus.count(kinds.EXTENSION_UI, "live3") == 1  # registered before the headers left
        uis.cancel()
        await wait_for(lambda: app.bus.count(session="live3") == 0, what="streams gone")


@pytest.mark.node
async def test_headers_received_means_subscribed_for_a_grpc_js_client(app):
    """grpc-js (Cline's own stack) waits for the call's 'metadata' event, then publishes: 100 rounds,
    every publish reaches the stream (tests/grpcjs/live.js, the pinned @grpc/grpc-js)."""
    node = require_binary("node")
    here = REPO / "tests" / "grpcjs"
    require("the pinned @grpc/grpc-js (bash .ci/setup)", (here / "node_modules" / "@grpc" / "grpc-js").is_dir(), "node")
    proc = await asyncio.create_subprocess_exec(node, str(here / "live.js"), f"127.0.0.1:{app.port}", "js", "100",
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert lines[-1] == {"done": 100}, lines[-3:]
    rounds = lines[:-1]
    assert [r["subscribers"] for r in rounds] == [1] * 100
    assert [r["got"] for r in rounds] == [f"js{i}" for i in range(100)]
    await wait_for(lambda: app.bus.count(session="js") == 0, what="grpc-js streams gone")


# ---- 8. keepalive frees a frozen client's streams --------------------------------------------------


async def test_a_frozen_client_is_dropped_by_keepalive(spawn):
    server = spawn("--keepalive-seconds", "1", "--keepalive-timeout-seconds", "1")
    await server.wait_ready()
    frozen = subscriber(server.target, "frozen", 3)
    try:
        assert await asyncio.to_thread(frozen.stdout.readline) == b"live\n"
        async with Connection(server.target, session="frozen") as conn:
            assert (await conn.host.GetBusStats(common_pb2.Empty())).subscriptions == 3
            os.kill(frozen.pid, signal.SIGSTOP)
            start = time.monotonic()
            while (await conn.host.GetBusStats(common_pb2.Empty())).subscriptions:
                assert time.monotonic() - start < 10, "the frozen client's streams were not freed"
                await asyncio.sleep(0.2)
            took = time.monotonic() - start
        print(f"\nfrozen client's 3 subscriptions freed after {took:.1f} s (keepalive 1 s + timeout 1 s)")
        assert took <= 6
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        frozen.wait()

