"""python -m bench.sandbox: what `sandbox = true` (bubblewrap) adds to a hosted agent's start and
to its turns (issue 42; target: at most 100 ms more to start, turns unchanged within noise).

Three figures, each plain against sandboxed, medians of --n runs (interleaved, so drift in the
machine's load hits both alike):

* spawn: the local launcher alone, from `start` to the first line of a program that prints one
  and exits (`/bin/echo`): what bwrap's namespaces, mounts and masks cost, nothing else;
* start: the real pi (tests/pikit.py, a scripted model on loopback) in a uibus in this process,
  the first turn of a new session — process, pi's own start-up, handshake, one model turn — so
  the difference is what the sandbox adds to an agent's start as a user waits for it;
* turn: the next turns of the same session (the process already running).

Loopback only; every agent process is stopped before the next figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.chatkit import Agent, request
from tests.conftest import REPO, start_app
from tests.pikit import PI_DIR, Reply, pi_agent, scripted_model
from uibus.agents.launcher import LOCAL, Launch, Sandbox
from uibus.clients.connection import Connection
from uibus.config import Config


async def spawn_ms(box: Sandbox | None, tmp: Path) -> float:
    launch = Launch(agent="bench", session="s", tenant="bench", argv=("/bin/echo", "ready"), cwd=str(tmp),
                    env={"PATH": "/usr/bin:/bin", "HOME": str(tmp / "home")}, sandbox=box)
    started = time.perf_counter()
    async with LOCAL.start(launch) as proc:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        took = (time.perf_counter() - started) * 1000
        await proc.wait()
    assert line == b"ready\n", line
    return took


async def pi_ms(tmp: Path, n: int, turns: int) -> dict[bool, tuple[list[float], list[float]]]:
    """Per side (sandboxed or not): the first-turn and later-turn times of n sessions of the real
    pi, the two uibus servers' sessions taken in turn."""
    out: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    async with scripted_model() as model:
        apps = {}
        try:
            for sandbox in (False, True):
                work = tmp / ("boxed" if sandbox else "plain")
                work.mkdir()
                options: dict[str, Any] = {}
                if sandbox:
                    options = {"sandbox": True, "read_only": [str(PI_DIR), str(REPO / "examples" / "pi")]}
                agents = work / "agents.json"
                agents.write_text(json.dumps({"workspaces_dir": str(work / "ws"),
                                              "agents": [pi_agent(work, model, **options)]}))
                config = Config(host="127.0.0.1", port=0, http_port=0, store=":memory:", grace_seconds=1.0)
                apps[sandbox] = await start_app(replace(config, agents=str(agents)))
            for i in range(n):
                for sandbox, app in apps.items():
                    starts, later = out[sandbox]
                    async with Connection(f"127.0.0.1:{app.port}", session=f"bench-{i}") as conn:
                        for t in range(1 + turns):
                            model.script(Reply(text="ok"))
                            started = time.perf_counter()
                            responses = [r async for r in Agent(conn, "pi").StreamingChat(request("hi"))]
                            took = (time.perf_counter() - started) * 1000
                            assert responses[-1].response.text == "ok", responses[-1]
                            (starts if t == 0 else later).append(took)
        finally:
            for app in apps.values():
                await app.aclose()
    return out


def line(name: str, plain: list[float], boxed: list[float]) -> str:
    a, b = statistics.median(plain), statistics.median(boxed)
    return f"{name:<8} plain {a:8.1f} ms   sandbox {b:8.1f} ms   added {b - a:+8.1f} ms   (median of {len(plain)})"


async def run(n: int, turns: int) -> dict[str, Any]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SystemExit("bwrap is not installed (apt-get install bubblewrap, or .ci/setup --system)")
    with tempfile.TemporaryDirectory(prefix="uibus-bench-sandbox-") as name:
        tmp = Path(name)
        (tmp / "home").mkdir()
        box = Sandbox(bwrap=bwrap, homes_dir=str(tmp / "homes"))
        spawn: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(max(n, 20)):
            for sandboxed in (False, True):
                spawn[sandboxed].append(await spawn_ms(box if sandboxed else None, tmp))
        pi = await pi_ms(tmp, n, turns)
    return {"spawn": spawn, "start": (pi[False][0], pi[True][0]), "turn": (pi[False][1], pi[True][1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sandbox", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--n", type=int, default=8, help="sessions per side (default 8)")
    p.add_argument("--turns", type=int, default=3, help="later turns per session (default 3)")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    a = p.parse_args(argv)
    res = asyncio.run(run(max(1, min(a.n, 50)), max(0, min(a.turns, 20))))
    print(line("spawn", res["spawn"][False], res["spawn"][True]))
    print(line("start", *res["start"]))
    if res["turn"][0]:
        print(line("turn", *res["turn"]))
    if a.json:
        Path(a.json).write_text(json.dumps({k: (v if isinstance(v, tuple) else [v[False], v[True]])
                                            for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
