"""A local OTLP/HTTP receiver that decodes and counts spans, for benchmarking uibus with tracing on.

    python -m bench.otlp_sink --port 4318 &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \\
        python -m bench.instructions

It decodes every export (as a collector would) and prints the span count on exit (SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


async def serve(port: int) -> None:
    count = 0

    async def traces(request: web.Request) -> web.Response:
        nonlocal count
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        count += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
    await runner.cleanup()
    print(f"spans received: {count}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
