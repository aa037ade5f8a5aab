"""Client roles. Each runs in its own worker process (spawned, so no gRPC state crosses a fork).

A worker waits for `(role, params)` on its pipe, runs the role in a fresh event loop and sends
back a dict. Roles that must run side by side (subscribers while a publisher publishes) share a
`counts` array in shared memory: each subscriber process bumps its own slot per delivery, which
lets the publisher keep a fixed number of events in flight without any extra RPC.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from bench.procstat import rss_kb
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import host_pb2_grpc

SESSION = "bench"
WORKER_HEADER = "x-uibus-worker"  # response metadata of `uibus serve --workers N`: which worker answered
MD = (("x-uibus-session", SESSION),)
CHAT_PATH = "/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/StreamingChat"
STREAMS_PER_CHANNEL = 100
NODE_SUBSCRIBER = Path(__file__).resolve().parent / "grpcjs" / "subscriber.js"
MAX_RATE_INFLIGHT = 512  # open-loop publishing: more unanswered publishes than this = overloaded

Params = dict[str, Any]


def channel(target: str) -> grpc.aio.Channel:
    # A local subchannel pool gives every channel its own TCP connection, as separate clients have.
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def stats_stubs(target: str, workers: int,
                      timeout: float = 30) -> tuple[list[grpc.aio.Channel], list[host_pb2_grpc.HostServiceStub]]:
    """One HostService stub per worker of `uibus serve --workers N` (N = `workers`): GetBusStats is
    per process, so counts are summed over these. Each channel has its own connection, which the
    kernel gives to some worker (SO_REUSEPORT); its answers name that worker (`x-uibus-worker`), so
    channels are opened until every worker has one. A single-process server: one stub."""
    chans: list[grpc.aio.Channel] = []
    stubs: dict[str, host_pb2_grpc.HostServiceStub] = {}
    deadline = time.monotonic() + timeout
    while len(stubs) < max(1, workers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"found {len(stubs)} of {workers} workers at {target}")
        ch = channel(target)
        stub = host_pb2_grpc.HostServiceStub(ch)
        call = stub.GetBusStats(common_pb2.Empty(), metadata=MD)
        await call
        index = (await call.initial_metadata()).get(WORKER_HEADER, "")
        if index in stubs:
            await ch.close()
            continue
        chans.append(ch)
        stubs[index] = stub
    return chans, list(stubs.values())


async def _wait_subs(hosts: list[host_pb2_grpc.HostServiceStub], pred: Callable[[int], bool], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = 0
        for host in hosts:
            n += (await host.GetBusStats(common_pb2.Empty(), metadata=MD)).subscriptions
        if pred(n) or time.monotonic() > deadline:
            return n
        await asyncio.sleep(0.002)


async def subscribe(p: Params, counts: Any, stop: Any) -> Params:
    """Holds `streams` subscribeToPartialMessage streams until `stop`; records latency per phase tag."""
    slot, n = p["slot"], p["streams"]
    per = p.get("per_channel", STREAMS_PER_CHANNEL)
    chans = [channel(p["target"]) for _ in range(math.ceil(n / per))]
    lat: dict[str, list[int]] = {}
    errors: list[str] = []

    async def read(call: Any) -> None:
        try:
            async for msg in call:
                now = time.monotonic_ns()
                counts[slot] += 1
                tag, _, sent = msg.text.partition(":")
                if tag != "max":
                    lst = lat.get(tag)
                    if lst is None:
                        lst = lat[tag] = []
                    lst.append(now - int(sent))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(f"{exc.code().name}: {exc.details()}")
        except asyncio.CancelledError:
            pass

    calls = [ui_pb2_grpc.UiServiceStub(chans[i // per]).subscribeToPartialMessage(
        common_pb2.EmptyRequest(), metadata=MD) for i in range(n)]
    tasks = [asyncio.ensure_future(read(c)) for c in calls]
    while not stop.is_set():  # noqa: ASYNC110 (a multiprocessing.Event cannot be awaited)
        await asyncio.sleep(0.05)
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in chans:
        await ch.close()
    return {"lat_ns": lat, "errors": errors[:5], "n_errors": len(errors)}


async def subscribe_node(p: Params, counts: Any, stop: Any) -> Params:
    """`subscribe` with the streams held by a @grpc/grpc-js process (bench/grpcjs/subscriber.js),
    which needs somewhat less CPU per message than grpc.aio (about 100 against 135 µs here), so
    more of the machine is left to the server. This process only relays the count the Node
    process prints (at most once a millisecond) into its shared-memory slot (the publisher's
    window reads it), then returns what Node reports."""
    slot = p["slot"]
    base = counts[slot]
    proc = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node", str(NODE_SUBSCRIBER), "--target", p["target"], "--streams", str(p["streams"]),
        "--per-channel", str(p.get("per_channel", STREAMS_PER_CHANNEL)), "--session", SESSION,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        limit=1 << 28)  # the report line holds every latency
    assert proc.stdin is not None and proc.stdout is not None
    stdout = proc.stdout
    result: Params = {"lat_ns": {}, "errors": ["the node subscriber reported nothing"], "n_errors": 1}

    async def relay() -> None:
        nonlocal result
        async for line in stdout:
            if line.startswith(b"c "):
                counts[slot] = base + int(line[2:])
            elif line.startswith(b"r "):
                result = json.loads(line[2:])

    reader = asyncio.ensure_future(relay())
    try:
        while not stop.is_set() and not reader.done():  # noqa: ASYNC110 (a multiprocessing.Event cannot be awaited)
            await asyncio.sleep(0.05)
        proc.stdin.write(b"stop\n")
        await proc.stdin.drain()
        proc.stdin.close()
        await asyncio.wait_for(reader, 60)
    finally:
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return result


async def publish(p: Params, counts: Any, stop: Any) -> Params:
    """Publishes ClineMessages carrying `<tag>:<monotonic ns at send>` in `text`.

    mode "max": closed loop, at most `window` events not yet received by all `subs` subscribers,
    for `duration` s; reports deliveries/s. mode "rate": open loop at `rate` events/s.
    """
    ch = channel(p["target"])
    host = host_pb2_grpc.HostServiceStub(ch)
    subs, tag, duration = p["subs"], p["tag"], p["duration"]
    await host.GetBusStats(common_pb2.Empty(), metadata=MD)  # connected before the clock starts
    inflight: set[asyncio.Future[Any]] = set()
    errors: list[str] = []
    seq = p.get("seq0", 0)

    def done(f: asyncio.Future[Any]) -> None:
        inflight.discard(f)
        if not f.cancelled() and f.exception() is not None:
            errors.append(repr(f.exception())[:200])

    def send() -> None:
        nonlocal seq
        seq += 1
        msg = ui_pb2.ClineMessage(ts=seq, type=ui_pb2.SAY, say=ui_pb2.TEXT, partial=True,
                                  text=f"{tag}:{time.monotonic_ns()}")
        f = asyncio.ensure_future(host.PublishPartialMessage(msg, metadata=MD))
        inflight.add(f)
        f.add_done_callback(done)

    def received() -> int:
        return sum(counts[:])

    base = received()
    sent = 0
    behind = 0
    t0 = time.monotonic()
    if p["mode"] == "max":
        window = p["window"]
        while time.monotonic() - t0 < duration:
            if sent - (received() - base) / subs < window and len(inflight) < window:
                send()
                sent += 1
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.0005)
    else:
        rate = p["rate"]
        total = max(1, int(rate * duration))
        while sent < total:
            due = min(total, int((time.monotonic() - t0) * rate) + 1)
            while sent < due:
                if len(inflight) >= MAX_RATE_INFLIGHT:
                    behind += 1
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                send()
                sent += 1
            await asyncio.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
    send_end = time.monotonic()
    if inflight:
        await asyncio.wait(inflight)
    # Wait for the last deliveries; stop once nothing more arrives for a second (drops never come).
    last, last_change = received(), time.monotonic()
    while last - base < sent * subs and time.monotonic() - last_change < 1.0:
        await asyncio.sleep(0.001)
        now = received()
        if now != last:
            last, last_change = now, time.monotonic()
    t_end = last_change if last - base < sent * subs else time.monotonic()
    await ch.close()
    delivered = last - base
    return {"sent": sent, "delivered": delivered, "expected": sent * subs, "elapsed": t_end - t0,
            "send_s": send_end - t0, "rate": delivered / (t_end - t0), "behind": behind,
            "errors": errors[:5], "n_errors": len(errors), "seq": seq}


async def _windowed(p: Params, one_call: Callable[[Any, float], Awaitable[None]],
                    make_stub: Callable[[Any], Any]) -> None:
    """Runs `callers` loops of `one_call` until `start_at + duration` (system-wide monotonic clock)."""
    chans = [channel(p["target"]) for _ in range(min(p["callers"], 4))]
    stubs = [make_stub(ch) for ch in chans]
    end = p["start_at"] + p["duration"]

    async def loop(stub: Any) -> None:
        while time.monotonic() < end:
            await one_call(stub, end)

    await asyncio.gather(*(loop(stubs[i % len(stubs)]) for i in range(p["callers"])))
    for ch in chans:
        await ch.close()


async def unary(p: Params, counts: Any, stop: Any) -> Params:
    """Closed-loop scrollToSettings callers; counts calls that finish inside the window."""
    start = p["start_at"]
    lat: list[float] = []
    errors: list[str] = []
    req = common_pb2.StringRequest(value="general")

    async def one(stub: ui_pb2_grpc.UiServiceStub, end: float) -> None:
        t = time.monotonic()
        try:
            await stub.scrollToSettings(req, metadata=MD)
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(0.01)
            return
        t2 = time.monotonic()
        if start <= t and t2 <= end:
            lat.append(t2 - t)

    await _windowed(p, one, ui_pb2_grpc.UiServiceStub)
    return {"lat_s": lat, "errors": errors[:5], "n_errors": len(errors)}


async def chat(p: Params, counts: Any, stop: Any) -> Params:
    """Closed-loop StreamingChat callers (MAXIMAL filter: every chunk is a message)."""
    start = p["start_at"]
    req = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN,
                                                                   text=p.get("text", "bench")),
                                chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
    # uibus's local agent takes its chunk count and pacing per request from sly_data; raw ignores it.
    req.sly_data.update({"chunks": p["chunks"], "delay_ms": 0})
    # An explicit empty ChatContext starts a new conversation on every call, so a call's cost does not
    # depend on how many turns the session already had (uibus keeps up to 200 messages of context).
    req.chat_context.SetInParent()
    calls: list[tuple[float, float, int]] = []  # (time to first chunk, call duration, chunks)
    in_window = 0
    errors: list[str] = []

    def make(ch: Any) -> Any:
        return ch.unary_stream(CHAT_PATH, request_serializer=agent_pb2.ChatRequest.SerializeToString,
                               response_deserializer=agent_pb2.ChatResponse.FromString)

    async def one(method: Any, end: float) -> None:
        nonlocal in_window
        t = time.monotonic()
        first = 0.0
        n = 0
        try:
            async for _ in method(req, metadata=MD):
                now = time.monotonic()
                if not n:
                    first = now - t
                n += 1
                if start <= now <= end:
                    in_window += 1
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(0.05)
            return
        if start <= t:
            calls.append((first, time.monotonic() - t, n))

    await _windowed(p, one, make)
    return {"calls": calls, "chunks_in_window": in_window, "errors": errors[:5], "n_errors": len(errors)}


async def cycles(p: Params, counts: Any, stop: Any) -> Params:
    """`cycles` subscribe/cancel cycles in batches of `batch` open streams at a time.

    `workers` > 1: the server's worker count (subscriptions are counted over all of them);
    `pids`: the processes whose RSS is summed per batch."""
    batch, total = p["batch"], p["cycles"]
    chans = [channel(p["target"]) for _ in range(math.ceil(batch / STREAMS_PER_CHANNEL))]
    if p.get("workers", 1) > 1:
        stat_chans, hosts = await stats_stubs(p["target"], p["workers"])
    else:
        stat_chans, hosts = [], [host_pb2_grpc.HostServiceStub(chans[0])]
    base = await _wait_subs(hosts, lambda n: True, 0)
    done = 0
    t0 = time.monotonic()
    stuck = 0
    rss: list[tuple[int, int]] = []  # (cycles done before the batch, server RSS KB with it open)
    while done < total:
        k = min(batch, total - done)
        calls = [ui_pb2_grpc.UiServiceStub(chans[i // STREAMS_PER_CHANNEL]).subscribeToPartialMessage(
            common_pb2.EmptyRequest(), metadata=MD) for i in range(k)]
        if await _wait_subs(hosts, lambda n, k=k: n >= base + k, 10) < base + k:
            stuck += 1
        if p.get("pids"):  # sampled with the batch open: the allocator's swings are smallest there
            rss.append((done, sum(rss_kb(pid) for pid in p["pids"])))
        for c in calls:
            c.cancel()
        if await _wait_subs(hosts, lambda n: n <= base, 10) > base:
            stuck += 1
        done += k
    elapsed = time.monotonic() - t0
    for ch in chans + stat_chans:
        await ch.close()
    return {"cycles": done, "elapsed": elapsed, "stuck": stuck, "rss": rss}


ROLES: dict[str, Callable[[Params, Any, Any], Awaitable[Params]]] = {
    "subscribe": subscribe, "subscribe_node": subscribe_node, "publish": publish, "unary": unary, "chat": chat,
    "cycles": cycles}


def worker_main(conn: Connection, counts: Any, stop: Any,
                roles: dict[str, Callable[[Any, Any, Any], Awaitable[Any]]] | None = None) -> None:
    """A client process: runs `(role, params)` requests from the pipe until None, with `roles`
    (these benches' by default; bench.replicas passes its own)."""
    roles = ROLES if roles is None else roles
    # One loop for the worker's life: grpc.aio's poller thread may still post to the loop of a
    # finished role, which must not be a closed one.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        role, params = msg
        t0 = time.process_time()
        try:
            result = loop.run_until_complete(roles[role](params, counts, stop))
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        result["cpu_s"] = time.process_time() - t0
        conn.send(result)
