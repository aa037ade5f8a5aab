"""A broken, full or unreachable session store, end to end: real files, a real tmpfs that fills
up, a real redis-server that comes and goes, and `python -m uibus serve` in its own process.

What an operator must see: a store that cannot work fails the start with one line and exit 2; at
run time a failing store turns calls into UNAVAILABLE / RESOURCE_EXHAUSTED with a short message
(no traceback, a line or two of log), health NOT_SERVING and /readyz 503 with the reason until it
recovers, and SIGTERM still exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO, ServerProcess, free_port, require, require_binary
from tests.redisproc import RedisProcess
from uibus.clients.connection import Connection
from uibus.infra.errors import ConfigError, StoreFull
from uibus.infra.sqlite_store import SqliteStore
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HOST_SERVICE = "uibus.v1.HostService"


# ---- helpers ----------------------------------------------------------------------------------

def serve_once(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """`uibus serve` expected to refuse to start: its exit code and output."""
    return subprocess.run([sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", "0",
                           "--http-port", "0", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


async def make_store(path: Path, sessions: int = 300) -> None:
    """A real store file with some data in it, checkpointed (its pages all in the main file)."""
    store = SqliteStore(str(path))
    for i in range(sessions * 5):
        await store.put(f"s{i % sessions}", f"k{i}", {"v": "x" * 200})
    await store.close()


def rootpage(path: Path, table: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return int(db.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (table,)).fetchone()[0])


class Served:
    """A `uibus serve` process with its gRPC health, its /readyz and a client of one session."""

    def __init__(self, proc: ServerProcess, http_port: int) -> None:
        self.proc = proc
        self.http = f"http://127.0.0.1:{http_port}"
        self.channel = grpc.aio.insecure_channel(proc.target)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.conn = Connection(proc.target, session="faults")

    async def status(self, service: str = "") -> int | None:
        """The health of `service`, None while the server does not answer."""
        try:
            return int((await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)).status)
        except grpc.aio.AioRpcError:
            return None

    async def statuses(self) -> set[int | None]:
        return {await self.status(""), await self.status(HOST_SERVICE)}

    async def wait_status(self, want: int, timeout: float, what: str) -> float:
        """Waits until "" and HostService both report `want`; returns the seconds it took."""
        start = time.monotonic()
        while await self.statuses() != {want}:
            if self.proc.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.proc.returncode}: {self.log()}")
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}: {self.log()[-3000:]}")
            await asyncio.sleep(0.05)
        return time.monotonic() - start

    async def readyz(self) -> tuple[int, str]:
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(self.http + "/readyz")
            return r.status_code, r.text

    async def livez(self) -> int:
        async with httpx.AsyncClient(timeout=5) as http:
            return (await http.get(self.http + "/livez")).status_code

    def log(self) -> str:
        return self.proc.log.read_text(errors="replace")

    async def sigterm(self, timeout: float = 15) -> int:
        self.proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError("no exit after SIGTERM: " + self.log()[-3000:])
            await asyncio.sleep(0.05)
        return self.proc.proc.returncode

    async def close(self) -> None:
        await self.conn.close()
        await self.channel.close()
        self.proc.stop()


@contextlib.asynccontextmanager
async def served(tmp_path: Path, *args: str) -> AsyncIterator[Served]:
    http_port = free_port()
    server = Served(ServerProcess(tmp_path, "--http-port", str(http_port), "--log-level", "INFO", *args), http_port)
    try:
        yield server
    finally:
        await server.close()


@contextlib.contextmanager
def small_disk(where: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (skipped where mounting is not allowed), always unmounted."""
    where.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True).returncode == 0
    require("root and tmpfs", mounted)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Writes a file until the disk has no byte left; returns it (delete it to free the disk)."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


def tracebacks(text: str) -> int:
    return text.count("Traceback")


# ---- at start: a store that cannot work is a one-line exit 2 ---------------------------------

