"""The image and the compose stack, built from this checkout and run on a real Docker engine.

The engine and the stand-in bases come from tests/dockerenv.py (Debian's packages only: no image
registry is needed). The image is built from the Dockerfile as users build it, on a Debian stand-in
for python:3.11-slim, and run read-only, as uid 10001, on non-default ports; the compose stack runs
docker-compose.yml as it is, with stand-in redis and nginx images named by its variables, and is
checked through its nginx front (native gRPC, gRPC-Web, the CodeBolt WebSocket), across its two
replicas, and for session affinity. Needs root for dockerd (skips, or fails under UIBUS_REQUIRE_ALL).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import REPO, free_port, next_message, require_binary, run_reporter
from tests.dockerenv import IMAGE, Docker
from tests.webclient import call
from uibus.clients.connection import Connection
from uibus.pb.cline import common_pb2, ui_pb2

pytestmark = [pytest.mark.timeout(1200), pytest.mark.docker]


@pytest.fixture(scope="module")
def report(pytestconfig: pytest.Config) -> Callable[[str], None]:
    return run_reporter(pytestconfig, "container")


@pytest.fixture(scope="module")
def docker(report: Callable[[str], None]) -> Iterator[Docker]:
    engine = Docker()
    try:
        engine.start()  # inside: a dockerd that started but never answered is stopped too
        started = time.monotonic()
        engine.standins()
        engine.build_uibus()  # after `.ci/setup --system` prepared it: only checks it is current
        report(f"image {IMAGE} built from this checkout on the stand-in base ({time.monotonic() - started:.0f} s)")
        yield engine
    finally:
        engine.stop()


async def _serving(target: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if (await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{target} did not become SERVING")
            await asyncio.sleep(0.2)


# What an operator sets (docs/deployment.md): the image binds every interface, so it serves only with a token.
TOKEN = "container-test-" + secrets.token_hex(8)
BEARER = {"authorization": f"Bearer {TOKEN}"}


async def _round_trip(subscribe_at: str, publish_at: str, session: str, text: str) -> None:
    """A partial message published at one address reaches a subscriber at the other."""
    async with Connection(subscribe_at, session=session, token=TOKEN) as sub, \
            Connection(publish_at, session=session, token=TOKEN) as pub:
        stream = sub.ui.subscribeToPartialMessage(common_pb2.EmptyRequest())
        await asyncio.wait_for(stream.initial_metadata(), 10)  # headers = subscribed
        await pub.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1700000000001, type=ui_pb2.SAY,
                                                                 say=ui_pb2.TEXT, text=text))
        assert (await next_message(stream, timeout=10)).text == text
        stream.cancel()


async def test_image_runs_read_only_as_non_root_and_stops_cleanly(docker: Docker,
                                                                   report: Callable[[str], None]) -> None:
    grpc_port, http_port = free_port(), free_port()
    name = f"uibus-test-{grpc_port}"
    # Without a token the image does not serve at all: one line naming the flags, exit 2.
    refused = docker.run("run", "--rm", "--network", "none", IMAGE, check=False, timeout=60)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-2000:])
    assert "not a loopback address" in refused.stderr and "--auth-token" in refused.stderr, refused.stderr
    report("image without a token: exit 2, " + refused.stderr.strip().splitlines()[-1][:90] + " …")
    docker.run("run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp", "--network", "host",
               "-e", f"UIBUS_PORT={grpc_port}", "-e", f"UIBUS_HTTP_PORT={http_port}", "-e", f"UIBUS_AUTH_TOKEN={TOKEN}",
               # the image's own HEALTHCHECK command, on a faster schedule than its 10 s
               "--health-interval", "1s", "--health-start-period", "1s", IMAGE)
    try:
        target = f"127.0.0.1:{grpc_port}"
        await _serving(target)
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"http://127.0.0.1:{http_port}/readyz")).text == "ok\n"
            metrics = (await http.get(f"http://127.0.0.1:{http_port}/metrics", headers=BEARER)).text
        # One version three ways: the OCI label, `uibus --version` in the image and uibus_build_info of
        # the running container; and it is this checkout's (the fixture built it with the version
        # setuptools-scm derives here, as pip would: not the Dockerfile's default).
        label = docker.run("image", "inspect", "--format",
                           '{{index .Config.Labels "org.opencontainers.image.version"}}', IMAGE).stdout.strip()
        said = docker.run("exec", name, "uibus", "--version").stdout.strip()
        (info,) = [f for f in text_string_to_metric_families(metrics) if f.name == "uibus_build_info"]
        assert docker.built_version is not None, "setuptools-scm gave no version for the checkout"
        assert label == docker.built_version and said == f"uibus {label}", (label, said, docker.built_version)
        assert [(s.labels, s.value) for s in info.samples] == [({"version": label}, 1)], info.samples
        report(f"image {IMAGE}: label, `uibus --version` and uibus_build_info all say {label}")
        await _round_trip(target, target, "c1", "through the image")
        deadline = time.monotonic() + 30
        while docker.run("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip() != "healthy":
            assert time.monotonic() < deadline, docker.run("inspect", name).stdout[-2000:]
            await asyncio.sleep(0.5)
        assert docker.run("exec", name, "id", "-u").stdout.strip() == "10001"
        assert docker.run("exec", name, "sh", "-c", "touch /x 2>&1 || echo read-only").stdout.strip().endswith(
            "read-only")
        # The build's CA bundle (a BuildKit secret), pip's use of it and the wheels (a bind mount from
        # the build stage, whose mount point is left as an empty folder) stayed in the build stage.
        leftovers = docker.run("exec", name, "sh", "-c", "find /run/secrets /wheels -type f 2>/dev/null; "
                               "env | grep -c PIP_CERT",
                               check=False).stdout.split()
        assert leftovers == ["0"], leftovers
        started = time.monotonic()
        docker.run("stop", "-t", "20", name, timeout=60)
        stopped = time.monotonic() - started
        assert docker.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
        assert stopped < 20, stopped
        size = int(docker.run("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
        report(f"image {IMAGE}: {size / 1e6:.0f} MB (on the stand-in base); docker stop -> exit 0 in {stopped:.2f} s")
    finally:
        docker.run("rm", "-f", name, check=False)


def _compose_run(docker: Docker, *args: str, env: dict[str, str],
                 timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("docker-compose"), "-p", "uibustest", *args], cwd=REPO,
                          capture_output=True, text=True, env={**docker.env, **env}, timeout=timeout)


def _compose(docker: Docker, *args: str, env: dict[str, str], timeout: float = 300) -> str:
    done = _compose_run(docker, *args, env=env, timeout=timeout)
    assert done.returncode == 0, f"docker-compose {' '.join(args)}: {done.stderr[-3000:]}"
    return done.stdout


def _metric(page: str, method: str) -> float:
    total = 0.0
    for line in page.splitlines():
        if line.startswith("uibus_rpc_duration_seconds_count{") and f'method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_compose_stack_through_its_front_and_across_replicas(docker: Docker,
                                                                   report: Callable[[str], None]) -> None:
    grpc_port, http_port = free_port(), free_port()
    env = {"UIBUS_REDIS_IMAGE": "uibus-standin/redis", "UIBUS_NGINX_IMAGE": "uibus-standin/nginx",
           "UIBUS_FRONT_GRPC_PORT": str(grpc_port), "UIBUS_FRONT_HTTP_PORT": str(http_port),
           "UIBUS_AUTH_TOKEN": TOKEN, "REDIS_PASSWORD": "redis-" + TOKEN,
           # the image the fixture built: compose names it by these (`.ci/version --env` for an operator)
           "UIBUS_IMAGE_TAG": IMAGE.split(":", 1)[1], "UIBUS_VERSION": docker.built_version or "0+unknown"}
    require_binary("docker-compose")  # before the try: its skip must not meet the cleanup's compose calls
    started = time.monotonic()
    try:
        # --no-build: the image the fixture built (compose builds without BuildKit secrets here).
        _compose(docker, "up", "-d", "--no-build", env=env)
        front = f"127.0.0.1:{grpc_port}"
        await _serving(front)
        report(f"compose stack (redis, 2 replicas, nginx) up and serving in {time.monotonic() - started:.0f} s")
        ips = {}
        for replica in ("uibus-1", "uibus-2"):
            cid = _compose(docker, "ps", "-q", replica, env=env).strip()
            ips[replica] = docker.run("inspect", "--format",
                                      "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", cid).stdout.strip()
        one, two = (f"{ips[r]}:26040" for r in ("uibus-1", "uibus-2"))
        # A subscription on one replica receives a publish made through the other (Redis between them).
        await _round_trip(one, two, "across", "from replica 2 to replica 1")
        await _round_trip(two, one, "across-back", "from replica 1 to replica 2")
        # Through the front: native gRPC (h2c) …
        await _round_trip(front, front, "front", "through nginx")
        # … gRPC-Web …
        async with httpx.AsyncClient(timeout=10) as http:
            reply = await call(http, f"http://127.0.0.1:{http_port}/uibus.v1.HostService/GetSessionState", b"",
                               headers={"x-uibus-session": "front", **BEARER})
            assert reply.status == 0, reply.message
            # The front passes the browser's Host on (port included): a page's own origin is admitted,
            # another site's page is refused, as on a replica itself.
            page = f"http://localhost:{http_port}"
            own = await call(http, f"{page}/uibus.v1.HostService/GetSessionState", b"",
                             headers={"x-uibus-session": "front", "origin": page, **BEARER})
            assert own.status == 0 and own.headers["access-control-allow-origin"] == page, own.message
            cross = await http.post(f"{page}/uibus.v1.HostService/GetSessionState", content=b"",
                                    headers={"content-type": "application/grpc-web+proto",
                                             "origin": "https://evil.example", **BEARER})
            assert cross.status_code == 403 and "--cors-origins" in cross.text
            assert (await http.get(f"http://127.0.0.1:{http_port}/readyz")).text == "ok\n"
        # … and the CodeBolt WebSocket.
        async with ws_connect(f"ws://127.0.0.1:{http_port}/agent-to-app?session=front",
                              additional_headers=BEARER) as ws:
            await ws.send(json.dumps({"type": "memoryEvent", "action": "memorySet", "requestId": "m1",
                                      "message": {"key": "k", "value": 1}}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["success"] is True
        # Session affinity: every call of one session lands on the same replica.
        method = "/uibus.v1.HostService/GetSessionState"

        async def counts() -> list[float]:
            async with httpx.AsyncClient(timeout=10) as http:
                return [_metric((await http.get(f"http://{ips[r]}:8080/metrics", headers=BEARER)).text, method)
                        for r in ("uibus-1", "uibus-2")]

        before = await counts()
        async with Connection(front, session="sticky", token=TOKEN) as conn:
            for _ in range(20):
                await conn.host.GetSessionState(common_pb2.Empty())
        gained = [after - was for after, was in zip(await counts(), before, strict=True)]
        assert sorted(gained) == [0, 20], gained
        report("compose: a publish through one replica reached a subscriber on the other, both ways; native "
               "gRPC, gRPC-Web and the WebSocket through nginx; 20 calls of one session all on one replica "
               f"({gained})")
    finally:
        logs = _compose_run(docker, "logs", "--no-color", "--tail", "20", env=env, timeout=60).stdout
        down = _compose_run(docker, "down", "-v", "-t", "20", env=env, timeout=120)
        if down.returncode:
            report("compose down failed: " + down.stderr[-500:] + "\n" + logs[-2000:])

