"""Shared fixtures: real servers on loopback, real channels, real external programs.

`UIBUS_REQUIRE_ALL=1` (set by .ci/run) turns "this machine lacks redis-server / chromium" skips
into failures, so CI can never pass by skipping.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.support import NEEDS, http_client, needs
from uibus.app import App
from uibus.app.installers import INSTALLERS
from uibus.app.main import loop_factory
from uibus.clients.connection import Connection
from uibus.edge.wiring import Installer
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # The per-test timeout's timer (tests/watchdog.py): fails a hung test, asyncio's loop or uvloop,
    # with every thread's and task's stack; pytest-timeout keeps reading the settings.
    if config.pluginmanager.has_plugin("timeout") and not config.pluginmanager.has_plugin("tests.watchdog"):
        config.pluginmanager.import_plugin("tests.watchdog")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by them
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The docs' command blocks that are not run here (marked `docs-test: skip`, each naming the test
    that covers it: tests/test_docs_run.py checks that), listed so a reader of the log sees them."""
    ran = (r for reports in terminalreporter.stats.values() for r in reports)
    if not any(str(getattr(r, "nodeid", "")).startswith("tests/test_docs_run.py") for r in ran):
        return
    from tests.docs_blocks import all_blocks

    skipped = [b for b in all_blocks() if b.skip]
    if skipped:
        terminalreporter.section("docs blocks not run here (each names the test that covers it)")
        for block in skipped:
            terminalreporter.write_line(f"{block.where}: {block.skip}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The markers of what a test needs (pyproject.toml's list): from the fixtures it uses (marked
    with tests.support.needs), and `slow` for a test allowed more than the default timeout."""
    default = float(config.getini("timeout") or 0) if config.pluginmanager.has_plugin("timeout") else 0.0
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        for marker in sorted({m for fixturedefs in defs for d in fixturedefs for m in getattr(d.func, NEEDS, ())}):
            item.add_marker(marker)
        timeout = item.get_closest_marker("timeout")
        if default and timeout is not None and timeout.args and float(timeout.args[0]) > default:
            item.add_marker("slow")


_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def require(what: str, ok: bool, marker: str | None = None) -> None:
    """Skips when `what` is missing here, but fails under UIBUS_REQUIRE_ALL (CI). With `marker`
    (what `what` is, of pyproject.toml's markers), the running test must carry it, present or
    not, so that `pytest -m` slices select every test that needs it."""
    if marker is not None and _running and _running[-1].get_closest_marker(marker) is None:
        pytest.fail(f"{_running[-1].nodeid} needs {what} but is not marked `{marker}`: add "
                    f"@pytest.mark.{marker}, or tests.support.needs({marker!r}) on the fixture that needs it")
    if ok:
        return
    if os.environ.get("UIBUS_REQUIRE_ALL") == "1":
        pytest.fail(f"{what} is required in CI (UIBUS_REQUIRE_ALL=1) but is missing")
    pytest.skip(f"{what} is not available on this machine")


CHROMIUM = "/usr/bin/chromium"
# The programs behind pyproject.toml's markers; require_binary checks the test carries the marker.
BINARY_MARKERS = {"redis-server": "redis", "redis-cli": "redis", CHROMIUM: "browser", "node": "node", "npm": "node",
                  "docker": "docker", "dockerd": "docker", "docker-compose": "docker"}


def require_binary(name: str) -> str:
    path = shutil.which(name) or (name if os.path.exists(name) else None)
    require(name, path is not None, BINARY_MARKERS.get(name))
    return path  # type: ignore[return-value]


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_EPHEMERAL_FLOOR = _ephemeral_floor()
_handed_out: set[int] = set()
_ports = random.Random()


def free_port() -> int:
    """A loopback port free now, for a server the test starts next. A port the kernel handed out
    (bind to port 0) is in its ephemeral range, where any outgoing connection or other `port 0`
    server can take it before ours binds it (CI saw "address already in use" that way); so the
    port is picked at random *below* that range, where only an explicit bind takes a port, and
    never twice in one test process."""
    low = 20000 if _EPHEMERAL_FLOOR > 21000 else 1024
    for _ in range(1000):
        port = _ports.randrange(low, min(_EPHEMERAL_FLOOR, 65536))
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}..{_EPHEMERAL_FLOOR}")


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture
@needs("browser")
async def browser() -> AsyncIterator[Any]:
    """Debian's headless Chromium, driven by Python playwright (the tests' pages run in it)."""
    require_binary(CHROMIUM)
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        require("python playwright", False, "browser")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


def shots(tmp_path: Path) -> Path:
    """Where screenshots go: UIBUS_SCREENSHOTS (.ci/run keeps them), else the test's tmp dir."""
    return Path(os.environ.get("UIBUS_SCREENSHOTS") or tmp_path)


async def chat_on_page(browser: Any, http_port: int, session: str, agent: str, text: str,
                       height: int = 1000) -> Any:
    """The browser page of `session`, live, with `text` sent to `agent` from its chat box."""
    page = await browser.new_page(viewport={"width": 1100, "height": height})
    await page.goto(f"http://127.0.0.1:{http_port}/?session={session}")
    await page.wait_for_selector('#status[data-state="live"]', timeout=5000)
    await page.wait_for_function("a => [...document.querySelectorAll('#agent option')].some(o => o.value === a)",
                                 arg=agent, timeout=5000)
    await page.select_option("#agent", agent)
    await page.fill("#input", text)
    await page.press("#input", "Enter")
    return page


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "uibus.db"), grace_seconds=2.0)


