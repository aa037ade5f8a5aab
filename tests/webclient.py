"""A small gRPC-Web client for tests: real HTTP (httpx), frames parsed by hand, arrival times kept.

It is deliberately independent of the server's adapter code, so the tests check the wire format
rather than the adapter against itself.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import unquote

import httpx


def frame(payload: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(payload)) + payload


@dataclass
class Reply:
    http_status: int
    headers: httpx.Headers
    messages: list[bytes] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each message
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> int:
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        assert value is not None, f"no grpc-status in trailers {self.trailers} or headers {dict(self.headers)}"
        return int(value)

    @property
    def message(self) -> str:
        return unquote(self.trailers.get("grpc-message", self.headers.get("grpc-message", "")))


class FrameReader:
    """Incremental decoder of a (binary or base64 text) gRPC-Web response body."""

    def __init__(self, text: bool) -> None:
        self.text = text
        self.raw = b""
        self.pending_b64 = b""

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        if self.text:
            data = self.pending_b64 + chunk
            cut = len(data) - len(data) % 4
            self.pending_b64 = data[cut:]
            decoded = b""
            start = 0
            # padded chunks may follow each other: decode each 4-char group run separately
            for i in range(0, cut, 4):
                if b"=" in data[i:i + 4]:
                    decoded += base64.b64decode(data[start:i + 4])
                    start = i + 4
            decoded += base64.b64decode(data[start:cut])
            self.raw += decoded
        else:
            self.raw += chunk
        out = []
        while len(self.raw) >= 5:
            flag, length = struct.unpack(">BI", self.raw[:5])
            if len(self.raw) < 5 + length:
                break
            out.append((flag, self.raw[5:5 + length]))
            self.raw = self.raw[5 + length:]
        return out


def parse_trailers(block: bytes) -> dict[str, str]:
    out = {}
    for line in block.decode().split("\r\n"):
        if line:
            k, _, v = line.partition(":")
            out[k.strip().lower()] = v.strip()
    return out


async def call_stream(client: httpx.AsyncClient, url: str, request: bytes, *, text: bool = False,
                      headers: dict[str, str] | None = None, frames: list[bytes] | None = None
                      ) -> AsyncIterator[tuple[str, object]]:
    """Yields ("headers", Reply), then ("message", bytes) per message, then ("trailers", dict)."""
    body = b"".join(frame(f) for f in (frames if frames is not None else [request]))
    ctype = "application/grpc-web-text" if text else "application/grpc-web+proto"
    if text:
        body = base64.b64encode(body)
    hdrs = {"content-type": ctype, "x-grpc-web": "1", **(headers or {})}
    async with client.stream("POST", url, content=body, headers=hdrs) as resp:
        reply = Reply(resp.status_code, resp.headers)
        yield "headers", reply
        reader = FrameReader(text)
        async for chunk in resp.aiter_raw():
            for flag, payload in reader.feed(chunk):
                if flag & 0x80:
                    reply.trailers = parse_trailers(payload)
                    yield "trailers", reply.trailers
                else:
                    reply.messages.append(payload)
                    reply.arrivals.append(time.monotonic())
                    yield "message", payload


async def call(client: httpx.AsyncClient, url: str, request: bytes = b"", **kw: object) -> Reply:
    """Runs a call to the end and returns everything it produced."""
    reply: Reply | None = None
    async for kind, value in call_stream(client, url, request, **kw):  # type: ignore[arg-type]
        if kind == "headers":
            reply = value  # type: ignore[assignment]
    assert reply is not None
    return reply
