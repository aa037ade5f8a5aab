"""Resuming the JSON-RPC doors' streams (docs/streams/resume.md), against a real uibus on loopback:

* `/mcp`: the MCP TypeScript SDK's own client (tests/acp/mcp-resume.mjs, unmodified SDK) loses a
  tool call's event stream (its process is killed), the call goes on publishing, and a new client
  of the same MCP session resumes with the SDK's `resumptionToken` (GET + Last-Event-ID): exactly
  the missed progress, once, in order, then the result. A too-old id and an unknown one are told.
* `/acp` over HTTP: GET with Last-Event-ID gives exactly the events after it on that stream.
* ACP `session/resume` from a cursor (`_meta` `uibus/since`), with the ACP SDK's client app
  (tests/acp/editor.mjs): exactly the log's events after the cursor, then live; a cursor below the
  log's floor gets `uibus/gap` and the history whole.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.acpkit import need, prompt, seqs_of
from tests.conftest import REPO, free_port, running, wait_for
from tests.test_acp_serve import CWD, editor
from uibus.app import App
from uibus.app.installers import MCP
from uibus.infra.config import Config

pytestmark = pytest.mark.timeout(120)
SCRIPT = REPO / "tests" / "acp" / "mcp-resume.mjs"


@pytest.fixture
async def app(config: Config) -> AsyncIterator[App]:
    async with running(replace(config, http_port=free_port())) as app:
        yield app


def _gauge(app: App, name: str) -> float:
    for line in app.metrics.render().decode().splitlines():  # type: ignore[union-attr]
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no gauge {name}")


class Node:
    """One run of mcp-resume.mjs and the JSON lines it printed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, *args: str) -> Node:
        proc = await asyncio.create_subprocess_exec(shutil.which("node") or "node", str(SCRIPT), *args,
                                                    cwd=SCRIPT.parent, stdout=asyncio.subprocess.PIPE)
        return cls(proc)

    async def until(self, predicate: Any, timeout: float = 30) -> None:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while not predicate(self.lines):
                line = await self.proc.stdout.readline()
                assert line, f"the client ended first: {self.lines[-8:]}"
                self.lines.append(json.loads(line))

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [x for x in self.lines if x["ev"] == ev]


@pytest.mark.node
async def test_mcp_ts_sdk_resumes_a_tool_calls_stream_with_its_resumption_token(app: App) -> None:
    need("@modelcontextprotocol/sdk")
    url = f"http://127.0.0.1:{app.http_port}/mcp"
    headers = json.dumps({"x-uibus-session": "mcp-resume"})
    args = json.dumps({"user_message": {"type": "HUMAN", "text": "resume me please"},
                       "sly_data": {"chunks": 30, "delay_ms": 60}})
    first = await Node.start("call", url, headers, "hello_world", args)
    await first.until(lambda lines: sum(x["ev"] == "progress" for x in lines) >= 5)
    first.proc.kill()  # the client is gone mid-stream, as a crashed editor or a cut network
    await first.proc.wait()
    session = first.of("session")[0]["id"]
    token = first.of("token")[-1]["token"]
    name, _, seen = token.rpartition(".")
    stream = app[MCP].streams[name].stream
    await wait_for(lambda: stream.ids.last >= int(seen) + 5, 5, what="events published while nobody reads")
    assert _gauge(app, "uibus_mcp_calls_in_flight") == 1  # a broken stream is not a cancellation

    second = await Node.start("resume", url, headers, "hello_world", args, session, token, "1")
    await second.until(lambda lines: lines[-1:] != [] and lines[-1]["ev"] in ("result", "error"))
    assert (await second.proc.wait()) == 0
    assert second.lines[-1]["ev"] == "result", second.lines
    text = second.lines[-1]["result"]["content"][0]["text"]
    before, after = first.of("progress"), second.of("progress")
    assert after and after[0]["progress"] == before[-1]["progress"] + 1  # resumed right after what it had
    numbers = [p["progress"] for p in before + after]
    assert numbers == list(range(1, 31))  # every piece once, in order
    assert "".join(p["message"] for p in before + after) == text
    assert 'You said: "resume me please"' in text
    await wait_for(lambda: _gauge(app, "uibus_mcp_calls_in_flight") == 0, 5, what="the call ended")