async def start_app(config: Config, installers: Sequence[Installer] = INSTALLERS, **kw: Any) -> App:
    """A started App. A port picked with `free_port()` can be taken by another server's ephemeral
    port before the App binds it; then the start fails cleanly (nothing is left open) and is
    retried on a fresh port."""
    for attempt in range(3):
        app = App(config, installers=installers, **kw)
        try:
            await app.start()
            return app
        except OSError:
            if attempt == 2 or not config.http_port or "store" in kw:  # a given store was closed with it
                raise
            config = replace(config, http_port=free_port())
    raise AssertionError("unreachable")


@asynccontextmanager
async def running(config: Config, installers: Sequence[Installer] = INSTALLERS) -> AsyncIterator[App]:
    """A started App, stopped (gracefully) on exit."""
    app = await start_app(config, installers)
    try:
        yield app
    finally:
        await app.aclose(grace=1.0)


@asynccontextmanager
async def connections(app: App) -> AsyncIterator[Callable[..., Connection]]:
    """Opens native gRPC connections (one channel each) to `app`, all closed on exit."""
    opened: list[Connection] = []

    def open_(session: str = "default", **kw: object) -> Connection:
        conn = Connection(f"127.0.0.1:{app.port}", session=session, **kw)  # type: ignore[arg-type]
        opened.append(conn)
        return conn

    try:
        yield open_
    finally:
        for conn in opened:
            await conn.close()


@pytest.fixture
def installers() -> Sequence[Installer]:
    """The parts the `app` and `web` fixtures install (a module may add test-only ones)."""
    return INSTALLERS


@pytest.fixture
async def app(config: Config, installers: Sequence[Installer]) -> AsyncIterator[App]:
    async with running(config, installers) as app:
        yield app


@pytest.fixture
async def connect(app: App) -> AsyncIterator[Callable[..., Connection]]:
    async with connections(app) as open_:
        yield open_


@pytest.fixture
def web_config(config: Config) -> Config:
    """The config of `web`: with the HTTP port on (override it in a module to change more)."""
    return replace(config, http_port=free_port())


@pytest.fixture
async def web(web_config: Config, installers: Sequence[Installer]) -> AsyncIterator[App]:
    """An App serving HTTP too (gRPC-Web, neuro-san HTTP API, webview, /metrics)."""
    async with running(web_config, installers) as app:
        yield app


@pytest.fixture
async def web_connect(web: App) -> AsyncIterator[Callable[..., Connection]]:
    async with connections(web) as open_:
        yield open_


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for absolute URLs (10 s timeout)."""
    async with http_client() as client:
        yield client


@pytest.fixture
async def web_http(web: App) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on `web`'s HTTP port: paths alone will do."""
    async with http_client(web) as client:
        yield client


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on (as another server would)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# The loop the in-process servers of the tests run on: the one `uibus serve` runs on by default
# (--loop auto: uvloop where installed), or UIBUS_TEST_LOOP=asyncio|uvloop. Servers the tests
# start as processes follow UIBUS_LOOP like any `uibus serve`.
TEST_LOOP = os.environ.get("UIBUS_TEST_LOOP", "auto")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    factory = loop_factory(TEST_LOOP) or asyncio.new_event_loop
    return {"uvloop" if factory is not asyncio.new_event_loop else "asyncio": factory}


def run_reporter(pytestconfig: pytest.Config, tag: str) -> Callable[[str], None]:
    """A writer of lines into the test run's own output, as `[tag] line` (CI's log shows them;
    stdout is captured): for figures a test measures (the container's build, the fuzz suite's cases)."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if terminal is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                terminal.write_line(f"\n[{tag}] {line}")
    return write


async def wait_for(predicate: Callable[[], bool], timeout: float = 2.0, what: str = "condition") -> float:
    """Polls `predicate` until true; returns the seconds it took, fails after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


class Reader:
    """Reads a server stream in the background so a test can wait for "nothing arrives" without
    cancelling the call (cancelling a grpc.aio read cancels the whole RPC)."""

    END = object()

    def __init__(self, call: Any) -> None:
        self.call = call
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for message in self.call:
                self.queue.put_nowait(message)
            self.queue.put_nowait(self.END)
        except grpc.aio.AioRpcError as exc:
            self.queue.put_nowait(exc)

    async def next(self, timeout: float = 2.0) -> Any:
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        if item is self.END:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.call.cancel()


async def next_message(stream: Any, timeout: float = 2.0) -> Any:
    """The stream's next message; on a Reader, waiting does not cancel the call."""
    if isinstance(stream, Reader):
        return await stream.next(timeout)
    return await asyncio.wait_for(stream.read(), timeout)


def subscriber(target: str, session: str, n: int, *, read: bool = True) -> subprocess.Popen[bytes]:
    """tests/scripts/subscriber.py in its own process: prints "live" once its `n` streams are
    subscribed; kill it for a real disconnect, SIGSTOP it for a frozen client."""
    args = [sys.executable, str(Path(__file__).parent / "scripts" / "subscriber.py"), target, session, str(n)]
    if not read:
        args.append("--no-read")
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)


class ServerProcess:
    """`python -m uibus serve` in its own process, as an operator would run it."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = tmp_path / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", "0", "--store", str(tmp_path / "proc.db"), *args]
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        self.target = f"127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = 20.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited {self.proc.returncode}: {self.log.read_text()}")
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError("server did not become ready: " + self.log.read_text())
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    procs: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        p = ServerProcess(tmp_path, *args, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


__all__ = ["Config", "Reader", "ServerProcess", "common_pb2", "free_port", "host_pb2", "next_message", "replace",
           "require", "require_binary", "wait_for"]
