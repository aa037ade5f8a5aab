"""python -m bench.agents: what a hosted coding agent (`backend = "rpc"`) costs the uibus process,
measured against the in-process `local` backend in the same server, in one run.

Why a bench of its own: bench/run.py compares uibus's stream path with a raw grpc.aio server, with
the `local` agent as the source of chunks. An `rpc` agent adds a child process whose every text
delta arrives as one JSON line on a pipe, which uibus reads, parses and turns into a piece; that
work is paid by the uibus process, per piece, and is what this bench isolates. It starts ONE
`uibus serve` (loopback, `--http-port 0`, a tmp store) with four agents:

* `local`: the local backend (delay_ms 0, sly_data `chunks` = --words), the baseline;
* `pi`: the real pinned pi (tests/pikit.py `pi_agent`) on a scripted OpenAI-compatible model that
  runs in a child process of the bench and answers every request with --words words at once;
* `replay`: bench/rpc_replay_agent.py, which writes one turn captured from the real pi (the same
  bytes) back to back: pi's lines without pi's pace (pi writes a line when the model's piece
  arrives, so uibus wakes per piece; the replay fills the pipe);
* `echo`: examples/rpc_echo_agent.py, a minimal RPC agent whose JSON lines are small (pi's
  `message_update` repeats the whole partial message twice per delta, so its lines grow with the
  reply). It echoes its prompt word by word, so it gets a prompt of --words words, and its
  baseline is the local agent given the same long prompt (every MAXIMAL response echoes the
  request, so the prompt's size is part of each piece's cost).

First the RSS that K sessions add to the uibus process when each ran one turn and now sits idle,
local against pi (whose sessions each hold an idle pi process; its RSS/PSS is printed for
information). Then closed-loop MAXIMAL StreamingChat calls (one session per caller, so one agent
process per rpc caller) for --duration per phase, with the uibus process's own CPU (not its
agents'), read from /proc, and the bytes it read, per AI piece received; pieces/s and time to first
piece. Before the server starts, real agent lines are captured and parsed in this process, to say
how much of the per-piece difference is JSON parsing. See bench/README.md "Hosted agents".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from bench import procstat
from bench.run import ROOT, Plan, _launch, _wait_grpc, fmt, free_port, stop_proc, uibus_serve
from tests.chatkit import local
from tests.pikit import PI, Model, Reply, pi_agent, scripted_model
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2

try:  # private to the server, which may change: without it the in-process view figure is left out
    from uibus.agents.rpc import _TurnView as TurnView
except ImportError:
    TurnView = None  # type: ignore[assignment,misc]

AI = chat_pb2.ChatMessage.AI
ECHO_AGENT = ROOT / "examples" / "rpc_echo_agent.py"
REPLAY_AGENT = Path(__file__).resolve().parent / "rpc_replay_agent.py"
RPC_AGENTS = ("pi", "replay", "echo")
BASELINE = {"pi": "local", "replay": "local", "echo": "local_long"}  # each rpc agent's local twin
# A short turn for the idle-session phase: the scripted model answers a prompt that contains this
# with a few words instead of the long reply (the session only has to hold an agent that has run).
IDLE_MARK = "idle-session-turn"
VOCAB = ("the", "agent", "streams", "its", "reply", "word", "by", "word", "while", "uibus", "reads",
         "each", "JSON", "line", "from", "pipe", "and", "turns", "into", "piece")


def words(n: int, prefix: str = "") -> str:
    """n words (about 5 characters each with their space), the shape of a model's text."""
    return prefix + " ".join(VOCAB[i % len(VOCAB)] for i in range(n))