@pytest.mark.parametrize("kind", ["garbage", "directory", "damaged"])
async def test_unusable_store_file_fails_the_start_with_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.db"
    if kind == "garbage":
        path.write_bytes(os.urandom(64 * 1024))
    elif kind == "directory":
        path.mkdir()
    else:  # a real store whose middle pages were overwritten (a bad disk, a partial copy)
        await make_store(path)
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.seek(size // 2 // 4096 * 4096)
            f.write(os.urandom(4 * 4096))
    done = serve_once("--store", str(path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"uibus serve: --store: {path}: "), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    why = {"garbage": "not a SQLite database", "directory": "is a directory", "damaged": "damaged file"}[kind]
    assert why in lines[0]


async def test_unusable_store_is_a_config_error_in_process(tmp_path: Path) -> None:
    """The same through the API: App.start raises ConfigError("--store", …) and leaves nothing open."""
    from uibus.app import App
    from uibus.infra.config import Config

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all" * 1000)
    app = App(Config(host="127.0.0.1", port=0, http_port=0, store=str(garbage)))
    with pytest.raises(ConfigError) as err:
        await app.start()
    assert err.value.source == "--store" and str(garbage) in err.value.what


def test_redis_url_of_another_scheme_fails_the_start_with_one_line() -> None:
    done = serve_once("--redis-url", "http://user:secret@127.0.0.1:6379/0")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("uibus serve: --redis-url: ") and "redis://" in lines[0]
    assert "secret" not in done.stderr  # the URL may carry a password: never echoed


# ---- at run time: disk full ------------------------------------------------------------------

async def test_disk_full_is_resource_exhausted_not_serving_and_recovers(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        async with served(tmp_path, "--store", str(disk / "uibus.db")) as server:
            await server.proc.wait_ready()
            host = server.conn.host
            await host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
            filler = fill(disk)

            for i in range(5):  # every write fails the same clear way, none with a traceback
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await host.SetTheme(host_pb2.TextEvent(text=f'{{"kind":"light{i}"}}'), timeout=5)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
                assert (err.value.details() or "").startswith("session store is full: ")
            await server.wait_status(NOT_SERVING, 3, "NOT_SERVING while the disk is full")
            code, text = await server.readyz()
            assert code == 503 and "session store is full" in text
            assert await server.livez() == 200  # alive: restarting fixes no full disk
            log = server.log()
            assert tracebacks(log) == 0
            assert log.count("session store failing") == 1, log

            filler.unlink()
            took = await server.wait_status(SERVING, 5, "SERVING once the disk has room")
            assert took < 5
            assert await server.readyz() == (200, "ok\n")
            await host.SetTheme(host_pb2.TextEvent(text='{"kind":"back"}'))
            assert "session store recovered" in server.log()

            fill(disk)  # full again when SIGTERM comes: the final checkpoint may fail, the exit is still 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await host.SetTheme(host_pb2.TextEvent(text='{"kind":"x"}'), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await server.sigterm() == 0, server.log()[-3000:]
            log = server.log()
            assert tracebacks(log) == 0, log
            assert log.count("session store failing") <= 2, log


# ---- at run time: pages damaged under a running server ---------------------------------------

async def test_pages_damaged_while_running_are_unavailable_until_repaired(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    await make_store(path)
    page = rootpage(path, "kv")
    with path.open("rb") as f:
        f.seek((page - 1) * 4096)
        good = f.read(4096)
    async with served(tmp_path, "--store", str(path)) as server:
        await server.proc.wait_ready()
        host = server.conn.host
        await host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))

        def write_page(data: bytes) -> None:
            """Overwrites the kv root page in the file, then commits something elsewhere through a
            second connection: the server's page cache is dropped and it reads the file again."""
            with path.open("r+b") as f:
                f.seek((page - 1) * 4096)
                f.write(data)
            with contextlib.closing(sqlite3.connect(path)) as db:
                db.execute(f"PRAGMA user_version = {int.from_bytes(os.urandom(2), 'big')}")

        write_page(b"\xff" * 4096)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await host.SetTheme(host_pb2.TextEvent(text='{"kind":"light"}'), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert err.value.details() == "session store unavailable: database disk image is malformed"
        await server.wait_status(NOT_SERVING, 3, "NOT_SERVING with a damaged page")
        code, text = await server.readyz()
        assert code == 503 and "database disk image is malformed" in text
        await asyncio.sleep(1.5)  # the probe's one-row write succeeds, but its quick_check does not
        assert await server.statuses() == {NOT_SERVING}

        write_page(good)  # repaired in place (as a restore would)
        await server.wait_status(SERVING, 5, "SERVING once the file checks out again")
        await host.SetTheme(host_pb2.TextEvent(text='{"kind":"repaired"}'))
        assert await server.sigterm() == 0
        log = server.log()
        assert tracebacks(log) == 0, log
        assert log.count("session store failing") == 1, log


# ---- Redis: down at start, up, down, up ------------------------------------------------------

@pytest.mark.redis
async def test_redis_down_at_start_is_not_serving_until_it_answers(tmp_path: Path) -> None:
    require_binary("redis-server")
    redis = RedisProcess(tmp_path)
    redis.kill()  # its port is now free: nothing listens on the URL the server is given
    try:
        async with served(tmp_path, "--redis-url", redis.url) as server:
            await server.wait_status(NOT_SERVING, 15, "a started server, NOT_SERVING")
            code, text = await server.readyz()
            assert code == 503 and "Redis unreachable" in text, text
            assert await server.livez() == 200
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await server.conn.host.GetSessionState(common_pb2.Empty(), timeout=8)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (err.value.details() or "").startswith("session store unavailable: Redis unreachable")

            redis.start()
            took = await server.wait_status(SERVING, 6, "SERVING once Redis answers")
            assert took < 6
            assert await server.readyz() == (200, "ok\n")
            await server.conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
            await server.conn.host.GetSessionState(common_pb2.Empty(), timeout=5)

            redis.kill()
            await server.wait_status(NOT_SERVING, 6, "NOT_SERVING once Redis is gone")
            assert (await server.readyz())[0] == 503
            redis.start()
            await server.wait_status(SERVING, 6, "SERVING once Redis is back")
            await server.conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"light"}'), timeout=5)
            assert await server.sigterm() == 0
            assert tracebacks(server.log()) == 0, server.log()
    finally:
        redis.kill()


@pytest.mark.redis
async def test_redis_out_of_memory_is_store_full_until_it_has_room(tmp_path: Path) -> None:
    """maxmemory with noeviction: writes fail StoreFull (RESOURCE_EXHAUSTED), the store is unhealthy
    (its probe's SET is refused too) until Redis has room again."""
    require_binary("redis-server")
    from redis.asyncio import Redis

    from uibus.infra.redis import RedisStore

    redis = RedisProcess(tmp_path)
    admin = Redis.from_url(redis.url)
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "2mb")
        async with RedisStore(redis.url) as store:
            with pytest.raises(StoreFull, match=r"^session store is full: Redis out of memory"):
                for i in range(10_000):
                    await store.put(f"s{i % 50}", f"k{i}", "x" * 1000)
            with pytest.raises(StoreFull, match=r"^session store is full: Redis out of memory \(used memory"):
                await store.update("s1", "k", lambda _: "y" * 5000)  # a MULTI: Redis words it otherwise
            assert store.problem is not None and store.problem.startswith("session store is full")
            await asyncio.sleep(1.5)
            assert not store.healthy  # PING answers, the probe's SET does not
            await admin.config_set("maxmemory", "0")
            deadline = time.monotonic() + 5
            while not store.healthy:
                assert time.monotonic() < deadline, "the store did not recover"
                await asyncio.sleep(0.05)
            await store.put("s", "k", 1)
    finally:
        await admin.aclose()
        redis.kill()


@pytest.mark.redis
async def test_redis_refusing_writes_is_unavailable_until_it_takes_them(tmp_path: Path) -> None:
    """A Redis turned into a replica (a failover gone wrong) answers READONLY: UNAVAILABLE with
    words, not INTERNAL; the store is unhealthy until it is a primary again."""
    require_binary("redis-server")
    from redis.asyncio import Redis

    from uibus.infra.errors import StoreUnavailable
    from uibus.infra.redis import RedisStore

    redis = RedisProcess(tmp_path)
    admin = Redis.from_url(redis.url)
    try:
        async with RedisStore(redis.url) as store:
            await store.put("s", "k", 1)
            await admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            for write in (store.put("s", "k", 2), store.update("s", "k", lambda v: 3)):
                with pytest.raises(StoreUnavailable) as err:
                    await write
                assert str(err.value) == "session store unavailable: Redis refuses commands (a read-only replica)"
            assert not store.healthy
            await admin.execute_command("REPLICAOF", "NO", "ONE")
            deadline = time.monotonic() + 5
            while not store.healthy:
                assert time.monotonic() < deadline, "the store did not recover"
                await asyncio.sleep(0.05)
            await store.put("s", "k", 4)
            assert await store.get("s", "k") == 4
    finally:
        await admin.aclose()
        redis.kill()
