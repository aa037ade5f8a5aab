"""Replicas on one Redis: what an event costs the deployment as replicas are added (docs/scaling.md).

With one bus channel per deployment every replica receives every envelope, so a replica's cost
grows with the number of replicas N even when its own sessions' traffic does not. Sharded channels
(`--bus-shards K`) are meant to make a replica hear only the shards its subscribers are in. This
bench shows which of the two the code in the tree does: for N = 2 and 4 (one fresh redis-server
and N `uibus serve --redis-url …` processes each), every replica holds S `subscribeToPartialMessage`
streams on sessions of its own (no session is on two replicas) and one publisher sends
`HostService.PublishPartialMessage` events for every session, each through a replica picked at
random, at a fixed rate per replica (so per-replica work stays the same as N grows, as when a
deployment is scaled out for more sessions). Per N it reports the replicas' CPU per delivery (from
/proc, every replica summed), its ratio to N=2, and each replica's `uibus_replication_received_total`
(scraped from /metrics) against the envelopes it needed: events for its sessions published through
another replica. One channel reads ≈ N there; a replica that hears only what it needs reads ≈ 1.

    .venv/bin/python -m bench.replicas            # 2 rounds of 15 s windows, shards 256 and 1: ~2.5 minutes
    .venv/bin/python -m bench.replicas --quick    # one round of 5 s windows: under a minute
    .venv/bin/python -m bench.replicas --bus-shards 1 --replicas 2,4,6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench import procstat
from bench.run import ROOT, Pool, free_port, start_redis, stop_proc, uibus_command
from bench.workers import pct
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc
from uibus.pb.uibus.v1 import host_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
SESSION_KEY = "x-uibus-session"
MAX_INFLIGHT = 256  # unanswered publishes; beyond it the publisher waits (counted as `behind`)
COUNTERS = ("received", "unwanted", "sent", "dropped", "bad")  # uibus_replication_<name>_total
TAG = "m"  # text prefix of measured events (the warm-up's are "w"): only these give latencies

Params = dict[str, Any]


@dataclass
class Plan:
    replicas: tuple[int, ...] = (2, 4)
    shards: tuple[int, ...] = (256, 1)  # 256: the new default; 1: one channel, the old behaviour
    subscribers: int = 20  # streams per replica
    sessions: int = 10  # sessions per replica (the streams spread over them round-robin)
    rate: float = 100.0  # events per second per replica, so N × rate in all
    duration: float = 15.0  # measured publishing window, seconds
    warmup: float = 1.0  # publishing before the window (connections, first-use allocations)
    rounds: int = 2
    uibus_args: tuple[str, ...] = ()
    # "other": each event through a replica other than its session's (every delivery crosses Redis,
    # at N=2 as at N=4, so the CPU figures compare like with like); "random": any replica (at N
    # replicas (N-1)/N of them cross, so CPU per delivery grows with N by the mix alone).
    route: str = "other"

    @classmethod
    def quick(cls) -> Plan:
        return cls(duration=5.0, rounds=1)

    def configs(self) -> list[tuple[int, int]]:
        return [(k, n) for k in self.shards for n in self.replicas]


# ---------------------------------------------------------------------------------------------
# Client roles, each in a spawned process of its own (no gRPC state crosses a fork). The
# subscriber bumps counts[r] per delivery on replica r; the parent reads the shared array to
# tell when every delivery has arrived.


def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


async def subscribe(p: Params, counts: Any, stop: Any) -> Params:
    """Holds p["streams"][r] (session names, one per stream) on replica r until `stop` (at most
    p["max_s"] seconds); records publish→receive latency of measured events."""
    chans = [_channel(t) for t in p["targets"]]
    lat: list[int] = []
    errors: list[str] = []

    async def read(r: int, call: Any) -> None:
        try:
            async for msg in call:
                counts[r] += 1
                tag, _, sent = msg.text.partition(":")
                if tag == TAG:
                    lat.append(time.monotonic_ns() - int(sent))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(f"{exc.code().name}: {exc.details()}")
        except asyncio.CancelledError:
            pass

    calls = [(r, ui_pb2_grpc.UiServiceStub(chans[r]).subscribeToPartialMessage(
        common_pb2.EmptyRequest(), metadata=((SESSION_KEY, s),)))
        for r, names in enumerate(p["streams"]) for s in names]
    tasks = [asyncio.ensure_future(read(r, c)) for r, c in calls]
    deadline = time.monotonic() + p["max_s"]
    while not stop.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110 (a multiprocessing.Event)
        await asyncio.sleep(0.05)
    for _, c in calls:
        c.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in chans:
        await ch.close()
    return {"lat_ns": lat, "errors": errors[:5], "n_errors": len(errors)}


async def publish(p: Params, counts: Any, stop: Any) -> Params:
    """Open loop at p["rate"] events/s for p["duration"] s: event i is for session i (mod the list,
    so every session gets the same share), sent through a replica drawn at random (seeded).

    Returns what the parent needs to judge the replicas: per replica, the envelopes it needed from
    Redis (events for its sessions sent through another replica), and the deliveries expected."""
    chans = [_channel(t) for t in p["targets"]]
    hosts = [host_pb2_grpc.HostServiceStub(ch) for ch in chans]
    for host in hosts:  # connected before the clock starts
        await host.GetBusStats(common_pb2.Empty())
    rng = random.Random(p["seed"])
    sessions = [(str(name), int(owner)) for name, owner in p["sessions"]]  # lists after the pipe
    subs: dict[str, int] = p["subs"]
    n = len(hosts)
    needed, via = [0] * n, [0] * n
    expected = 0
    inflight: set[asyncio.Future[Any]] = set()
    errors: list[str] = []

    def done(f: asyncio.Future[Any]) -> None:
        inflight.discard(f)
        if not f.cancelled() and f.exception() is not None:
            errors.append(repr(f.exception())[:200])

    def send(i: int) -> None:
        nonlocal expected
        name, owner = sessions[i % len(sessions)]
        if p["route"] == "other" and n > 1:
            r = rng.randrange(n - 1)
            r += r >= owner
        else:
            r = rng.randrange(n)
        via[r] += 1
        if r != owner:
            needed[owner] += 1
        expected += subs[name]
        msg = ui_pb2.ClineMessage(ts=p["seq0"] + i + 1, type=ui_pb2.SAY, say=ui_pb2.TEXT, partial=True,
                                  text=f"{p['tag']}:{time.monotonic_ns()}")
        f = asyncio.ensure_future(hosts[r].PublishPartialMessage(msg, metadata=((SESSION_KEY, name),)))
        inflight.add(f)
        f.add_done_callback(done)

    rate = p["rate"]
    total = max(1, int(rate * p["duration"]))
    sent = behind = 0
    t0 = time.monotonic()
    while sent < total:
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        while sent < due:
            if len(inflight) >= MAX_INFLIGHT:
                behind += 1
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            send(sent)
            sent += 1
        await asyncio.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
    send_s = time.monotonic() - t0
    if inflight:
        await asyncio.wait(inflight, timeout=30)
    for ch in chans:
        await ch.close()
    return {"sent": sent, "expected": expected, "needed": needed, "via": via, "send_s": send_s,
            "behind": behind, "errors": errors[:5], "n_errors": len(errors)}


ROLES: dict[str, Callable[[Params, Any, Any], Awaitable[Params]]] = {"subscribe": subscribe, "publish": publish}


class Clients(Pool):
    """Two client processes: 0 holds every subscriber stream, 1 publishes, so the publisher's pace
    does not depend on how fast deliveries are read; counts[r] is the deliveries on replica r."""

    SUBSCRIBER, PUBLISHER = 0, 1

    def __init__(self, slots: int) -> None:
        super().__init__(2, ROLES, slots)


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Deployment:
    redis: subprocess.Popen[bytes]
    replicas: list[Replica] = field(default_factory=list)

    @property
    def cpu_pids(self) -> dict[str, int]:
        return {**{f"replica{i}": r.proc.pid for i, r in enumerate(self.replicas)}, "redis": self.redis.pid}

    def stop(self) -> None:
        for r in self.replicas:  # SIGTERM to all first: their shutdowns overlap
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            stop_proc(r.proc)
        stop_proc(self.redis)


def scrape(replica: Replica) -> dict[str, float]:
    """The replica's `uibus_replication_*` counters and `connected` gauge from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.http_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^uibus_replication_(\w+?)(?:_total)? ([0-9.eE+-]+)$", text, re.MULTILINE):
        out[m.group(1)] = float(m.group(2))
    return out


