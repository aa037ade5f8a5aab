"""The baseline: the least a grpc.aio server can do to serve the benchmarked methods.

It serves the same paths and messages as uibus (so one client drives both) with nothing in the
way: no session, no validation, no store, no interceptors. Fan-out is one bounded
`asyncio.Queue` per subscriber (drop-oldest at the same bound as uibus, counted), so the
bench's uibus/raw ratios show what uibus's own code costs on top of grpc.aio itself.

Run: `python -m bench.raw_server --port P [--chat-chunks 1000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc

from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import agent_pb2, agent_pb2_grpc, chat_pb2
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc

QUEUE_SIZE = 256  # uibus's default --queue-size
KIND = "partial_message"


class Fanout:
    """Subscribers of the one topic the bench uses, plus the counters GetBusStats reports."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[Any]] = set()
        self.published = 0
        self.delivered = 0
        self.dropped = 0

    def publish(self, item: Any) -> int:
        self.published += 1
        for q in self.queues:
            if q.full():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(item)
        n = len(self.queues)
        self.delivered += n
        return n


class RawUi(ui_pb2_grpc.UiServiceServicer):
    def __init__(self, fanout: Fanout, swallow_cancel: bool = False, headers: bool = False) -> None:
        self.fanout = fanout
        self.swallow_cancel = swallow_cancel
        self.headers = headers

    async def scrollToSettings(self, request: common_pb2.StringRequest, context: Any) -> common_pb2.KeyValuePair:
        return common_pb2.KeyValuePair(key="scrollToSettings", value=request.value)

    async def subscribeToPartialMessage(self, request: common_pb2.EmptyRequest,
                                        context: Any) -> AsyncIterator[ui_pb2.ClineMessage]:
        q: asyncio.Queue[Any] = asyncio.Queue(QUEUE_SIZE)
        self.fanout.queues.add(q)
        try:
            if self.headers:  # as uibus's streams do once subscribed: a client can wait for them
                await context.send_initial_metadata(())
            while True:
                yield await q.get()
        except asyncio.CancelledError:
            if not self.swallow_cancel:
                raise
            # The known grpc.aio trap (grpc/grpc#43360), on purpose: shows what the memory
            # scenario reports for a handler that ends quietly instead of re-raising.
        finally:
            self.fanout.queues.discard(q)


class RawHost(host_pb2_grpc.HostServiceServicer):
    def __init__(self, fanout: Fanout) -> None:
        self.fanout = fanout

    async def PublishPartialMessage(self, request: ui_pb2.ClineMessage, context: Any) -> host_pb2.PublishReply:
        return host_pb2.PublishReply(subscribers=self.fanout.publish(request))

    async def GetBusStats(self, request: common_pb2.Empty, context: Any) -> host_pb2.BusStats:
        f = self.fanout
        n = len(f.queues)
        kind = host_pb2.KindStats(kind=KIND, subscriptions=n, published=f.published, delivered=f.delivered,
                                  dropped=f.dropped)
        return host_pb2.BusStats(kinds=[kind], subscriptions=n)


class RawAgent(agent_pb2_grpc.AgentServiceServicer):
    """Streams `chunks` small AI messages and a final AGENT_FRAMEWORK answer, each echoing the request."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    async def StreamingChat(self, request: agent_pb2.ChatRequest,
                            context: Any) -> AsyncIterator[agent_pb2.ChatResponse]:
        for i in range(self.chunks):
            yield agent_pb2.ChatResponse(request=request, response=chat_pb2.ChatMessage(
                type=chat_pb2.ChatMessage.AI, text=f"w{i} "))
        yield agent_pb2.ChatResponse(request=request, response=chat_pb2.ChatMessage(
            type=chat_pb2.ChatMessage.AGENT_FRAMEWORK, text="done"))


def _extra_methods(server: grpc.aio.Server, n: int) -> None:
    """Registers `n` unused unary methods: shows what the number of registered methods costs per RPC."""
    async def unused(request: bytes, context: Any) -> bytes:
        return b""

    handlers = {f"M{i}": grpc.unary_unary_rpc_method_handler(unused) for i in range(n)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Extra", handlers),))
    server.add_registered_method_handlers("bench.Extra", handlers)


class GenericOnly:
    """Stands in for the server while servicers install: registered methods become one generic
    handler (a dict lookup), so grpc.aio's per-registered-method work per RPC is not done."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        pass  # generated add_*_to_server also adds a generic handler for the same methods


async def serve(port: int, chunks: int, swallow_cancel: bool, extra_methods: int = 0,
                generic_only: bool = False, headers: bool = False) -> None:
    real = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server: Any = GenericOnly(real) if generic_only else real
    if extra_methods:
        _extra_methods(server, extra_methods)
    fanout = Fanout()
    ui_pb2_grpc.add_UiServiceServicer_to_server(RawUi(fanout, swallow_cancel, headers), server)
    host_pb2_grpc.add_HostServiceServicer_to_server(RawHost(fanout), server)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(RawAgent(chunks), server)
    server = real
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chat-chunks", type=int, default=1000)
    p.add_argument("--swallow-cancel", action="store_true",
                   help="subscription handlers swallow CancelledError (to check the memory scenario)")
    p.add_argument("--extra-methods", type=int, default=0, help="register this many unused methods")
    p.add_argument("--generic-only", action="store_true", help="serve every method through generic handlers")
    p.add_argument("--headers", action="store_true",
                   help="subscription streams send their response headers once subscribed, as uibus's do")
    p.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's own loop")
    ns = p.parse_args()
    factory = None
    if ns.uvloop:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(ns.port, ns.chat_chunks, ns.swallow_cancel, ns.extra_methods, ns.generic_only,
                         ns.headers))


if __name__ == "__main__":
    main()
