"""Fair shares: does a busy tenant raise another tenant's unary latency? (docs/security/quotas.md)

The bar: a tenant within its quota cannot raise another tenant's p99 unary latency more
than 2×. One `uibus serve` with a tokens file naming two tenants. Tenant B's single client makes
unary calls one after another, paced at --b-rate (200/s: within its own quota), and measures each
(p50/p99), first alone, then while tenant A's 64 closed-loop callers (another process) make calls as
fast as they are answered — A at its quota: its rate (`--quota-calls-per-second`) throttles it, its
calls waiting for their tokens. Each setting runs on a fresh server: the rate quota on (the default)
and off (`--quota-calls-per-second 0`), with the default `--tenant-concurrency` unless told. The
table gives B alone, B under A, their ratio (the bar: ≤ 2 at p99), A's rate (and refusals), and the
load average (1 min) before and after the row: the machine may be shared, so outside load is part of
every figure.

    .venv/bin/python -m bench.fairness                      # ~30 s: 4 s windows, rate 800 and off
    .venv/bin/python -m bench.fairness --repeat 3           # every setting three times
    .venv/bin/python -m bench.fairness --rates 400,800,0 --limits 16,0 --a-callers 128 --window 6
    .venv/bin/python -m bench.fairness --method ui          # cline.UiService/scrollToSettings instead

Performance is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
TOKENS = "a-token (team-a) team-a-*\nb-token (team-b) team-b-*\n"
A_CHANNELS = 4  # A's callers are spread over this many connections (as several clients would be)


def _stub(channel: grpc.aio.Channel, method: str) -> Any:
    """The measured unary call: SessionService/ListSessions (a store read) or UiService/scrollToSettings."""
    if method == "ui":
        from uibus.pb.cline import common_pb2

        call = channel.unary_unary("/cline.UiService/scrollToSettings",
                                   request_serializer=common_pb2.StringRequest.SerializeToString,
                                   response_deserializer=common_pb2.KeyValuePair.FromString)
        return lambda md: call(common_pb2.StringRequest(value="x"), metadata=md, timeout=30)
    from uibus.pb.uibus.v1 import sessions_pb2

    call = channel.unary_unary("/uibus.v1.SessionService/ListSessions",
                               request_serializer=sessions_pb2.ListSessionsRequest.SerializeToString,
                               response_deserializer=sessions_pb2.SessionList.FromString)
    return lambda md: call(sessions_pb2.ListSessionsRequest(), metadata=md, timeout=30)


def _md(token: str, session: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"), ("x-uibus-session", session))


async def _hammer(target: str, callers: int, method: str, seconds: float) -> tuple[int, int]:
    """A's load: `callers` closed-loop callers for `seconds`; (calls answered, calls refused)."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(A_CHANNELS)]
    stubs = [_stub(ch, method) for ch in channels]
    md = _md("a-token", "team-a-1")
    done = [0, 0]
    end = time.monotonic() + seconds

    async def caller(i: int) -> None:
        call = stubs[i % len(stubs)]
        while time.monotonic() < end:
            try:
                await call(md)
                done[0] += 1
            except grpc.aio.AioRpcError:
                done[1] += 1
                await asyncio.sleep(0.01)  # refused: a polite client backs off a little

    try:
        await asyncio.gather(*(caller(i) for i in range(callers)))
    finally:
        for ch in channels:
            await ch.close()
    return done[0], done[1]


def _a_process(target: str, callers: int, method: str, seconds: float, out: Any) -> None:
    out.put(asyncio.run(_hammer(target, callers, method, seconds)))


