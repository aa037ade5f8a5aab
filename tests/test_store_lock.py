"""One embedded store, one serving uibus (uibus.infra.store_lock), and `uibus backup` of it.

Real `uibus serve` processes on one SQLite file: the second refuses in one line naming the first
and the flags to use instead; a SIGKILLed holder leaves nothing that blocks the next start; `--workers`
on Redis never touches the lock; `uibus backup` copies the store while a server writes to it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, ServerProcess
from tests.redisproc import RedisProcess, redis_server
from uibus.clients.connection import Connection
from uibus.infra.sqlite_store import SqliteStore
from uibus.infra.store_lock import StoreInUse
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

__all__ = ["redis_server"]


def serve(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`uibus serve` on `store` that is expected to refuse (bounded: one that serves is a failure)."""
    return subprocess.run([sys.executable, "-m", "uibus", "serve", "--port", "0", "--http-port", "0", "--store",
                           str(store), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


async def test_a_second_serve_on_the_same_store_refuses_naming_the_first(
        spawn: Callable[..., ServerProcess], tmp_path: Path) -> None:
    first = spawn()
    await first.wait_ready()
    store = tmp_path / "proc.db"
    for args in ((), ("--port", str(first.port))):  # its own ports, or the first's: told of the store either way
        refused = serve(store, *args)
        assert refused.returncode == 1, (refused.returncode, refused.stderr)
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"uibus serve: --store: {store} is served by uibus pid {first.proc.pid} ("), line
        assert f"gRPC 127.0.0.1:{first.port}" in line and "since " in line and f"in {REPO}" in line, line
        assert "--store PATH" in line and "--redis-url" in line, line
    assert first.proc.poll() is None  # the first serves on, untouched
    other = spawn("--store", str(tmp_path / "other.db"))  # the flag the refusal names: a second instance
    await other.wait_ready()


async def test_the_lock_dies_with_a_killed_holder(spawn: Callable[..., ServerProcess], tmp_path: Path) -> None:
    first = spawn()
    await first.wait_ready()
    async with Connection(first.target, session="kept") as conn:
        await conn.host.SetTheme(host_pb2.TextEvent(text='{"kind":"dark"}'))
    first.proc.kill()  # SIGKILL: no teardown ran, the lock file is still there with its pid
    await asyncio.to_thread(first.proc.wait, 10)
    assert str(first.proc.pid) in (tmp_path / "proc.db.lock").read_text()
    again = spawn()
    await again.wait_ready()
    async with Connection(again.target, session="kept") as conn:
        assert (await conn.host.GetSessionState(common_pb2.Empty())).theme == '{"kind":"dark"}'
    assert f'"pid": {again.proc.pid},' in (tmp_path / "proc.db.lock").read_text()


async def test_in_one_process_the_lock_is_held_until_close_and_readers_are_never_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "u.db")
    held = SqliteStore(path, serving={"grpc": "127.0.0.1:1"})
    try:
        lock = held._lock
        assert lock is not None and lock._fd is not None and not os.get_inheritable(lock._fd)  # agents never hold it
        with pytest.raises(StoreInUse) as refused:
            SqliteStore(path, serving={"grpc": "127.0.0.1:2"})
        assert f"served by uibus pid {os.getpid()} (gRPC 127.0.0.1:1," in str(refused.value)
        reader = SqliteStore(path)  # not serving (a test, a tool): reads beside the server
        await reader.close()
    finally:
        await held.close()
    again = SqliteStore(path, serving={})
    await again.close()


@pytest.mark.redis
async def test_workers_on_redis_are_not_held_by_a_sqlite_store(
        spawn: Callable[..., ServerProcess], redis_server: RedisProcess) -> None:
    """The refusal's other way out: replicas on Redis. `--workers 2` (which shares Redis between its
    workers) starts while a SQLite uibus serves the --store it is also given: that file is not its store."""
    alone = spawn()
    await alone.wait_ready()
    workers = spawn("--workers", "2", "--redis-url", redis_server.url, "--grace-seconds", "1")
    await workers.wait_ready(timeout=60)
    assert alone.proc.poll() is None and workers.proc.poll() is None


async def test_backup_is_one_consistent_file_while_the_server_writes(
        spawn: Callable[..., ServerProcess], tmp_path: Path) -> None:
    server = spawn()
    await server.wait_ready()
    written: list[str] = []
    stop, twenty = asyncio.Event(), asyncio.Event()

    async def write() -> None:
        i = 0
        while not stop.is_set() and i < 2000:  # bounded; stops once the backup is done
            async with Connection(server.target, session=f"b{i}") as conn:
                await conn.host.SetTheme(host_pb2.TextEvent(text=f'{{"n":{i}}}'))
            written.append(f"b{i}")
            if len(written) == 20:
                twenty.set()
            i += 1

    writer = asyncio.create_task(write())
    try:
        await asyncio.wait_for(twenty.wait(), 60)
        before = list(written)  # acknowledged before the backup began: all must be in it
        dest = tmp_path / "copy.db"
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "uibus", "backup", str(dest), "--store",
                                                        str(tmp_path / "proc.db")],
                                       capture_output=True, text=True, timeout=120, cwd=REPO)
        during = len(written) - len(before)
    finally:
        stop.set()
        await writer
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"backed up {tmp_path / 'proc.db'} (") and "one file" in done.stdout, done.stdout
    assert during > 0 or len(written) == 2000, "the server was not writing during the backup"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("copy.db")) == ["copy.db"]  # no -wal/-shm
    assert oct(dest.stat().st_mode & 0o777) == "0o600"
    with contextlib.closing(sqlite3.connect(dest)) as db:
        assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    # The copy is a store uibus serves: every session acknowledged before the backup has its theme.
    copy = spawn("--store", str(dest))
    await copy.wait_ready()
    for session in (before[0], before[-1]):
        async with Connection(copy.target, session=session) as conn:
            state = await conn.host.GetSessionState(common_pb2.Empty())
            assert state.theme == f'{{"n":{session[1:]}}}', (session, state.theme)
    again = subprocess.run([sys.executable, "-m", "uibus", "backup", str(dest), "--store", str(tmp_path / "proc.db")],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert again.returncode == 2 and again.stderr.strip() == f"uibus backup: {dest} exists: remove it or name another"
