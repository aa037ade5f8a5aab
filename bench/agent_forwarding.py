"""python -m bench.agents --forwarded: what carrying a hosted agent's turn to its owner replica costs.

Two uibus replicas (A, B) on one fresh redis-server serve the same `echo` RPC agent
(examples/rpc_echo_agent.py: small JSON lines, so uibus's own per-piece work dominates). Each caller
has its own session, whose first turn goes to A: A takes the agent's lease and runs its process.
Then, per caller count, pairs of closed-loop windows (--rounds, alternated: on a shared machine a
neighbour's load then falls on both paths alike) of MAXIMAL StreamingChat turns over the same
sessions and agent processes:

* `local`: the callers talk to A, the owner: each turn runs where it arrived;
* `forwarded`: the callers talk to B, which carries each turn to A over the bus
  (uibus.replicas.turn_forwarding) and streams A's replies back.

The figure is uibus CPU per AI piece received, both replicas' processes counted (not the agents',
not Redis's, which is printed apart), and the ratio forwarded / local per pair and its median
(the target: ≤ 1.3×).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench import procstat
from bench.agents import ECHO_AGENT, Caller, Window, chat_request, words
from bench.run import ROOT, Plan, _launch, _wait_grpc, free_port, start_redis, stop_proc, uibus_serve

AI_AGENT = "echo"


def agents_file(tmp: Path, sessions: int) -> Path:
    keep = {"idle_seconds": 3600, "start_timeout_seconds": 60, "max_processes": sessions + 2}
    path = tmp / "agents.json"
    path.write_text(json.dumps({"agents": [{
        "name": AI_AGENT, "backend": "rpc", "description": "bench agent echo",
        "options": {"command": [sys.executable, str(ECHO_AGENT)], "cwd": str(ROOT), **keep}}]}))
    return path


def start_replica(label: str, tmp: Path, agents: Path, redis_url: str) -> tuple[Any, int]:
    port = free_port()
    cmd = uibus_serve(sys.executable, ROOT, port, tmp / f"{label}.db", Plan(), "--agents", str(agents),
                      "--redis-url", redis_url)
    proc, log = _launch(label, cmd, ROOT, tmp)
    try:
        _wait_grpc(label, proc, port, cmd, log)
    except BaseException:
        stop_proc(proc)
        raise
    return proc, port


async def window(targets: list[str], sessions: list[str], text: str, n_words: int,
                 duration: float, lead: float, pids: list[int]) -> dict[str, Any]:
    req = chat_request(text, n_words)
    callers = [Caller(t, AI_AGENT, s) for t, s in zip(targets, sessions, strict=True)]
    try:
        await asyncio.gather(*(c.turn(req) for c in callers))  # warm: each path's first turn outside
        w = Window()
        w.start = time.monotonic() + lead
        w.end = w.start + duration
        loops = asyncio.gather(*(c.loop(req, w) for c in callers))
        await asyncio.sleep(max(0.0, w.start - time.monotonic()))
        t0, cpu0 = time.monotonic(), [procstat.cpu_seconds(p) for p in pids]
        await asyncio.sleep(max(0.0, w.end - time.monotonic()))
        t1, cpu1 = time.monotonic(), [procstat.cpu_seconds(p) for p in pids]
        await loops
    finally:
        for c in callers:
            await c.channel.close()
    pieces = max(w.pieces, 1)
    used = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    ttfp = [c[0] for c in w.calls]
    out: dict[str, Any] = {
        "cpu_us": sum(used[:2]) / pieces * 1e6,  # both replicas
        "a_us": used[0] / pieces * 1e6, "b_us": used[1] / pieces * 1e6, "redis_us": used[2] / pieces * 1e6,
        "pps": w.pieces / (t1 - t0), "ttfp_p50_ms": statistics.median(ttfp) * 1e3 if ttfp else None,
        "calls": len(w.calls)}
    if w.errors:
        out["errors"] = f"{len(w.errors)}: {w.errors[0]}"
    return out


async def run(callers: tuple[int, ...], n_words: int, duration: float, lead: float, rounds: int,
              tmp: Path) -> list[dict[str, Any]]:
    redis, redis_port = start_redis("fwd", tmp)
    url = f"redis://127.0.0.1:{redis_port}/0"
    procs: list[Any] = [redis]
    try:
        agents = agents_file(tmp, max(callers))
        a, a_port = start_replica("replica-a", tmp, agents, url)
        procs.insert(0, a)
        b, b_port = start_replica("replica-b", tmp, agents, url)
        procs.insert(0, b)
        await asyncio.sleep(1.0)  # both on the bus
        text = words(n_words)
        pids = [a.pid, b.pid, redis.pid]
        rows = []
        for n in callers:
            sessions = [f"fwd-{n}-{i}" for i in range(n)]
            owners = [Caller(f"127.0.0.1:{a_port}", AI_AGENT, s) for s in sessions]
            try:  # the first turn of each session at A: A owns the agent
                await asyncio.gather(*(c.turn(chat_request("hello", n_words)) for c in owners))
            finally:
                for c in owners:
                    await c.channel.close()
            for r in range(rounds):  # alternated, so a neighbour's load falls on both paths alike
                local = await window([f"127.0.0.1:{a_port}"] * n, sessions, text, n_words, duration, lead, pids)
                forwarded = await window([f"127.0.0.1:{b_port}"] * n, sessions, text, n_words, duration, lead, pids)
                rows.append({"callers": n, "round": r, "local": local, "forwarded": forwarded,
                             "ratio": forwarded["cpu_us"] / local["cpu_us"] if local["cpu_us"] else None})
        return rows
    finally:
        for p in procs:
            stop_proc(p)


def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m bench.agents --forwarded", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--forwarded", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--callers", default="")
    p.add_argument("--words", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0, help="local/forwarded window pairs per caller count")
    p.add_argument("--json", metavar="PATH")
    ns, _ = p.parse_known_args(argv)
    duration = ns.duration or (1.5 if ns.quick else 6.0)
    callers = tuple(int(x) for x in ns.callers.split(",")) if ns.callers else ((1,) if ns.quick else (1, 4))
    n_words = ns.words or (100 if ns.quick else 300)
    rounds = ns.rounds or (1 if ns.quick else 3)
    load = procstat.loadavg()
    with tempfile.TemporaryDirectory(prefix="uibus-bench-fwd-") as tmp:
        rows = asyncio.run(run(callers, n_words, duration, 0.5, rounds, Path(tmp)))
    print(f"grpcio {grpc.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, {n_words} words "
          f"per reply, {duration:g} s windows; load average before/after {load:.2f}/{procstat.loadavg():.2f}")
    print("callers | path      | uibus µs/piece (A+B) | A µs | B µs | redis µs | pieces/s | ttfp p50 ms | calls")
    for r in rows:
        for path in ("local", "forwarded"):
            f = r[path]
            print(f"{r['callers']:7} | {path:9} | {f['cpu_us']:20.1f} | {f['a_us']:4.1f} | {f['b_us']:4.1f} | "
                  f"{f['redis_us']:8.1f} | {f['pps']:8.0f} | {f['ttfp_p50_ms'] or 0:11.1f} | {f['calls']}"
                  + (f"  errors {f['errors']}" if "errors" in f else ""))
        print(f"{r['callers']:7} | forwarded / local: {r['ratio']:.2f}× (round {r['round'] + 1})")
    for n in callers:
        ratios = [r["ratio"] for r in rows if r["callers"] == n and r["ratio"]]
        print(f"{n} caller(s): forwarded / local, median of {len(ratios)} rounds: {statistics.median(ratios):.2f}×")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0
