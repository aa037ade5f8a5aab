"""One command, one machine: uibus against a raw grpc.aio baseline (and grpc-js), alternating, as ratios.

All servers run at once in their own processes (loopback only); client roles run in spawned
worker processes. Every scenario runs against raw, then uibus, then grpc-js (Node, when found),
then (next round) the same again, so drift in the machine's load hits all alike; the table shows
per-figure medians over rounds and the uibus/raw and uibus/grpcjs ratios. Servers are restarted
each round so memory figures start fresh.
"""

from __future__ import annotations

import argparse
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
from bench.workers import MD, pct, worker_main
from uibus.pb.cline import common_pb2
from uibus.pb.uibus.v1 import host_pb2, host_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SERVERS = ("raw", "uibus", "grpcjs")
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
    # label -> project checkout with its own .venv (e.g. another grpcio): adds raw@label, uibus@label
    alt_roots: dict[str, str] = field(default_factory=dict)

    def steps(self) -> list[tuple[str, int]]:
        params = {"memory": (self.mem_subs,), "unary": self.unary_c, "chat": self.chat_c, "fanout": self.fanout_s}
        return [(sc, p) for sc in self.scenarios for p in params[sc]]

    def all_servers(self) -> list[str]:
        # grpcjs has no @LABEL twin: --with swaps the Python/grpcio side, which Node does not use.
        alt = [f"{s}@{label}" for label in self.alt_roots for s in self.servers if s != "grpcjs"]
        return [*self.servers, *alt]

    @classmethod
    def quick(cls) -> Plan:
        return cls(rounds=1, duration=1.0, lead=0.6, cycles=3000)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    stub: host_pb2_grpc.HostServiceStub
    channel: grpc.Channel
    rss_start_kb: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> host_pb2.BusStats:
        return self.stub.GetBusStats(common_pb2.Empty(), metadata=MD, timeout=10)

    def losses(self) -> int:
        """Events a full mailbox threw away or merged (what a subscriber never saw)."""
        return sum(k.dropped + k.coalesced for k in self.stats().kinds)

    def wait_subs(self, want: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while True:
            n = self.stats().subscriptions
            if n == want or time.monotonic() > deadline:
                return n
            time.sleep(0.02)


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


def start_server(name: str, tmp: Path, plan: Plan) -> Server:
    port = free_port()
    kind, _, label = name.partition("@")
    root = Path(plan.alt_roots[label]).resolve() if label else ROOT
    python = str(root / ".venv" / "bin" / "python") if label else sys.executable
    if kind == "raw":
        cmd = [python, "-m", "bench.raw_server", "--port", str(port), "--chat-chunks", str(plan.chat_chunks),
               *plan.raw_args]
    elif kind == "grpcjs":  # node itself is the server process, so /proc/<pid> reads its CPU and RSS
        cmd = [shutil.which("node") or "node", str(GRPCJS / "server.js"), "--port", str(port),
               "--chat-chunks", str(plan.chat_chunks)]
    else:  # the documented way to run uibus
        cmd = [*uibus_command(python, root), "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
               "--store", str(tmp / f"{name}.db"), "--log-level", "WARNING", *plan.uibus_args]
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(cmd, cwd=root, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    srv = Server(name, proc, port, log, host_pb2_grpc.HostServiceStub(channel), channel)
    deadline = time.monotonic() + 30
    while True:
        try:
            srv.stats()
            break
        except grpc.RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} server did not start ({' '.join(cmd)}):\n{log.read_text()[-3000:]}") from None
            time.sleep(0.1)
    time.sleep(0.3)
    srv.rss_start_kb = procstat.rss_kb(srv.pid)
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


def stop_server(srv: Server) -> None:
    srv.channel.close()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(15)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait()


class Pool:
    """Worker processes that run client roles (bench.workers) on command."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.counts = ctx.Array("q", n, lock=False)
        self.stop = ctx.Event()
        self.workers = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, self.counts, self.stop), daemon=True)
            proc.start()
            self.workers.append((proc, parent))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p, _ in self.workers if p.pid]

    def send(self, i: int, role: str, params: dict[str, Any]) -> None:
        self.workers[i][1].send((role, params))

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
            conn.send(None)
            proc.join(5)
            if proc.is_alive():
                proc.terminate()


@dataclass
class Snap:
    t: float
    server_cpu: float
    busy: float
    ours: float


@dataclass
class Bench:
    plan: Plan
    pool: Pool
    servers: dict[str, Server] = field(default_factory=dict)
    outside: dict[str, list[float]] = field(default_factory=dict)  # server -> outside cores per phase
    ref: dict[int, float] = field(default_factory=dict)  # S -> max deliveries/s of this round's first server

    def our_pids(self) -> list[int]:
        return [os.getpid(), *self.pool.pids, *(s.pid for s in self.servers.values())]

    def snap(self, srv: Server) -> Snap:
        return Snap(time.monotonic(), procstat.cpu_seconds(srv.pid), procstat.machine_busy_seconds(),
                    sum(procstat.cpu_seconds(p) for p in self.our_pids()))

    def delta(self, srv: Server, a: Snap, b: Snap) -> tuple[float, float]:
        """(server CPU seconds, outside load in cores) between two snaps."""
        wall = max(b.t - a.t, 1e-6)
        outside = max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / wall)
        self.outside.setdefault(srv.name, []).append(outside)
        return b.server_cpu - a.server_cpu, outside

    def measured(self, srv: Server, fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
        a = self.snap(srv)
        result = fn()
        cpu, _ = self.delta(srv, a, self.snap(srv))
        return result, cpu

    def windowed(self, srv: Server, role: str, parts: list[int],
                 extra: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
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
    rss0 = procstat.rss_kb(srv.pid)
    pool.reset()
    pool.send(0, "subscribe", {"target": srv.target, "streams": plan.mem_subs, "slot": 0})
    got = srv.wait_subs(plan.mem_subs)
    time.sleep(0.5)
    rss1 = procstat.rss_kb(srv.pid)
    pool.stop.set()
    pool.recv(0)
    srv.wait_subs(0)
    out[f"memory.kb_per_sub@{plan.mem_subs}"] = (rss1 - rss0) / max(got, 1)
    out[f"memory.rss_{plan.mem_subs}_subs_mb"] = rss1 / 1024
    batch = plan.cycle_batch
    pool.call(0, "cycles", {"target": srv.target, "cycles": 2 * batch, "batch": batch})  # warm-up
    time.sleep(0.3)
    rss_a = procstat.rss_kb(srv.pid)
    res, cpu = b.measured(srv, lambda: pool.call(0, "cycles", {"target": srv.target, "cycles": plan.cycles,
                                                                "batch": batch, "pid": srv.pid}))
    time.sleep(0.3)
    rss_b = procstat.rss_kb(srv.pid)
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
    out["memory.cpu_us_per_cycle"] = cpu / res["cycles"] * 1e6
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
    out[f"{key}.cpu_us"] = cpu / max(len(lat), 1) * 1e6
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
    out[f"{key}.cpu_us"] = cpu / max(chunks, 1) * 1e6
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
        pool.send(i, "subscribe", {"target": srv.target, "streams": k, "slot": i})
    if srv.wait_subs(s) != s:
        raise RuntimeError(f"{srv.name}: {s} subscriptions did not all arrive")
    common = {"target": srv.target, "subs": s, "duration": plan.duration}
    window = max(2, min(32, 2000 // s))
    res, cpu = b.measured(srv, lambda: pool.call(PUBLISHER, "publish", {
        **common, "mode": "max", "window": window, "tag": "max", "seq0": seq}))
    seq = res["seq"]
    out[f"{key}.max_dps"] = res["rate"]
    out[f"{key}.cpu_us"] = cpu / max(res["delivered"], 1) * 1e6
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
    p.add_argument("--servers", help="comma-separated: raw,uibus,grpcjs (default all; grpcjs when node is found)")
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
        plan.servers = tuple(s for s in SERVERS if s in ns.servers.split(","))
    if "grpcjs" in plan.servers and not setup_grpcjs():
        plan.servers = tuple(s for s in plan.servers if s != "grpcjs")
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
                b.servers = {name: start_server(name, Path(tmp), plan) for name in plan.all_servers()}
                if ns.profile and "uibus" in b.servers and profiler is None:
                    profiler = start_profiler(b.servers["uibus"].pid, ns.profile)
                b.ref = {}
                try:
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
          f"{plan.rounds} round(s) of {plan.duration:g} s phases, {elapsed:.0f} s total; "
          f"load average before/after {load_before:.2f}/{meta['loadavg_after']:.2f}")
    print(text)
    print(f"\nresults: {out}")
    return 0


def start_profiler(pid: int, path: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "250", "--format", "speedscope",
                             "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
