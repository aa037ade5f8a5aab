"""A rolling upgrade with live traffic: the previous release (uibus 0.1.0, built from commit PREVIOUS of
this repository's history into a venv of its own) and this one run as replicas on one real
redis-server, with tracing on, while chat turns, a hosted agent's turns forwarded between the two
versions, dialogs answered on the other version and UI subscriptions go on; then the old replica is
replaced by a new one, as a Kubernetes RollingUpdate does. Nothing acknowledged is lost, no turn
waits for a lease to expire, and no replica counts an envelope bad (uibus_replication_bad_total).

The previous release is built once per checkout into .venv-previous/ (from requirements.lock with
pip's cache: seconds after the first time) and reused while its stamp names the same commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.chatkit import local, write_agents
from tests.conftest import REPO, Reader, free_port, require
from tests.pikit import turn_of
from tests.redisproc import RedisProcess
from tests.support import clean_env
from tests.test_acp_agent import ACP_DIR, fixture_agent
from uibus.clients.connection import Connection
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc

PREVIOUS = "477ee00"  # uibus 0.1.0, the previous release (RELEASES, tag v0.1.0; tests/test_release.py keeps them equal)
PREVIOUS_VENV = REPO / ".venv-previous"
LEASE_S = 4.0  # a turn that waited for a lease to expire would take at least this long

pytestmark = [pytest.mark.redis, pytest.mark.node, pytest.mark.slow, pytest.mark.timeout(900)]


# -- the previous release, built from the repository's history --------------------------------------


def _run(cmd: list[str], **kw: Any) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")


@pytest.fixture(scope="session")
def previous_release() -> Path:
    """The `uibus` command of the previous release, installed from `git archive PREVIOUS` with its own
    requirements.lock into .venv-previous/. Fails, saying how to fix it, when the history is missing
    (a shallow clone)."""
    found = subprocess.run(["git", "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], cwd=REPO, capture_output=True,
                           timeout=60)
    if found.returncode != 0:
        pytest.fail(f"the previous release, commit {PREVIOUS}, is not in this clone's history, so the rolling "
                    "upgrade cannot be tested: clone with history (or `git fetch --unshallow`)")
    uibus = PREVIOUS_VENV / "bin" / "uibus"
    stamp = PREVIOUS_VENV / ".uibus-previous"
    if uibus.exists() and stamp.exists() and stamp.read_text() == PREVIOUS:
        return uibus
    shutil.rmtree(PREVIOUS_VENV, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="uibus-previous-") as tmp:
        archive, src = Path(tmp) / "src.tar", Path(tmp) / "src"
        _run(["git", "archive", "--format=tar", "-o", str(archive), PREVIOUS], cwd=REPO)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
        _run([sys.executable, "-m", "venv", str(PREVIOUS_VENV)])
        pip = [str(PREVIOUS_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "-r", str(src / "requirements.lock")], env=clean_env())
        _run([*pip, "--no-deps", str(src)], env=clean_env())
    stamp.write_text(PREVIOUS)
    return uibus


# -- replicas as processes ----------------------------------------------------------------------


class Replica:
    """`uibus serve` of one release, in its own process, on the shared Redis, with /metrics."""

    def __init__(self, name: str, command: list[str], tmp: Path, redis: RedisProcess, agents: str) -> None:
        self.name = name
        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        env = clean_env(tmp, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME=f"uibus-{name}")
        self.proc = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
             "--store", str(tmp / f"{name}.db"), "--redis-url", redis.url, "--agents", agents,
             "--agent-lease-seconds", str(LEASE_S), "--grace-seconds", "2"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
        self.conns: list[Connection] = []

    async def ready(self) -> None:
        deadline = time.monotonic() + 60
        async with grpc.aio.insecure_channel(self.target) as channel:
            while True:
                assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-3000:]}"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if health.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                assert time.monotonic() < deadline, f"{self.name} not serving: {self.log.read_text()[-3000:]}"
                await asyncio.sleep(0.1)

    def connect(self, session: str) -> Connection:
        conn = Connection(self.target, session=session)
        self.conns.append(conn)
        return conn

    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5)).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    async def build_version(self) -> str | None:
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5)).text
        found = [s.labels["version"] for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "uibus_build_info"]
        return found[0] if found else None

    async def stop(self) -> int:
        """SIGTERM, as a rollout does: drain, end streams, release what it owns, exit."""
        for conn in self.conns:
            await conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        for _ in range(300):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return self.proc.returncode


@contextlib.asynccontextmanager
async def running(name: str, command: list[str], tmp: Path, redis: RedisProcess, agents: str
                  ) -> AsyncIterator[Replica]:
    replica = Replica(name, command, tmp, redis, agents)
    try:
        await replica.ready()
        yield replica
    finally:
        await replica.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(replica.proc.pid, signal.SIGKILL)  # anything it started and left behind


# -- the traffic ----------------------------------------------------------------------------------


class Traffic:
    """Live load across whichever replicas are `live`: partial messages published on each and read on
    every replica's UI stream, chat turns, and what each check found."""

    def __init__(self) -> None:
        self.live: list[Replica] = []
        self.acked: dict[int, float] = {}  # ts of a publish a replica acknowledged -> when
        self.seen: dict[str, set[int]] = {}  # replica -> ts its UI stream delivered
        self.since: dict[str, float] = {}  # replica -> when its UI stream was live
        self.chats = 0
        self.failures: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.stopping = False

    async def subscribe(self, replica: Replica) -> None:
        """A UI stream on `replica`, live once a marker published on another replica reaches it."""
        stream = replica.connect("live").ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
        await asyncio.wait_for(stream.initial_metadata(), 10)
        self.seen[replica.name] = set()
        reader = Reader(stream)
        self.since[replica.name] = time.monotonic()

        async def pump() -> None:
            while not self.stopping or True:
                try:
                    message = await reader.next(timeout=3600)
                except (StopAsyncIteration, grpc.aio.AioRpcError):
                    return
                self.seen[replica.name].add(message.ts)

        self.tasks.append(asyncio.create_task(pump()))

    async def publish_loop(self) -> None:
        ts = 1_000_000
        while not self.stopping:
            for replica in list(self.live):
                ts += 1
                try:
                    await replica.connect("live").host.PublishPartialMessage(
                        ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=f"{replica.name} {ts}"),
                        timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if replica in self.live:
                        self.failures.append(f"publish on {replica.name}: {exc.code().name} {exc.details()}")
                    continue
                self.acked[ts] = time.monotonic()
            await asyncio.sleep(0.02)

    async def chat_loop(self) -> None:
        n = 0
        while not self.stopping:
            for replica in list(self.live):
                n += 1
                try:
                    responses = await asyncio.wait_for(turn_of(replica.connect(f"chat-{n}"), "chat", f"hi {n}"), 20)
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    if replica in self.live:
                        self.failures.append(f"chat on {replica.name}: {exc!r}"[:300])
                    continue
                if not responses or not responses[-1].response.text:
                    self.failures.append(f"chat on {replica.name}: no answer")
                self.chats += 1
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self.tasks += [asyncio.create_task(self.publish_loop()), asyncio.create_task(self.chat_loop())]

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.sleep(1.0)  # the last acknowledged events cross Redis
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def lost(self, replica: str, until: float | None = None) -> list[int]:
        """Acknowledged events published while `replica`'s stream was live that it never delivered."""
        since = self.since[replica]
        return sorted(ts for ts, at in self.acked.items()
                      if at > since + 0.2 and (until is None or at < until - 0.5) and ts not in self.seen[replica])