def _ready(replica: Replica) -> bool:
    try:
        with grpc.insecure_channel(replica.target) as ch:
            host_pb2_grpc.HostServiceStub(ch).GetBusStats(common_pb2.Empty(), timeout=2)
        return scrape(replica).get("connected") == 1.0
    except (grpc.RpcError, OSError):
        return False


def start_deployment(n: int, shards: int, tmp: Path, plan: Plan) -> Deployment:
    """One fresh redis-server and `n` replicas on it (started together, then awaited: each is up
    when it answers gRPC and its /metrics says it is connected to Redis)."""
    redis, redis_port = start_redis(f"n{n}-k{shards}", tmp)
    dep = Deployment(redis)
    try:
        for i in range(n):
            port, http_port = free_port(), free_port()
            log = tmp / f"n{n}-k{shards}-replica{i}.log"
            cmd = [*uibus_command(sys.executable, ROOT), "--host", "127.0.0.1", "--port", str(port),
                   "--http-port", str(http_port), "--store", str(tmp / f"r{i}.db"),
                   "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--bus-shards", str(shards),
                   "--grace-seconds", "1", "--log-level", "WARNING", *plan.uibus_args]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            dep.replicas.append(Replica(proc, port, http_port, log))
        deadline = time.monotonic() + 60
        for r in dep.replicas:
            while not _ready(r):
                if r.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"replica on port {r.port} did not start ({' '.join(map(str, r.proc.args))}):"
                                     f"\n{r.log.read_text()[-3000:]}")
                time.sleep(0.1)
    except BaseException:
        dep.stop()
        raise
    return dep


