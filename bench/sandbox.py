"""python -m bench.sandbox: what `sandbox = true` (bubblewrap) adds to a hosted agent's start and
to its turns (docs/hosting/isolation.md; target: at most 100 ms more to start, turns unchanged within noise).

The sandbox measured is the one agents get: bwrap with a user namespace of its own (`--unshare-user`,
as root `--uid 65534 --gid 65534`), `--disable-userns`, `--cap-drop ALL`, the seccomp filter
(uibus.agents.seccomp, `--seccomp FD`) and the host's secret files masked; the run first checks
that a process in it has no capability and its seccomp filter (the `confined` line) — a figure of
a sandbox weaker than agents' would mean nothing.

Three figures, each plain against sandboxed, medians of --n runs (interleaved, so drift in the
machine's load hits both alike):

* spawn: the local launcher alone, from `start` to the first line of a program that prints one
  and exits (`/bin/echo`): what bwrap's namespaces, mounts and masks cost, nothing else;
* start: the real pi (tests/pikit.py, a scripted model on loopback) in a uibus in this process,
  the first turn of a new session — process, pi's own start-up, handshake, one model turn — so
  the difference is what the sandbox adds to an agent's start as a user waits for it;
* turn: the next turns of the same session (the process already running).

The sandboxed pi's network is the agents' default (`--network default`: "outbound" through pasta
where this uibus has it, the scripted model's port allowed with `loopback_ports`), or `--network
host` (the host's, as `network = true` was before "outbound": what the sandbox itself costs) or
`outbound`. spawn always shares the host's (a Sandbox built directly).

Agents' option `limits` (uibus.agents.limits: a cgroup per agent process) applies to both sides
alike, with its defaults; `--no-limits` sets every limit to 0 (no cgroups), to tell what the
sandbox costs from what the cgroups do.

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
from uibus.agents import config as agents_config
from uibus.agents.launcher import Launch, Sandbox
from uibus.agents.local_launcher import LOCAL
from uibus.clients.connection import Connection
from uibus.infra.config import Config


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


async def confined(box: Sandbox, tmp: Path) -> dict[str, str]:
    """What a process in `box` is: its uid, capabilities and seccomp mode (/proc/self/status); a
    RuntimeError when it keeps a capability or runs without its filter."""
    launch = Launch(agent="bench", session="s", tenant="bench", argv=("/bin/cat", "/proc/self/status"), cwd=str(tmp),
                    env={"PATH": "/usr/bin:/bin", "HOME": str(tmp / "home")}, sandbox=box)
    async with LOCAL.start(launch) as proc:
        assert proc.stdout is not None
        out = await proc.stdout.read()
        await proc.wait()
    status = {k: v.strip() for k, v in (ln.split(":", 1) for ln in out.decode().splitlines() if ":" in ln)}
    got = {"uid": status.get("Uid", "?").split()[0], "CapEff": status.get("CapEff", "?"),
           "CapBnd": status.get("CapBnd", "?"), "Seccomp": status.get("Seccomp", "?"),
           "NoNewPrivs": status.get("NoNewPrivs", "?")}
    if got["Seccomp"] != "2" or any(int(got[k], 16) for k in ("CapEff", "CapBnd") if got[k] != "?"):
        raise RuntimeError(f"the sandbox measured is not the hardened one: {got}")
    return got


NO_LIMITS = {"pids": 0, "memory_mb": 0, "cpu": 0, "disk_mb": 0}


def network_options(network: str, port: int) -> dict[str, Any]:
    """The sandboxed pi's network options: `network` ("default": none given) and, where this uibus
    knows option loopback_ports (network "outbound"), the scripted model's port."""
    ports = "loopback_ports" in getattr(agents_config, "ISOLATION_OPTIONS", ())
    options: dict[str, Any] = {} if network == "default" else {"network": network}
    if ports and network != "host":
        options["loopback_ports"] = [port]
    return options


async def pi_ms(tmp: Path, n: int, turns: int, limits: bool = True,
                network: str = "default") -> dict[bool, tuple[list[float], list[float]]]:
    """Per side (sandboxed or not): the first-turn and later-turn times of n sessions of the real
    pi, the two uibus servers' sessions taken in turn."""
    out: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    async with scripted_model() as model:
        apps = {}
        try:
            for sandbox in (False, True):
                work = tmp / ("boxed" if sandbox else "plain")
                work.mkdir()
                options: dict[str, Any] = {} if limits else {"limits": NO_LIMITS}
                if sandbox:
                    options |= {"sandbox": True, "read_only": [str(PI_DIR), str(REPO / "examples" / "pi")],
                                **network_options(network, model.port)}
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


async def run(n: int, turns: int, limits: bool = True, network: str = "default") -> dict[str, Any]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SystemExit("bwrap is not installed (apt-get install bubblewrap, or .ci/setup --system)")
    with tempfile.TemporaryDirectory(prefix="uibus-bench-sandbox-") as name:
        tmp = Path(name)
        (tmp / "home").mkdir()
        box = Sandbox(bwrap=bwrap, homes_dir=str(tmp / "homes"))
        status = await confined(box, tmp)
        spawn: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(max(n, 20)):
            for sandboxed in (False, True):
                spawn[sandboxed].append(await spawn_ms(box if sandboxed else None, tmp))
        pi = await pi_ms(tmp, n, turns, limits, network)
    return {"spawn": spawn, "start": (pi[False][0], pi[True][0]), "turn": (pi[False][1], pi[True][1]),
            "confined": status, "limits": limits, "network": network}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sandbox", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--n", type=int, default=8, help="sessions per side (default 8)")
    p.add_argument("--turns", type=int, default=3, help="later turns per session (default 3)")
    p.add_argument("--no-limits", action="store_true", help="agents' option limits all 0 (no cgroups), both sides")
    p.add_argument("--network", choices=("default", "host", "outbound"), default="default",
                   help="the sandboxed pi's option network (default: the agents' default)")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    a = p.parse_args(argv)
    res = asyncio.run(run(max(1, min(a.n, 50)), max(0, min(a.turns, 20)), not a.no_limits, a.network))
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(figures(res)))
    return 0


def report(res: dict[str, Any]) -> str:
    """The figures of `run` as lines (also what `python -m bench.agents --isolation` prints)."""
    c = res["confined"]
    lines = [f"confined: uid {c['uid']}, CapEff {c['CapEff']}, CapBnd {c['CapBnd']}, Seccomp {c['Seccomp']}, "
             f"NoNewPrivs {c['NoNewPrivs']}; agents' limits (cgroups): {'defaults' if res['limits'] else 'off'}; "
             f"pi's network: {res.get('network', 'default')}",
             line("spawn", res["spawn"][False], res["spawn"][True]), line("start", *res["start"])]
    if res["turn"][0]:
        lines.append(line("turn", *res["turn"]))
    return "\n".join(lines)


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """Every figure of `run`, JSON-ready: per step, [plain runs, sandboxed runs] in ms."""
    out: dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else [v[False], v[True]]) for k, v in res.items()
                           if k in ("spawn", "start", "turn")}
    return {**out, "confined": res["confined"], "limits": res["limits"], "network": res.get("network", "default")}


if __name__ == "__main__":
    sys.exit(main())
