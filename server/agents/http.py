"""The HTTP client side of the backends that call other servers (aiohttp).

One `ClientSession` per backend, made lazily inside the running loop and closed at shutdown, so
connections are pooled across turns. `open_stream` is the cancel-safe way to read a streamed
body: when the turn is cancelled (client gone) or closed, the response is closed rather than
released, which drops the connection at once — the upstream sees the disconnect and stops
generating instead of talking to a pooled socket nobody reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from uibus.agents import AgentError
from uibus.infra.errors import InvalidArgument
from uibus.infra.json_input import load_json
from uibus.infra.telemetry.spans import http_request

MAX_ERROR_BODY = 2_000


class HttpClient:
    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, raise_for_status=False)
        return self._session

    @asynccontextmanager
    async def open_stream(self, url: str, body: Any, headers: dict[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """POSTs JSON and yields the response once its status is 2xx; AgentError otherwise."""
        async with http_request(url, headers := dict(headers)) as span:  # traceparent added when traced
            try:
                resp = await self.session().post(url, json=body, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise AgentError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
            if span is not None:
                span.set_attribute("http.response.status_code", resp.status)
            try:
                if resp.status // 100 != 2:
                    text = (await resp.text(errors="replace"))[:MAX_ERROR_BODY]
                    raise AgentError(f"{url} answered HTTP {resp.status}: {text.strip() or resp.reason}")
                yield resp
            except BaseException:
                resp.close()  # drop the connection: never hand a half-read stream back to the pool
                raise
            else:
                resp.release()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines without line ends, as they arrive; read errors become AgentError."""
    try:
        async for raw in resp.content:
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AgentError(f"the stream from {resp.url} broke off: {exc or type(exc).__name__}") from exc


def json_object(source: str, text: str, what: str) -> dict[str, Any]:
    """One JSON object from an upstream stream (a JSON line, an SSE `data:` payload); anything
    else is an AgentError naming the upstream and showing the start of what it sent."""
    try:
        data = load_json(text, what)
    except InvalidArgument as exc:
        raise AgentError(f"{source} sent {'an' if what[0] in 'aeiou' else 'a'} {what} that is not JSON: "
                         f"{text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise AgentError(f"{source} sent an unexpected {what}: {text[:200]!r}")
    return data