async def agent_turn(replica: Replica, session: str, text: str) -> float:
    """One turn of the hosted ACP agent asked on `replica`: how long it took (it must end well)."""
    started = time.monotonic()
    responses = await asyncio.wait_for(turn_of(replica.connect(session), "acp", text), 30)
    assert responses and responses[-1].response.text, f"{session} on {replica.name}: {responses}"
    return time.monotonic() - started


async def dialog_across(asker: Replica, answerer: Replica, session: str) -> None:
    """A Confirm asked on `asker`, seen by a UI on `answerer` and answered there."""
    ui = Reader(extension_ui_pb2_grpc.ExtensionUiServiceStub(answerer.connect(session).channel).Subscribe(
        ext_pb.SubscribeRequest()))
    try:
        await asyncio.wait_for(ui.call.initial_metadata(), 10)
        agent = extension_ui_pb2_grpc.ExtensionUiServiceStub(asker.connect(session).channel)
        call = asyncio.ensure_future(agent.Confirm(ext_pb.ConfirmRequest(title=f"{session}?", timeout_ms=20_000)))
        event = await ui.next(timeout=10)
        while not event.HasField("request"):
            event = await ui.next(timeout=10)
        respond = extension_ui_pb2_grpc.ExtensionUiServiceStub(answerer.connect(session).channel).Respond
        await respond(ext_pb.RespondRequest(id=event.request.id, confirmed=True), timeout=10)
        result = await asyncio.wait_for(call, 10)
        assert result.outcome == ext_pb.DIALOG_OUTCOME_ANSWERED and result.confirmed, (session, result)
    finally:
        ui.call.cancel()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    yield server
    server.kill()


