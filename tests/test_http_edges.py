"""The HTTP port's connection edges, over real sockets: a connection that never sends, or sends
half a request, is closed within the header timeout; an idle kept-alive one within the idle
timeout; one over the connection cap is refused at once while the others keep working; a silent
WebSocket is closed by its unanswered ping; deeply nested JSON is refused, never a crash; and a
taken HTTP port is one error line and exit 1.

Bounds here are small (1 s) so that each test stays within a few seconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import REPO, ServerProcess, free_port, running
from tests.webclient import call
from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2

HEADER_S = 1.0
IDLE_S = 1.0
MARGIN_S = 1.5  # a loaded 2-core CI machine; the timers themselves fire within milliseconds
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n"


@pytest.fixture
def web_config(config: Config) -> Config:
    return replace(config, http_port=free_port(), http_header_timeout_seconds=HEADER_S, http_idle_seconds=IDLE_S,
                   ws_ping_seconds=0.5, ws_ping_timeout_seconds=0.5)


async def until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
        except (ConnectionResetError, BrokenPipeError):
            return data
        if not chunk:
            return data
        data += chunk


async def read_response(reader: asyncio.StreamReader, timeout: float = 3.0) -> bytes:
    """One response with a content-length body (all uibus's plain-text answers have one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await asyncio.wait_for(reader.readexactly(length), timeout)
    return head + body


async def open_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


# ---- header timeout and idle keep-alive -------------------------------------------------------------


async def test_silent_and_partial_connections_are_closed_while_calls_go_on(web: App) -> None:
    """200 connections that send nothing and 200 that stop mid-request are all closed about one
    header timeout after they connected; /healthz and a gRPC-Web call answer all the while."""
    port = web.http_port
    partials = [b"GET /hea", b"GET /healthz HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-a: 1"]
    opened: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter, bool]] = []
    for i in range(400):
        # Timed from before the connect: the server accepts it after this, so a connection closed
        # at its header timeout is never measured short (this loop also runs the server).
        at = time.monotonic()
        reader, writer = await open_raw(port)
        partial = i % 2 == 1
        if partial:
            writer.write(partials[i % len(partials)])
        opened.append((at, reader, writer, partial))
    all_open = time.monotonic()

    latencies: list[float] = []
    stop = asyncio.Event()

    async def keep_calling() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert (await http.get("/healthz")).text == "ok\n"
                reply = await call(http, f"http://127.0.0.1:{port}/cline.UiService/scrollToSettings",
                                   common_pb2.StringRequest(value="general").SerializeToString())
                assert reply.http_status == 200 and reply.status == 0, reply.message
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.05)

    caller = asyncio.ensure_future(keep_calling())

    async def closed_after(at: float, reader: asyncio.StreamReader) -> tuple[float, bytes]:
        data = await until_closed(reader, HEADER_S + MARGIN_S + 2)
        return time.monotonic() - at, data

    results = await asyncio.gather(*(closed_after(at, reader) for at, reader, _, _ in opened))
    stop.set()
    await asyncio.wait_for(caller, 10)  # re-raises a failed call
    for _, _, writer, _ in opened:
        writer.close()
    took = [t for t, _ in results]
    print(f"\n400 connections: opened in {all_open - opened[0][0]:.2f} s; each closed {min(took):.2f}–"
          f"{max(took):.2f} s after it connected; all closed {time.monotonic() - opened[0][0]:.2f} s after the "
          f"first; {len(latencies)} calls meanwhile, slowest {max(latencies) * 1000:.0f} ms")
    assert min(took) >= HEADER_S - 0.1, "closed before the header timeout"
    assert max(took) <= HEADER_S + MARGIN_S, f"a connection stayed open {max(took):.2f} s"
    for (_, _, _, partial), (_, data) in zip(opened, results, strict=True):
        # Nothing for a connection that sent nothing; a half request is told 408.
        assert data.startswith(b"HTTP/1.1 408 ") if partial else data == b"", data
    assert len(latencies) >= 5 and max(latencies) < 1.0