def subscriptions(replica: Replica) -> int:
    with grpc.insecure_channel(replica.target) as ch:
        return host_pb2_grpc.HostServiceStub(ch).GetBusStats(common_pb2.Empty(), timeout=5).subscriptions


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def drain(clients: Clients, want: int, quiet_s: float = 1.0, limit_s: float = 20.0) -> int:
    """Waits until `want` deliveries have arrived, or nothing more came for `quiet_s` (a lost one
    never comes), at most `limit_s`; returns how many arrived."""
    last, changed = clients.delivered(), time.monotonic()
    end = changed + limit_s
    while last < want and time.monotonic() - changed < quiet_s and time.monotonic() < end:
        time.sleep(0.002)
        now = clients.delivered()
        if now != last:
            last, changed = now, time.monotonic()
    return last


@dataclass
class Snap:
    t: float
    cpu: dict[str, float]
    busy: float
    ours: float


def snap(dep: Deployment, clients: Clients) -> Snap:
    ours = [os.getpid(), *clients.pids, *dep.cpu_pids.values()]
    return Snap(time.monotonic(), {k: procstat.cpu_seconds(p) for k, p in dep.cpu_pids.items()},
                procstat.machine_busy_seconds(), sum(procstat.cpu_seconds(p) for p in ours))


def run_config(n: int, shards: int, rnd: int, plan: Plan, clients: Clients, tmp: Path) -> dict[str, Any]:
    """One deployment of `n` replicas on `shards` bus shards: warm-up, one measured window, figures."""
    names = [[f"r{r}-s{k}" for k in range(plan.sessions)] for r in range(n)]  # disjoint per replica
    streams = [[names[r][i % plan.sessions] for i in range(plan.subscribers)] for r in range(n)]
    subs = {s: row.count(s) for row in streams for s in set(row)}
    sessions = [(s, r) for r in range(n) for s in names[r]]
    rng_order = random.Random(1000 * rnd + n)
    rng_order.shuffle(sessions)  # every replica's sessions interleaved in the publishing order
    dep = start_deployment(n, shards, tmp, plan)
    try:
        clients.reset()
        targets = [r.target for r in dep.replicas]
        hold = plan.warmup + plan.duration + 120
        clients.send(Clients.SUBSCRIBER, "subscribe", {"targets": targets, "streams": streams, "max_s": hold})
        wait_until(lambda: all(subscriptions(r) == plan.subscribers for r in dep.replicas), 60,
                   f"{plan.subscribers} subscriptions on each of {n} replicas")
        time.sleep(0.5)  # a replica's own SUBSCRIBE to a newly needed shard lands after the stream opens
        common = {"targets": targets, "sessions": sessions, "subs": subs, "rate": plan.rate * n,
                  "route": plan.route}
        clients.send(Clients.PUBLISHER, "publish", {**common, "duration": plan.warmup, "tag": "w", "seq0": 0,
                                                    "seed": rnd})
        warm = clients.recv(Clients.PUBLISHER, plan.warmup + 60)
        drain(clients, warm["expected"])
        time.sleep(0.3)  # stragglers (unwanted envelopes) of the warm-up are counted before the window
        base = clients.delivered()
        before = [scrape(r) for r in dep.replicas]
        a = snap(dep, clients)
        clients.send(Clients.PUBLISHER, "publish", {**common, "duration": plan.duration, "tag": TAG,
                                                    "seq0": warm["sent"], "seed": 100 + rnd})
        res = clients.recv(Clients.PUBLISHER, plan.duration + 60)
        delivered = drain(clients, base + res["expected"]) - base
        b = snap(dep, clients)
        after = [scrape(r) for r in dep.replicas]
        clients.stop.set()
        sub = clients.recv(Clients.SUBSCRIBER, 60)
    finally:
        clients.stop.set()
        dep.stop()
    wall = max(b.t - a.t, 1e-6)
    cpu = {k: b.cpu[k] - a.cpu[k] for k in a.cpu}
    replicas_cpu = sum(v for k, v in cpu.items() if k != "redis")
    counters = [{c: after[i].get(c, 0.0) - before[i].get(c, 0.0) for c in COUNTERS} for i in range(n)]
    received = [c["received"] for c in counters]
    needed = res["needed"]
    lat = sub["lat_ns"]
    return {
        "round": rnd, "shards": shards, "replicas": n, "events": res["sent"], "expected": res["expected"],
        "delivered": delivered, "lost": res["expected"] - delivered,
        "cpu_us_per_delivery": replicas_cpu / max(delivered, 1) * 1e6,
        "redis_us_per_delivery": cpu["redis"] / max(delivered, 1) * 1e6,
        "cores_per_replica": replicas_cpu / wall / n,
        "received_per_replica": statistics.mean(received), "needed_per_replica": statistics.mean(needed),
        "unwanted_per_replica": statistics.mean(c["unwanted"] for c in counters),
        "received_over_needed": sum(received) / max(sum(needed), 1),
        "p50_ms": (pct(lat, 50) or 0) / 1e6 if lat else None, "p99_ms": (pct(lat, 99) or 0) / 1e6 if lat else None,
        "outside_cores": max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / wall),
        "behind": res["behind"], "errors": res["n_errors"] + sub["n_errors"],
        "error_samples": res["errors"] + sub["errors"],
        "_cpu_s": cpu, "_counters": counters, "_needed": needed, "_via": res["via"], "wall_s": wall,
    }