class Cuttable:
    """A TCP proxy in front of uibus whose connections can be cut (as a network drops them); new
    connections go through, as after the network is back."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.links: set[asyncio.StreamWriter] = set()
        self.requests: list[bytes] = []  # the first bytes of every connection (its request line, headers)
        self.tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Cuttable:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()
        self.cut()
        await self.server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.links |= {writer, up_writer}
        first = [True]

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
            try:
                while data := await src.read(65536):
                    if upstream and first[0]:
                        self.requests.append(data)
                        first[0] = False
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer, True), copy(up_reader, writer, False))
        self.links -= {writer, up_writer}

    def cut(self) -> None:
        for writer in list(self.links):
            writer.transport.abort()


@pytest.mark.node
async def test_mcp_ts_sdk_reconnects_by_itself_after_the_network_dropped_its_stream(app: App) -> None:
    """The SDK's own reconnection (no token handling by the caller): the connection is cut mid-stream,
    the call goes on, and the transport's GET with Last-Event-ID gets the rest, each piece once."""
    need("@modelcontextprotocol/sdk")
    async with Cuttable(app.http_port) as proxy:
        url = f"http://127.0.0.1:{proxy.port}/mcp"
        args = json.dumps({"user_message": {"type": "HUMAN", "text": "through a bad network"},
                           "sly_data": {"chunks": 30, "delay_ms": 50}})
        proc = await asyncio.create_subprocess_exec(
            shutil.which("node") or "node", str(SCRIPT), "call", url, json.dumps({"x-uibus-session": "mcp-cut"}),
            "hello_world", args, cwd=SCRIPT.parent, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "MCP_RETRIES": "3"})
        client = Node(proc)
        try:
            await client.until(lambda lines: sum(x["ev"] == "progress" for x in lines) >= 4)
            proxy.cut()  # the network drops every connection; the call goes on publishing
            await client.until(lambda lines: lines[-1]["ev"] in ("result", "error"))
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    assert client.lines[-1]["ev"] == "result", client.lines
    assert [p["progress"] for p in client.of("progress")] == list(range(1, 31))  # each once, in order
    text = client.lines[-1]["result"]["content"][0]["text"]
    assert "".join(p["message"] for p in client.of("progress")) == text
    resumed = [r for r in proxy.requests if b"\r\nlast-event-id: " in r.lower()]  # (a new connection: all were cut)
    assert len(resumed) == 1 and resumed[0].startswith(b"GET /mcp "), proxy.requests
    await wait_for(lambda: _gauge(app, "uibus_mcp_calls_in_flight") == 0, 5, what="the call ended")


async def _open_stream(http: httpx.AsyncClient, url: str, headers: dict[str, str], ident: int,
                       chunks: int = 20, delay_ms: int = 40) -> tuple[Any, Any]:
    body = {"jsonrpc": "2.0", "id": ident, "method": "tools/call", "params": {
        "name": "hello_world", "arguments": {"user_message": {"type": "HUMAN", "text": "edges"},
                                             "sly_data": {"chunks": chunks, "delay_ms": delay_ms}},
        "_meta": {"progressToken": f"p{ident}"}}}
    r = http.stream("POST", url, json=body, headers={**headers, "accept": "application/json, text/event-stream"})
    response = await r.__aenter__()
    return r, response


async def _events(lines: Any, n: int) -> list[tuple[str, str]]:
    """The next `n` events (id, data) of an SSE body's lines."""
    out: list[tuple[str, str]] = []
    ident = ""
    while len(out) < n:
        line = await asyncio.wait_for(anext(lines), 10)
        if line.startswith("id: "):
            ident = line[4:]
        elif line.startswith("data: "):
            out.append((ident, line[6:]))
    return out


