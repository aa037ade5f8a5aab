"""python -m bench.mcp [N]: the per-request cost of `/mcp` in its two eras, against one server, in the
same run — today's (2025-11-25: `initialize` once, then each call with its `Mcp-Session-Id`) and the
stateless era (2026-07-28: no handshake, each request carrying its `_meta` envelope and the
routing headers the server checks). N rounds (default 2000) of `tools/list` and of `tools/call`
`notify_user` (a call that runs the pipeline and the domain without waiting for anyone), one
keep-alive HTTP client, requests interleaved era by era so both see the same machine. Prints the
median and p90 of each and the ratio modern / today; the handshake is not counted there (a
client pays it once per connection today, never in the new era), and is in a last line: a client
that connects for one call.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx

from uibus.app import App
from uibus.infra.config import Config

MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}


def _stats(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.9)]


async def main(n: int) -> None:
    d = tempfile.mkdtemp()
    with socket.socket() as probe:  # a free port for the HTTP side (0 turns it off)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = App(Config(host="127.0.0.1", port=0, http_port=port, store=f"{d}/u.db"))
    await app.start()
    url = f"http://127.0.0.1:{app.http_port}/mcp"
    base = {"content-type": "application/json", "accept": "application/json", "x-uibus-session": "bench"}
    async with httpx.AsyncClient(timeout=30) as http:
        init = await http.post(url, headers=base, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})
        legacy = {**base, "mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
        calls: dict[str, tuple[dict[str, Any], str | None]] = {
            "tools/list": ({}, None), "tools/call": ({"name": "notify_user", "arguments": {"message": "hi"}},
                                                    "notify_user")}
        times: dict[tuple[str, str], list[float]] = {}
        for i in range(n + 50):  # the first 50 rounds warm up
            for method, (params, name) in calls.items():
                modern = {**base, "mcp-protocol-version": MODERN, "mcp-method": method,
                          **({"mcp-name": name} if name else {})}
                for era, headers, body in (
                        ("2025-11-25", legacy, {"jsonrpc": "2.0", "id": i, "method": method, "params": params}),
                        (MODERN, modern, {"jsonrpc": "2.0", "id": i, "method": method,
                                          "params": {**params, "_meta": META}})):
                    t = time.perf_counter()
                    answer = await http.post(url, headers=headers, json=body)
                    spent = (time.perf_counter() - t) * 1e6
                    assert answer.status_code == 200 and "result" in answer.json(), answer.text
                    if i >= 50:
                        times.setdefault((method, era), []).append(spent)
        # A client that connects for one call (a CLI, a serverless function): today it pays the
        # handshake (initialize, notifications/initialized) each time; the new era sends the call alone.
        once: dict[str, list[float]] = {"2025-11-25": [], MODERN: []}
        call = {"name": "notify_user", "arguments": {"message": "hi"}}
        for i in range(n // 4 + 10):
            t = time.perf_counter()
            init = await http.post(url, headers=base, json={"jsonrpc": "2.0", "id": 0, "method": "initialize",
                                                            "params": {"protocolVersion": "2025-11-25",
                                                                       "capabilities": {}}})
            session = {**base, "mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
            await http.post(url, headers=session, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
            await http.post(url, headers=session, json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                        "params": call})
            spent_today = (time.perf_counter() - t) * 1e6
            t = time.perf_counter()
            await http.post(url, headers={**base, "mcp-protocol-version": MODERN, "mcp-method": "tools/call",
                                          "mcp-name": "notify_user"},
                            json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {**call, "_meta": META}})
            spent_new = (time.perf_counter() - t) * 1e6
            if i >= 10:
                once["2025-11-25"].append(spent_today)
                once[MODERN].append(spent_new)
    for method in calls:
        today, p90_today = _stats(times[(method, "2025-11-25")])
        new, p90_new = _stats(times[(method, MODERN)])
        print(f"{method:11s} 2025-11-25 median={today:7.0f} us p90={p90_today:7.0f} us | {MODERN} median={new:7.0f} us "
              f"p90={p90_new:7.0f} us | ratio modern/today={new / today:.2f}x")
    today, _ = _stats(once["2025-11-25"])
    new, _ = _stats(once[MODERN])
    print(f"one call from a new client: 2025-11-25 (initialize + initialized + call) median={today:7.0f} us | "
          f"{MODERN} (the call) median={new:7.0f} us | ratio modern/today={new / today:.2f}x")
    await app.aclose(grace=0.5)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