async def test_a_slow_drip_of_header_bytes_is_closed_at_the_timeout(web: App) -> None:
    """Slowloris: a byte every 0.2 s keeps the connection busy but never finishes the headers."""
    reader, writer = await open_raw(web.http_port)
    start = time.monotonic()
    request = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: " + b"a" * 100
    closed = asyncio.ensure_future(until_closed(reader, HEADER_S + MARGIN_S + 2))
    for byte in request:
        if closed.done():
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.2)
    data = await closed
    took = time.monotonic() - start
    writer.close()
    assert HEADER_S - 0.1 <= took <= HEADER_S + MARGIN_S, took
    assert data.startswith(b"HTTP/1.1 408")


async def test_kept_alive_connection_idles_out_and_a_later_request_is_timed_from_its_first_byte(web: App) -> None:
    reader, writer = await open_raw(web.http_port)
    writer.write(HEALTHZ)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
    answered = time.monotonic()
    assert await until_closed(reader, IDLE_S + MARGIN_S + 2) == b""  # idle: closed without a word
    took = time.monotonic() - answered
    assert IDLE_S - 0.1 <= took <= IDLE_S + MARGIN_S, took
    writer.close()

    # A second request within the idle time is served; the third starts and stalls: it gets the
    # header timeout from its first byte (the idle timer stopped when that byte came).
    reader, writer = await open_raw(web.http_port)
    writer.write(HEALTHZ)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.6)
    writer.write(HEALTHZ)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.6)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    stalled = time.monotonic()
    data = await until_closed(reader, HEADER_S + MARGIN_S + 2)
    took = time.monotonic() - stalled
    writer.close()
    assert data.startswith(b"HTTP/1.1 408")
    assert HEADER_S - 0.1 <= took <= HEADER_S + MARGIN_S, took