@dataclass
class Settings:
    duration: float = 8.0  # seconds per measured window
    lead: float = 1.0  # closed-loop warm-up before each window (after each caller's first turn)
    callers: tuple[int, ...] = (1, 4)
    words: int = 500
    idle_sessions: int = 20
    settle: float = 2.0  # before each RSS reading
    agents: tuple[str, ...] = RPC_AGENTS  # pi always runs (the memory figures are pi's)
    cprofile: str = ""
    syscalls: bool = False  # count the uibus process's syscalls per piece with `perf stat` (diagnostic)
    profile: str = ""  # a folder: py-spy records uibus in each window into <phase>.txt (diagnostic)

    @classmethod
    def quick(cls) -> Settings:
        return cls(duration=1.0, lead=0.3, callers=(1, 4), words=200, idle_sessions=4, settle=0.7)


# ---------------------------------------------------------------------------------------------
# The scripted model, in a child process (its CPU is neither the client's nor uibus's)


class _LastRequest(list[Any]):
    """Model.requests that keeps only the last request body (tests keep all; a bench run would
    hold every growing conversation pi sends)."""

    last: Any = None
    count = 0

    def append(self, body: Any) -> None:
        self.last = body
        self.count += 1


class _Script(list[Any]):
    """Model.replies that never runs out: the long reply, or a short one for an idle-session turn.
    The model's handler appends the request body just before it pops a reply, with no await
    between, so `requests.last` is this request's."""

    def __init__(self, requests: _LastRequest, long_text: str) -> None:
        super().__init__()
        self.requests = requests
        self.long_text = long_text

    def __bool__(self) -> bool:
        return True

    def pop(self, index: Any = -1) -> Any:
        body = self.requests.last or {}
        last = json.dumps((body.get("messages") or [{}])[-1])
        return Reply(text="idle and ready.") if IDLE_MARK in last else Reply(text=self.long_text)


def model_main(conn: Connection, n_words: int) -> None:
    """Runs tests/pikit.py's scripted model until the parent closes the pipe; sends its port."""
    async def serve() -> None:
        async with scripted_model() as model:
            requests = _LastRequest()
            model.requests = requests
            model.replies = _Script(requests, words(n_words) + " ")
            conn.send(model.port)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, conn.recv)
            except EOFError:
                pass

    asyncio.run(serve())