# ---------------------------------------------------------------------------------------------
# The table


FIGURES = ("events", "delivered", "lost", "cpu_us_per_delivery", "redis_us_per_delivery", "cores_per_replica",
           "received_per_replica", "needed_per_replica", "unwanted_per_replica", "received_over_needed",
           "p50_ms", "p99_ms", "outside_cores", "errors")


def summarize(runs: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    """Per (shards, N): each figure's median over rounds, plus CPU per delivery ÷ the N=2 row's
    (the smallest N of the same shards)."""
    rows = []
    for shards, n in plan.configs():
        mine = [r for r in runs if r["shards"] == shards and r["replicas"] == n]
        if not mine:
            continue
        row: dict[str, Any] = {"shards": shards, "replicas": n, "rounds": len(mine)}
        for f in FIGURES:
            vals = [r[f] for r in mine if r[f] is not None]
            row[f] = statistics.median(vals) if vals else None
        rows.append(row)
    for row in rows:
        first = next(r for r in rows if r["shards"] == row["shards"])
        row["cpu_ratio"] = row["cpu_us_per_delivery"] / first["cpu_us_per_delivery"] \
            if first["cpu_us_per_delivery"] else None
    return rows


def _num(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("shards", "shards", 0), ("replicas", "N", 0), ("delivered", "deliveries", 0), ("lost", "lost", 0),
            ("cpu_us_per_delivery", "CPU µs/delivery", 1), ("cpu_ratio", "÷ N=2", 2),
            ("cores_per_replica", "cores/replica", 3), ("redis_us_per_delivery", "redis µs/deliv.", 1),
            ("received_per_replica", "recv/replica", 0), ("needed_per_replica", "needed/replica", 0),
            ("received_over_needed", "recv÷needed", 2), ("unwanted_per_replica", "unwanted/replica", 0),
            ("p99_ms", "p99 ms", 1), ("outside_cores", "load", 2)]
    widths = [max(len(title), 7) for _, title, _ in cols]
    lines = ["  ".join(f"{t:>{w}}" for (_, t, _), w in zip(cols, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    for row in rows:
        lines.append("  ".join(f"{_num(row.get(k), d):>{w}}" for (k, _, d), w in zip(cols, widths, strict=True)))
    return "\n".join(lines)


def git_commit() -> str:
    """HEAD's short hash, with `+dirty` when server/ has uncommitted changes: the figures are of
    the tree as it is, which other work may be changing."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "server"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{head}+dirty" if dirty else head or "unknown"


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        p.error(f"{what}: want comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{what}: want integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round of 5 s windows (under a minute)")
    p.add_argument("--rounds", type=int, help="rounds (each runs every configuration once; median shown)")
    p.add_argument("--duration", type=float, help="seconds of measured publishing per configuration")
    p.add_argument("--replicas", default="2,4", help="comma-separated replica counts (default 2,4)")
    p.add_argument("--bus-shards", default="256,1",
                   help="comma-separated --bus-shards values (default 256,1: sharded, then one channel as before)")
    p.add_argument("--subscribers", type=int, default=Plan.subscribers, help="streams per replica (default 20)")
    p.add_argument("--sessions", type=int, default=Plan.sessions, help="sessions per replica (default 10)")
    p.add_argument("--rate", type=float, default=Plan.rate,
                   help="events per second per replica (default 100; N × rate in all)")
    p.add_argument("--route", choices=("other", "random"), default=Plan.route,
                   help="each event through another replica than its session's (default), or any replica")
    p.add_argument("--uibus-arg", action="append", default=[], help="extra flag for every replica (repeatable)")
    p.add_argument("--out", help="JSON result file (default bench/results/replicas-<time>.json)")
    ns = p.parse_args(argv)
    plan = Plan.quick() if ns.quick else Plan()
    if ns.rounds:
        plan.rounds = ns.rounds
    if ns.duration:
        plan.duration = ns.duration
    plan.replicas = _ints(ns.replicas, "--replicas", p)
    plan.shards = _ints(ns.bus_shards, "--bus-shards", p)
    if ns.subscribers < 1 or ns.sessions < 1 or ns.sessions > ns.subscribers:
        p.error("want 1 <= --sessions <= --subscribers")
    if not 0 < ns.rate <= 2000 or not 0 < plan.duration <= 120 or not 1 <= plan.rounds <= 10:
        p.error("want 0 < --rate <= 2000, 0 < --duration <= 120, 1 <= --rounds <= 10")
    plan.subscribers, plan.sessions, plan.rate = ns.subscribers, ns.sessions, ns.rate
    plan.uibus_args = tuple(ns.uibus_arg)
    plan.route = ns.route
    if not shutil.which("redis-server"):
        p.error("redis-server not found on PATH")

    started = time.time()
    t0 = time.monotonic()
    commit = git_commit()
    clients = Clients(max(plan.replicas))
    runs: list[dict[str, Any]] = []
    load_before = procstat.loadavg()
    try:
        for rnd in range(plan.rounds):
            for shards, n in plan.configs():
                t = time.monotonic()
                with tempfile.TemporaryDirectory(prefix="uibus-bench-replicas-") as tmp:
                    run = run_config(n, shards, rnd, plan, clients, Path(tmp))
                runs.append(run)
                print(f"round {rnd + 1}/{plan.rounds} shards {shards:>4} N={n}  {time.monotonic() - t:5.1f}s  "
                      f"{run['delivered']:,} deliveries, {run['cpu_us_per_delivery']:.1f} µs each, "
                      f"recv÷needed {run['received_over_needed']:.2f}, outside load {run['outside_cores']:.2f}",
                      flush=True)
    finally:
        clients.close()
    rows = summarize(runs, plan)
    elapsed = time.monotonic() - t0
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": elapsed,
            "commit": commit, "argv": sys.argv, "python": platform.python_version(), "grpcio": grpc.__version__,
            "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": procstat.loadavg(),
            "plan": asdict(plan)}
    out = Path(ns.out) if ns.out else RESULTS / time.strftime("replicas-%Y%m%d-%H%M%S.json", time.gmtime(started))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1, default=str))
    print()
    print(f"commit {commit}, {meta['started']}, grpcio {grpc.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; {plan.rounds} round(s) of {plan.duration:g} s windows, {elapsed:.0f} s total; "
          f"per replica {plan.subscribers} streams on {plan.sessions} sessions of its own, "
          f"{plan.rate:g} events/s (N × that in all, each through "
          f"{'a replica other than its session' + chr(39) + 's' if plan.route == 'other' else 'a random replica'})")
    print(table(rows))
    print("CPU µs/delivery: every replica's CPU (utime+stime) over the window ÷ deliveries; ÷ N=2: that, over "
          "the same shards' first row;\nrecv/replica: uibus_replication_received_total gained per replica; "
          "needed/replica: events for its sessions sent through another replica;\nload: outside load, cores "
          "busy with other work (rerun above ~0.3)")
    errors = sum(r["errors"] for r in runs)
    if errors:
        print(f"{errors} client errors, e.g. {next(r['error_samples'] for r in runs if r['errors'])[:2]}")
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