async def test_a_long_response_is_not_cut_by_the_timers(web: App) -> None:
    """The timers bound waiting for a request, not serving one: a stream longer than both lives."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web.http_port}", timeout=10) as http:
        body = {"user_message": {"text": "slow"}, "chat_filter": {"chat_filter_type": "MAXIMAL"},
                "sly_data": {"chunks": 6, "delay_ms": 400}}
        start = time.monotonic()
        async with http.stream("POST", "/api/v1/hello_world/streaming_chat", json=body) as resp:
            assert resp.status_code == 200
            lines = [line async for line in resp.aiter_lines() if line.strip()]
        assert time.monotonic() - start > max(HEADER_S, IDLE_S) + 0.5
        assert "error" not in lines[-1] and "slow" in json.loads(lines[-1])["response"]["text"]


# ---- connection cap ---------------------------------------------------------------------------------


async def test_connection_over_the_cap_is_refused_and_the_others_keep_working(web_config: Config) -> None:
    cfg = replace(web_config, http_max_connections=50, http_header_timeout_seconds=10.0, http_idle_seconds=10.0)
    async with running(cfg) as app:
        conns = [await open_raw(app.http_port) for _ in range(50)]
        for reader, writer in conns:  # each is accepted and usable
            writer.write(HEALTHZ)
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200")

        reader, writer = await open_raw(app.http_port)
        start = time.monotonic()
        data = await until_closed(reader, 3)
        writer.close()
        assert time.monotonic() - start < 1.0 and data.startswith(b"HTTP/1.1 503"), data
        refused = 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=3) as http:
            try:
                refused = (await http.get("/healthz")).status_code
            except httpx.TransportError:  # the 503 may come before the request is written
                refused = 503
        assert refused == 503

        for reader, writer in conns:  # the first 50 still answer
            writer.write(HEALTHZ)
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200")

        conns[0][1].close()  # one leaves: a new one fits again
        deadline = time.monotonic() + 3
        while True:
            reader, writer = await open_raw(app.http_port)
            writer.write(HEALTHZ)
            try:
                answer = await read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                answer = b""
            writer.close()
            if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        for _, writer in conns[1:]:
            writer.close()


# ---- WebSocket pings ----------------------------------------------------------------------------------


async def test_a_websocket_that_answers_no_ping_is_closed(web: App) -> None:
    """A client that completes the upgrade and then goes silent (never a pong) is closed after the
    ping interval plus the ping timeout (0.5 + 0.5 s here)."""
    reader, writer = await open_raw(web.http_port)
    key = base64.b64encode(os.urandom(16))
    writer.write(b"GET /agent-to-app?session=s1 HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\n"
                 b"connection: Upgrade\r\nsec-websocket-version: 13\r\nsec-websocket-key: " + key + b"\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 101"), head
    upgraded = time.monotonic()
    data = await until_closed(reader, 5)
    took = time.monotonic() - upgraded
    writer.close()
    assert 0.9 <= took <= 1.0 + MARGIN_S, took
    assert data[:1] == b"\x89"  # a ping frame came first (then a close frame)


# ---- nested JSON ------------------------------------------------------------------------------------


async def test_deeply_nested_frame_is_answered_and_the_socket_stays(web: App) -> None:
    async with ws_connect(f"ws://127.0.0.1:{web.http_port}/agent-to-app?session=s1") as ws:
        for frame in ("[" * 100_000, json.dumps({"type": "chatEvent", "action": "getChatHistory", "requestId": "d",
                                                   "message": {"deep": json.loads("[" * 70 + "]" * 70)}})):
            await ws.send(frame)
            reply = json.loads(await asyncio.wait_for(ws.recv(), 3))
            assert reply["success"] is False and "nested deeper than 64 levels" in reply["error"], reply
            assert reply["code"] == "INVALID_ARGUMENT"
        await asyncio.sleep(1.2)  # past a ping round: this client answers pings, so it stays
        await ws.send(json.dumps({"type": "chatEvent", "action": "getChatHistory", "requestId": "ok", "message": {}}))
        reply = json.loads(await asyncio.wait_for(ws.recv(), 3))
        assert reply["requestId"] == "ok" and reply["success"] is True, reply


async def test_deeply_nested_http_api_body_is_400(web: App) -> None:
    url = f"http://127.0.0.1:{web.http_port}/api/v1/hello_world/streaming_chat"
    async with httpx.AsyncClient(timeout=5) as http:
        for body in (b"[" * 100_000, b"{" + b'"a": {' * 100_000,
                     json.dumps({"user_message": {"text": "x"}, "sly_data": {"d": json.loads("[" * 70 + "]" * 70)}})):
            r = await http.post(url, content=body)
            assert r.status_code == 400, r.text
            assert "nested deeper than 64 levels" in r.json()["error"] and r.json()["code"] == "INVALID_ARGUMENT"
        ok = await http.post(url, json={"user_message": {"text": "still here"}})
        assert ok.status_code == 200 and "still here" in ok.text


# ---- bind failure -----------------------------------------------------------------------------------


async def test_taken_http_port_fails_the_start_with_oserror(config: Config, taken_port: int) -> None:
    app = App(replace(config, http_port=taken_port))
    with pytest.raises(OSError, match=f"^--http-port: cannot listen on 127.0.0.1:{taken_port}: "):
        await app.start()
    with socket.socket() as sock:  # the gRPC port it had bound is free again
        sock.bind(("127.0.0.1", app.port))


def test_a_failed_start_leaves_no_noise_behind(taken_port: int) -> None:
    """In its own interpreter, so that what happens at exit (a gRPC server collected after its loop
    closed says "Event loop is closed") is seen too: the error is the OSError and nothing else."""
    script = (
        "import asyncio\n"
        "from uibus.app import App\n"
        "from uibus.infra.config import Config\n"
        "async def main():\n"
        "    try:\n"
        f"        await App(Config(host='127.0.0.1', port=0, http_port={taken_port}, store=':memory:')).start()\n"
        "    except OSError as exc:\n"
        "        print('OSError:', exc)\n"
        "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"OSError: --http-port: cannot listen on 127.0.0.1:{taken_port}: address already in use\n"
    assert out.stderr == ""


def test_serve_on_a_taken_http_port_is_one_line_and_exit_1(spawn: Callable[..., ServerProcess],
                                                           taken_port: int) -> None:
    proc = spawn("--http-port", str(taken_port))
    assert proc.proc.wait(20) == 1, proc.log.read_text()
    output = proc.log.read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert str(taken_port) in lines[0] and "Traceback" not in output and "Event loop is closed" not in output
