"""python -m bench.acp: what an editor attached over ACP pays to first chunk, against the same turn
over gRPC.

Starts ONE `uibus serve` (loopback, a tmp store) whose agent is the local backend with no delay
(its reply's first piece is ready at once, so what is measured is the way in, not the agent), then
runs --turns turns, one at a time, each way:

* grpc: neuro-san StreamingChat (MAXIMAL) on a grpc.aio channel, as `uibus chat` does: from the
  call to its first AI piece;
* acp-stdio: `uibus acp --agent local` spawned as an editor spawns it, spoken to with JSON-RPC
  lines on its stdio: from writing `session/prompt` to reading the first `agent_message_chunk`
  (the gRPC call above plus `uibus acp`'s process hop and its JSON framing);
* acp-ws: `/acp` on the HTTP port over a WebSocket (the in-process channel, no second process);
* acp-http: `/acp` over ACP's Streamable HTTP (each message a POST, what uibus says on SSE streams
  of the connection and of the session), the same in-process channel.

Prints median, p90 and mean per way, and the medians' difference to grpc (the added latency), to
the first chunk and to the end of the turn (an ACP prompt answers once the session's feed has
shown the turn's last message, so no update of it can arrive after the answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import websockets

from bench.run import ROOT, free_port
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2

_AI = chat_pb2.ChatMessage.AI


async def _wait_ready(port: int, deadline_s: float = 30) -> None:
    end = time.monotonic() + deadline_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        while True:
            try:
                await asyncio.wait_for(channel.channel_ready(), 1)
                return
            except TimeoutError:
                if time.monotonic() > end:
                    raise SystemExit("uibus serve did not start") from None


async def over_grpc(port: int, turns: int) -> list[tuple[float, float]]:
    out = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/local.AgentService/StreamingChat",
                                    request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                    response_deserializer=agent_pb2.ChatResponse.FromString)
        for i in range(turns):
            request = agent_pb2.ChatRequest(
                user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=f"turn {i}"),
                chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
            start, first = time.perf_counter(), None
            async for response in call(request, metadata=(("x-uibus-session", "bench-grpc"),)):
                if first is None and response.response.type == _AI:
                    first = time.perf_counter() - start
            assert first is not None
            out.append((first, time.perf_counter() - start))
    return out


class _Lines:
    """JSON-RPC over a line pipe (stdio of `uibus acp`) or a WebSocket, the editor's side."""

    def __init__(self, send: Any, recv: Any) -> None:
        self.send, self.recv, self.ident = send, recv, 0

    async def call(self, method: str, params: dict[str, Any]) -> tuple[Any, float | None, float]:
        """The result, the seconds to the first agent_message_chunk (None if there was none) and
        to the answer."""
        self.ident += 1
        start, first = time.perf_counter(), None
        await self.send(json.dumps({"jsonrpc": "2.0", "id": self.ident, "method": method, "params": params}))
        while True:
            message = json.loads(await self.recv())
            if message.get("id") == self.ident and "method" not in message:
                if "error" in message:
                    raise SystemExit(f"{method}: {message['error']}")
                return message["result"], first, time.perf_counter() - start
            update = (message.get("params") or {}).get("update") or {}
            if first is None and update.get("sessionUpdate") == "agent_message_chunk":
                first = time.perf_counter() - start

    async def turns(self, turns: int) -> list[tuple[float, float]]:
        await self.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        session = (await self.call("session/new", {"cwd": "/", "mcpServers": []}))[0]["sessionId"]
        out = []
        for i in range(turns):
            _, first, whole = await self.call("session/prompt", {"sessionId": session,
                                                          "prompt": [{"type": "text", "text": f"turn {i}"}]})
            assert first is not None
            out.append((first, whole))
        return out


