"""The service as an operator runs it: a real `python -m uibus serve` process, signals, restarts,
auth and TLS."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Reader, free_port, next_message, replace, require_binary, wait_for
from uibus.app import App
from uibus.app.installers import INSTALLERS
from uibus.clients.connection import Connection
from uibus.edge.wiring import Installer, Setup
from uibus.infra import kinds
from uibus.infra.sqlite_store import SqliteStore
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

EMPTY_REQ = common_pb2.EmptyRequest()


async def test_sigterm_with_50_open_streams(spawn):
    server = spawn("--grace-seconds", "3", "--drain-seconds", "0.5")
    await server.wait_ready()
    async with Connection(server.target, session="busy") as conn, \
            grpc.aio.insecure_channel(server.target) as health_ch:
        streams = [Reader(conn.ui.subscribeToPartialMessage(EMPTY_REQ)) for _ in range(50)]

        async def open_count() -> int:
            return (await conn.host.GetBusStats(common_pb2.Empty())).subscriptions

        for _ in range(200):
            if await open_count() == 50:
                break
            await asyncio.sleep(0.02)
        assert await open_count() == 50
        watch = health_pb2_grpc.HealthStub(health_ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await next_message(watch)).status == health_pb2.HealthCheckResponse.SERVING

        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert (await next_message(watch, timeout=3)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        for s in streams:  # every client sees its stream end with a status, not a hang
            with pytest.raises(StopAsyncIteration):
                await s.next(timeout=5)
            assert await s.call.code() == grpc.StatusCode.OK
        rc = await asyncio.to_thread(server.proc.wait, 10)
        took = time.monotonic() - t0
    assert rc == 0, server.log.read_text()
    assert took < 0.5 + 3 + 2  # drain + grace + process start-up slack
    assert '"msg": "stopped"' in server.log.read_text()


async def test_sigint_exits_zero(spawn):
    server = spawn()
    await server.wait_ready()
    server.proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(server.proc.wait, 10) == 0


async def test_state_survives_restart(tmp_path, config):
    config = replace(config, store=str(tmp_path / "persist.db"))
    for round_ in range(2):
        app = App(config)
        await app.start()
        try:
            async with Connection(f"127.0.0.1:{app.port}", session="keep") as conn:
                if round_ == 0:
                    await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"solarized"}'))
                    await conn.host.SetAnnouncement(host_pb2.AnnouncementState(latest_announcement_id="a7"))
                    await conn.ui.onDidShowAnnouncement(EMPTY_REQ)
                else:
                    theme = Reader(conn.ui.subscribeToTheme(EMPTY_REQ))
                    assert (await next_message(theme)).value == '{"kind":"solarized"}'
                    state = await conn.host.GetSessionState(common_pb2.Empty())
                    assert state.announcement.latest_announcement_id == "a7"
                    assert state.announcement.last_shown_announcement_id == "a7"
                    theme.cancel()
        finally:
            await app.aclose(grace=0.5)


async def test_state_survives_process_restart(spawn, tmp_path):
    first = spawn()
    await first.wait_ready()
    async with Connection(first.target, session="proc") as conn:
        await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
    first.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.proc.wait, 10) == 0
    second = spawn()  # same tmp_path, same store file
    await second.wait_ready()
    async with Connection(second.target, session="proc") as conn:
        assert (await conn.host.GetSessionState(common_pb2.Empty())).theme == '{"kind":"dark"}'


async def test_bearer_token(config):
    app = App(replace(config, auth_token="s3cret"))
    await app.start()
    target = f"127.0.0.1:{app.port}"
    try:
        async with Connection(target) as anon, Connection(target, token="wrong") as wrong, \
                Connection(target, token="s3cret") as good:
            for conn in (anon, wrong):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await conn.ui.scrollToSettings(common_pb2.StringRequest(value="x"))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await conn.ui.subscribeToTheme(EMPTY_REQ).read()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await good.ui.scrollToSettings(common_pb2.StringRequest(value="x"))).key == "scrollToSettings"
            # Kubernetes probes send no token: health stays open.
            health = health_pb2_grpc.HealthStub(anon.channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == 1
        assert app.bus.count() == 0
    finally:
        await app.aclose(grace=0.5)


async def test_tls(tmp_path, config):
    openssl = require_binary("openssl")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    app = App(replace(config, host="localhost", tls_cert=str(cert), tls_key=str(key)))
    await app.start()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{app.port}", creds) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service="cline.UiService"))).status == 1
        async with grpc.aio.insecure_channel(f"localhost:{app.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=2)
    finally:
        await app.aclose(grace=0.5)


def test_bad_config_is_refused(tmp_path):
    import sys

    proc = subprocess.run([sys.executable, "-m", "uibus", "serve", "--port", "70000",
                           "--store", str(tmp_path / "x.db")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "uibus serve: --port: must be within 0..65535" in proc.stderr


async def test_port_in_use_fails_clearly(app, tmp_path):
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", str(app.port), "--http-port", "0",
        "--store", str(tmp_path / "y.db"), stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode != 0
    assert str(app.port) in err.decode()


async def test_watchers_see_not_serving_when_stop_starts(app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="cline.UiService"))
        assert (await next_message(watch)).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.ensure_future(app.aclose(grace=0.5))
        assert (await next_message(watch)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
    await wait_for(lambda: app.bus.count() == 0)


# ---- App as owned resources: installers, failed starts, the two shutdown phases ---------------

def recording(log: list[str], name: str, fail_setup: bool = False, fail_teardown: bool = False) -> Installer:
    """A test installer that records its setup and teardown (and can fail either)."""

    @asynccontextmanager
    async def install(setup: Setup) -> AsyncIterator[None]:
        log.append(f"{name} up")
        if fail_setup:
            raise RuntimeError(f"{name} cannot start")
        try:
            yield
        finally:
            log.append(f"{name} down")
            if fail_teardown:
                raise RuntimeError(f"{name} cannot stop")
    install.__name__ = name
    return install


async def test_installers_are_undone_in_reverse(config):
    log: list[str] = []
    async with App(config, installers=[*INSTALLERS, recording(log, "a"), recording(log, "b")]) as app:
        assert log == ["a up", "b up"]
        async with Connection(f"127.0.0.1:{app.port}") as conn:  # the default parts still serve
            assert (await conn.ui.scrollToSettings(common_pb2.StringRequest(value="x"))).key == "scrollToSettings"
    assert log == ["a up", "b up", "b down", "a down"]


class RecordingStore(SqliteStore):
    def __init__(self, path: str, log: list[str]) -> None:
        super().__init__(path)
        self.log = log

    async def close(self) -> None:
        self.log.append("store closed")
        await super().close()


async def test_a_failed_start_undoes_what_started(config, tmp_path):
    log: list[str] = []
    app = App(config, installers=[recording(log, "a"), recording(log, "b", fail_setup=True), recording(log, "c")],
              store=RecordingStore(config.store, log))
    with pytest.raises(RuntimeError, match="b cannot start"):
        await app.start()
    assert log == ["a up", "b up", "a down", "store closed"]  # c never started; a, then the store, undone


async def test_a_port_taken_fails_start_and_releases_everything(config):
    log: list[str] = []
    async with App(replace(config, http_port=free_port())) as first:
        # the HTTP port is taken (a store of its own: the first one's is refused, tests/test_store_lock.py)
        taken = replace(config, port=0, http_port=first.http_port, store=config.store + ".second")
        second = App(taken, installers=[*INSTALLERS, recording(log, "x")])
        with pytest.raises(OSError):
            await second.start()
        assert log == ["x up", "x down"]
        grpc_port = second.port  # bound before the HTTP port failed, and released since
        assert grpc_port
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        assert server.add_insecure_port(f"127.0.0.1:{grpc_port}") == grpc_port
        await server.stop(None)


async def test_teardown_errors_are_collected_and_every_part_still_closes(config):
    log: list[str] = []
    app = App(config, installers=[recording(log, "a"), recording(log, "b", fail_teardown=True), recording(log, "c")])
    await app.start()
    with pytest.raises(RuntimeError, match="b cannot stop"):
        await app.aclose(grace=0.5)
    assert log == ["a up", "b up", "c up", "c down", "b down", "a down"]


def hanging(log: list[str], entered: asyncio.Event) -> Installer:
    """A test installer whose teardown hangs until it is cancelled."""

    @asynccontextmanager
    async def install(setup: Setup) -> AsyncIterator[None]:
        yield
        entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            log.append("hanging teardown cancelled")
    install.__name__ = "hanging"
    return install


async def test_a_cancelled_teardown_still_closes_the_agents_bus_and_store(config, monkeypatch):
    """The task running the teardown is cancelled midway (as asyncio.run cancels what is left at
    exit, or a second signal): every later teardown still runs, the cancel still propagates."""
    from uibus.agents.config import AgentTable

    log: list[str] = []
    table_close = AgentTable.aclose

    async def recorded_close(table: AgentTable) -> None:
        log.append("agents closed")
        await table_close(table)
    monkeypatch.setattr(AgentTable, "aclose", recorded_close)
    entered = asyncio.Event()
    app = App(config, installers=[recording(log, "a"), hanging(log, entered), recording(log, "c")],
              store=RecordingStore(config.store, log))
    await app.start()
    closing = asyncio.ensure_future(app.aclose(grace=0.5))
    await asyncio.wait_for(entered.wait(), 10)
    assert app._closing is not None
    app._closing.cancel()  # the teardown itself, not just the caller (which is shielded from it)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 10)
    assert log == ["a up", "c up", "c down", "hanging teardown cancelled", "a down", "agents closed",
                   "store closed"]
    assert app.core is not None and app.core.agent_sessions.count() == 0
    with pytest.raises(Exception, match="shutting down"):
        app.bus.subscribe("s", kinds.PARTIAL_MESSAGE)


async def test_begin_shutdown_refuses_new_work_then_aclose_stops(config, tmp_path):
    app = App(replace(config, http_port=free_port()))
    await app.start()
    target = f"127.0.0.1:{app.port}"
    async with Connection(target, session="p") as conn, httpx.AsyncClient() as http:
        stream = Reader(conn.ui.subscribeToPartialMessage(EMPTY_REQ))
        await wait_for(lambda: app.bus.count() == 1, what="a stream")
        assert (await http.get(f"http://127.0.0.1:{app.http_port}/readyz")).status_code == 200

        await app.begin_shutdown()
        assert app.stopping
        assert (await http.get(f"http://127.0.0.1:{app.http_port}/readyz")).status_code == 503
        with pytest.raises(StopAsyncIteration):  # open streams ended with OK
            await stream.next()
        assert await stream.call.code() == grpc.StatusCode.OK
        health = health_pb2_grpc.HealthStub(conn.channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        # Still serving calls (a load balancer may still send some), but no new streams.
        assert (await conn.ui.scrollToSettings(common_pb2.StringRequest(value="x"))).key == "scrollToSettings"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await conn.ui.subscribeToTheme(EMPTY_REQ).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        await asyncio.gather(app.aclose(grace=0.5), app.aclose())  # safe to call twice, even at once
        with pytest.raises(grpc.aio.AioRpcError):
            await conn.ui.scrollToSettings(common_pb2.StringRequest(value="x"), timeout=1)
    assert app.bus.count() == 0


@pytest.mark.parametrize(("args", "uvloop"), [((), True), (("--loop", "asyncio"), False), (("--loop", "uvloop"), True)])
async def test_the_event_loop_is_the_one_configured(spawn, args: tuple[str, ...], uvloop: bool) -> None:
    """`--loop auto` (the default) runs on uvloop, which the package installs; `--loop asyncio` on
    Python's own. Told from outside: whether the process has uvloop's extension mapped."""
    server = spawn(*args)
    await server.wait_ready()
    async with Connection(server.target, session="loop") as conn:
        await conn.host.GetBusStats(common_pb2.Empty())  # serving: the loop runs calls
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert ("uvloop/loop" in maps) is uvloop
