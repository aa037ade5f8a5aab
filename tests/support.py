"""Helpers many test modules share, defined once: /metrics over real HTTP, an HTTP client on an
app, the ExtensionUiService stub on a connection, a child process's clean environment, and the
marker a fixture gives the tests that use it.

Plain functions only; the fixtures built on them (`http`, `web_http`, `taken_port`) are in
conftest.py, where pytest finds them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from uibus.app import App
from uibus.clients.connection import Connection
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc

F = TypeVar("F", bound=Callable[..., object])
NEEDS = "__uibus_needs__"


def needs(*markers: str) -> Callable[[F], F]:
    """Under @pytest.fixture: every test that uses the fixture (directly or through another one)
    gets these markers (redis, browser, docker, node; see pyproject.toml), so `pytest -m` selects it."""
    def mark(fixture: F) -> F:
        setattr(fixture, NEEDS, frozenset(markers))
        return fixture
    return mark


# Where /metrics is read: an App (with its metrics or operator token, as Prometheus would be given),
# an HTTP port on loopback, or a client whose base URL is the app's HTTP port.
Where = App | int | httpx.AsyncClient
# {(sample name, sorted labels): value}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@asynccontextmanager
async def http_client(app: App | None = None, timeout: float = 10) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client; with `app`, its base URL is the app's HTTP port (paths alone will do)."""
    base = f"http://127.0.0.1:{app.http_port}" if app is not None else ""
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        yield client


async def scrape_text(where: Where) -> str:
    """The /metrics page over real HTTP, as Prometheus reads it; fails unless it is served."""
    if isinstance(where, httpx.AsyncClient):
        r = await where.get("/metrics")
    else:
        headers = {}
        if isinstance(where, App):
            token = where.config.metrics_token or where.config.auth_token
            headers = {"authorization": f"Bearer {token}"} if token else {}
        port = where.http_port if isinstance(where, App) else where
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"http://127.0.0.1:{port}/metrics", headers=headers)
    assert r.status_code == 200, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/plain"), r.headers["content-type"]
    return r.text


async def scrape(where: Where) -> Samples:
    """/metrics as {(sample name, labels): value}."""
    text = await scrape_text(where)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape_by_name(where: Where) -> dict[str, float]:
    """/metrics as {sample name: value}, for series without labels (of a labelled one, the last sample)."""
    text = await scrape_text(where)
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def ext(conn: Connection) -> extension_ui_pb2_grpc.ExtensionUiServiceStub:
    """The ExtensionUiService stub on `conn`'s channel (which carries the session metadata)."""
    return extension_ui_pb2_grpc.ExtensionUiServiceStub(conn.channel)


def clean_env(tmp: Path | None = None, /, **extra: str) -> dict[str, str]:
    """The environment for a child process that must see only what its test gives it: without this
    session's venv or import path (VIRTUAL_ENV, PYTHONPATH, PYTHONHOME) or UIBUS_* settings; with
    `tmp`, uibus's state directory (XDG_STATE_HOME) in it rather than the user's; then `extra`."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("UIBUS_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1")
    if tmp is not None:
        env["XDG_STATE_HOME"] = str(tmp / "state")
    env.update(extra)
    return env
