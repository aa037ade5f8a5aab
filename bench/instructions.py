"""Instructions per operation, counted by valgrind: the measure that does not drift with the machine.

Wall-clock and CPU-time figures on a shared 2-core machine move by 5-15 % from run to run (even
two identical raw servers differ that much), which hides a change of a few percent. Under
valgrind's callgrind the server executes the very same instructions whatever else the machine
does, so the count per operation compares two builds to a fraction of a percent.

    python -m bench.instructions                       # this checkout
    python -m bench.instructions --with old=/tmp/old   # and another one (its own .venv), side by side

Each server runs under `valgrind --tool=callgrind --instr-atstart=no` (slow: ~50x), is warmed up
(1,500 unary calls first, past CPython's first full garbage collection, then each scenario), then
counting is switched on (`callgrind_control -i on`) for exactly N operations and off again, and the
total instruction count (every thread: Python, grpc core, the kernel interface) is divided
by N. Operations: a unary `scrollToSettings`; a `PublishPartialMessage` delivered to 10
`subscribeToPartialMessage` streams (per delivery, the publish included); a MAXIMAL `StreamingChat`
of 200 chunks from the local agent (per chunk received); subscribe/cancel cycles (per cycle), as
`python -m bench`'s memory scenario runs them: a batch of 50 `subscribeToPartialMessage` streams
opened, each awaited until subscribed (its response headers: raw runs with `--headers` to send them
as uibus does, so no polling is counted while they open), all cancelled, then `GetBusStats` asked
every 0.5 s until the server counts none (a poll or two per batch, both servers alike).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.run import ROOT, uibus_command
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2
from uibus.pb.uibus.v1 import host_pb2_grpc

CHAT_CHUNKS = 200
SUBSCRIBERS = 10
CYCLE_BATCH = 50
# Uncounted unary calls before any scenario. CPython's first full garbage collection walks every
# object startup made (~50,000: ~20 million instructions) and comes due within about the first
# thousand calls (until it has run once, 10 middle-generation collections are enough to start it),
# so without this it lands in whichever build's counted window it happens to reach first.
WARM_CALLS = 1500
SCENARIOS = ("unary", "fanout", "chat", "cycles")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Counted:
    """One server under callgrind, counting only between `on()` and `off()`."""

    def __init__(self, root: Path, tmp: Path, label: str) -> None:
        self.port = free_port()
        self.out = tmp / f"callgrind.{label}"
        self.raw = label == "raw"
        python = str(root / ".venv" / "bin" / "python")
        if self.raw:  # the bench's minimal grpc.aio server, serving the same three operations
            server = [python, "-m", "bench.raw_server", "--port", str(self.port), "--chat-chunks",
                      str(CHAT_CHUNKS), "--headers"]
        else:
            server = [*uibus_command(python, root), "--host", "127.0.0.1", "--port", str(self.port),
                      "--http-port", "0", "--store", str(tmp / f"{label}.db"), "--log-level", "WARNING"]
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out}", *server]
        self.log = (tmp / f"{label}.log").open("wb")
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{self.port}"

    async def ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            host = host_pb2_grpc.HostServiceStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"server exited {self.proc.returncode}")
                try:
                    if self.raw:  # raw serves no health service: its first answer means ready
                        await host.GetBusStats(common_pb2.Empty(), timeout=5)
                        return
                    if (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == 1:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("server did not become ready under valgrind")
                await asyncio.sleep(0.5)

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.pid)], check=True, capture_output=True,
                       timeout=120)

    def on(self) -> None:
        self._control("-i", "on")

    def off_and_count(self) -> int:
        """Switches counting off, dumps, and returns the instructions counted since `on()`."""
        self._control("-i", "off")
        self._control("-d")
        total = 0
        for dump in self.out.parent.glob(self.out.name + "*"):
            for line in dump.read_text(errors="replace").splitlines():
                m = re.match(r"totals: (\d+)", line)
                if m:
                    total += int(m.group(1))
                    break
            dump.unlink()
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def measure(server: Counted, n: int, op: Callable[[int], Awaitable[int]]) -> float:
    """Instructions per unit of work: `op(k)` does k operations and returns the units done."""
    await op(max(10, n // 10))  # warm up: imports, caches, code paths
    server.on()
    done = await op(n)
    return server.off_and_count() / done


async def subscriptions(host: host_pb2_grpc.HostServiceStub) -> int:
    return (await host.GetBusStats(common_pb2.Empty())).subscriptions


async def drained(host: host_pb2_grpc.HostServiceStub, every: float) -> None:
    """Returns once the server counts no subscription, asking every `every` seconds."""
    for _ in range(int(120 / every)):
        if not await subscriptions(host):
            return
        await asyncio.sleep(every)
    raise SystemExit("the cancelled streams did not end")


async def scenarios(server: Counted, n: int, only: tuple[str, ...] = SCENARIOS) -> dict[str, float]:
    async with grpc.aio.insecure_channel(server.target) as ch:
        ui = ui_pb2_grpc.UiServiceStub(ch)
        host = host_pb2_grpc.HostServiceStub(ch)
        md = (("x-uibus-session", "count"),)

        async def unary(k: int) -> int:
            for _ in range(k):
                await ui.scrollToSettings(common_pb2.StringRequest(value="x"))
            return k

        await unary(WARM_CALLS)
        streams = [ui.subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=md) for _ in range(SUBSCRIBERS)]
        for _ in range(300):  # the streams open in the background: wait until all are subscribed
            if await subscriptions(host) >= SUBSCRIBERS:
                break
            await asyncio.sleep(0.2)
        else:
            raise SystemExit("the subscriber streams did not open")

        async def fanout(k: int) -> int:
            for i in range(k):
                await host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1 + i, type=ui_pb2.SAY, text="x"), metadata=md)
                for s in streams:
                    await s.read()
            return k * SUBSCRIBERS

        chat_call = ch.unary_stream("/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/StreamingChat",
                                    request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                    response_deserializer=agent_pb2.ChatResponse.FromString)
        request = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text="hi"),
                                        chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL),
                                        chat_context=chat_pb2.ChatContext())
        request.sly_data.update({"chunks": CHAT_CHUNKS, "delay_ms": 0})

        async def chat(k: int) -> int:
            chunks = 0
            for _ in range(max(1, k // CHAT_CHUNKS)):
                chunks += sum([1 async for _ in chat_call(request)])
            return chunks

        async def cycles(k: int) -> int:
            done = 0
            while done < k:
                calls = [ui.subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=md)
                         for _ in range(min(CYCLE_BATCH, k - done))]
                await asyncio.gather(*(c.initial_metadata() for c in calls))  # each one subscribed
                for c in calls:
                    c.cancel()
                await drained(host, 0.5)
                done += len(calls)
            return done

        out = {}
        if "unary" in only:
            out["unary scrollToSettings (per call)"] = await measure(server, n, unary)
        if "fanout" in only:
            out[f"fan-out to {SUBSCRIBERS} (per delivery)"] = await measure(server, n // SUBSCRIBERS, fanout)
        if "chat" in only:
            out[f"chat, {CHAT_CHUNKS} chunks (per chunk)"] = await measure(server, n * 2, chat)
        for s in streams:
            s.cancel()
        if "cycles" in only:
            await drained(host, 0.2)
            out[f"subscribe+cancel, {CYCLE_BATCH} at a time (per cycle)"] = await measure(
                server, max(CYCLE_BATCH, n // 2 // CYCLE_BATCH * CYCLE_BATCH), cycles)
        return out


async def run(roots: dict[str, Path], n: int, only: tuple[str, ...] = SCENARIOS) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="uibus-instr-") as tmp:
        for label, root in roots.items():
            print(f"{label}: starting under valgrind (about a minute) …", file=sys.stderr, flush=True)
            server = Counted(root, Path(tmp), label)
            try:
                await server.ready()
                results[label] = await scenarios(server, n, only)
            finally:
                server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=400, help="operations counted per scenario (default 400)")
    p.add_argument("--with", dest="alt", action="append", default=[], metavar="LABEL=DIR",
                   help="also count the checkout DIR (with its own DIR/.venv); repeatable")
    p.add_argument("--no-raw", action="store_true", help="leave out the raw grpc.aio baseline")
    p.add_argument("--only", default=",".join(SCENARIOS),
                   help=f"comma-separated scenarios to count (default: all of {','.join(SCENARIOS)})")
    ns = p.parse_args(argv)
    only = tuple(x.strip() for x in ns.only.split(",") if x.strip())
    if not only or set(only) - set(SCENARIOS):
        p.error(f"--only takes some of {','.join(SCENARIOS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed here (Debian package valgrind)", file=sys.stderr)
        return 2
    roots = {"uibus": ROOT}
    for spec in ns.alt:
        label, _, folder = spec.partition("=")
        roots[f"uibus@{label}"] = Path(folder).resolve()
    if not ns.no_raw:
        roots["raw"] = ROOT
    results = asyncio.run(run(roots, ns.n, only))
    labels = [label for label in results if label != "raw"]
    ratios = [(f"{label.split('@')[1]}/main", label, labels[0]) for label in labels[1:]]
    if "raw" in results:
        ratios += [(f"{label.split('@')[1] if '@' in label else label}/raw", label, "raw") for label in labels]
        labels.append("raw")
    print(f"{'instructions per operation':40}" + "".join(f"{label:>16}" for label in labels)
          + "".join(f"{title:>12}" for title, _, _ in ratios))
    for name in results[labels[0]]:
        row = f"{name:40}" + "".join(f"{results[label][name]:>16,.0f}" for label in labels)
        row += "".join(f"{results[a][name] / results[b][name]:>12.3f}" for _, a, b in ratios)
        print(row)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