async def over_stdio(port: int, turns: int) -> list[tuple[float, float]]:
    uibus = str(Path(sys.executable).parent / "uibus")
    proc = await asyncio.create_subprocess_exec(uibus, "acp", "--agent", "local", "--target", f"127.0.0.1:{port}",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    async def send(line: str) -> None:
        stdin.write(line.encode() + b"\n")
        await stdin.drain()

    try:
        return await _Lines(send, stdout.readline).turns(turns)
    finally:
        stdin.close()
        await proc.wait()


async def over_ws(http_port: int, turns: int) -> list[tuple[float, float]]:
    async with websockets.connect(f"ws://127.0.0.1:{http_port}/acp?agent=local", max_size=None) as ws:
        return await _Lines(ws.send, ws.recv).turns(turns)


async def over_http(http_port: int, turns: int) -> list[tuple[float, float]]:
    url = f"http://127.0.0.1:{http_port}/acp?agent=local"
    inbox: asyncio.Queue[str] = asyncio.Queue()
    readers: dict[str, asyncio.Task[None]] = {}  # "" the connection's stream, else a session's
    async with httpx.AsyncClient(timeout=None) as http:
        headers = {"content-type": "application/json"}

        async def read(session: str) -> None:
            more = {"acp-session-id": session} if session else {}
            async with http.stream("GET", url, headers={**headers, "accept": "text/event-stream", **more}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        await inbox.put(line[6:])

        async def send(text: str) -> None:
            if "acp-connection-id" not in headers:  # initialize: answered by its POST, naming the connection
                r = await http.post(url, content=text, headers=headers)
                headers["acp-connection-id"] = r.headers["acp-connection-id"]
                readers[""] = asyncio.create_task(read(""))
                await inbox.put(r.text)
                return
            session = (json.loads(text).get("params") or {}).get("sessionId")
            if session and session not in readers:
                readers[session] = asyncio.create_task(read(session))
            more = {"acp-session-id": session} if session else {}
            r = await http.post(url, content=text, headers={**headers, **more})
            assert r.status_code == 202, r.text

        try:
            return await _Lines(send, inbox.get).turns(turns)
        finally:
            for task in readers.values():
                task.cancel()
            await asyncio.gather(*readers.values(), return_exceptions=True)
            await http.delete(url, headers=headers)


def _row(name: str, values: list[float], base: float | None) -> str:
    ms = sorted(v * 1000 for v in values)
    median, p90, mean = statistics.median(ms), ms[int(len(ms) * 0.9) - 1], statistics.fmean(ms)
    added = "" if base is None else f"{median - base:+8.2f}"
    return f"{name:<10} {median:8.2f} {p90:8.2f} {mean:8.2f} {added}"


async def main(turns: int, warmup: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        agents = Path(tmp) / "agents.json"
        agents.write_text(json.dumps({"agents": [{"name": "local", "backend": "local",
                                                  "options": {"delay_ms": 0, "chunks": 8}}]}))
        port, http_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port",
               str(http_port), "--store", str(Path(tmp) / "uibus.db"), "--agents", str(agents),
               "--log-level", "WARNING"]
        server = subprocess.Popen(cmd, cwd=ROOT)
        try:
            await _wait_ready(port)
            await asyncio.sleep(0.5)
            results: dict[str, list[tuple[float, float]]] = {}
            for name, way, where in (("grpc", over_grpc, port), ("acp-stdio", over_stdio, port),
                                     ("acp-ws", over_ws, http_port), ("acp-http", over_http, http_port)):
                await way(where, warmup)  # type: ignore[operator]
                results[name] = await way(where, turns)  # type: ignore[operator]
        finally:
            server.terminate()
            server.wait(15)
    for column, what in ((0, "first agent_message_chunk / AI piece"), (1, "the prompt's answer / the call's end")):
        print(f"time to {what}, {turns} turns each (ms)")
        print(f"{'way':<10} {'median':>8} {'p90':>8} {'mean':>8} {'added':>8}")
        base = statistics.median(v[column] * 1000 for v in results["grpc"])
        for name, values in results.items():
            print(_row(name, [v[column] for v in values], None if name == "grpc" else base))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    ns = parser.parse_args()
    asyncio.run(main(ns.turns, ns.warmup))