async def _measure(target: str, method: str, seconds: float, per_second: float) -> list[float]:
    """B: one caller, one call after another, at most `per_second` of them (B stays within its own rate
    quota: the bar is about a tenant within its quota) for `seconds`; each call's latency in ms."""
    async with grpc.aio.insecure_channel(target) as ch:
        call = _stub(ch, method)
        md = _md("b-token", "team-b-1")
        for _ in range(20):  # warm: the connection, the server's caches
            await call(md)
            await asyncio.sleep(1 / per_second)
        out: list[float] = []
        end = time.monotonic() + seconds
        due = time.monotonic()
        while (now := time.monotonic()) < end:
            if due > now:
                await asyncio.sleep(due - now)
            due = max(due, now) + 1 / per_second  # paced, never a burst to catch up
            t = time.perf_counter()
            await call(md)
            out.append((time.perf_counter() - t) * 1000)
        return out


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _serve(tmp: Path, rate: int, limit: int) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp / "tokens").write_text(TOKENS)
    cmd = [sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
           "--store", str(tmp / f"uibus-{rate}-{limit}-{time.monotonic_ns()}.db"), "--tokens-file",
           str(tmp / "tokens"), "--quota-calls-per-second", str(rate), "--tenant-concurrency", str(limit),
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"127.0.0.1:{port}"


async def _ready(target: str, proc: subprocess.Popen[bytes]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 30
    async with grpc.aio.insecure_channel(target) as ch:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"uibus exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
    raise SystemExit("uibus did not start within 30 s")


def run_one(rate: int, limit: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    proc, target = _serve(tmp, rate, limit)
    try:
        asyncio.run(_ready(target, proc))
        alone = asyncio.run(_measure(target, args.method, args.window, args.b_rate))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        a_seconds = args.window + args.head_start + 1.0
        a = ctx.Process(target=_a_process, args=(target, args.a_callers, args.method, a_seconds, out))
        a.start()
        time.sleep(args.head_start)  # A's callers connected and at full load (0: B sees A's first burst too)
        loaded = asyncio.run(_measure(target, args.method, args.window, args.b_rate))
        a_ok, a_refused = out.get(timeout=args.window + 30)
        a.join(10)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    row = {"rate": rate, "limit": limit, "b_calls_alone": len(alone), "b_calls_loaded": len(loaded),
           "a_rate": a_ok / a_seconds, "a_refused": a_refused, "load": (load_before, os.getloadavg()[0])}
    for name, p in (("p50", 50), ("p99", 99)):
        row[f"alone_{name}"] = _pct(alone, p)
        row[f"loaded_{name}"] = _pct(loaded, p)
        row[f"ratio_{name}"] = row[f"loaded_{name}"] / row[f"alone_{name}"]
    row["alone_mean"] = statistics.fmean(alone)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| --quota-calls-per-second | --tenant-concurrency | B alone p50 / p99 ms | B under A p50 / p99 ms | "
            "ratio p50 / p99 | A calls/s (refused) | load avg before / after |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['rate'] or '0 (off)'} | {r['limit'] or '0 (off)'} | {r['alone_p50']:.2f} / "
                     f"{r['alone_p99']:.2f} | {r['loaded_p50']:.2f} / {r['loaded_p99']:.2f} | {r['ratio_p50']:.1f}× / "
                     f"{r['ratio_p99']:.1f}× | {r['a_rate']:,.0f} ({r['a_refused']}) | "
                     f"{r['load'][0]:.2f} / {r['load'][1]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="800,0", help="comma-separated --quota-calls-per-second values (0 = off)")
    p.add_argument("--limits", default="16", help="comma-separated --tenant-concurrency values (0 = off)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every setting (interleaved), 1 to 5")
    p.add_argument("--a-callers", type=int, default=64, help="tenant A's concurrent closed-loop callers")
    p.add_argument("--b-rate", type=float, default=200, help="tenant B's calls per second (within its quota)")
    p.add_argument("--head-start", type=float, default=1.0,
                   help="seconds A runs before B measures (0: B's window includes A's first burst, a full bucket)")
    p.add_argument("--window", type=float, default=4.0, help="seconds B measures, alone and under load (≤ 30)")
    p.add_argument("--method", choices=("sessions", "ui"), default="sessions",
                   help="the unary call: SessionService/ListSessions or cline.UiService/scrollToSettings")
    args = p.parse_args(argv)
    if not (1 <= args.b_rate <= 10_000 and 1 <= args.repeat <= 5 and 0.5 <= args.window <= 30
            and 1 <= args.a_callers <= 1024 and 0 <= args.head_start <= 10):
        p.error("--repeat 1..5, --window 0.5..30, --a-callers 1..1024, --b-rate 1..10000, --head-start 0..10")
    settings = [(int(r), int(limit)) for r in args.rates.split(",") if r.strip()
                for limit in args.limits.split(",") if limit.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="uibus-fairness-") as tmp:
        for _ in range(args.repeat):
            for rate, limit in settings:
                row = run_one(rate, limit, args, Path(tmp))
                rows.append(row)
                print(f"--quota-calls-per-second {rate} --tenant-concurrency {limit}: B p99 {row['alone_p99']:.2f} ms "
                      f"alone, {row['loaded_p99']:.2f} ms under A ({row['ratio_p99']:.1f}×); A {row['a_rate']:,.0f}/s; "
                      f"load {row['load'][0]:.2f}/{row['load'][1]:.2f}", flush=True)
    print(f"\nA: {args.a_callers} closed-loop callers on {A_CHANNELS} connections, {args.method}; "
          f"B: 1 caller, {args.b_rate:g}/s; "
          f"{args.window:g} s windows; {os.cpu_count()} cores\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
