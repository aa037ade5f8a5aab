"""The one JSON-RPC core (uibus.infra.peer.Peer), by itself: two peers talking JSON lines over a
real socket pair, each with its own receive loop. Request and response, an error answer, a timeout,
the peer's cancel of a request it sent, the end failing what is outstanding and joining what runs,
a caller's cancel propagating — and every count back to zero afterwards."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from uibus.infra.jsonrpc import (
    CANCEL_REQUEST,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_CANCELLED,
    RpcError,
    dump,
)
from uibus.infra.peer import Method, Peer
from uibus.infra.tasks import Tasks


class Line:
    """One end of a socket pair as a JSON-lines framing (what `uibus acp` speaks on stdio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.sent: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self.writer.write(dump(message).encode() + b"\n")
        await self.writer.drain()

    async def receive(self) -> bytes | None:
        line = await self.reader.readline()
        return line or None

    async def raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


class Ends:
    def __init__(self, a: Peer, b: Peer, line_a: Line, line_b: Line, loops: Tasks) -> None:
        self.a, self.b, self.line_a, self.line_b, self.loops = a, b, line_a, line_b, loops


@asynccontextmanager
async def pair(methods: dict[str, Method], **options: Any) -> AsyncIterator[Ends]:
    """Peer `a` serves `methods`; peer `b` asks. Each runs its receive loop; closing ends both."""
    left, right = socket.socketpair()
    line_a = Line(*await asyncio.open_connection(sock=left))
    line_b = Line(*await asyncio.open_connection(sock=right))
    a = Peer(line_a.send, name="a", methods=methods, **options)
    b = Peer(line_b.send, name="b")
    async with Tasks("peer loops") as loops:
        loops.spawn(a.run(line_a.receive), name="a")
        loops.spawn(b.run(line_b.receive), name="b")
        try:
            yield Ends(a, b, line_a, line_b, loops)
        finally:
            for line in (line_a, line_b):
                line.writer.close()
            await loops.join()
    for peer in (a, b):
        assert len(peer.pending) == 0 and len(peer.incoming) == 0, peer.name  # nothing left behind


async def until(done: Callable[[], bool]) -> None:
    """Waits (bounded) for `done`: what the other end does arrives over the socket."""
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


async def add(params: dict[str, Any]) -> Any:
    if not isinstance(params.get("x"), int):
        raise RpcError(-32602, "x must be an integer")
    return {"sum": params["x"] + params.get("y", 0)}


async def test_a_request_gets_its_result_and_an_error_its_error() -> None:
    async with pair({"add": add}) as ends:
        assert await ends.b.request("add", {"x": 2, "y": 3}) == {"sum": 5}
        with pytest.raises(RpcError) as error:
            await ends.b.request("add", {"x": "two"})
        assert error.value.code == -32602 and "integer" in error.value.message
        with pytest.raises(RpcError) as missing:
            await ends.b.request("nope", {})
        assert missing.value.code == METHOD_NOT_FOUND
        assert len(ends.b.pending) == 0


async def test_concurrent_requests_are_matched_by_id() -> None:
    async def slow(params: dict[str, Any]) -> Any:
        await asyncio.sleep(params["wait"])
        return params["wait"]

    async with pair({"slow": slow}) as ends:
        results = await asyncio.gather(*(ends.b.request("slow", {"wait": w}) for w in (0.05, 0.0, 0.02)))
        assert results == [0.05, 0.0, 0.02]


async def test_a_request_times_out_and_is_forgotten() -> None:
    started = asyncio.Event()

    async def hang(params: dict[str, Any]) -> Any:
        started.set()
        await asyncio.Event().wait()

    async with pair({"hang": hang}) as ends:
        with pytest.raises(TimeoutError):
            await ends.b.request("hang", {}, timeout=0.1)
        assert started.is_set() and len(ends.b.pending) == 0
        assert len(ends.a.incoming) == 1  # still running there until its end cancels it


async def test_the_peer_withdraws_a_request_it_is_answered_cancelled() -> None:
    cancelled = asyncio.Event()

    async def hang(params: dict[str, Any]) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with pair({"hang": hang}) as ends:
        sent: list[int] = []
        asking = asyncio.ensure_future(ends.b.request("hang", {}, sent=sent.append))
        await until(lambda: len(ends.a.incoming) > 0)
        await ends.b.notify(CANCEL_REQUEST, {"requestId": sent[0]})
        with pytest.raises(RpcError) as error:
            await asking
        assert error.value.code == REQUEST_CANCELLED and cancelled.is_set()
        await until(lambda: len(ends.a.incoming) == 0)


async def test_withdrawing_our_request_tells_the_peer() -> None:
    cancelled = asyncio.Event()

    async def hang(params: dict[str, Any]) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with pair({"hang": hang}) as ends:
        sent: list[int] = []
        asking = asyncio.ensure_future(ends.b.request("hang", {}, sent=sent.append))
        await until(lambda: bool(sent) and len(ends.a.incoming) > 0)
        await ends.b.withdraw(sent[0], "not needed any more")
        with pytest.raises(RpcError) as error:
            await asking
        assert error.value.code == REQUEST_CANCELLED and error.value.message == "not needed any more"
        await asyncio.wait_for(cancelled.wait(), 5)  # the peer stopped working on it


async def test_the_end_fails_what_is_outstanding_and_joins_what_runs() -> None:
    cancelled = asyncio.Event()

    async def hang(params: dict[str, Any]) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with pair({"hang": hang}) as ends:
        asking = asyncio.ensure_future(ends.b.request("hang", {}))
        await until(lambda: len(ends.a.incoming) > 0)
        ends.line_a.writer.close()  # a's side of the wire goes: both framings end
        with pytest.raises(RpcError) as error:
            await asking
        assert error.value.code == INTERNAL_ERROR and "ended" in error.value.message
        await ends.loops.join()
        assert cancelled.is_set() and len(ends.a.incoming) == 0 and ends.a.ended and ends.b.ended
        with pytest.raises(RpcError):  # nothing starts behind the end
            await ends.b.request("hang", {}, timeout=1)


async def test_a_cancel_of_the_caller_propagates() -> None:
    async def hang(params: dict[str, Any]) -> Any:
        await asyncio.Event().wait()

    async with pair({"hang": hang}) as ends:
        asking = asyncio.ensure_future(ends.b.request("hang", {}))
        await until(lambda: len(ends.b.pending) > 0)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        assert len(ends.b.pending) == 0


async def test_what_is_no_message_is_answered_and_changes_nothing() -> None:
    async with pair({"add": add}) as ends:
        await ends.line_b.raw(b'{"jsonrpc": "2.0", "id": 1, "method": \n')
        await ends.line_b.raw(b'{"id": 2, "method": "add"}\n')
        await ends.line_b.raw(b'{"jsonrpc": "2.0", "id": 9, "result": {}}\n')  # an answer to nothing
        assert await ends.b.request("add", {"x": 1}) == {"sum": 1}
        codes = [m["error"]["code"] for m in ends.line_a.sent if "error" in m]
        assert codes == [PARSE_ERROR, INVALID_REQUEST]
        assert ends.line_a.sent[1]["id"] == 2  # a sound id is answered with


async def test_requests_beyond_the_bound_are_refused_at_once() -> None:
    release = asyncio.Event()

    async def hold(params: dict[str, Any]) -> Any:
        await release.wait()
        return "done"

    async with pair({"hold": hold}, max_running=2) as ends:
        held = [asyncio.ensure_future(ends.b.request("hold", {})) for _ in range(2)]
        await until(lambda: len(ends.a.incoming) >= 2)
        with pytest.raises(RpcError) as error:
            await ends.b.request("hold", {})
        assert error.value.code == INVALID_REQUEST and "2 requests" in error.value.message
        release.set()
        assert await asyncio.gather(*held) == ["done", "done"]


async def test_notifications_reach_their_handler() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with pair({}, notified=lambda method, params: seen.append((method, params))) as ends:
        await ends.b.notify("session/cancel", {"sessionId": "s"})
        await ends.b.notify(CANCEL_REQUEST, {"requestId": 41})  # a cancel of nothing running: no handler call
        await until(lambda: bool(seen))
        assert seen == [("session/cancel", {"sessionId": "s"})]