async def test_mcp_resume_edges_are_answered_never_a_silent_hole(app: App) -> None:
    url = f"http://127.0.0.1:{app.http_port}/mcp"
    async with httpx.AsyncClient(timeout=10) as http:
        init = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}}})
        headers = {"mcp-session-id": init.headers["mcp-session-id"], "x-uibus-session": "mcp-edges"}
        # GET without Last-Event-ID: uibus sends nothing unasked
        assert (await http.get(url, headers={**headers, "accept": "text/event-stream"})).status_code == 405
        # a resume straight after the priming event, then from the middle: exactly what follows, once
        r, response = await _open_stream(http, url, headers, 2)
        got = await _events(response.aiter_lines(), 4)  # the priming event and three pieces
        await r.__aexit__(None, None, None)
        assert got[0][1] == "" and [json.loads(d)["params"]["progress"] for _, d in got[1:]] == [1, 2, 3]
        async with http.stream("GET", url, headers={**headers, "last-event-id": got[2][0],
                                                    "accept": "text/event-stream"}) as resumed:
            assert resumed.status_code == 200
            rest = [json.loads(d) for _, d in await _events(resumed.aiter_lines(), 19)]
        assert [m["params"]["progress"] for m in rest[:-1]] == list(range(3, 21))  # after piece 2, each once
        assert rest[-1]["id"] == 2 and "result" in rest[-1]
        # the same stream again from an id it never gave, another session's, no stream at all: 404
        for bad in (f"{got[0][0].rpartition('.')[0]}.99", got[1][0], "nope.1"):
            other = headers if bad != got[1][0] else {**headers, "mcp-session-id": "someone-else"}
            answer = await http.get(url, headers={**other, "last-event-id": bad, "accept": "text/event-stream"})
            assert answer.status_code == 404, (bad, answer.text)
            assert answer.json()["error"]["data"]["status"] == "NOT_FOUND"
        # an id older than the replay log keeps: the call's DATA_LOSS error, and the call is cancelled
        app[MCP].replay_bytes = 600
        r, response = await _open_stream(http, url, headers, 3, chunks=40, delay_ms=30)
        got = await _events(response.aiter_lines(), 12)
        await r.__aexit__(None, None, None)
        too_old = await http.get(url, headers={**headers, "last-event-id": got[1][0], "accept": "text/event-stream"})
        assert too_old.status_code == 200
        error = json.loads(too_old.text.split("data: ", 1)[1])
        assert error["id"] == 3 and error["error"]["data"]["status"] == "DATA_LOSS"
        assert "no longer kept" in error["error"]["message"]
        await wait_for(lambda: _gauge(app, "uibus_mcp_calls_in_flight") == 0, 5, what="the too-old call cancelled")
        # nobody resumes: the call is cancelled once the wait is over, as a client that left
        app[MCP].resume_s = 0.3
        r, response = await _open_stream(http, url, headers, 4, chunks=100, delay_ms=50)
        await _events(response.aiter_lines(), 2)
        await r.__aexit__(None, None, None)
        assert _gauge(app, "uibus_mcp_calls_in_flight") == 1
        await wait_for(lambda: _gauge(app, "uibus_mcp_calls_in_flight") == 0, 3, what="the abandoned call cancelled")
        # ended streams are kept resume_s for a late resume, then forgotten with their replay logs
        await asyncio.sleep(0.4)
        assert (await http.post(url, json={"jsonrpc": "2.0", "id": 9, "method": "ping"}, headers=headers)).is_success
        assert app[MCP].streams == {} and app[MCP].replay.used == 0 and not app[MCP].replay.queues


