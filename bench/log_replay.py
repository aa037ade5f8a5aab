"""python -m bench.log_replay: what resuming from a cursor costs (docs/streams/resume.md).

Starts `uibus serve` the documented way (embedded SQLite store; with --redis, on a redis-server of
its own started here), publishes N ClineMessages (distinct ts, --text-bytes of text each) into one
session through HostService, then a client resumes `subscribeToPartialMessage` with
`x-uibus-since: 0` and reads all N. Prints the replay's time (subscribe to last message), the
server's RSS before and at its peak during the replay, and with --redis the Redis memory of the
session's log (MEMORY USAGE of its stream and index) at the default retention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _ready(target: str, proc: subprocess.Popen[bytes]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        for _ in range(400):
            if proc.poll() is not None:
                raise SystemExit(f"uibus exited {proc.returncode}")
            try:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    raise SystemExit("uibus did not become ready")


async def run(n: int, text_bytes: int, redis_url: str) -> dict[str, float]:
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
               "--store", str(Path(tmp) / "uibus.db"), "--log-level", "WARNING"]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        proc = subprocess.Popen(cmd, cwd=ROOT)
        target = f"127.0.0.1:{port}"
        try:
            await _ready(target, proc)
            md = (("x-uibus-session", "replay"),)
            async with grpc.aio.insecure_channel(target) as ch:
                host = host_pb2_grpc.HostServiceStub(ch)
                text = "x" * text_bytes
                started = time.monotonic()
                for start in range(0, n, 200):
                    await asyncio.gather(*(host.PublishPartialMessage(ui_pb2.ClineMessage(
                        ts=1_000_000 + i, type=ui_pb2.SAY, say=ui_pb2.TEXT, text=text), metadata=md)
                        for i in range(start, min(n, start + 200))))
                publish_s = time.monotonic() - started
                await asyncio.sleep(1.0)  # the write-behind has committed everything
                rss_before = _rss_kb(proc.pid)
                peak = rss_before
                ui = ui_pb2_grpc.UiServiceStub(ch)
                started = time.monotonic()
                call = ui.subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=(*md, ("x-uibus-since", "0")))
                got = 0
                async for _ in call:
                    got += 1
                    if got % 500 == 0:
                        peak = max(peak, _rss_kb(proc.pid))
                    if got == n:
                        break
                replay_s = time.monotonic() - started
                call.cancel()
                peak = max(peak, _rss_kb(proc.pid))
            out = {"events": n, "text_bytes": text_bytes, "publish_s": round(publish_s, 3),
                   "replay_s": round(replay_s, 3), "replay_events_per_s": round(n / replay_s),
                   "rss_before_mb": round(rss_before / 1024, 1), "rss_peak_mb": round(peak / 1024, 1)}
            if redis_url:
                import redis

                r = redis.Redis.from_url(redis_url)
                stream = r.memory_usage("uibus:{replay}:log", samples=0) or 0
                index = r.memory_usage("uibus:{replay}:logidx", samples=0) or 0
                out["redis_log_mb"] = round((stream + index) / 1024 / 1024, 2)
                out["redis_entries"] = r.xlen("uibus:{replay}:log")
            return out
        finally:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--text-bytes", type=int, default=200)
    p.add_argument("--redis", action="store_true", help="also on a redis-server started here")
    ns = p.parse_args()
    print(json.dumps({"embedded": asyncio.run(run(ns.events, ns.text_bytes, ""))}))
    if ns.redis:
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server not found")
        rport = _port()
        with tempfile.TemporaryDirectory() as tmp:
            redis_proc = subprocess.Popen([server, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
            try:
                time.sleep(0.5)
                print(json.dumps({"redis": asyncio.run(run(ns.events, ns.text_bytes, f"redis://127.0.0.1:{rport}/0"))}))
            finally:
                redis_proc.kill()
                redis_proc.wait(10)


if __name__ == "__main__":
    main()