# ---------------------------------------------------------------------------------------------
# The uibus process and its agents


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (the agent processes and whatever they started)."""
    found: list[int] = []
    level = [pid]
    while level:
        level = procstat.children_of(level)
        found += level
    return found


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process so far, all its threads (utime, stime of /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / procstat.TICK, int(fields[12]) / procstat.TICK


def read_bytes(pid: int) -> int:
    """Bytes the process has read so far, from pipes, sockets and files (`rchar` of /proc/<pid>/io)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kb(pid: int) -> int:
    """Proportional set size (shared pages split among the processes that map them)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def agent_entries(tmp: Path, model_port: int, s: Settings) -> dict[str, dict[str, Any]]:
    """The rpc agents' entries: pi (tests/pikit.py's, on the scripted model), replay (of the pi turn
    run() records into tmp) and echo; each may hold a process for every session this run opens
    (max_processes), idle for an hour."""
    per_run = sum(s.callers) + s.idle_sessions + 4  # CPU phases, idle sessions, their warm-up, a margin
    keep = {"idle_seconds": 3600, "start_timeout_seconds": 60, "max_processes": per_run}
    pi = pi_agent(tmp, Model(port=model_port), name="pi", **keep)
    home = Path(pi["options"]["env"]["HOME"])
    # One pi conversation per caller and phase grows by a reply per turn: no compaction (it would
    # call the model for a summary mid-window) and a context window it cannot fill.
    (home / ".pi" / "agent" / "settings.json").write_text(json.dumps({"compaction": {"enabled": False}}))
    models = home / ".pi" / "agent" / "models.json"
    config = json.loads(models.read_text())
    for m in config["providers"]["script"]["models"]:
        m["contextWindow"] = 100_000_000
    models.write_text(json.dumps(config))

    def python_agent(name: str, *argv: str) -> dict[str, Any]:
        return {"name": name, "backend": "rpc", "description": f"bench agent {name}",
                "options": {"command": [sys.executable, *argv], "cwd": str(ROOT), **keep}}

    return {"pi": pi, "echo": python_agent("echo", str(ECHO_AGENT)),
            "replay": python_agent("replay", str(REPLAY_AGENT), str(tmp / "pi-turn.jsonl"))}


def write_agents_file(tmp: Path, entries: dict[str, dict[str, Any]], s: Settings) -> Path:
    path = tmp / "agents.json"
    agents = [local("local"), *(entries[name] for name in s.agents)]
    path.write_text(json.dumps({"agents": agents, "default_agent": "local"}))
    return path


@dataclass
class Uibus:
    proc: Any
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_uibus(tmp: Path, agents: Path, s: Settings) -> Uibus:
    port = free_port()
    cmd = uibus_serve(sys.executable, ROOT, port, tmp / "uibus.db", Plan(), "--agents", str(agents))
    if s.cprofile:  # python -m cProfile -o FILE -m uibus serve …: the profile is written at exit (SIGTERM)
        cmd = [cmd[0], "-m", "cProfile", "-o", str(Path(s.cprofile).resolve()), *cmd[1:]]
    proc, log = _launch("uibus", cmd, ROOT, tmp)
    try:
        _wait_grpc("uibus", proc, port, cmd, log)
    except BaseException:
        stop_proc(proc)
        raise
    return Uibus(proc, port, log)


# ---------------------------------------------------------------------------------------------
# Closed-loop chat callers


def chat_request(text: str, n_words: int) -> agent_pb2.ChatRequest:
    """The same request for every agent: MAXIMAL, an empty chat_context (uibus's stored
    conversation starts over each call; an rpc agent keeps its own), sly_data for the local agent's
    piece count (the rpc agents ignore it; it is echoed in every response for all of them)."""
    req = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=text),
                                chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
    req.sly_data.update({"chunks": n_words, "delay_ms": 0})
    req.chat_context.SetInParent()
    return req


@dataclass
class Window:
    start: float = float("inf")
    end: float = float("-inf")
    pieces: int = 0  # AI pieces received inside [start, end]
    calls: list[tuple[float, float, int]] = field(default_factory=list)  # (ttfp s, call s, pieces), started inside
    errors: list[str] = field(default_factory=list)


class Caller:
    """One caller: its own channel and its own uibus session (so its own agent process)."""

    def __init__(self, target: str, agent: str, session: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.chat = self.channel.unary_stream(f"/{agent}.AgentService/StreamingChat",
                                              request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                              response_deserializer=agent_pb2.ChatResponse.FromString)
        self.md = (("x-uibus-session", session),)

    async def turn(self, req: agent_pb2.ChatRequest, w: Window | None = None) -> int:
        t = time.monotonic()
        first = 0.0
        n = 0
        async for r in self.chat(req, metadata=self.md, timeout=120):
            if r.response.type == AI:
                now = time.monotonic()
                if not n:
                    first = now - t
                n += 1
                if w is not None and w.start <= now <= w.end:
                    w.pieces += 1
        if w is not None and w.start <= t <= w.end:
            w.calls.append((first, time.monotonic() - t, n))
        return n

    async def loop(self, req: agent_pb2.ChatRequest, w: Window) -> None:
        while time.monotonic() < w.end:
            try:
                await self.turn(req, w)
            except grpc.aio.AioRpcError as exc:
                w.errors.append(f"{exc.code().name}: {exc.details()}")
                await asyncio.sleep(0.05)


@dataclass
class Snap:
    t: float
    cpu: float  # uibus process
    user: float  # of which in user space (Python, grpc, upb)
    agents_cpu: float  # its descendants (the agent processes)
    read: int  # uibus rchar
    busy: float  # the machine
    ours: float  # every process of this run


class Bench:
    def __init__(self, s: Settings, uibus: Uibus, model_pid: int) -> None:
        self.s = s
        self.uibus = uibus
        self.model_pid = model_pid

    def snap(self) -> Snap:
        kids = descendants(self.uibus.pid)
        agents = sum(procstat.cpu_seconds(p) for p in kids)
        user, system = cpu_split(self.uibus.pid)
        cpu = user + system
        ours = cpu + agents + procstat.cpu_seconds(os.getpid()) + procstat.cpu_seconds(self.model_pid)
        return Snap(time.monotonic(), cpu, user, agents, read_bytes(self.uibus.pid), procstat.machine_busy_seconds(),
                    ours)

    async def phase(self, agent: str, callers: int, text: str, tag: str) -> dict[str, Any]:
        """`callers` closed-loop callers of `agent` over one window; the figures per AI piece."""
        s = self.s
        req = chat_request(text, s.words)
        cs = [Caller(self.uibus.target, agent, f"{tag}-{i}") for i in range(callers)]
        try:
            # First turns outside the window: each rpc caller's agent process starts here.
            await asyncio.gather(*(c.turn(req) for c in cs))
            w = Window()
            w.start = time.monotonic() + s.lead
            w.end = w.start + s.duration
            loops = asyncio.gather(*(c.loop(req, w) for c in cs))
            await asyncio.sleep(max(0.0, w.start - time.monotonic()))
            a = self.snap()
            perf = await start_perf(self.uibus.pid) if s.syscalls else None
            spy = await start_py_spy(self.uibus.pid, Path(s.profile) / f"{tag}.txt") if s.profile else None
            await asyncio.sleep(max(0.0, w.end - time.monotonic()))
            b = self.snap()
            counts = await stop_perf(perf) if perf is not None else {}
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                await spy.wait()
            await loops
        finally:
            for c in cs:
                await c.channel.close()
        wall = b.t - a.t
        pieces = max(w.pieces, 1)
        ttfp = [c[0] for c in w.calls]
        out: dict[str, Any] = {
            "cpu_us": (b.cpu - a.cpu) / pieces * 1e6,
            "cpu_user_us": (b.user - a.user) / pieces * 1e6,
            "cpu_sys_us": ((b.cpu - b.user) - (a.cpu - a.user)) / pieces * 1e6,
            "pps": w.pieces / wall,
            "ttfp_p50_ms": statistics.median(ttfp) * 1e3 if ttfp else None,
            "call_p50_ms": statistics.median(c[1] for c in w.calls) * 1e3 if w.calls else None,
            "pieces_per_call": statistics.median(c[2] for c in w.calls) if w.calls else None,
            "read_b": (b.read - a.read) / pieces,
            "uibus_cores": (b.cpu - a.cpu) / wall,
            "_agent_cores": (b.agents_cpu - a.agents_cpu) / wall,  # every agent process, idle ones too
            "_outside_cores": max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / wall),
            "_calls": len(w.calls),
        }
        if agent != "local":
            out["agent_cpu_us"] = (b.agents_cpu - a.agents_cpu) / pieces * 1e6
        for name, (n, secs) in counts.items():  # perf's window is the measured one, less its start-up
            out[f"sys_{name}"] = n / max(w.pieces / wall * secs, 1)
        if w.errors:
            out["errors"] = f"{len(w.errors)}: {w.errors[0]}"
        return out

    async def idle_sessions(self, agent: str, tag: str) -> dict[str, Any]:
        """RSS the uibus process gains per session that ran one turn of `agent` and now sits idle
        (for an rpc agent: holding its process), and the agent processes' own RSS/PSS."""
        s = self.s
        k = s.idle_sessions
        text = f"{IDLE_MARK}: hello"
        req = chat_request(text, 8)
        gate = asyncio.Semaphore(4)  # pi starts cost about a second of CPU each: a few at a time

        async def one(session: str) -> None:
            async with gate:
                c = Caller(self.uibus.target, agent, session)
                try:
                    await c.turn(req)
                finally:
                    await c.channel.close()

        await asyncio.gather(*(one(f"{tag}-warm-{i}") for i in range(2)))  # first-use allocations
        await asyncio.sleep(s.settle)
        rss0, kids0 = procstat.rss_kb(self.uibus.pid), set(descendants(self.uibus.pid))
        await asyncio.gather(*(one(f"{tag}-{i}") for i in range(k)))
        await asyncio.sleep(s.settle)
        rss1 = procstat.rss_kb(self.uibus.pid)
        new = [p for p in descendants(self.uibus.pid) if p not in kids0]
        out: dict[str, Any] = {"kib_per_session": (rss1 - rss0) / k, "_rss_before_kib": rss0,
                               "_rss_after_kib": rss1}
        if agent != "local":
            out["agent_processes"] = len(new)
            out["agent_rss_mib"] = sum(procstat.rss_kb(p) for p in new) / k / 1024
            out["agent_pss_mib"] = sum(pss_kb(p) for p in new) / k / 1024
        return out