async def test_acp_over_http_resumes_a_stream_from_last_event_id(app: App) -> None:
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as http:
        opened = await http.post("/acp", json=init)
        conn = {"Acp-Connection-Id": opened.headers["acp-connection-id"]}
        listing = {"jsonrpc": "2.0", "method": "session/list", "params": {}}
        sse = {**conn, "Accept": "text/event-stream"}
        async with http.stream("GET", "/acp", headers=sse) as events:
            for i in (10, 11, 12):
                assert (await http.post("/acp", json={**listing, "id": i}, headers=conn)).status_code == 202
            first = await _events(events.aiter_lines(), 3)
        assert [json.loads(d)["id"] for _, d in first] == [10, 11, 12]
        for i in (13, 14, 15):  # published while nobody reads
            assert (await http.post("/acp", json={**listing, "id": i}, headers=conn)).status_code == 202
        async with http.stream("GET", "/acp", headers={**sse, "Last-Event-ID": first[1][0]}) as events:
            lines = events.aiter_lines()
            replayed = await _events(lines, 4)
            assert (await http.post("/acp", json={**listing, "id": 16}, headers=conn)).status_code == 202
            live = await _events(lines, 1)
        assert [json.loads(d)["id"] for _, d in replayed + live] == [12, 13, 14, 15, 16]  # once, in order, then live
        assert [int(i) for i, _ in replayed + live] == list(range(int(first[1][0]) + 1, int(first[1][0]) + 6))
        # an id the stream never gave: 404; older than its replay log keeps: 410
        unknown = await http.get("/acp", headers={**sse, "Last-Event-ID": "999"})
        assert unknown.status_code == 404 and "not an event of this stream" in unknown.text
        new = {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}}
        async with http.stream("GET", "/acp", headers=sse) as events:
            assert (await http.post("/acp", json=new, headers=conn)).status_code == 202
            session = json.loads((await _events(events.aiter_lines(), 1))[0][1])["result"]["sessionId"]
        on_session = {**conn, "Acp-Session-Id": session}
        async with http.stream("GET", "/acp", headers={**on_session, "Accept": "text/event-stream"}) as events:
            lines = events.aiter_lines()
            for i in (20, 21):  # two replies of ~700 KB: more than a stream's replay log keeps
                prompt = {"jsonrpc": "2.0", "id": i, "method": "session/prompt", "params": {
                    "sessionId": session, "prompt": [{"type": "text", "text": "y" * 700_000}]}}
                assert (await http.post("/acp", json=prompt, headers=on_session)).status_code == 202
                while not any(json.loads(d).get("id") == i for _, d in await _events(lines, 1)):
                    pass
        gone = await http.get("/acp", headers={**on_session, "Accept": "text/event-stream", "Last-Event-ID": "1"})
        assert gone.status_code == 410 and "no longer kept" in gone.text and "uibus/since" in gone.text