async def test_previous_release_and_this_one_side_by_side_then_the_old_replaced(
        previous_release: Path, redis: RedisProcess, tmp_path: Path) -> None:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    agents = write_agents(tmp_path, [local("chat"), fixture_agent(tmp_path)])
    old_cmd, new_cmd = [str(previous_release)], [sys.executable, "-m", "uibus"]
    traffic = Traffic()
    turns: list[float] = []
    async with running("old", old_cmd, tmp_path, redis, agents) as old, \
            running("new1", new_cmd, tmp_path, redis, agents) as new1:
        assert await old.build_version() is None  # 0.1.0 has no uibus_build_info
        assert await new1.build_version() is not None
        traffic.live = [old, new1]
        await traffic.subscribe(old)
        await traffic.subscribe(new1)
        traffic.start()
        # A hosted agent on each version, its turns asked on the other: forwarded both ways.
        turns.append(await agent_turn(old, "agent-old", "start on old"))
        turns.append(await agent_turn(new1, "agent-new", "start on new"))
        for i in range(3):
            turns.append(await agent_turn(new1, "agent-old", f"forwarded to old {i}"))
            turns.append(await agent_turn(old, "agent-new", f"forwarded to new {i}"))
        await dialog_across(old, new1, "dialog-1")
        await dialog_across(new1, old, "dialog-2")
        await asyncio.sleep(2)  # past the new replica's census (1 s): it has heard the old one
        assert (await new1.metrics())["uibus_replication_wire_version"] == 1  # it keeps to 0.1.0's form
        turns.append(await agent_turn(new1, "agent-old", "still forwarded"))

        # The rollout: a new replica up, then the old one stopped, traffic going on throughout.
        async with running("new2", new_cmd, tmp_path, redis, agents) as new2:
            await traffic.subscribe(new2)
            traffic.live = [old, new1, new2]
            await asyncio.sleep(1.0)
            old_metrics = await old.metrics()
            traffic.live = [new1, new2]
            old_gone = time.monotonic()
            assert await old.stop() == 0, old.log.read_text()[-3000:]
            # The agent the old replica owned goes on elsewhere at once: its lease was given back.
            turns.append(await agent_turn(new2, "agent-old", "after the old one left"))
            turns.append(await agent_turn(new1, "agent-new", "the new one's agent"))
            await dialog_across(new2, new1, "dialog-3")
            await asyncio.sleep(2.0)
            await traffic.stop()
            new_metrics = [await new1.metrics(), await new2.metrics()]

    assert not traffic.failures, traffic.failures[:10]
    assert traffic.chats >= 10 and len(traffic.acked) >= 100, (traffic.chats, len(traffic.acked))
    for replica in ("new1", "new2"):
        assert not traffic.lost(replica), f"{replica} lost acknowledged events: {traffic.lost(replica)[:20]}"
    assert not traffic.lost("old", until=old_gone), traffic.lost("old", until=old_gone)[:20]
    assert max(turns) < LEASE_S, f"a turn waited for a lease: {turns}"
    for metrics in (old_metrics, *new_metrics):
        assert metrics["uibus_replication_bad_total"] == 0, metrics
        assert metrics["uibus_replication_received_total"] > 0
    assert all(m["uibus_replication_kept_local_total"] == 0 for m in new_metrics)
    # Traces were on across the two versions: each side continued traces the other published
    # (a CONSUMER span per traced envelope received, from the console exporter's output).
    for name in ("old", "new1"):
        assert (tmp_path / f"{name}.log").read_text().count('"kind": "SpanKind.CONSUMER"') > 0, name
