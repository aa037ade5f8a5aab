"""One command, one machine: uibus against a raw grpc.aio baseline (and grpc-js), alternating, as ratios.

All servers run at once in their own processes (loopback only); client roles run in spawned
worker processes. Every scenario runs against raw, then uibus, then grpc-js (Node, when found),
then (next round) the same again, so drift in the machine's load hits all alike; the table shows
per-figure medians over rounds and the uibus/raw and uibus/grpcjs ratios. Servers are restarted
each round so memory figures start fresh. With --servers, uibus on Redis (redis, redis2, workers2;
each on its own redis-server) runs too, with its ratio to local uibus (bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench import procstat
from bench.workers import MD, STREAMS_PER_CHANNEL, WORKER_HEADER, pct, worker_main
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SERVERS = ("raw", "uibus", "grpcjs")  # the default set
# uibus with Redis (store and bus): one replica, two replicas (publisher on one, subscribers on the
# other), `uibus serve --workers 2`. Only with --servers; each gets its own redis-server.
REDIS_KINDS = ("redis", "redis2", "workers2")
# The two servers on the other event loop: uibus on asyncio's own (`--loop asyncio`; its default is
# uvloop), raw on uvloop (raw_server.py --uvloop). Only with --servers.
LOOP_KINDS = ("uibus-asyncio", "raw-uvloop")
KINDS = (*SERVERS, *REDIS_KINDS, *LOOP_KINDS)
# Each variant's figures as a ratio to its own twin on asyncio's loop (a column `variant/twin`).
TWIN = {**{kind: "uibus" for kind in REDIS_KINDS}, "uibus-asyncio": "uibus", "raw-uvloop": "raw"}
GRPCJS = Path(__file__).resolve().parent / "grpcjs"  # @grpc/grpc-js twin of raw_server.py (Cline's own stack)
SCENARIOS = ("memory", "unary", "chat", "fanout")
N_WORKERS = 3
PUBLISHER = 2  # worker index; 0 and 1 subscribe / call


@dataclass
class Plan:
    rounds: int = 3
    duration: float = 4.0  # seconds per measured phase
    lead: float = 1.5  # warm-up before a closed-loop window
    fanout_s: tuple[int, ...] = (1, 10, 100, 1000)
    unary_c: tuple[int, ...] = (1, 10, 100)
    chat_c: tuple[int, ...] = (1, 10)
    chat_chunks: int = 1000
    mem_subs: int = 1000
    cycles: int = 30_000
    cycle_batch: int = 1000  # = mem_subs: the heap is already sized for it, so RSS does not shrink
    scenarios: tuple[str, ...] = SCENARIOS
    servers: tuple[str, ...] = SERVERS
    uibus_args: tuple[str, ...] = ()
    raw_args: tuple[str, ...] = ()
    subscribers: str = "python"  # the fan-out's subscriber clients: grpc.aio, or "node" (@grpc/grpc-js)
    # The fan-out's closed loop keeps max(2, min(32, this // S)) events in flight: at S=1000 only 2,
    # so the max rate is bounded by a delivery's round trip as much as by the server's CPU.
    window_deliveries: int = 2000
    per_channel: int = STREAMS_PER_CHANNEL  # fan-out subscriber streams per channel (each its own connection)
    # label -> project checkout with its own .venv (e.g. another grpcio): adds raw@label, uibus@label
    alt_roots: dict[str, str] = field(default_factory=dict)

    def steps(self) -> list[tuple[str, int]]:
        params = {"memory": (self.mem_subs,), "unary": self.unary_c, "chat": self.chat_c, "fanout": self.fanout_s}
        return [(sc, p) for sc in self.scenarios for p in params[sc]]

    def all_servers(self) -> list[str]:
        # grpcjs has no @LABEL twin: --with swaps the Python/grpcio side, which Node does not use;
        # nor have the Redis kinds (an older checkout may have neither --redis-url nor --workers).
        alt = [f"{s}@{label}" for label in self.alt_roots for s in self.servers if s in ("raw", "uibus")]
        return [*self.servers, *alt]

    @classmethod
    def quick(cls) -> Plan:
        return cls(rounds=1, duration=1.0, lead=0.6, cycles=3000)


@dataclass
class Server:
    """One server kind as the clients see it: `port` for every role, `publish_port` for the fan-out
    publisher (replica A of redis2, else the same port). `proc` is the process clients talk to
    (replica B of redis2, the parent of workers2); `helpers` are stopped after it (replica A, then
    the kind's redis-server)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    stubs: list[host_pb2_grpc.HostServiceStub]  # GetBusStats of every process with subscriptions: summed
    channels: list[grpc.Channel]
    publish_port: int = 0
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cpu_pids: dict[str, int] = field(default_factory=dict)  # label -> pid; its CPU counts as the server's
    mem_pids: list[int] = field(default_factory=list)  # whose RSS is the server's memory
    workers: int = 1  # worker processes of `uibus serve --workers N`
    rss_start_kb: int = 0

    def __post_init__(self) -> None:
        self.publish_port = self.publish_port or self.port
        self.cpu_pids = self.cpu_pids or {"server": self.proc.pid}
        self.mem_pids = self.mem_pids or [self.proc.pid]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return list(dict.fromkeys([self.proc.pid, *self.cpu_pids.values(), *(h.pid for h in self.helpers)]))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def publish_target(self) -> str:
        return f"127.0.0.1:{self.publish_port}"

    def all_stats(self) -> list[host_pb2.BusStats]:
        return [stub.GetBusStats(common_pb2.Empty(), metadata=MD, timeout=10) for stub in self.stubs]

    def losses(self) -> int:
        """Events a full mailbox threw away or merged (what a subscriber never saw), over every worker."""
        return sum(k.dropped + k.coalesced for st in self.all_stats() for k in st.kinds)

    def subscriptions(self) -> list[int]:
        """Open subscriptions per process (per worker for workers2)."""
        return [st.subscriptions for st in self.all_stats()]

    def wait_subs(self, want: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while True:
            n = sum(self.subscriptions())
            if n == want or time.monotonic() > deadline:
                return n
            time.sleep(0.02)

    def rss_kb(self) -> int:
        return sum(procstat.rss_kb(pid) for pid in self.mem_pids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uibus_command(python: str, root: Path) -> list[str]:
    """How the checkout at `root` runs the uibus server: `python -m uibus serve` since `server/` is
    installed as the package `uibus`; an older checkout (`--with LABEL=DIR`) ran `python -m server`
    (options only, no subcommand; importable from `root` as the working directory)."""
    try:
        one_package = "uibus.clients.cli" in (root / "server" / "__main__.py").read_text()
    except OSError:
        one_package = True
    return [python, "-m", "uibus", "serve"] if one_package else [python, "-m", "server"]


def _launch(name: str, cmd: list[str], root: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / f"{name}.log"
    return subprocess.Popen(cmd, cwd=root, stdout=log.open("wb"), stderr=subprocess.STDOUT), log


def _wait_grpc(name: str, proc: subprocess.Popen[bytes], port: int, cmd: list[str], log: Path) -> None:
    """Until the server at `port` answers GetBusStats (SystemExit when it exits or takes over 30 s)."""
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = host_pb2_grpc.HostServiceStub(ch)
        while True:
            try:
                stub.GetBusStats(common_pb2.Empty(), metadata=MD, timeout=5)
                return
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} server did not start ({' '.join(cmd)}):\n"
                                     f"{log.read_text()[-3000:]}") from None
                time.sleep(0.1)


def _worker_stubs(port: int, workers: int,
                  timeout: float = 30) -> tuple[list[grpc.Channel], list[host_pb2_grpc.HostServiceStub]]:
    """One channel per worker of `uibus serve --workers N` (see bench.workers.stats_stubs; the
    same, synchronous): each has its own connection, and answers name their worker."""
    chans: list[grpc.Channel] = []
    stubs: dict[str, host_pb2_grpc.HostServiceStub] = {}
    deadline = time.monotonic() + timeout
    while len(stubs) < max(1, workers):
        if time.monotonic() > deadline:
            for ch in chans:
                ch.close()
            raise SystemExit(f"found {len(stubs)} of {workers} workers on port {port} within {timeout:g} s")
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        stub = host_pb2_grpc.HostServiceStub(ch)
        try:
            _, call = stub.GetBusStats.with_call(common_pb2.Empty(), metadata=MD, timeout=5)
        except grpc.RpcError:
            ch.close()
            time.sleep(0.1)
            continue
        index = dict(call.initial_metadata() or ()).get(WORKER_HEADER, "")
        if index in stubs:
            ch.close()
            continue
        chans.append(ch)
        stubs[index] = stub
    return chans, list(stubs.values())


def start_redis(name: str, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A fresh, empty redis-server on loopback for one server kind (nothing saved); its port."""
    port = free_port()
    folder = tmp / f"{name}-redis"
    folder.mkdir()
    cmd = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
           "--save", "", "--appendonly", "no", "--dir", str(folder)]
    proc, log = _launch(f"{name}-redis", cmd, folder, tmp)
    deadline = time.monotonic() + 15
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_proc(proc)
            raise SystemExit(f"redis-server for {name} did not start ({' '.join(cmd)}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def start_server(name: str, tmp: Path, plan: Plan) -> Server:
    kind, _, label = name.partition("@")
    if kind in REDIS_KINDS:
        return start_redis_kind(name, tmp, plan)
    port = free_port()
    root = Path(plan.alt_roots[label]).resolve() if label else ROOT
    python = str(root / ".venv" / "bin" / "python") if label else sys.executable
    if kind in ("raw", "raw-uvloop"):
        cmd = [python, "-m", "bench.raw_server", "--port", str(port), "--chat-chunks", str(plan.chat_chunks),
               *plan.raw_args, *(["--uvloop"] if kind == "raw-uvloop" else [])]
    elif kind == "grpcjs":  # node itself is the server process, so /proc/<pid> reads its CPU and RSS
        cmd = [shutil.which("node") or "node", str(GRPCJS / "server.js"), "--port", str(port),
               "--chat-chunks", str(plan.chat_chunks)]
    else:  # the documented way to run uibus
        cmd = uibus_serve(python, root, port, tmp / f"{name}.db", plan,
                          *(["--loop", "asyncio"] if kind == "uibus-asyncio" else []))
    proc, log = _launch(name, cmd, root, tmp)
    try:
        _wait_grpc(name, proc, port, cmd, log)
    except BaseException:
        stop_proc(proc)
        raise
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    srv = Server(name, proc, port, log, [host_pb2_grpc.HostServiceStub(channel)], [channel])
    time.sleep(0.3)
    srv.rss_start_kb = srv.rss_kb()
    return srv


def uibus_serve(python: str, root: Path, port: int, store: Path, plan: Plan, *extra: str) -> list[str]:
    return [*uibus_command(python, root), "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
            "--store", str(store), "--log-level", "WARNING", *extra, *plan.uibus_args]


def start_redis_kind(name: str, tmp: Path, plan: Plan) -> Server:
    """redis: one uibus replica on its own redis-server; redis2: replicas A (the fan-out publisher's)
    and B (everything else) on one redis-server; workers2: `uibus serve --workers 2` on one."""
    redis, redis_port = start_redis(name, tmp)
    url = f"redis://127.0.0.1:{redis_port}/0"
    started: list[subprocess.Popen[bytes]] = [redis]
    try:
        def replica(label: str, *extra: str) -> tuple[subprocess.Popen[bytes], int, Path]:
            port = free_port()
            cmd = uibus_serve(sys.executable, ROOT, port, tmp / f"{label}.db", plan, "--redis-url", url, *extra)
            proc, log = _launch(label, cmd, ROOT, tmp)
            started.insert(0, proc)
            _wait_grpc(label, proc, port, cmd, log)
            return proc, port, log

        helpers = [redis]
        publish_port = 0
        workers = 2 if name == "workers2" else 1
        if name == "redis2":
            proc_a, publish_port, _ = replica(f"{name}-a")
            helpers.insert(0, proc_a)
            proc, port, log = replica(f"{name}-b")
            cpu_pids = {"replica_a": proc_a.pid, "replica_b": proc.pid}
        elif workers > 1:
            proc, port, log = replica(name, "--workers", str(workers))
            cpu_pids = {"parent": proc.pid}
        else:
            proc, port, log = replica(name)
            cpu_pids = {"uibus": proc.pid}
        if workers > 1:
            channels, stubs = _worker_stubs(port, workers)  # also: every worker serves
            kids = procstat.children(proc.pid)
            cpu_pids.update({f"worker_pid{pid}": pid for pid in kids})
            mem_pids = [proc.pid, *kids]
        else:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            channels, stubs = [channel], [host_pb2_grpc.HostServiceStub(channel)]
            mem_pids = [proc.pid]
        cpu_pids["redis"] = redis.pid
    except BaseException:
        for p in started:
            stop_proc(p)
        raise
    srv = Server(name, proc, port, log, stubs, channels, publish_port=publish_port, helpers=helpers,
                 cpu_pids=cpu_pids, mem_pids=mem_pids, workers=workers)
    time.sleep(0.3)
    srv.rss_start_kb = srv.rss_kb()
    return srv


def setup_grpcjs() -> bool:
    """Installs bench/grpcjs's pinned npm packages when missing or when the lock changed (a stamp,
    as .ci/setup does), so a run needs no manual step; False (said in one line) when it cannot."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node:
        print("grpc-js skipped: node not found on PATH", flush=True)
        return False
    lock = GRPCJS / "package-lock.json"
    stamp = GRPCJS / "node_modules" / ".uibus-lock"
    try:
        current = stamp.read_bytes() == lock.read_bytes()
    except OSError:
        current = False
    if current:
        return True
    if not npm:
        print("grpc-js skipped: npm not found on PATH (bench/grpcjs/node_modules needs installing)", flush=True)
        return False
    print("installing bench/grpcjs's pinned npm packages (npm ci: @grpc/grpc-js, @grpc/proto-loader)", flush=True)
    cmd = [npm, "ci", "--prefix", str(GRPCJS), "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print("grpc-js skipped: npm ci took over 600 s", flush=True)
        return False
    if done.returncode != 0:
        print(f"grpc-js skipped: npm ci failed: {(done.stderr or done.stdout).strip()[-300:]}", flush=True)
        return False
    shutil.copyfile(lock, stamp)
    return True


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_server(srv: Server) -> None:
    for ch in srv.channels:
        ch.close()
    for proc in [srv.proc, *srv.helpers]:  # uibus processes first, their redis-server last
        stop_proc(proc)


class Pool:
    """Worker processes that run client roles (bench.workers, or a table of their own) on command;
    `counts` is an array of `slots` counters (one per worker by default) they bump per delivery."""

    def __init__(self, n: int, roles: dict[str, Callable[..., Any]] | None = None, slots: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.counts = ctx.Array("q", slots or n, lock=False)
        self.stop = ctx.Event()
        self.workers = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, self.counts, self.stop, roles), daemon=True)
            proc.start()
            self.workers.append((proc, parent))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p, _ in self.workers if p.pid]

    def send(self, i: int, role: str, params: dict[str, Any]) -> None:
        self.workers[i][1].send((role, params))

    def delivered(self) -> int:
        return sum(self.counts[:])

    def recv(self, i: int, timeout: float = 300) -> dict[str, Any]:
        conn = self.workers[i][1]
        if not conn.poll(timeout):
            raise RuntimeError(f"worker {i} gave no answer within {timeout} s")
        result = conn.recv()
        if "error" in result:
            raise RuntimeError(f"worker {i}: {result['error']}\n{result.get('trace', '')}")
        return result

    def call(self, i: int, role: str, params: dict[str, Any]) -> dict[str, Any]:
        self.send(i, role, params)
        return self.recv(i)

    def reset(self) -> None:
        self.stop.clear()
        for i in range(len(self.counts)):
            self.counts[i] = 0

    def close(self) -> None:
        for proc, conn in self.workers:
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


@dataclass
class Snap:
    t: float
    server_cpu: dict[str, float]  # label (Server.cpu_pids) -> CPU seconds so far
    busy: float
    ours: float


def put_cpu(out: dict[str, Any], figure: str, cpu: dict[str, float], ops: int) -> None:
    """`figure` = server CPU µs per operation over every process of the server; for a server with
    a redis-server also `<figure>_redis` (its share, included in `figure`), and for several
    processes each one's CPU seconds in the JSON only (`_<figure>_by_process`)."""
    out[figure] = sum(cpu.values()) / max(ops, 1) * 1e6
    if "redis" in cpu:
        out[f"{figure}_redis"] = cpu["redis"] / max(ops, 1) * 1e6
    if len(cpu) > 1:
        out[f"_{figure}_by_process"] = cpu


@dataclass
class Bench:
    plan: Plan
    pool: Pool
    servers: dict[str, Server] = field(default_factory=dict)
    outside: dict[str, list[float]] = field(default_factory=dict)  # server -> outside cores per phase
    ref: dict[int, float] = field(default_factory=dict)  # S -> max deliveries/s of this round's first server

    def our_pids(self) -> list[int]:
        """The bench's own processes: itself, its client workers and what they started (the Node
        subscribers of `--subscribers node`), and the servers."""
        workers = list(self.pool.pids)
        if self.plan.subscribers == "node":
            workers += procstat.children_of(self.pool.pids)
        return [os.getpid(), *workers, *(p for s in self.servers.values() for p in s.pids)]

    def snap(self, srv: Server) -> Snap:
        return Snap(time.monotonic(), {k: procstat.cpu_seconds(p) for k, p in srv.cpu_pids.items()},
                    procstat.machine_busy_seconds(), sum(procstat.cpu_seconds(p) for p in self.our_pids()))

    def delta(self, srv: Server, a: Snap, b: Snap) -> tuple[dict[str, float], float]:
        """(server CPU seconds per process label, outside load in cores) between two snaps."""
        wall = max(b.t - a.t, 1e-6)
        outside = max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / wall)
        self.outside.setdefault(srv.name, []).append(outside)
        return {k: b.server_cpu[k] - a.server_cpu[k] for k in a.server_cpu}, outside

    def measured(self, srv: Server, fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float]]:
        a = self.snap(srv)
        result = fn()
        cpu, _ = self.delta(srv, a, self.snap(srv))
        return result, cpu

    def windowed(self, srv: Server, role: str, parts: list[int],
                 extra: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Runs a closed-loop role on workers 0..len(parts)-1 over one shared window; server CPU in it."""
        plan = self.plan
        start_at = time.monotonic() + plan.lead
        for i, k in enumerate(parts):
            self.pool.send(i, role, {"target": srv.target, "callers": k, "start_at": start_at,
                                     "duration": plan.duration, **extra})
        time.sleep(max(0.0, start_at - time.monotonic()))
        a = self.snap(srv)
        time.sleep(plan.duration)
        cpu, _ = self.delta(srv, a, self.snap(srv))
        return [self.pool.recv(i) for i in range(len(parts))], cpu


def split(n: int) -> list[int]:
    return [n] if n == 1 else [n - n // 2, n // 2]


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def run_memory(b: Bench, srv: Server, _: int = 0) -> dict[str, Any]:
    plan, pool = b.plan, b.pool
    out: dict[str, Any] = {"memory.rss_idle_mb": srv.rss_start_kb / 1024}
    pool.reset()  # warm the stream path once so the first-use allocations are not counted per subscription
    pool.send(0, "subscribe", {"target": srv.target, "streams": 20, "slot": 0})
    srv.wait_subs(20)
    pool.stop.set()
    pool.recv(0)
    srv.wait_subs(0)
    time.sleep(0.3)
    rss0 = srv.rss_kb()
    pool.reset()
    pool.send(0, "subscribe", {"target": srv.target, "streams": plan.mem_subs, "slot": 0})
    got = srv.wait_subs(plan.mem_subs)
    time.sleep(0.5)
    rss1 = srv.rss_kb()
    pool.stop.set()
    pool.recv(0)
    srv.wait_subs(0)
    out[f"memory.kb_per_sub@{plan.mem_subs}"] = (rss1 - rss0) / max(got, 1)
    out[f"memory.rss_{plan.mem_subs}_subs_mb"] = rss1 / 1024
    batch = plan.cycle_batch
    cyc = {"target": srv.target, "batch": batch, "workers": srv.workers}
    pool.call(0, "cycles", {**cyc, "cycles": 2 * batch})  # warm-up
    time.sleep(0.3)
    rss_a = srv.rss_kb()
    res, cpu = b.measured(srv, lambda: pool.call(0, "cycles", {**cyc, "cycles": plan.cycles, "pids": srv.mem_pids}))
    time.sleep(0.3)
    rss_b = srv.rss_kb()
    # Lasting growth: the plateau of RSS (sampled with each batch open) in the last third of the
    # cycles minus that in the first third, per cycle in between. A leak lifts the plateau; the
    # allocator's occasional trims only dip below it (see _memory.rss_kb_by_cycle in the JSON).
    pts = res["rss"]
    if len(pts) >= 6:
        third = len(pts) // 3
        first, last = pts[:third], pts[-third:]
        span = statistics.median(x for x, _ in last) - statistics.median(x for x, _ in first)
        out["memory.growth_b_per_cycle"] = (max(y for _, y in last) - max(y for _, y in first)) * 1024 / span
    out["memory.end_minus_start_b_per_cycle"] = (rss_b - rss_a) * 1024 / res["cycles"]
    out["_memory.rss_kb_by_cycle"] = pts  # kept in the JSON, not in the table
    out["memory.cycles_per_s"] = res["cycles"] / res["elapsed"]
    put_cpu(out, "memory.cpu_us_per_cycle", cpu, res["cycles"])
    if res["stuck"]:
        out["memory.stuck_batches"] = res["stuck"]
    return out


def run_unary(b: Bench, srv: Server, c: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    results, cpu = b.windowed(srv, "unary", split(c), {})
    lat = [x for r in results for x in r["lat_s"]]
    key = f"unary.c{c}"
    out[f"{key}.rps"] = len(lat) / b.plan.duration
    out[f"{key}.p50_ms"] = ms(pct(lat, 50))
    out[f"{key}.p99_ms"] = ms(pct(lat, 99))
    put_cpu(out, f"{key}.cpu_us", cpu, len(lat))
    errors = sum(r["n_errors"] for r in results)
    if errors:
        out[f"{key}.errors"] = f"{errors}: {results[0]['errors'][:1]}"
    return out


def run_chat(b: Bench, srv: Server, c: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    results, cpu = b.windowed(srv, "chat", split(c), {"chunks": b.plan.chat_chunks})
    key = f"chat.c{c}"
    errors = sum(r["n_errors"] for r in results)
    chunks = sum(r["chunks_in_window"] for r in results)
    calls = [x for r in results for x in r["calls"]]
    if errors and not calls:
        out[f"{key}.errors"] = f"{errors}: {next(e for r in results for e in r['errors'])}"
        return out
    out[f"{key}.cps"] = chunks / b.plan.duration
    out[f"{key}.ttfc_p50_ms"] = ms(pct([x[0] for x in calls], 50))
    out[f"{key}.call_p50_ms"] = ms(pct([x[1] for x in calls], 50))
    out[f"{key}.call_p99_ms"] = ms(pct([x[1] for x in calls], 99))
    out[f"{key}.chunks_per_call"] = statistics.median(x[2] for x in calls) if calls else None
    put_cpu(out, f"{key}.cpu_us", cpu, chunks)
    if errors:
        out[f"{key}.errors"] = errors
    return out


def run_fanout(b: Bench, srv: Server, s: int) -> dict[str, Any]:
    """Closed-loop max, then open-loop at 25% and 50% of the first server's (raw's) max of this round."""
    plan, pool, ref = b.plan, b.pool, b.ref
    out: dict[str, Any] = {}
    seq = 0
    key = f"fanout.S{s}"
    pool.reset()
    parts = split(s)
    for i, k in enumerate(parts):
        pool.send(i, "subscribe_node" if plan.subscribers == "node" else "subscribe",
                  {"target": srv.target, "streams": k, "slot": i, "per_channel": plan.per_channel})
    if srv.wait_subs(s) != s:
        raise RuntimeError(f"{srv.name}: {s} subscriptions did not all arrive")
    if srv.workers > 1:  # where the kernel put the subscribers' connections
        out[f"_{key}.subs_by_worker"] = srv.subscriptions()
    # The publisher's server: replica A for redis2 (so every delivery crosses Redis), else the same.
    common = {"target": srv.publish_target, "subs": s, "duration": plan.duration}
    window = max(2, min(32, plan.window_deliveries // s))
    res, cpu = b.measured(srv, lambda: pool.call(PUBLISHER, "publish", {
        **common, "mode": "max", "window": window, "tag": "max", "seq0": seq}))
    seq = res["seq"]
    out[f"{key}.max_dps"] = res["rate"]
    put_cpu(out, f"{key}.cpu_us", cpu, res["delivered"])
    base = ref.get(s) or res["rate"]
    ref.setdefault(s, res["rate"])
    for frac in (25, 50):
        lost0 = srv.losses()
        res, cpu = b.measured(srv, lambda frac=frac: pool.call(PUBLISHER, "publish", {
            **common, "mode": "rate", "rate": frac / 100 * base / s, "tag": f"r{frac}", "seq0": seq}))  # noqa: B023
        seq = res["seq"]
        out[f"{key}.r{frac}_lost"] = srv.losses() - lost0 + (res["expected"] - res["delivered"])
        out[f"{key}.r{frac}_dps"] = res["delivered"] / res["elapsed"]
        if res["behind"]:
            out[f"{key}.r{frac}_publisher_behind"] = res["behind"]
    pool.stop.set()
    subs = [pool.recv(i) for i in range(len(parts))]
    # What receiving cost the clients (Python workers, plus their Node processes with --subscribers node).
    received = sum(pool.counts[i] for i in range(len(parts)))
    client_cpu = sum(r.get("cpu_s", 0.0) + r.get("node_cpu_s", 0.0) for r in subs)
    out[f"_{key}.subscriber_cpu_us"] = client_cpu / max(received, 1) * 1e6
    out[f"_{key}.subscriber_cpu_s"] = {"workers": sum(r.get("cpu_s", 0.0) for r in subs),
                                       "node": sum(r.get("node_cpu_s", 0.0) for r in subs), "received": received}
    for frac in (25, 50):
        lat = [x for r in subs for x in r["lat_ns"].get(f"r{frac}", [])]
        out[f"{key}.r{frac}_p50_ms"] = None if not lat else pct(lat, 50) / 1e6  # type: ignore[operator]
        out[f"{key}.r{frac}_p99_ms"] = None if not lat else pct(lat, 99) / 1e6  # type: ignore[operator]
    errors = sum(r["n_errors"] for r in subs)
    if errors:
        out[f"{key}.errors"] = errors
    srv.wait_subs(0)
    return out


RUNNERS: dict[str, Callable[[Bench, Server, int], dict[str, Any]]] = {
    "memory": run_memory, "unary": run_unary, "chat": run_chat, "fanout": run_fanout}


# ---------------------------------------------------------------------------------------------
# Targets and the table


def verdict(key: str, raw: float | None, ub: float | None) -> str:
    if ub is None:
        return ""
    name = key.rsplit(".", 1)[-1]
    if name.endswith("_lost") and "r50" in name:
        return "ok" if ub == 0 else "MISS (target 0)"
    if name.startswith("kb_per_sub"):
        return "ok" if ub <= 40 else "MISS (target <= 40 KB)"
    if name == "growth_b_per_cycle":
        return "ok" if ub < 50 else "MISS (target < 50 B)"
    if raw is None or raw == 0:
        return ""
    if name in ("max_dps", "rps", "cps"):
        return "ok" if ub >= 0.8 * raw else "MISS (target >= 0.8x)"
    if name.endswith("p99_ms"):
        limit = 1.5 * raw + (1.0 if raw < 1.0 else 0.0)
        return "ok" if ub <= limit else f"MISS (target <= {limit:.2f} ms)"
    if name == "cpu_us" or name.startswith("cpu_us"):
        return "ok" if ub <= 1.3 * raw else "MISS (target <= 1.3x)"
    return ""


def _ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, int | float) and isinstance(b, int | float) and b
    return a / b if ok else None


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per figure: each server's median over rounds, uibus/raw per grpcio build, uibus/grpcjs, and the verdict."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r["metrics"] if k not in keys and not k.startswith("_")]
    labels = sorted({n.partition("@")[2] for n in names if "@" in n})
    summary: dict[str, dict[str, Any]] = {}
    for key in keys:
        row: dict[str, Any] = {}
        for name in names:
            vals = [r["metrics"][key] for r in runs if r["server"] == name and key in r["metrics"]]
            nums = [v for v in vals if isinstance(v, int | float)]
            row[name] = statistics.median(nums) if nums else (vals[0] if vals else None)
            row[f"{name}_all"] = vals
        raw, ub = row.get("raw"), row.get("uibus")
        row["ratio"] = _ratio(ub, raw)
        row["ratio_js"] = _ratio(ub, row.get("grpcjs"))
        for kind, twin in TWIN.items():
            if kind in names:
                row[f"{kind}/{twin}"] = _ratio(row.get(kind), row.get(twin))
        for label in labels:
            row[f"ratio@{label}"] = _ratio(row.get(f"uibus@{label}"), row.get(f"raw@{label}"))
            row[f"uibus@{label}/uibus"] = _ratio(row.get(f"uibus@{label}"), ub)
        row["verdict"] = verdict(key, raw if isinstance(raw, int | float) else None,
                                 ub if isinstance(ub, int | float) else None)
        loads = [x for r in runs if key in r["metrics"] for x in r["outside_cores"]]
        row["outside_load"] = statistics.median(loads) if loads else None
        summary[key] = row
    return summary


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        a = abs(v)
        return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.01 else f"{v:.3f}"
    return str(v)[:40]


def table(summary: dict[str, dict[str, Any]], names: list[str], outside: dict[str, list[float]]) -> str:
    labels = sorted({n.partition("@")[2] for n in names if "@" in n})
    cols: list[tuple[str, str, bool]] = [(n, n, False) for n in names if "@" not in n]
    cols.append(("ratio", "uibus/raw", True))
    if "grpcjs" in names:
        cols.append(("ratio_js", "uibus/grpcjs", True))
    cols += [(f"{kind}/{twin}", f"{kind}/{twin}", True) for kind, twin in TWIN.items()
             if kind in names and twin in names]
    for label in labels:
        cols += [(n, n, False) for n in names if n.endswith("@" + label)]
        cols += [(f"ratio@{label}", f"ratio@{label}", True), (f"uibus@{label}/uibus", f"{label}/main", True)]
    width = [max(9, len(title)) for _, title, _ in cols]
    head = f"{'figure':<31}" + "".join(f" {t:>{w}}" for (_, t, _), w in zip(cols, width, strict=True))
    head += f" {'load':>5}"
    lines = [head + "  verdict", "-" * (len(head) + 10)]
    for key, row in summary.items():
        cells = []
        for (col, _, is_ratio), w in zip(cols, width, strict=True):
            v = row.get(col)
            cells.append(f" {('-' if v is None else f'{v:.2f}') if is_ratio else fmt(v):>{w}}")
        load = "-" if row["outside_load"] is None else f"{row['outside_load']:.2f}"
        lines.append(f"{key:<31}" + "".join(cells) + f" {load:>5}  {row['verdict']}")
    lines.append("load = median outside load (cores busy with other work) while that figure was measured")
    for name, vals in outside.items():
        if vals:
            lines.append(f"outside load during {name} phases (cores busy with other work): median "
                         f"{statistics.median(vals):.2f}, max {max(vals):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short round (< 2 minutes)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--duration", type=float, help="seconds per measured phase")
    p.add_argument("--only", help=f"comma-separated scenarios of {','.join(SCENARIOS)}")
    p.add_argument("--servers", help="comma-separated of raw,uibus,grpcjs (the default: all three; grpcjs when "
                   "node is found), redis,redis2,workers2 (uibus on Redis; when redis-server is found) and "
                   "uibus-asyncio,raw-uvloop (each on the other event loop)")
    p.add_argument("--fanout", help="comma-separated subscriber counts, e.g. 10,1000")
    p.add_argument("--unary", help="comma-separated unary concurrencies, e.g. 1,100")
    p.add_argument("--chat", help="comma-separated chat concurrencies, e.g. 1,10")
    p.add_argument("--cycles", type=int, help="subscribe/cancel cycles for the memory scenario")
    p.add_argument("--chat-chunks", type=int, help="chunks per chat reply (raw server; uibus: see --uibus-arg)")
    p.add_argument("--with", dest="alt", action="append", default=[], metavar="LABEL=DIR",
                   help="also run raw@LABEL and uibus@LABEL from checkout DIR with its own DIR/.venv "
                        "(e.g. another grpcio version); repeatable")
    p.add_argument("--uibus-arg", action="append", default=[], help="extra flag for the uibus server (repeatable)")
    p.add_argument("--raw-arg", action="append", default=[], help="extra flag for the raw server (repeatable), "
                   "e.g. --raw-arg=--swallow-cancel")
    p.add_argument("--subscribers", choices=("python", "node"), default=Plan.subscribers,
                   help="the fan-out's subscriber clients: grpc.aio (default) or @grpc/grpc-js on Node, which "
                        "leaves more of the machine to the server (see bench/README.md)")
    p.add_argument("--window-deliveries", type=int, default=Plan.window_deliveries, metavar="N",
                   help="fan-out max: keep max(2, min(32, N/S)) events in flight (default 2000; more lets a "
                        "server that has cores to spare, e.g. --workers 2, use them)")
    p.add_argument("--streams-per-connection", type=int, default=Plan.per_channel, metavar="N",
                   help="fan-out subscriber streams per channel, each channel its own connection (default 100; "
                        "a Cline webview holds about 11 on one)")
    p.add_argument("--profile", metavar="FILE", help="record the uibus server with py-spy into FILE (speedscope)")
    p.add_argument("--out", help="JSON result file (default bench/results/<time>.json)")
    ns = p.parse_args(argv)
    plan = Plan.quick() if ns.quick else Plan()
    if ns.rounds:
        plan.rounds = ns.rounds
    if ns.duration:
        plan.duration = ns.duration
    if ns.only:
        plan.scenarios = tuple(s for s in SCENARIOS if s in ns.only.split(","))
    if ns.servers:
        wanted = ns.servers.split(",")
        if unknown := [s for s in wanted if s not in KINDS]:
            p.error(f"--servers: unknown {','.join(unknown)} (known: {','.join(KINDS)})")
        plan.servers = tuple(s for s in KINDS if s in wanted)
    if any(s in REDIS_KINDS for s in plan.servers) and not shutil.which("redis-server"):
        print(f"redis skipped: redis-server not found on PATH "
              f"({','.join(s for s in plan.servers if s in REDIS_KINDS)} not run)", flush=True)
        plan.servers = tuple(s for s in plan.servers if s not in REDIS_KINDS)
    if ("grpcjs" in plan.servers or ns.subscribers == "node") and not setup_grpcjs():
        if ns.subscribers == "node":
            p.error("--subscribers node needs node and bench/grpcjs's npm packages")
        plan.servers = tuple(s for s in plan.servers if s != "grpcjs")
    plan.subscribers = ns.subscribers
    plan.window_deliveries = ns.window_deliveries
    plan.per_channel = ns.streams_per_connection
    if not plan.servers:
        p.error("no server left to run")
    if ns.fanout:
        plan.fanout_s = tuple(int(x) for x in ns.fanout.split(","))
    if ns.unary:
        plan.unary_c = tuple(int(x) for x in ns.unary.split(","))
    if ns.chat:
        plan.chat_c = tuple(int(x) for x in ns.chat.split(","))
    if ns.cycles:
        plan.cycles = ns.cycles
    if ns.chat_chunks:
        plan.chat_chunks = ns.chat_chunks
    plan.uibus_args = tuple(ns.uibus_arg)
    plan.raw_args = tuple(ns.raw_arg)
    for spec in ns.alt:
        label, _, root = spec.partition("=")
        if not root or not (Path(root) / ".venv" / "bin" / "python").exists():
            p.error(f"--with {spec}: want LABEL=DIR where DIR/.venv/bin/python exists")
        plan.alt_roots[label] = root

    started = time.time()
    t_start = time.monotonic()
    pool = Pool(N_WORKERS)
    b = Bench(plan, pool)
    runs: list[dict[str, Any]] = []
    load_before = procstat.loadavg()
    profiler: subprocess.Popen[bytes] | None = None
    try:
        for rnd in range(plan.rounds):
            with tempfile.TemporaryDirectory(prefix="uibus-bench-") as tmp:
                b.servers = {}
                b.ref = {}
                try:  # servers started before one that fails to start are stopped too
                    for name in plan.all_servers():
                        b.servers[name] = start_server(name, Path(tmp), plan)
                    if ns.profile and "uibus" in b.servers and profiler is None:
                        profiler = start_profiler(b.servers["uibus"].pid, ns.profile)
                    # Servers alternate per scenario step (each S, each concurrency), so the two
                    # measurements compared in a row are seconds apart.
                    for scenario, param in plan.steps():
                        for name in plan.all_servers():
                            srv = b.servers[name]
                            t0 = time.monotonic()
                            n_out = len(b.outside.get(name, []))
                            metrics = RUNNERS[scenario](b, srv, param)
                            outside = b.outside.get(name, [])[n_out:]
                            runs.append({"round": rnd, "server": name, "scenario": scenario, "param": param,
                                         "metrics": metrics, "seconds": time.monotonic() - t0,
                                         "loadavg": procstat.loadavg(), "outside_cores": outside})
                            print(f"round {rnd + 1}/{plan.rounds} {scenario:<6} {param:>4} {name:<11} "
                                  f"{time.monotonic() - t0:5.1f}s  outside load "
                                  f"{statistics.median(outside) if outside else 0:.2f} cores", flush=True)
                finally:
                    if profiler is not None:
                        profiler.send_signal(signal.SIGINT)
                        profiler.wait(30)
                    for srv in b.servers.values():
                        stop_server(srv)
    finally:
        pool.close()
    summary = summarize(runs, plan.all_servers())
    text = table(summary, plan.all_servers(), b.outside)
    elapsed = time.monotonic() - t_start
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": elapsed,
            "argv": sys.argv, "python": platform.python_version(), "grpcio": grpc.__version__,
            "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": procstat.loadavg(),
            "plan": {k: v for k, v in vars(plan).items()}}
    out = Path(ns.out) if ns.out else RESULTS / time.strftime("%Y%m%d-%H%M%S.json", time.gmtime(started))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1, default=str))
    print()
    print(f"grpcio {grpc.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{plan.rounds} round(s) of {plan.duration:g} s phases, {elapsed:.0f} s total, "
          f"fan-out: {plan.subscribers} subscribers, {plan.per_channel} streams per connection, window "
          f"{plan.window_deliveries} deliveries; "
          f"load average before/after {load_before:.2f}/{meta['loadavg_after']:.2f}")
    print(text)
    print(f"\nresults: {out}")
    return 0


def start_profiler(pid: int, path: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "250", "--native", "--format", "speedscope",
                             "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