@pytest.mark.node
async def test_acp_session_resume_from_a_cursor_replays_exactly_what_followed_then_live(config: Config) -> None:
    need("@agentclientprotocol/sdk")
    async with running(replace(config, http_port=free_port(), log_max_events=6)) as app:
        url = f"ws://127.0.0.1:{app.http_port}/acp"
        one, other = await editor("ws", url), await editor("ws", url)
        later = None
        try:
            for ed in (one, other):
                await ed.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            session = (await one.call("session/new", {"cwd": CWD, "mcpServers": []}))["sessionId"]
            assert await other.call("session/resume", {"sessionId": session, "cwd": CWD, "mcpServers": []}) == {}
            answered = await one.answer_of(one.start("session/prompt", prompt(session, "first")))
            cursor = answered["meta"]["uibus/seq"]  # how far the log came with the editor's own turn
            await other.until(lambda _: "first" in other.text(session), 10, "the turn at the other editor")
            seen = [s for s in seqs_of(other, session) if s is not None]  # another UI's turn: from the log, stamped
            assert seen and seen == sorted(seen) and max(seen) <= cursor
            await one.close()  # the editor goes away; the session goes on without it
            mark = len(other.events)
            await other.call("session/prompt", prompt(session, "second"))
            missed = other.text(session, start=mark)
            assert 'You said: "second"' in missed

            later = await editor("ws", url)  # the editor again, on a new connection, with its cursor
            await later.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            resume = {"sessionId": session, "cwd": CWD, "mcpServers": [], "_meta": {"uibus/since": cursor}}
            answer = await later.answer_of(later.start("session/resume", resume))
            assert answer["ev"] == "response" and "uibus/gap" not in answer.get("meta", {}), answer
            assert later.text(session) == missed  # exactly what followed the cursor, once: nothing of "first"
            seqs = seqs_of(later, session)
            assert seqs and None not in seqs and seqs == sorted(seqs) and min(seqs) > cursor  # type: ignore
            assert answer["meta"]["uibus/seq"] == max(seqs)  # type: ignore[type-var]
            mark = len(later.events)
            await other.call("session/prompt", prompt(session, "third"))  # then live, on the same subscription
            await later.until(lambda _: 'You said: "third"' in later.text(session, start=mark), 10, "live")
            live = seqs_of(later, session, mark)
            assert None not in live and min(live) > max(seqs)  # type: ignore

            # a cursor below the log's floor (6 entries kept): the gap said, and the recent history whole
            for text in ("fourth", "fifth", "sixth"):
                await other.call("session/prompt", prompt(session, text))
            await later.call("session/close", {"sessionId": session})
            mark = len(later.events)
            answer = await later.answer_of(later.start("session/resume", resume))
            assert answer["ev"] == "response" and answer["meta"]["uibus/gap"] is True, answer
            assert 'You said: "sixth"' in later.text(session, start=mark)
            # a cursor that is no seq, a replayFrom uibus does not offer: -32602, never resumed without it
            for bad in ({"_meta": {"uibus/since": -1}}, {"replayFrom": {"type": "_elsewhere"}}):
                code, _ = await later.fails("session/resume", {**resume, "_meta": {}, **bad})
                assert code == -32602, bad
            # the v2 draft's replayFrom start: all the log keeps
            mark = len(later.events)
            start = {**resume, "_meta": {}, "replayFrom": {"type": "start"}}
            assert (await later.answer_of(later.start("session/resume", start)))["ev"] == "response"
            assert 'You said: "sixth"' in later.text(session, start=mark)
        finally:
            for ed in (one, other, later):
                if ed is not None and ed.proc.returncode is None:
                    await ed.close()
        await wait_for(lambda: app.core.bus.count() == 0, 10, what="every editor's subscriptions ended")


async def test_replay_logs_are_bounded_per_stream_and_per_group_oldest_first() -> None:
    """The SSE writer's replay log (uibus.edge.transports.sse): each stream keeps at most its own bound, a
    group of streams (a connection's, /mcp's) at most the group's, the oldest streams' events going
    first; what is resumed past the log is TooOld, and an event taken but not delivered is never lost."""
    from uibus.edge.transports import sse

    group = sse.Replay(600)
    old, new = sse.Queue(sse.Budget(10_000), "old", 600, group), sse.Queue(sse.Budget(10_000), "new", 600, group)
    for queue in (old, new):
        for _ in range(5):
            queue.push(b"x" * 90)  # 108 bytes framed
            assert await queue.take(0) is not None
    assert group.used <= 600 and old.sent_bytes + new.sent_bytes == group.used
    for _ in range(5):
        new.push(b"y" * 90)
        await new.take(0)
    assert not old.sent and new.sent_bytes <= 600 < new.sent_bytes + 110  # the old stream's log went first
    with pytest.raises(sse.TooOld):
        old.resume("old.4")
    with pytest.raises(sse.UnknownId):
        new.resume("old.4")
    new.resume(new.ident(new.floor))  # from the oldest kept: exactly what follows, in order
    again = [await new.take(0) for _ in range(len(new.queue))]
    assert [f.split(b"\n")[0] for f in again] == [b"id: new.%d" % n for n in range(new.floor + 1, 11)]
    # taken, then trimmed by another stream of the group before it was written: it waits again
    new.push(b"z")
    taken = await new.take(0)
    assert taken is not None
    while new.sent:
        new.trim_one()
    new.put_back(taken)
    assert await new.take(0) == taken and new.floor == new.ids.last - 1
    group.remove(old)
    group.remove(new)
    assert group.used == 0
