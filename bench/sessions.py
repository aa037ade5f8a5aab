"""python -m bench.sessions N: ListSessions latency with N stored sessions (SQLite store), over native
gRPC, one client, 30 calls after one warm-up (which fills the per-session title cache). A listing
shows at most 500 sessions (uibus.domain.sessions.MAX_LISTED); the store's index is read whole.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time

import grpc

from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc


async def main(n: int) -> None:
    d = tempfile.mkdtemp()
    app = App(Config(host="127.0.0.1", port=0, http_port=0, store=f"{d}/u.db"))
    await app.start()
    store = app.core.store
    for i in range(n):
        await store.put(f"s-{i:05d}", "session/meta", {"title": f"session {i}"})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        api = sessions_pb2_grpc.SessionServiceStub(ch)
        await api.ListSessions(pb.ListSessionsRequest())  # warm the title cache
        times = []
        for _ in range(30):
            t = time.perf_counter()
            r = await api.ListSessions(pb.ListSessionsRequest())
            times.append((time.perf_counter() - t) * 1000)
        print(f"sessions={n} listed={len(r.sessions)} median={statistics.median(times):.1f} ms "
              f"p90={sorted(times)[26]:.1f} ms")
    await app.aclose(grace=0.5)

if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