SYSCALLS = ("sendmsg", "recvmsg", "read", "write", "epoll_wait", "epoll_pwait", "futex")


async def start_perf(pid: int) -> tuple[asyncio.subprocess.Process, float]:
    """`perf stat` counting the syscalls of every thread of `pid` (grpc's poller threads included)
    until stop_perf; which of them each piece costs says whether pieces are sent one by one."""
    events = ",".join(f"syscalls:sys_enter_{n}" for n in SYSCALLS)
    proc = await asyncio.create_subprocess_exec("perf", "stat", "-x", ",", "-e", events, "-p", str(pid),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    return proc, time.monotonic()


async def stop_perf(perf: tuple[asyncio.subprocess.Process, float]) -> dict[str, tuple[int, float]]:
    """syscall -> (count, seconds counted); {} when perf could not count."""
    proc, t0 = perf
    secs = time.monotonic() - t0
    proc.send_signal(signal.SIGINT)
    _, err = await proc.communicate()
    counts: dict[str, tuple[int, float]] = {}
    for line in err.decode(errors="replace").splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[0].isdigit() and parts[2].startswith("syscalls:sys_enter_"):
            counts[parts[2].removeprefix("syscalls:sys_enter_")] = (int(parts[0]), secs)
    return counts


def py_spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


async def start_py_spy(pid: int, out: Path) -> asyncio.subprocess.Process:
    """py-spy recording `pid` with native frames (grpc's Cython and C, libc's syscalls) as collapsed
    stacks ("frame;frame;… count" lines) until SIGINT; read them with any flame-graph tool."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return await asyncio.create_subprocess_exec(
        py_spy(), "record", "--pid", str(pid), "--rate", "250", "--native", "--format", "raw", "--output", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------
# Parsing real agent lines in this process (what uibus does per line, without the server)


async def capture(entry: dict[str, Any], text: str) -> list[bytes]:
    """One turn's stdout lines of an agent started as uibus starts it (its agents-file entry)."""
    o = entry["options"]
    proc = await asyncio.create_subprocess_exec(
        *o["command"], cwd=o.get("cwd"), env={**os.environ, **o.get("env", {})}, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=1 << 24, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    lines: list[bytes] = []
    try:
        async with asyncio.timeout(60):
            proc.stdin.write(b'{"type": "get_state", "id": "s"}\n')
            await proc.stdout.readuntil(b"\n")
            proc.stdin.write(json.dumps({"type": "prompt", "id": "p", "message": text}).encode() + b"\n")
            while True:
                line = await proc.stdout.readuntil(b"\n")
                lines.append(line)
                if json.loads(line).get("type") == "agent_end":
                    break
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return lines


def parse_costs(lines: list[bytes]) -> dict[str, Any]:
    """Per text piece of one captured turn: stdout bytes, and the µs uibus's reader spends on the
    turn's lines: `json.loads` (RpcSession._line) and `_TurnView.event` (what makes the pieces)."""
    class _Ui:  # text deltas never reach the UI side; a stub for the other events
        session = "bench"

        def say(self, *a: Any, **k: Any) -> int:
            return 0

        def next_ts(self) -> int:
            return 1

    texts = [raw[:-1] for raw in lines if raw.strip()]
    msgs = [json.loads(t) for t in texts]
    pieces = sum(1 for m in msgs if m.get("type") == "message_update"
                 and (m.get("assistantMessageEvent") or {}).get("type") == "text_delta")
    deltas = [len(t) for t, m in zip(texts, msgs, strict=True) if m.get("type") == "message_update"
              and (m.get("assistantMessageEvent") or {}).get("type") == "text_delta"]

    def best(fn: Callable[[], None], reps: int = 7) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def loads() -> None:
        for t in texts:
            json.loads(t)

    def view() -> None:
        v = TurnView(_Ui())
        for m in msgs:
            v.event(m.get("type"), m)

    n = max(pieces, 1)
    return {"pieces": pieces, "lines": len(texts), "bytes_per_piece": sum(len(t) + 1 for t in texts) / n,
            "delta_line_bytes": statistics.mean(deltas) if deltas else 0.0,
            "json_us": best(loads) / n * 1e6, "view_us": best(view) / n * 1e6 if TurnView is not None else None}


# ---------------------------------------------------------------------------------------------
# The run and its table


ROWS = [  # (figure suffix of a phase, what it is); the JSON has every figure
    ("cpu_us", "uibus CPU µs/piece"), ("cpu_user_us", "  of which user"), ("cpu_sys_us", "  of which system"),
    ("pps", "pieces/s"), ("ttfp_p50_ms", "first piece p50 ms"), ("pieces_per_call", "pieces/call"),
    ("read_b", "uibus bytes read/piece"), ("agent_cpu_us", "agent CPU µs/piece (its own processes)"),
    *((f"sys_{n}", f"{n} calls/piece (perf)") for n in SYSCALLS)]


def build_rows(res: dict[str, Any], s: Settings) -> list[dict[str, Any]]:
    """One row per figure: an rpc agent, its local baseline (BASELINE), rpc/local, the outside load."""
    rows: list[dict[str, Any]] = []

    def ratio(a: Any, b: Any) -> float | None:
        ok = isinstance(a, int | float) and isinstance(b, int | float) and b
        return a / b if ok else None

    for rpc in s.agents:
        base = BASELINE[rpc]
        for c in s.callers:
            r, lo = res["phases"][f"{rpc}.c{c}"], res["phases"][f"{base}.c{c}"]
            load = max(r["_outside_cores"], lo["_outside_cores"])
            for key, label in ROWS:
                if key in r or key in lo:
                    rows.append({"figure": f"{rpc}.c{c}.{key}", "label": label, "rpc": r.get(key),
                                 "local": lo.get(key), "ratio": ratio(r.get(key), lo.get(key)), "load": load})
            for name, ph in (("rpc", r), ("local", lo)):
                if "errors" in ph:
                    rows.append({"figure": f"{rpc}.c{c}.errors", "label": f"{name} errors", name: ph["errors"]})
    mem_pi, mem_local = res["memory"]["pi"], res["memory"]["local"]
    rows.append({"figure": f"memory.kib_per_idle_session@{s.idle_sessions}", "label": "uibus RSS KiB/session",
                 "rpc": mem_pi["kib_per_session"], "local": mem_local["kib_per_session"],
                 "ratio": ratio(mem_pi["kib_per_session"], mem_local["kib_per_session"])})
    for key, label in (("agent_rss_mib", "one idle pi: RSS MiB"), ("agent_pss_mib", "one idle pi: PSS MiB"),
                       ("agent_processes", "new agent processes")):
        rows.append({"figure": f"memory.{key}", "label": label, "rpc": mem_pi.get(key)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'figure':<34} {'rpc':>10} {'local':>10} {'rpc/local':>9} {'load':>5}  what"
    lines = [head, "-" * (len(head) + 20)]
    for r in rows:
        ratio = r.get("ratio")
        load = r.get("load")
        lines.append(f"{r['figure']:<34} {fmt(r.get('rpc')):>10} {fmt(r.get('local')):>10} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>9} {'-' if load is None else f'{load:.2f}':>5}"
                     f"  {r['label']}")
    lines.append("rpc = pi (pi.*), pi's recorded lines written back to back (replay.*) or examples/rpc_echo_agent.py "
                 "(echo.*); local = the local backend, same request (echo.*: the same long prompt)")
    lines.append("load = outside load (cores busy with other work) during the rpc or local window, the larger")
    return "\n".join(lines)


def parse_table(parse: dict[str, dict[str, Any]]) -> str:
    head = f"{'agent lines, parsed in process':<34} {'bytes/piece':>11} {'delta line B':>12} {'lines/turn':>10} " \
           f"{'json.loads µs/piece':>19} {'_TurnView µs/piece':>18}"
    lines = [head, "-" * len(head)]
    for name, p in parse.items():
        lines.append(f"{name:<34} {fmt(p['bytes_per_piece']):>11} {fmt(p['delta_line_bytes']):>12} "
                     f"{p['lines']:>10} {fmt(p['json_us']):>19} {fmt(p['view_us']):>18}")
    return "\n".join(lines)


async def run(s: Settings, model_port: int, model_pid: int, tmp: Path) -> dict[str, Any]:
    entries = agent_entries(tmp, model_port, s)
    res: dict[str, Any] = {"phases": {}, "memory": {}, "parse": {}}
    long_prompt = words(s.words)

    # The agents' own lines first, captured straight from them (no uibus running yet); the pi
    # turn is also what the replay agent writes.
    pi_turn = await capture(entries["pi"], "hello")
    (tmp / "pi-turn.jsonl").write_bytes(b"".join(pi_turn))
    res["parse"]["pi"] = parse_costs(pi_turn)
    if "echo" in s.agents:
        res["parse"]["echo"] = parse_costs(await capture(entries["echo"], long_prompt))
    path = write_agents_file(tmp, entries, s)

    uibus = start_uibus(tmp, path, s)
    res["uibus_rss_start_kib"] = procstat.rss_kb(uibus.pid)
    try:
        b = Bench(s, uibus, model_pid)
        # Memory first, on a server that has only warmed up: after the chat phases, the sessions'
        # objects would fit in memory those phases freed, and RSS would not show them.
        for agent in ("local", "pi"):
            t0 = time.monotonic()
            res["memory"][agent] = await b.idle_sessions(agent, f"idle-{agent}")
            print(f"idle {agent:<5} {time.monotonic() - t0:5.1f}s  "
                  f"{fmt(res['memory'][agent]['kib_per_session'])} KiB/session", flush=True)
        plan = [("local", "hello", "local"), ("pi", "hello", "pi")]
        if "replay" in s.agents:
            plan.append(("replay", "hello", "replay"))
        if "echo" in s.agents:
            plan += [("local", long_prompt, "local_long"), ("echo", long_prompt, "echo")]
        for c in s.callers:
            for agent, text, name in plan:
                t0 = time.monotonic()
                ph = await b.phase(agent, c, text, f"{name}-c{c}")
                res["phases"][f"{name}.c{c}"] = ph
                print(f"{name:<10} c{c:<3} {time.monotonic() - t0:5.1f}s  {fmt(ph['cpu_us']):>6} µs/piece "
                      f"{fmt(ph['pps']):>7} pieces/s  outside load {ph['_outside_cores']:.2f}"
                      + (f"  ERRORS {ph['errors']}" if "errors" in ph else ""), flush=True)
        res["uibus_rss_end_kib"] = procstat.rss_kb(uibus.pid)
    finally:
        stop_proc(uibus.proc)
        if uibus.proc.returncode not in (0, None):
            print(f"uibus exited with {uibus.proc.returncode}; log:\n{uibus.log.read_text()[-2000:]}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--forwarded" in args:  # a turn carried to the agent's owner replica against a local one
        from bench import agent_forwarding
        return agent_forwarding.main(args)
    if "--isolation" in args:  # what the sandbox adds to start and turn, the disk a worktree costs
        from bench import isolation
        return isolation.main(args)
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short everything: a smoke run (< 1 minute)")
    p.add_argument("--duration", type=float, help="seconds per measured window (default 8)")
    p.add_argument("--callers", help="comma-separated closed-loop caller counts (default 1,4)")
    p.add_argument("--words", type=int, help="words per reply = AI pieces per call (default 500)")
    p.add_argument("--idle-sessions", type=int, help="K idle agent sessions for the memory figure (default 20)")
    p.add_argument("--agents", help="comma-separated rpc agents of pi,replay,echo (default all; pi always runs)")
    p.add_argument("--syscalls", action="store_true", help="also count uibus's syscalls per piece (needs perf "
                   "and its syscalls tracepoints)")
    p.add_argument("--profile", metavar="DIR", help="record uibus with py-spy in every window, DIR/<phase>.txt "
                   "(collapsed stacks; needs py-spy, e.g. pip install '.[bench]')")
    p.add_argument("--cprofile", metavar="FILE", help="run uibus under cProfile, the profile written to FILE")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    p.add_argument("--forwarded", action="store_true", help="instead: a hosted agent's turn forwarded to its "
                   "owner replica against a local one (bench/agent_forwarding.py)")
    p.add_argument("--isolation", action="store_true", help="instead: what sandbox = true adds to an agent's "
                   "start and turn, and the disk a worktree costs (bench/isolation.py)")
    ns = p.parse_args(argv)
    s = Settings.quick() if ns.quick else Settings()
    if ns.duration:
        s.duration = ns.duration
    if ns.callers:
        s.callers = tuple(int(x) for x in ns.callers.split(","))
    if ns.words:
        s.words = ns.words
    if ns.idle_sessions:
        s.idle_sessions = ns.idle_sessions
    if ns.agents:
        wanted = set(ns.agents.split(","))
        if unknown := wanted - set(RPC_AGENTS):
            p.error(f"--agents: unknown {','.join(sorted(unknown))} (known: {','.join(RPC_AGENTS)})")
        s.agents = tuple(a for a in RPC_AGENTS if a in wanted | {"pi"})
    s.cprofile = ns.cprofile or ""
    s.syscalls = ns.syscalls
    s.profile = ns.profile or ""
    if s.profile and not os.access(py_spy(), os.X_OK):
        p.error("--profile needs py-spy on PATH or next to this python (pip install '.[bench]')")
    if s.syscalls and not shutil.which("perf"):
        p.error("--syscalls needs perf on PATH")
    if not PI.exists():
        p.error(f"the pinned pi is missing ({PI}): npm ci --prefix tests/pi")
    if not shutil.which("node"):
        p.error("pi needs node on PATH")

    t_start = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = procstat.loadavg()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    model = ctx.Process(target=model_main, args=(child, s.words), daemon=True)
    model.start()
    try:
        if not parent.poll(30):
            raise SystemExit("the scripted model did not start")
        port = parent.recv()
        with tempfile.TemporaryDirectory(prefix="uibus-bench-agents-") as tmp:
            res = asyncio.run(run(s, port, model.pid or 0, Path(tmp)))
    finally:
        parent.close()
        model.join(5)
        if model.is_alive():
            model.terminate()
    rows = build_rows(res, s)
    elapsed = time.monotonic() - t_start
    print()
    print(f"grpcio {grpc.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{s.words} words per reply, callers {','.join(map(str, s.callers))}, {s.duration:g} s windows, "
          f"{s.idle_sessions} idle sessions, {elapsed:.0f} s total; load average before/after "
          f"{load_before:.2f}/{procstat.loadavg():.2f}")
    print(table(rows))
    print()
    names = {"pi": "pi (= replay), one real turn", "echo": "echo (examples/rpc_echo_agent.py)"}
    print(parse_table({names[k]: v for k, v in res["parse"].items()}))
    if ns.json:
        meta = {"started": started, "seconds": elapsed, "argv": sys.argv, "python": platform.python_version(),
                "grpcio": grpc.__version__, "cpus": os.cpu_count(), "settings": vars(s)}
        Path(ns.json).write_text(json.dumps({"meta": meta, "rows": rows, **res}, indent=1, default=str))
        print(f"\nresults: {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
