"""A subscriber in its own process, so a test can really disconnect it (SIGKILL closes its TCP
connection) or freeze it (SIGSTOP: the connection stays, nothing answers, nothing is read).

Usage: subscriber.py TARGET SESSION N [--no-read]
Opens N `subscribeToAddToInput` streams, prints "live" once every stream's response headers have
arrived (uibus sends them as soon as the subscription is registered), then reads until killed.
With --no-read it reads nothing until a line arrives on stdin, then reads each stream to its end
and prints "end <STATUS> <messages read>" per stream.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from uibus.pb.cline import common_pb2, ui_pb2_grpc


async def main(target: str, session: str, n: int, read: bool) -> None:
    # A large window is not wanted here: a frozen reader should stall the server's writes early.
    async with grpc.aio.insecure_channel(target) as channel:
        stub = ui_pb2_grpc.UiServiceStub(channel)
        calls = [stub.subscribeToAddToInput(common_pb2.EmptyRequest(), metadata=(("x-uibus-session", session),))
                 for _ in range(n)]
        for call in calls:
            await call.initial_metadata()
        print("live", flush=True)
        if not read:
            await asyncio.to_thread(sys.stdin.readline)
        for line in await asyncio.gather(*(_drain(call) for call in calls)):
            print(line, flush=True)


async def _drain(call: grpc.aio.UnaryStreamCall) -> str:  # type: ignore[type-arg]
    n = 0
    try:
        async for _ in call:
            n += 1
    except grpc.aio.AioRpcError as exc:
        return f"end {exc.code().name} {n}"
    return f"end OK {n}"


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--no-read" not in sys.argv))
